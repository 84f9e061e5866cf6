"""`ftcli train` end to end for each dense / MoE family of issue 28 at its real width, layers cut: the shipped recipes'
own settings (full SFT through the FSDP2 loop, LoRA through TRL + PEFT), random init, synthetic chats, a few steps.

    llama3-8b-h100            Llama-3.1-8B width, full SFT (fused ops as shipped), 2 layers
    qwen3-8b (llama3-8b-h100) Qwen3-8B width (q/k norms) on the same full-SFT settings, 2 layers
    gemma3-12b-h100           gemma-3-12b-it (the VLM, text trained, tower frozen), full SFT, 6 layers (5 sliding + 1 global)
    qwen3-30b-a3b-lora-h100   Qwen3-30B-A3B width, LoRA on attention + experts, base sharded by FSDP2, 2 layers
    gpt-oss-h100              gpt-oss-20b width, LoRA on attention, each decoder layer compiled (as shipped), 4 layers
    llama3-70b-lora-h100      Llama-3.3-70B width, LoRA, base sharded by FSDP2, 2 layers

Each run is `python -m ftcli train` (the launcher, torchrun on the GPUs present) in its own process, `--jobs` at a
time; the table comes from each run's metrics.jsonl (loss, tokens/s, memory) and its first log lines (the packed
attention backend, the features). Step 1 includes compilation; tokens/s is the median of the later steps.

H200 (project root; carry .gpu and .gpu-ao, transformers 5.24 unpacked into /tmp/gpu-site):
    python benchmarks/families_train_gpu.py --jobs 2
CPU logic check (each family's tiny config, 256-token blocks, one CPU process):
    python benchmarks/families_train_gpu.py --tiny
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "max_position_embeddings": 40960}
# name -> (recipe, real config, tiny config, tokenizer, layers, extra --set)
RUNS = {
    "llama3-8b": ("llama3-8b-h100", "models/meta-llama--Llama-3.1-8B-Instruct.json", "tiny-llama3.json", "llama3", 2,
                  []),
    "qwen3-8b": ("llama3-8b-h100", "tiny-qwen3.json", "tiny-qwen3.json", "qwen3", 2,
                 ["model.model_type=qwen3", *(f"model.config_overrides.{k}={v}" for k, v in QWEN3_8B.items())]),
    "gemma3-12b": ("gemma3-12b-h100", "models/google--gemma-3-12b-it.json", "tiny-gemma3.json", "gemma3", 6, []),
    "qwen3-30b-a3b-lora": ("qwen3-30b-a3b-lora-h100", "models/Qwen--Qwen3-30B-A3B.json", "tiny-qwen3-moe.json",
                           "qwen3", 2, []),
    "gpt-oss-20b-lora": ("gpt-oss-h100", "models/openai--gpt-oss-20b.json", "tiny-gpt-oss.json", "gpt-oss", 4,
                         ["model.quantization=none"]),
    "llama3-70b-lora": ("llama3-70b-lora-h100", "models/meta-llama--Llama-3.3-70B-Instruct.json", "tiny-llama3.json",
                        "llama3", 2, []),
}


NOTE_WORDS = ("packed kernels", "trainable params", "attention", "fused", "fp8", "compiled", "expert lora", "warning", "sharded")


def sets_for(name: str, args, out: Path) -> list[str]:
    from ftcli.config.recipe import load_recipe

    recipe, real, tiny, tok, layers, extra = RUNS[name]
    block = 256 if args.tiny else args.block or load_recipe(recipe).data.packing.block_len
    sets = [
        "model.init=random", f"model.config=pkg://assets/{tiny if args.tiny else real}",
        f"model.tokenizer=pkg://assets/tokenizer-{tok}", f"model.config_overrides.num_hidden_layers={layers}",
        "data.source=synthetic", "data.streaming=false", f"data.synthetic.num_examples={60 if args.tiny else 300}",
        f"data.synthetic.mean_tokens={100 if args.tiny else 1200}", f"data.synthetic.max_tokens={block}",
        f"data.max_length={block}", f"data.packing.block_len={block}", "training.grad_accum=1", "training.log_every=1",
        f"training.max_steps={args.steps}", "tracking.enabled=false", "training.checkpoint.enabled=false", "training.checkpoint.save_final_hf=false",
        f"output.dir={out / name}",
    ]
    if args.tiny:
        extra = [e for e in extra if "config_overrides" not in e]  # the tiny config's own width
        sets += ["model.dtype=float32", "training.cpu_processes=1", "training.optimizer.fused=false"]
        if recipe != "qwen3-30b-a3b-lora-h100" and "lora" not in recipe:
            sets += ["training.fused_ops=[]"]  # Triton kernels: CUDA only
    return sets + extra


def run_one(name: str, args, out: Path) -> dict:
    recipe = RUNS[name][0]
    cmd = [sys.executable, "-m", "ftcli", "train", "--recipe", recipe]
    for s in sets_for(name, args, out):
        cmd += ["--set", s]
    if args.tiny and recipe in ("gemma3-12b-h100",):
        cmd += ["--set", "model.model_type=gemma3_text", "--set", "model.model_class=causal_lm"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    row = {"name": name, "recipe": recipe, "rc": proc.returncode, "wall_s": round(wall, 1),
           "notes": [line.split(", run dir ")[0] for line in lines if any(w in line.lower() for w in NOTE_WORDS)][:6]}
    metrics = out / name / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [s for s in steps if "loss" in s and "step" in s]
    if proc.returncode != 0 or not steps:
        row["error"] = [line for line in log.splitlines() if line.strip()][-12:]
        return row
    row["losses"] = [round(float(s["loss"]), 4) for s in steps]
    later = steps[1:] or steps
    for key in ("tokens_per_s", "tok_per_s", "tokens_per_second"):
        if key in steps[0]:
            row["tok_s"] = statistics.median(float(s[key]) for s in later)
    if "peak_mem" in steps[0]:
        row["mem"] = f"{max(float(s['peak_mem']) for s in steps):.1f} {steps[0].get('mem_unit', '')}".strip()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of: {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--block", type=int, default=0, help="tokens per packed block (0: each recipe's own)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (one GPU holds several cut models)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if args.tiny:
        args.steps = min(args.steps, 3)
    names = args.runs.split(",")
    with tempfile.TemporaryDirectory(prefix="ftcli-fam-train-") as tmp:
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(lambda n: run_one(n, args, Path(tmp)), names))
    for row in rows:
        print("RESULT", json.dumps(row), flush=True)
    print("\n| run | recipe | losses | tok/s (median after step 1) | peak memory | wall s | backend / features |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['recipe']} | FAILED rc {r['rc']}: {r['error'][-1][:120]} | | | {r['wall_s']} | |")
            continue
        tok = f"{r['tok_s']:,.0f}" if "tok_s" in r else "-"
        mem = r.get("mem", "-")
        print(f"| {r['name']} | {r['recipe']} | {' '.join(f'{x:.4f}' for x in r['losses'])} | {tok} | {mem} "
              f"| {r['wall_s']} | {'; '.join(r['notes']) or '-'} |")
    sys.exit(0 if all("error" not in r for r in rows) else 1)


if __name__ == "__main__":
    main()
