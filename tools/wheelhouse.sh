#!/usr/bin/env bash
# Fill DIR (default .whl) on a connected machine with every wheel the offline GPU machine needs:
# the notebook runners of tools/wheelhouse.txt with the dependencies its image lacks, and the
# measured competitors. Then, on the GPU machine, from the repository root:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
#   WHEELS=.whl make peers PYTHON=python3 && make reproduce PYTHON=python3
# PY312 names a Python 3.12 interpreter to resolve with (found under ~/.pyenv otherwise); without
# one, pip resolves for 3.12 with --python-version.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-.whl}
list="$root/tools/wheelhouse.txt"
mkdir -p "$dest"
py=${PY312:-}
if [ -z "$py" ]; then
  for c in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then py=$c; break; fi
  done
fi
target=(--only-binary=:all: --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
runners=$(grep -v -e '^#' -e '^--peer' -e '^\s*$' "$list")
peers=$(sed -n 's/^--peer //p' "$list")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -n "$py" ]; then
  "$py" -m pip download -q "${target[@]}" -d "$tmp/runners" $runners 2> >(grep -v 'is ignored' >&2)
else
  PYTHON=${PYTHON:-python3}
  "$PYTHON" -m pip download -q "${target[@]}" --python-version 3.12 -d "$tmp/runners" $runners \
    2> >(grep -v 'is ignored' >&2)
fi
# What the GPU image already holds serves as is: two versions of one package would stop the install.
present='^(attrs|certifi|charset_normalizer|click|filelock|fsspec|idna|iniconfig|jinja2|markupsafe|MarkupSafe|packaging|pluggy|pygments|pyyaml|PyYAML|requests|rich|setuptools|six|urllib3|pytest|numpy|matplotlib|pillow|python_dateutil|markdown_it_py|mdurl|psutil|typing_extensions|aiohttp|aiosignal|aiohappyeyeballs|frozenlist|multidict|propcache|yarl|contourpy|cycler|fonttools|kiwisolver|pyparsing)-'
for w in "$tmp/runners"/*.whl; do
  b=$(basename "$w")
  [[ $b =~ $present ]] || cp "$w" "$dest/"
done
# The competitors go into DIR/peers: installing DIR/*.whl into a site folder must never bring the
# seed's `mingru` along.
"${py:-${PYTHON:-python3}}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any \
  -d "$dest/peers" $peers 2> >(grep -v 'is ignored' >&2)
for p in $peers; do
  stem=$(echo "${p%%==*}" | tr 'A-Z-' 'a-z_')
  ls "$dest/peers" | tr 'A-Z' 'a-z' | grep -q "^${stem}-${p##*==}-" || { echo "wheelhouse: $p did not download" >&2; exit 1; }
done
echo "wheelhouse: $(find "$dest" -name '*.whl' | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest (competitors in $dest/peers)"
