#!/usr/bin/env bash
# Fill DIR (default .whl) with the wheels the GPU machine needs and cannot download: the notebook
# runners (papermill, nbval, ...) from ../shared/device/wheelhouse.sh, plus the optional benchmark
# peers fla-core and accelerated-scan and einops, the one dependency of theirs the image lacks.
# The peers are pure-Python wheels (their kernels are Triton); --no-deps keeps torch and triton out.
# Pinned so that the peers table names the versions it measured.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-.whl}
bash "$root/../shared/device/wheelhouse.sh" "$dest"
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any \
  -d "$dest" "fla-core==0.6.0" "accelerated-scan==0.3.1" "einops==0.8.2" 2>&1 | grep -v 'is ignored' >&2 || true
for w in fla_core accelerated_scan einops; do
  ls "$dest"/${w}-*.whl >/dev/null 2>&1 || { echo "wheelhouse: $w did not download" >&2; exit 1; }
done
echo "wheelhouse: $(ls "$dest" | wc -l) wheels in $dest, peers included (fla-core, accelerated-scan, einops)"
