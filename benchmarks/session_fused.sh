#!/usr/bin/env bash
# Issue 18's remaining levers on one H200, most important first, every step bounded by what is left of
# FUSED_BUDGET seconds (default 1300) from this script's start; tables go to stdout and $LOG as measured.
#   1  benchmarks/fused_ops_gpu.py: each fused op (training.fused_ops) against transformers' eager module at
#      the 27B width, 32k tokens: errors against float32 and forward + backward times
#   2  benchmarks/levers_gpu.py, one process (the first Qwen3.5 step compiles fla/tilelang: >= 170 s):
#      32k at 4 and 8 layers with keep 2 (recomputed layers) and 4 layers all kept (the recipe as shipped),
#      with and without the fused ops; compile=regions, fp8 + regions; 8k with the chunked loss
#   3  a torch.profiler pass over one 4-layer 32k step with the fused ops (categories and GPU idle)
# Device (project root; .gpu, .whl and .gpu-ao carried; trl/datasets left out of .gpu/whl, DEVELOPERS.md):
#   source .gpu/activate.sh && python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpu-site \
#     .whl/*.whl && tar -xJf .gpu-ao/torchao-0.18.0-noso.tar.xz -C /tmp/gpu-site && bash benchmarks/session_fused.sh
# CPU logic check (tiny models, the tests' stand-ins for the Triton kernels): FUSED_TINY=1 bash benchmarks/session_fused.sh
set -u -o pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
OUT=${OUT:-bench-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
LOG=${FUSED_LOG:-$OUT/session.log}
BUDGET=${FUSED_BUDGET:-1300}
START=$(date +%s)
export HF_HUB_OFFLINE=1 TRITON_CACHE_AUTOTUNING=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
cd "$ROOT" || exit 1
# shellcheck source=benchmarks/session_lib.sh
source "$HERE/session_lib.sh"
if [ -n "${FUSED_TINY:-}" ]; then
  PY=python; B32=512; B8=512; T=(--tiny); OPS=(--stand-ins); PROFILE_SET=()
else
  PY=python3; B32=32768; B8=8192; T=(); OPS=(--tokens 32768)
  PROFILE_SET=(--extra-set "training.fused_ops=[rms_norm,swiglu,gated_norm]")
fi
run() {  # run NAME MIN_SECONDS cmd...: skipped when fewer than MIN_SECONDS are left; killed at the budget
  local name=$1 min=$2 t; t=$(($(left) - 10)); shift 2
  if [ "$t" -lt "$min" ]; then say "### $name: skipped, $(left) s left"; return 0; fi
  say "### $name ($(($(date +%s) - START)) s in, timeout $t s): $*"
  timeout -k 30 "$t" "$@" 2>&1 | grep --line-buffered -v -e '^train ' -e 'it/s\]$' -e '^step [0-9]' | tee -a "$LOG"
  say "### $name: exit ${PIPESTATUS[0]} at $(($(date +%s) - START)) s"
}

machine_header

run "1 fused ops vs eager modules" 30 $PY benchmarks/fused_ops_gpu.py "${OPS[@]}"

if [ -n "${FUSED_TINY:-}" ]; then  # no Triton on CPU: the levers' logic with the variants that run here
  PARTS=("$B32:2:keep2" "$B32:2:keep2+regions" "$B8:2:chunked")
else
  PARTS=("$B32:4:keep2" "$B32:4:keep2+fused" "$B32:8:keep2" "$B32:8:keep2+fused" "$B32:4:base" "$B32:4:base+fused"
         "$B32:4:keep2+regions" "$B32:4:keep2+fp8+regions" "$B8:4:chunked" "$B8:8:chunked" "$B8:4:chunked+fused"
         "$B8:8:chunked+fused" "$B32:4:keep2+fused+fp8+regions" "$B32:8:keep2+fused+fp8+regions")
fi
run "2 levers" 200 $PY benchmarks/levers_gpu.py "${T[@]}" --parts "${PARTS[@]}" --budget $(($(left) - 140)) \
  --min-left 40 --published 32768:0.2658:0.729 8192:0.0604:0.169

run "3 profile, 4 layers, 32k, fused" 90 $PY benchmarks/depth_gpu.py "${T[@]}" --block-len "$B32" --what profile \
  --profile-layers 4 --timeout $(($(left) - 20)) "${PROFILE_SET[@]}"

say "### session done at $(($(date +%s) - START)) s of $BUDGET"
