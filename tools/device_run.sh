#!/usr/bin/env bash
# On the lent GPU machine (see ../shared/device/README.md): install the carried wheels, then run each
# argument as one step with a time limit, packing results/ and notebooks/ into $OUT after every step,
# so a step cut short still returns what the others wrote. Usage (carry .whl):
#   MINGRU_COMMIT=<sha> bash tools/device_run.sh "SECONDS:command" ...
# The parity sweep compiles hundreds of kernel variants: run it as parallel shards, e.g.
#   "300:for i in $(seq 0 15); do python3 -m mingru.bench parity --shard $i/16 --out /tmp/par/$i & done; wait;
#         python3 tools/merge_results.py parity results /tmp/par/*"
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH || exit 1
export MINGRU_COMMIT=${MINGRU_COMMIT:-unknown} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
for step in "$@"; do
  limit=${step%%:*} cmd=${step#*:}
  echo "== [$(date +%T)] $cmd (limit ${limit}s)"
  timeout -k 10 "$limit" bash -c "$cmd" || { echo "== step failed or timed out: $cmd"; status=1; }
  tar czf "$OUT/results.tgz" results notebooks
done
echo "== [$(date +%T)] done"
exit $status
