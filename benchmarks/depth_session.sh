#!/usr/bin/env bash
# One device call of benchmarks/depth_gpu.py (the published qwen-b300 loop vs `ftcli train` on the
# qwen-b300 recipe's settings, per layer) at one block length; prints the card and versions, then every
# table as soon as it is measured. Writes $OUT/rows-<block>.jsonl and $OUT/log-<block>.txt.
#   device: source .gpu/activate.sh && python3 -m pip install -q --no-index --no-deps --upgrade \
#           --target /tmp/gpu-site .whl/*.whl && bash benchmarks/depth_session.sh 32768 "4 8" "reference ftcli profile fit" 280 95 110
#   args:   block length, depths, what to run, timeouts (s) of the published loop's run, of each ftcli depth,
#           of the profile
# The first Qwen3.5 step on a fresh machine compiles fla/tilelang kernels (~3 minutes): the first sub-run
# (the published loop) pays it, so give it the longest timeout.
set -u -o pipefail
BLOCK=${1:-32768}; LAYERS=${2:-"4 8"}; WHAT=${3:-"reference ftcli profile fit"}; TREF=${4:-280}; TFT=${5:-95}; TPROF=${6:-110}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRITON_CACHE_AUTOTUNING=1
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys; sys.path.insert(0, '$HERE'); import common
print(common.staging_line('torch', 'transformers', 'triton', 'fla'))"
} 2>&1 | tee -a "$OUT/env.txt"
# shellcheck disable=SC2086
python3 "$HERE/depth_gpu.py" --block-len "$BLOCK" --layers $LAYERS --what $WHAT --timeout "$TREF" "$TFT" "$TPROF" \
  --out "/tmp/depth-$BLOCK" --rows "$OUT/rows-$BLOCK.jsonl" 2>&1 | grep -v '^train ' | tee "$OUT/log-$BLOCK.txt"
echo "depth_gpu exit ${PIPESTATUS[0]}"
