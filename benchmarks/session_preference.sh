#!/usr/bin/env bash
# The preference-tuning and context-parallel rows of BENCHMARKS.md on one H200, in parts chosen by name, each
# bounded by `timeout` so a slow part cannot eat the others' time. Prints every table to stdout and writes
# $OUT/summary.md (the tables) and $OUT/runs.log (everything).
#   carry: .gpu (../shared/gpu/stage.sh) and .gpu-ao (transformers 5.24 and torchao tars, DEVELOPERS.md)
#   device: source .gpu/activate.sh && bash benchmarks/session_preference.sh pref-llama cp-32k
# Parts: pref-llama (llama4 llama8 gptoss against TRL, TRL's precompute too), pref-qwen (qwen4 qwen8, the same),
# pref-stored (llama8 qwen8 with ftcli's precomputed reference), cp-32k, cp-128k, startup, lora.
# The first Qwen3.5 part on a fresh machine spends a few minutes compiling fla/tilelang kernels.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
SUM="$OUT/summary.md"; LOG="$OUT/runs.log"
if [ ! -d /tmp/gpu-site/transformers ] || ! grep -q '5.24' /tmp/gpu-site/transformers/__init__.py 2>/dev/null; then
  tar -xJf .gpu-ao/transformers-5.24.0-full.tar.xz -C /tmp/gpu-site
  tar -xJf .gpu-ao/torchao-0.18.0-noso.tar.xz -C /tmp/gpu-site
fi
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
{ date -u +"%Y-%m-%d %H:%M UTC"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import common
print(common.staging_line('torch', 'transformers', 'trl', 'peft', 'triton', 'fla', 'torchao'))"; } 2>&1 | tee -a "$SUM"
part() {  # name timeout command...
  local name=$1 t=$2; shift 2
  echo "### $name: $*" | tee -a "$SUM"
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/cur.log" 2>&1
  local rc=$?
  echo "exit $rc after $((SECONDS - t0)) s" | tee -a "$SUM"
  grep -E '^\||^device|^syncs:|OOM|Error|error:' "$OUT/cur.log" | grep -v 'it/s' | tee -a "$SUM"
  [ "$rc" -eq 0 ] || grep -E '^\[ *[0-9.]+s\]' "$OUT/cur.log" | tail -n 12 | tee -a "$SUM"
  cat "$OUT/cur.log" >> "$LOG"
}
P="python3 benchmarks/preference_gpu.py --steps 8 --warmup 3"
for name in "$@"; do
  case $name in
    pref-llama) part "$name" 330 $P --cases llama4 llama8 gptoss --trl-precompute ;;
    pref-qwen) part "$name" 420 $P --cases qwen4 qwen8 --trl-precompute ;;
    pref-stored) part "$name" 300 $P --cases llama8 qwen8 --ftcli-precompute ;;
    cp-32k) part "$name" 240 python3 benchmarks/cp_gpu.py --tokens 32768 --cp 2 4 8 --memory ;;
    cp-128k) part "$name" 200 python3 benchmarks/cp_gpu.py --tokens 131072 --cp 8 --memory ;;
    startup) part "$name" 240 python3 benchmarks/generate_startup_gpu.py --runs 2 ;;
    lora) part "$name" 280 python3 benchmarks/lora_gpt_oss_gpu.py --modes default,ftcli-8k,ftcli-16k --steps 6 --warmup 2 ;;
    *) echo "unknown part $name" | tee -a "$SUM" ;;
  esac
done
rm -f "$OUT/cur.log"
