#!/usr/bin/env bash
# Every GPU row of BENCHMARKS.md in one device call (one H200), most important first, each bounded by
# `timeout` so a slow one cannot eat the others' time. Writes $OUT/summary.md (the tables) and
# $OUT/runs.log (everything); the device tool returns at most 8 files, so keep it to these two.
#   device: source .gpu/activate.sh && python3 -m pip install -q --no-index --no-deps --upgrade \
#           --target /tmp/gpu-site .whl/*.whl; bash benchmarks/h200_session.sh
# A first run on a fresh machine spends ~1 minute of its first step compiling fla/tilelang kernels.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
SUM="$OUT/summary.md"; LOG="$OUT/runs.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$SUM" 2>&1
full() {  # name timeout args...
  local name=$1 t=$2; shift 2
  echo "### $name: python3 benchmarks/train_full_gpu.py $*" | tee -a "$LOG" >> "$SUM"
  timeout "$t" python3 benchmarks/train_full_gpu.py --gpus 1 "$@" > "$OUT/cur.log" 2>&1
  echo "exit $?" >> "$SUM"; sed -n '/^| variant/,$p' "$OUT/cur.log" >> "$SUM"; cat "$OUT/cur.log" >> "$LOG"
}
S="--steps 8 --warmup 3"
AC=training.activation_checkpointing; LOSS=training.loss.impl; MASTER=training.precision.master_dtype
full reference-32k 180 $S --variant reference
full default-32k 120 $S --variant ftcli --set $AC=none --set $LOSS=liger
full bf16-full-chunked-32k 120 $S --variant ftcli --set $MASTER=bfloat16 --set $AC=full --set $LOSS=chunked
full fp32-full-chunked-32k 120 $S --variant ftcli --set $AC=full --set $LOSS=chunked
timeout 280 python3 benchmarks/lora_gpt_oss_gpu.py --modes reference,default,ftcli-8k-no-ac --steps 6 --warmup 2 > "$OUT/cur.log" 2>&1
echo "lora exit $?" >> "$SUM"; sed -n '/^LoRA r8/,$p' "$OUT/cur.log" >> "$SUM"; cat "$OUT/cur.log" >> "$LOG"
full fp32-selective-chunked-32k 100 $S --variant ftcli --set $AC=selective --set $LOSS=chunked
full bf16-selective-chunked-32k 100 $S --variant ftcli --set $MASTER=bfloat16 --set $AC=selective --set $LOSS=chunked
full fp32-none-chunked-32k 100 $S --variant ftcli --set $AC=none --set $LOSS=chunked
full fp32-full-chunked-16k 80 $S --variant ftcli --block-len 16384 --set $AC=full --set $LOSS=chunked
full fp32-full-chunked-8k 80 $S --variant ftcli --block-len 8192 --set $AC=full --set $LOSS=chunked
rm -f "$OUT/cur.log"
