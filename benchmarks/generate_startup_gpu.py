"""Start-up of `ftcli generate` on a GPU, cold and warm (issue 46, item 11): each run is a fresh process,
so it pays the imports, the load, the kernel compilation and autotuning it does not find in the caches, and
the CUDA graph capture of the decoding step (once per process).

    python3 benchmarks/generate_startup_gpu.py [--config pkg://assets/tiny-qwen3_5.json] [--model-type qwen3_5_text]
        [--runs 3] [--new-tokens 32] [--device cuda]

One random-init model (the tiny Qwen3.5 hybrid by default: 2 layers, fla's gated-delta and conv kernels on
CUDA) is saved with the shipped tokenizer, then `python -m ftcli generate MODEL -p ... --greedy --json` runs
`--runs` times under each setting:

    per-process  every run gets an empty FTCLI_CACHE and empty Triton / inductor / tilelang caches (what a
                 fresh machine, or a machine whose caches live in a temp dir per process, pays every time)
    persistent   one FTCLI_CACHE for all runs, emptied once before the first (the first is cold, the next
                 ones find the kernels and autotune results it kept)

It prints one table to stdout: setting, run, wall seconds of the process, decoding tokens/s (from --json),
and the GPU-kernels line the run printed. On CPU (`--device cpu`) it checks the script's logic only (no
kernels are compiled there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TILELANG_CACHE_DIR", "FLA_CACHE_RESULTS")


def save_model(config: str, model_type: str, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer

    from ftcli.config.recipe import ModelConfig, resolve_path
    from ftcli.model.build import load_model

    torch.manual_seed(0)
    model = load_model(ModelConfig(init="random", config=config, tokenizer="unused", model_type=model_type,
                                   dtype="bfloat16"))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-qwen")).save_pretrained(out)
    return out


def one_run(model: Path, cache: Path, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
    env["FTCLI_CACHE"] = str(cache)
    cmd = [sys.executable, "-m", "ftcli", "generate", str(model), "-p", "What is 2 plus 4?", "--greedy", "--json",
           "--max-new-tokens", str(args.new_tokens), "--device", args.device]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - start
    if res.returncode != 0:
        return {"wall": wall, "tps": None, "note": (res.stderr.strip().splitlines() or ["?"])[-1][:100]}
    reply = json.loads(res.stdout.strip().splitlines()[-1])
    note = next((line for line in res.stderr.splitlines() if line.startswith("GPU kernels:")), "-")
    return {"wall": wall, "tps": reply.get("tokens_per_s"), "note": note[:100]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="pkg://assets/tiny-qwen3_5.json")
    ap.add_argument("--model-type", default="qwen3_5_text")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ftcli-startup-"))
    try:
        model = save_model(args.config, args.model_type, work / "model")
        rows = []
        for run in range(args.runs):
            fresh = work / f"fresh-{run}"
            rows.append(("per-process", run + 1, one_run(model, fresh, args)))
            shutil.rmtree(fresh, ignore_errors=True)
        shared = work / "shared"
        for run in range(args.runs):
            rows.append(("persistent", run + 1, one_run(model, shared, args)))
        print(f"| setting | run | wall s | tokens/s | kernels line |")
        print("|---|---:|---:|---:|---|")
        for setting, run, r in rows:
            tps = f"{r['tps']:.1f}" if r["tps"] is not None else "-"
            print(f"| {setting} | {run} | {r['wall']:.1f} | {tps} | {r['note']} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
