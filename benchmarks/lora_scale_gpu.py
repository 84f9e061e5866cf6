"""gpt-oss-120b LoRA with the base sharded by FSDP2, cut to N layers on one GPU, next to the memory model.

Each depth is a real `python -m ftcli train --recipe gpt-oss-120b-h100` (launcher -> torchrun -> TRL +
PEFT + accelerate FSDP2, training.sharding=fsdp from the recipe) with: random init at the 120b shape
(ftcli/assets/models/openai--gpt-oss-120b.json) cut to N layers, bf16 (no MXFP4 weights to dequantize),
the shipped gpt-oss tokenizer, synthetic chat data packed into the recipe's 4k blocks, max_steps steps,
tracking and checkpoints off. One GPU means world size 1: the "shard" is the whole N-layer base, so the
point checks the memory model's terms (base, adapter, optimizer, activations, loss) that do not depend on
the world size; the recipe's 8xH100 figure is the same model at 36 layers over 8 shards.

Reported per depth: median s/step and tokens/s (steps after --warmup, from metrics.jsonl), peak GPU
memory allocated / reserved (torch), and `ftcli.estimate.fit.memory_on` for the same recipe on 1 GPU; then the
per-layer slope and the 36-layer extrapolation of s/step (one GPU's compute for one 4k block; the 8-GPU
run adds FSDP's all-gathers), and the memory model's 8xH100 prediction for the real recipe.

`--experts grouped peft` runs each depth once per expert LoRA (`lora.experts`: the grouped, unmerged GEMMs of
ftcli.model.moe_lora, the recipe's default, or PEFT's folded ParamWrapper), `--ac none` without activation
checkpointing (where PEFT's fold keeps every layer's W + s·A·B and the grouped path does not).

H200 (project root, .gpu carried):  python benchmarks/lora_scale_gpu.py --layers 4 6
CPU logic check (tiny gpt-oss, 256-token blocks, 1 process): python benchmarks/lora_scale_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402

RECIPE = "gpt-oss-120b-h100"
CONFIG_120B = ROOT / "ftcli" / "assets" / "models" / "openai--gpt-oss-120b.json"


def depth_config(layers: int, tiny: bool, out: Path) -> Path:
    src = ROOT / "ftcli" / "assets" / "tiny-gpt-oss.json" if tiny else CONFIG_120B
    cfg = {k: v for k, v in json.loads(src.read_text()).items() if not k.startswith("_")}
    cfg["num_hidden_layers"] = layers
    if "layer_types" in cfg:
        cfg["layer_types"] = [cfg["layer_types"][i % len(cfg["layer_types"])] for i in range(layers)]
    else:  # gpt-oss alternates sliding and full attention, sliding first
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    path = out / f"gpt-oss-120b-{layers}layer.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def overrides(args, layers: int, out: Path, experts: str = "grouped") -> list[str]:
    sets = ["model.init=random", "model.quantization=none", "model.tokenizer=pkg://assets/tokenizer-gpt-oss",
            f"model.config={depth_config(layers, args.tiny, out)}", "data.source=synthetic",
            "data.synthetic.num_examples=600", f"data.synthetic.mean_tokens={120 if args.tiny else 1200}",
            f"data.synthetic.max_tokens={512 if args.tiny else 8192}", "tracking.enabled=false",
            "training.checkpoint.enabled=false", "training.checkpoint.save_final_hf=false",
            f"training.max_steps={args.steps}", "training.log_every=1", f"output.dir={out / f'l{layers}'}",
            f"lora.experts={experts}", f"training.activation_checkpointing={args.ac}"]
    if args.tiny:
        sets += ["model.dtype=float32", "training.optimizer.fused=false", "data.max_length=256",
                 "data.packing.block_len=256", "training.cpu_processes=1"]
    return sets


def predicted(sets: list[str], world: int) -> dict:
    from ftcli.estimate.fit import memory_on
    from ftcli.config.recipe import load_recipe

    return memory_on(load_recipe(RECIPE, sets), world).to_dict()


def run_depth(args, layers: int, out: Path, experts: str) -> dict:
    sets = overrides(args, layers, out, experts)
    cmd = [sys.executable, "-m", "ftcli", "train", "--recipe", RECIPE, "--force"]
    for s in sets:
        cmd += ["--set", s]
    start = time.perf_counter()
    log = out / f"l{layers}-{experts}.log"  # every line of the run with its time since start: where a slow build waits
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    timer = threading.Timer(args.timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    with open(log, "w") as f:
        for line in proc.stdout:
            f.write(f"[{time.perf_counter() - start:7.1f} s] {line}")
            f.flush()
    timer.cancel()
    code = proc.wait()
    code = "timeout" if code == -signal.SIGKILL else code
    tail = "".join(log.read_text().splitlines(keepends=True)[-12:])
    wall = time.perf_counter() - start
    metrics_file = out / f"l{layers}" / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    timed = steps[args.warmup:]
    row = {"layers": layers, "experts": experts, "ac": args.ac, "exit": code, "wall_s": round(wall, 1),
           "steps": len(steps), "predicted_1gpu": predicted(sets, 1),
           "grouped_installed": "expert LoRA: grouped, unmerged" in log.read_text()}  # the trainer's line
    if timed:
        row.update(s_per_step=statistics.median(m["s_per_step"] for m in timed),
                   tokens_per_s=statistics.median(m["tokens_per_s"] for m in timed),
                   peak_mem=max(m["peak_mem"] or 0 for m in steps), peak_reserved=max(m["peak_mem_reserved"] or 0 for m in steps),
                   mem_unit=steps[-1]["mem_unit"], losses=[round(m["loss"], 4) for m in steps])
    if code != 0:
        row["tail"] = tail
    shutil.rmtree(out / f"l{layers}", ignore_errors=True)  # the random-init base alone is 28 GB (26 GiB) at 4 layers
    return row


def table(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        head, model = [r["layers"], r["experts"], r["ac"], r["exit"]], f"{r['predicted_1gpu']['total']:.1f}"
        if "s_per_step" not in r:
            cells.append([*head, "-", "-", "-", model, "-", "-"])
            continue
        ratio = r["peak_mem"] / r["predicted_1gpu"]["total"] if r["peak_mem"] else float("nan")
        memory = f"{r['peak_mem']:.1f} ({r['peak_reserved']:.1f}) {r['mem_unit']}"
        cells.append([*head, f"{r['s_per_step']:.3f}", f"{r['tokens_per_s']:,.0f}", memory, model, f"{ratio:.2f}",
                      r["losses"]])
    lines = [common.table(["layers", "experts", "AC", "exit", "s/step", "tokens/s", "peak GiB allocated (reserved)",
                           "memory model, 1 GPU, GiB", "measured / model", "losses"], cells,
                          sep=["---:", "---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---"])]
    done = [r for r in rows if "s_per_step" in r and r["experts"] == rows[0]["experts"]]
    if len({r["layers"] for r in done}) >= 2:
        from ftcli.estimate.steptime import depth_fit

        slope, intercept = depth_fit([(r["layers"], r["s_per_step"]) for r in done])
        lines.append(f"\nper layer {slope:.4f} s, fixed part {intercept:.3f} s; 36 layers extrapolated "
                     f"{intercept + slope * 36:.2f} s/step for one GPU's 4k block (FSDP all-gathers not included)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="seconds per depth (the base is built on the CPU)")
    p.add_argument("--experts", nargs="+", choices=["grouped", "peft"], default=["grouped"])
    p.add_argument("--ac", choices=["full", "none"], default="full", help="training.activation_checkpointing")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    args.layers = args.layers or ([2, 4] if args.tiny else [4, 6])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(tempfile.mkdtemp(prefix="ftcli-lora-scale-"))
    eight = predicted(overrides(args, 36, out), 8)  # the shipped shape (36 layers) on the recipe's 8 GPUs
    print(f"memory model, {RECIPE} as shipped (36 layers), 8 GPUs: {eight}", flush=True)
    rows = []
    for n, experts in [(n, e) for n in args.layers for e in args.experts]:
        rows.append(run_depth(args, n, out, experts))
        print("ROW " + json.dumps(rows[-1]), flush=True)
        print(table(rows), flush=True)
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
