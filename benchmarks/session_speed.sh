#!/usr/bin/env bash
# One device call (one fresh H200) for issue 18's levers, most important first; every step is bounded by
# what is left of the call's budget (SPEED_BUDGET seconds from this script's start, default 490: the
# command's 540 s minus ~30 s of `source .gpu/activate.sh` + pip and a margin), and every table is printed
# as soon as it is measured (stdout and $OUT/session.log).
#   0  the collator's fla chunk indices == fla's own prepare_chunk_indices (the lever's correctness)
#   a  the per-block tensors, 4 layers, 32k, qwen-b300 settings: `ftcli train`'s worker steps the same 8
#      blocks with them and without them (as before), s/step, losses, host syncs per step  (depth_gpu lever)
#   c  in the same process, between the two: the eval pass (forward only, no grad, summed token CE)  (eval)
#      The first Qwen3.5 step on a fresh machine compiles fla/tilelang kernels (>= 170 s): a pays it.
#   b  8k blocks: the published loop at 4 and 8 layers, then `ftcli train` at 4 and 8 layers, the fit
#   d  benchmarks/generate_gpu.py --new-tokens 256 --batches 8,32 (random-init gpt-oss-20b); runs before b
#   device: source .gpu/activate.sh && python3 -m pip install -q --no-index --no-deps --upgrade \
#           --target /tmp/gpu-site .whl/*.whl && bash benchmarks/session_speed.sh
#   CPU logic check of every step (tiny models, 512-token blocks): SPEED_TINY=1 bash benchmarks/session_speed.sh
set -u -o pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
OUT=${OUT:-bench-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
LOG="$OUT/session.log"
BUDGET=${SPEED_BUDGET:-490}
START=$(date +%s)
TINY=${SPEED_TINY:-}
# tiny (CPU, a shared machine): 4 steps a part, every timeout x8, no budget of its own
if [ -n "$TINY" ]; then T=(--tiny); B32=512; B8=512; PY=python; STEPS=4; SCALE=8; BUDGET=${SPEED_BUDGET:-4000}
else T=(); B32=32768; B8=8192; PY=python3; STEPS=8; SCALE=1; fi
export HF_HUB_OFFLINE=1 TRITON_CACHE_AUTOTUNING=1
cd "$ROOT" || exit 1
# shellcheck source=benchmarks/session_lib.sh
source "$HERE/session_lib.sh"

cap() {  # cap SECONDS: min(SECONDS x SCALE, time left - 15)
  local l c; l=$(($(left) - 15)); c=$(($1 * SCALE)); [ "$c" -lt "$l" ] && echo "$c" || echo "$l"
}
run() {  # run NAME MIN_SECONDS MAX_SECONDS cmd...: skipped when fewer than MIN_SECONDS are left
  local name=$1 min=$(($2 * SCALE)) t; t=$(cap "$3"); shift 3
  if [ "$t" -lt "$min" ]; then say "### $name: skipped, $(left) s left"; return 0; fi
  say "### $name ($(($(date +%s) - START)) s in, timeout $t s): $*"
  timeout -k 45 "$t" "$@" 2>&1 | grep --line-buffered -v -e '^train ' -e 'it/s\]$' | tee -a "$LOG"
  say "### $name: exit ${PIPESTATUS[0]} at $(($(date +%s) - START)) s"
}

machine_header

run "0 chunk indices vs fla" 10 60 $PY - <<'EOF'
import numpy as np
import torch
from ftcli.data.collate import FLA_CHUNK, fla_chunk_indices
try:
    from fla.ops.utils import prepare_chunk_indices
except ImportError as e:  # CPU logic check: no fla here
    raise SystemExit(f"fla not importable ({e}); skipped")
rng = np.random.default_rng(0)
cases = [[1], [63], [64], [65], [70, 3, 1, 20, 5], [32768]] + [list(rng.integers(1, 3000, 20)) for _ in range(20)]
bad = 0
for lens in cases:
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ours = fla_chunk_indices(cu)
    theirs = prepare_chunk_indices(torch.tensor(cu, device="cuda"), FLA_CHUNK).cpu().numpy()
    bad += not np.array_equal(ours, theirs)
print(f"ftcli.data.collate.fla_chunk_indices == fla.ops.utils.prepare_chunk_indices on {len(cases)} layouts: {bad == 0}")
EOF

# a + c: 4 layers, 32k, one process: with the per-block tensors (pays the compile), eval, without them
run "a+c lever and eval, 32k, 4 layers" 120 330 $PY benchmarks/depth_gpu.py "${T[@]}" --block-len "$B32" \
  --what lever eval --inproc-layers 4 --inproc-steps "$STEPS" --timeout $(($(cap 330) - 5)) --out /tmp/speed-inproc

# d: decoding speed (random-init gpt-oss-20b), before b (the decode figure is wanted more than the 8k fit)
if [ -n "$TINY" ]; then
  run "d generate" 30 120 $PY benchmarks/generate_gpu.py --device cpu --dtype float32 \
    --config pkg://assets/tiny-gpt-oss.json --new-tokens 8 --batches 2,4
else
  run "d generate" 75 150 $PY benchmarks/generate_gpu.py --new-tokens 256 --batches 8,32
fi

# b: 8k, the published loop and ftcli at 4 and 8 layers, each sub-run in its own call (its own timeout)
R8="$OUT/rows-$B8.jsonl"
run "b published loop, 8k, 4 and 8 layers" 60 120 $PY benchmarks/depth_gpu.py "${T[@]}" --block-len "$B8" \
  --layers 4 8 --what reference --timeout $(($(cap 120) - 5)) --out /tmp/speed-8k --rows "$R8"
for n in 4 8; do
  run "b ftcli, 8k, $n layers" 45 90 $PY benchmarks/depth_gpu.py "${T[@]}" --block-len "$B8" --layers "$n" \
    --what ftcli --timeout $(($(cap 90) - 5)) --out /tmp/speed-8k --rows "$R8"
done
run "b fit, 8k" 5 60 $PY benchmarks/depth_gpu.py "${T[@]}" --block-len "$B8" --what fit --out /tmp/speed-8k --rows "$R8"

say "### session done at $(($(date +%s) - START)) s of $BUDGET"
