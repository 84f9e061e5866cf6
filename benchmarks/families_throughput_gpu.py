"""Full-SFT throughput at the Llama-3.1-8B width, layers cut: ftcli's FSDP2 loop against TRL's SFTTrainer.

Same shapes and settings on one GPU: random init, bf16 compute with fp32 master weights (TRL: fp32 model under
bf16 autocast), full activation checkpointing, AdamW, the same synthetic examples (ftcli.data.synthetic, seed 0:
token ids and prompt/response masks) packed into 8,192-token blocks (ftcli: bfd packing + its packed kernels;
TRL: packing=True, padding_free=True, completion-only loss; on a machine without flash-attn its attention is
sdpa over position_ids, which transformers turns into a block-diagonal mask). Tokens/s are medians over the
steps after --warmup (ftcli: its metrics.jsonl; TRL: tokens seen between logged steps), peak memory allocated.
Not the same initial weights or batch order: the losses are printed side by side, not compared.

H200:  source .gpu/activate.sh && python benchmarks/families_throughput_gpu.py --layers 4 8
CPU logic check (tiny Llama, 512-token blocks):  python benchmarks/families_throughput_gpu.py --tiny
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

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "benchmarks" / "recipes" / "llama8b-cut-h200.yaml"
TINY = ["model.config=pkg://assets/tiny-llama3.json", "data.packing.block_len=512", "data.synthetic.num_examples=300",
        "data.synthetic.mean_tokens=120", "data.synthetic.max_tokens=500", "training.max_steps=5",
        "training.precision.param_dtype=float32", "training.optimizer.fused=false"]


def sets_for(layers: int, tiny: bool, steps: int | None) -> list[str]:
    out = [*(TINY if tiny else []), f"model.config_overrides={{num_hidden_layers: {layers}}}"]
    return out + ([f"training.max_steps={steps}"] if steps else [])


def run_ftcli(layers: int, out: Path, tiny: bool, steps: int | None, warmup: int) -> dict:
    run_dir = out / f"ftcli-{layers}"
    args = [sys.executable, "-m", "ftcli", "train", "--recipe", str(RECIPE), "--force", "--set", f"output.dir={run_dir}"]
    for s in sets_for(layers, tiny, steps):
        args += ["--set", s]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if tiny else {})}
    if tiny:
        args += ["--set", "training.cpu_processes=1"]
    res = subprocess.run(args, cwd=ROOT, env=env)
    steps_ = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if res.returncode == 0 else []
    steady = [m for m in steps_ if m["step"] > warmup]
    return dict(impl="ftcli", layers=layers, exit=res.returncode,
                tokens_per_s=statistics.median(m["tokens_per_s_per_device"] for m in steady) if steady else None,
                peak=max((m["peak_mem"] for m in steps_), default=None),
                losses=[round(m["loss"], 3) for m in steps_])


def run_trl(layers: int, tiny: bool, steps: int | None, warmup: int) -> dict:
    """TRL in this process (no launcher): model from the same config, the same synthetic examples."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from ftcli.config.recipe import load_recipe, resolve_path
    from ftcli.data.synthetic import synthetic_examples

    recipe = load_recipe(str(RECIPE), sets_for(layers, tiny, steps))
    cfg = json.loads(Path(resolve_path(recipe.model.config, base=RECIPE.parent)).read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.update(recipe.model.config_overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    rows = [{"input_ids": ids.tolist(), "completion_mask": mask.astype(int).tolist()}
            for _, ids, mask in synthetic_examples(recipe.data.synthetic, config.vocab_size)]
    torch.manual_seed(0)
    device = "cpu" if tiny else "cuda"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").to(device)

    times: list[tuple[float, int]] = []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                times.append((time.perf_counter(), state.num_input_tokens_seen, logs["loss"]))

    block = recipe.data.packing.block_len
    sft = SFTConfig(output_dir=tempfile.mkdtemp(prefix="trl-"), max_steps=recipe.training.max_steps,
                    per_device_train_batch_size=1, gradient_accumulation_steps=1, learning_rate=1e-5,
                    lr_scheduler_type="constant", adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
                    bf16=not tiny, gradient_checkpointing=True, logging_steps=1, save_strategy="no", report_to=[],
                    packing=True, packing_strategy="bfd", padding_free=True, max_length=block,
                    completion_only_loss=True, include_num_input_tokens_seen="non_padding",
                    dataloader_num_workers=0, use_cpu=tiny, optim="adamw_torch_fused" if not tiny else "adamw_torch")
    if not tiny:
        torch.cuda.reset_peak_memory_stats()
    tokenizer = AutoTokenizer.from_pretrained(resolve_path(recipe.model.tokenizer))  # pre-tokenized rows: ids only
    trainer = SFTTrainer(model=model, args=sft, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         callbacks=[Clock()])
    trainer.train()
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(times[warmup:], times[warmup + 1:])]
    peak = torch.cuda.max_memory_allocated() / 2**30 if not tiny else None
    return dict(impl="trl", layers=layers, exit=0, tokens_per_s=statistics.median(rates) if rates else None,
                peak=peak, losses=[round(t[2], 3) for t in times])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--impl", nargs="+", choices=["ftcli", "trl"], default=["ftcli", "trl"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    warmup = 1 if args.tiny else args.warmup
    out = Path(tempfile.mkdtemp(prefix="ftcli-fam-bench-"))
    rows = []
    for layers in ([2] if args.tiny else args.layers):
        for impl in args.impl:
            try:
                row = run_ftcli(layers, out, args.tiny, args.steps, warmup) if impl == "ftcli" \
                    else run_trl(layers, args.tiny, args.steps, warmup)
            except Exception as e:  # noqa: BLE001 - one failed variant still prints the others
                row = dict(impl=impl, layers=layers, exit=f"{type(e).__name__}: {e}"[:200], tokens_per_s=None,
                           peak=None, losses=[])
            rows.append(row)
            print("ROW", json.dumps(row), flush=True)
    print(f"\nLlama-3.1-8B width{' (tiny CPU mode)' if args.tiny else ''}, 8k blocks, full checkpointing; medians over "
          f"steps > {warmup}\n")
    print("| impl | layers | tokens/s | peak GiB | losses | exit |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        peak = f"{r['peak']:.1f}" if r["peak"] else "-"
        print(f"| {r['impl']} | {r['layers']} | {tps} | {peak} | {' '.join(map(str, r['losses']))} | {r['exit']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
