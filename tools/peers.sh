#!/usr/bin/env bash
# Unpack each measured competitor into its own folder under DIR (default .peers/), never into the
# project's environment: mingru-scans imports as `mingru` and would shadow this package. Harnesses
# and tests put one folder on sys.path of a separate process. WHEELS=.whl installs offline from a
# wheelhouse (`make wheelhouse` on a connected machine). A competitor that cannot be fetched is
# reported and skipped: its rows then say "not measured".
set -u
dest=${1:-.peers}
PYTHON=${PYTHON:-python3}
src=()
if [ -n "${WHEELS:-}" ]; then src=(--no-index --find-links "$WHEELS" --find-links "$WHEELS/peers"); fi
unpack() {
  local name=$1; shift
  if [ -d "$dest/$name" ]; then return 0; fi
  if "$PYTHON" -m pip install -q --no-deps --no-compile "${src[@]}" --target "$dest/$name" "$@" >/dev/null 2>&1; then
    echo "peers: $name -> $dest/$name"
  else
    rm -rf "${dest:?}/$name"
    echo "peers: $name could not be installed (offline without a wheelhouse?); it will not be measured"
  fi
}
unpack mingru-scans mingru-scans==0.2.0
unpack minGRU-pytorch minGRU-pytorch==0.2.1 einops==0.8.2
unpack accelerated-scan accelerated-scan==0.3.1
unpack fla-core fla-core==0.6.0 einops==0.8.2
