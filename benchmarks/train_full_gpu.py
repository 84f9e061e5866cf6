"""Throughput and memory of `ftcli train` (the FSDP2 loop) at the qwen-b300 width, on 1 and 2 GPUs.

Runs the real CLI path (`python -m ftcli train`, launcher -> torchrun -> workers) on
benchmarks/recipes/qwen27b-4layer-h200.yaml (27B width, 4 layers, random init, synthetic 32k packed
blocks, 20 steps) once per GPU count, reads every run's metrics.jsonl (one line per step) and prints a
markdown table: tokens/s per GPU, MFU, s/step (medians over the steps after --warmup), peak memory.

Variants (more with --set, passed to every run):
    ftcli      the recipe: fp32 master weights, no activation checkpointing (4 layers fit), liger's fused
               linear cross-entropy, no compile; other settings with --set (BENCHMARKS.md lists each row's)
    reference  the published loop's settings (qwen-b300's train.py): full-logit loss, bf16 master weights,
               full activation checkpointing, no compile

H200 (from the project root, .gpu staged with ../shared/gpu/stage.sh and carried):
    source .gpu/activate.sh && python benchmarks/train_full_gpu.py --gpus 1 2 --variant ftcli reference
    source .gpu/activate.sh && python benchmarks/train_full_gpu.py --gpus 1 --block-len 16384 \
        --set training.activation_checkpointing=selective --set training.loss.impl=chunked
CPU logic check (tiny model, 512-token blocks, 1 and 2 gloo processes, same code path):
    python benchmarks/train_full_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "benchmarks" / "recipes" / "qwen27b-4layer-h200.yaml"
VARIANTS = {
    "ftcli": [],
    "reference": [
        "training.loss.impl=full",
        "training.precision.master_dtype=bfloat16",
        "training.activation_checkpointing=full",
        "training.compile=false",
        "training.grad_clip=null",
    ],
}
TINY = [  # CPU: the tiny Qwen3.5 config, small blocks, float32 compute, no liger (GPU only)
    "model.config=pkg://assets/tiny-qwen3_5.json",
    "data.packing.block_len=512",
    "data.synthetic.num_examples=400",
    "data.synthetic.mean_tokens=120",
    "data.synthetic.max_tokens=500",
    "training.max_steps=6",
    "training.precision.param_dtype=float32",
    "training.optimizer.fused=false",
    "training.loss.impl=chunked",
]


def run_one(n: int, variant: str, sets: list[str], out: Path, tiny: bool) -> dict:
    run_dir = out / f"{variant}-{n}{'cpu' if tiny else 'gpu'}"
    args = [sys.executable, "-m", "ftcli", "train", "--recipe", str(RECIPE), "--force",
            "--set", f"output.dir={run_dir}"]
    for s in [*(TINY if tiny else []), *VARIANTS[variant], *sets]:
        args += ["--set", s]
    env = dict(os.environ)
    if tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""
        args += ["--set", f"training.cpu_processes={n}"]
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(n)))
    print(f"\n=== {variant}, {n} {'CPU process' if tiny else 'GPU'}(s): {' '.join(args[3:])}", flush=True)
    start = time.perf_counter()
    res = subprocess.run(args, cwd=ROOT, env=env)
    row = {"variant": variant, "n": n, "exit": res.returncode, "wall_s": time.perf_counter() - start}
    metrics_file = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    row["steps"] = len(steps)
    if steps:
        row["peak_mem"] = max(m["peak_mem"] for m in steps)
        reserved = [m["peak_mem_reserved"] for m in steps if m.get("peak_mem_reserved") is not None]
        row["peak_reserved"] = max(reserved) if reserved else None
        row["mem_unit"] = steps[-1]["mem_unit"]
        row["final_loss"] = steps[-1]["loss"]
    return row | {"_steps": steps}


def summarize(row: dict, warmup: int) -> dict:
    steady = [m for m in row.pop("_steps") if m["step"] > warmup]
    if steady:
        row["tokens_per_s_per_device"] = statistics.median(m["tokens_per_s_per_device"] for m in steady)
        row["s_per_step"] = statistics.median(m["s_per_step"] for m in steady)
        mfu = [m["mfu"] for m in steady if m.get("mfu") is not None]
        row["mfu"] = statistics.median(mfu) if mfu else None
    return row


def table(rows: list[dict], block_len: str) -> str:
    cells = []
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        tps = f"{r['tokens_per_s_per_device']:,.0f}" if "tokens_per_s_per_device" in r else "-"
        sps = f"{r['s_per_step']:.3f}" if "s_per_step" in r else "-"
        mem = f"{r['peak_mem']:.1f} {r['mem_unit']}" if "peak_mem" in r else "-"
        if r.get("peak_reserved") is not None:
            mem = f"{r['peak_mem']:.1f} ({r['peak_reserved']:.1f}) {r['mem_unit']}"
        loss = f"{r['final_loss']:.3f}" if "final_loss" in r else "-"
        cells.append([r["variant"], r["n"], block_len, tps, mfu, sps, mem, loss, r["exit"]])
    return common.table(["variant", "devices", "block", "tokens/s/device", "MFU", "s/step", "peak mem (reserved)",
                         "final loss", "exit"], cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="device counts to run (default 1 2)")
    parser.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), default=["ftcli"],
                        help="ftcli: the recipe; reference: the published loop's settings")
    parser.add_argument("--block-len", type=int, default=None, help="override data.packing.block_len")
    parser.add_argument("--steps", type=int, default=None, help="override training.max_steps")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (default 3; tiny 1)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra recipe override (repeatable)")
    parser.add_argument("--tiny", action="store_true", help="CPU logic check: tiny model, gloo processes")
    parser.add_argument("--out", type=Path, default=None, help="run dirs go here (default: a temp dir)")
    args = parser.parse_args()

    sets = list(args.sets)
    if args.block_len:
        sets.append(f"data.packing.block_len={args.block_len}")
    if args.steps:
        sets.append(f"training.max_steps={args.steps}")
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    out = args.out or Path(tempfile.mkdtemp(prefix="ftcli-bench-"))
    rows = []
    for variant in args.variant:
        for n in args.gpus:
            rows.append(summarize(run_one(n, variant, sets, out, args.tiny), warmup))
    block = str(args.block_len or (512 if args.tiny else 32768))
    print(f"\nqwen27b-4layer{' (tiny CPU mode)' if args.tiny else ''}; medians over steps > {warmup}; "
          f"extra --set: {' '.join(sets) or '-'}; run dirs in {out}\n")
    print(table(rows, block))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
