"""LoRA throughput of gpt-oss-20b on one GPU: the published notebook's settings next to ftcli's packed modes.

All modes go through ftcli's real LoRA path (`ftcli.train.lora.trainer.build_trainer`: TRL SFTTrainer + PEFT,
ftcli's data rows and collator, token-normalized loss), on the gpt-oss-h100 recipe with random weights
at the real shape (benchmarks/gpt-oss-20b.json: 20.9B params, 19.1B of them experts) and synthetic chat
data (log-normal lengths around 1,200 tokens, 30% prompt), LoRA r 8 on all-linear (attention):

    reference                the published notebook's settings: one unpacked example per micro-batch,
                             truncated to 2,048; batch 1, grad accum 2; eager attention; experts
                             grouped_mm (transformers' CUDA default, which is what the published notebook ran)
    reference-eager-experts  the same with transformers' per-expert Python loop (informational)
    default                  the gpt-oss-h100 recipe's own block length, grad accum and checkpointing: packed
                             4k blocks (best-fit decreasing), grad accum 1, none; ftcli's packed attention
                             (flex attention + sinks on CUDA); experts grouped_mm
    ftcli-2k / -8k / -16k    packed blocks of that many tokens, grad accum 2 / 1 / 1, full checkpointing
    ftcli-Nk-no-ac           packed N-k blocks, grad accum 1, no activation checkpointing

In every mode data.max_length is the mode's block length (2,048 for `reference`, as in the published notebook).
Each mode builds its model, runs --warmup steps (flex compiles there), then times --steps optimizer
steps. Reported: trained tokens/s (the tokens with loss), seen tokens/s (all tokens through the model,
padding included), s/step, and peak GPU memory over the whole mode (torch max_memory_allocated).

H200 (project root; .gpu staged with ../shared/gpu/stage.sh and carried):
    source .gpu/activate.sh && python benchmarks/lora_gpt_oss_gpu.py --out $OUT/lora_gpt_oss.json
CPU logic check (tiny gpt-oss, same code path; numbers mean nothing):
    python benchmarks/lora_gpt_oss_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# block: tokens per micro-batch (max_length when unpacked); ga: gradient accumulation steps.
# The published notebook ran transformers' default experts implementation, which is grouped_mm on CUDA;
# "reference-eager-experts" shows what the per-expert Python loop would cost.
MODES = {
    "default": {"attn": "auto", "packing": True, "experts": "grouped_mm"},  # gpt-oss-h100's block, ga, checkpointing
    "reference": {"attn": "eager", "packing": False, "experts": "grouped_mm", "block": 2048, "ga": 2, "ac": "full"},
    "reference-eager-experts": {"attn": "eager", "packing": False, "experts": "eager", "block": 2048, "ga": 2,
                                "ac": "full"},
    "ftcli-2k": {"attn": "auto", "packing": True, "experts": "grouped_mm", "block": 2048, "ga": 2, "ac": "full"},
    "ftcli-8k": {"attn": "auto", "packing": True, "experts": "grouped_mm", "block": 8192, "ga": 1, "ac": "full"},
    "ftcli-16k": {"attn": "auto", "packing": True, "experts": "grouped_mm", "block": 16384, "ga": 1, "ac": "full"},
    "ftcli-4k-no-ac": {"attn": "auto", "packing": True, "experts": "grouped_mm", "block": 4096, "ga": 1, "ac": "none"},
    "ftcli-6k-no-ac": {"attn": "auto", "packing": True, "experts": "grouped_mm", "block": 6144, "ga": 1, "ac": "none"},
    "ftcli-8k-no-ac": {"attn": "auto", "packing": True, "experts": "grouped_mm", "block": 8192, "ga": 1, "ac": "none"},
    "ftcli-16k-no-ac": {"attn": "auto", "packing": True, "experts": "grouped_mm", "block": 16384, "ga": 1,
                        "ac": "none"},
}


def mode_recipe(mode: str, args, work: Path):
    from ftcli.config.recipe import load_recipe

    m = MODES[mode]
    recipe = load_recipe("gpt-oss-h100")
    length = 256 if args.tiny else m.get("block", recipe.data.packing.block_len)
    sets = [
        "model.init=random", "model.quantization=none", "model.tokenizer=pkg://assets/tokenizer-gpt-oss",
        f"model.config={'pkg://assets/tiny-gpt-oss.json' if args.tiny else ROOT / 'benchmarks' / 'gpt-oss-20b.json'}",
        f"model.attn_implementation={m['attn']}",
        "data.source=synthetic", f"data.synthetic.num_examples={args.examples}",
        f"data.synthetic.mean_tokens={120 if args.tiny else 1200}", f"data.max_length={length}",
        f"data.packing.enabled={str(m['packing']).lower()}", f"data.packing.block_len={length}",
        f"data.cache_dir={work / 'cache'}", f"output.dir={work / mode}",
        "tracking.enabled=false", "training.checkpoint.enabled=false",
        f"training.max_steps={args.warmup + args.steps}",
        f"training.grad_accum={m.get('ga', recipe.training.grad_accum)}",
        f"data.synthetic.max_tokens={max(length, 16384)}",
        f"training.activation_checkpointing={m.get('ac', recipe.training.activation_checkpointing)}",
    ]
    if args.tiny:
        sets += ["model.dtype=float32", "training.optimizer.fused=false"]
    return load_recipe("gpt-oss-h100", sets)


def run_mode(mode: str, args, work: Path) -> dict:
    from transformers import TrainerCallback
    from trl import SFTConfig

    from ftcli import data
    from ftcli.model.build import load_model
    from ftcli.train.lora.trainer import _attn_implementation, build_trainer, sft_config_kwargs, training_rows

    recipe = mode_recipe(mode, args, work)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    attn = _attn_implementation(recipe, device)
    tokenizer = data.load_tokenizer(recipe)
    rows = training_rows(recipe, tokenizer)

    torch.manual_seed(0)
    if device.type == "cuda":
        torch.zeros(1, device=device)  # reset_peak_memory_stats raises "Invalid device argument" before CUDA is up
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # allocated and reserved peaks
    t_build = time.perf_counter()
    model = load_model(recipe.model, attn_implementation=attn, device=device)
    experts = MODES[mode]["experts"]
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation(experts)
        except (ValueError, ImportError) as e:  # e.g. grouped_mm unavailable on this torch / device
            print(f"{mode}: experts_implementation={experts} refused ({str(e).splitlines()[0]}); keeping the default")
    experts = getattr(model.config, "_experts_implementation", None) or "eager"
    build_s = time.perf_counter() - t_build

    kwargs = sft_config_kwargs(recipe, work / mode)
    kwargs.update(report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=max(1, args.steps // 4),
                  use_cpu=device.type == "cpu")
    trainer, counter = build_trainer(recipe, model, tokenizer, rows, SFTConfig(**kwargs))

    marks = {}

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step in (args.warmup, args.warmup + args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                marks[state.global_step] = (time.perf_counter(), counter.trained, counter.seen)

    trainer.add_callback(Clock())
    trainer.train()
    (t0, trained0, seen0), (t1, trained1, seen1) = marks[args.warmup], marks[args.warmup + args.steps]
    seconds = t1 - t0
    result = {
        "mode": mode, "attention": attn or "default", "packing": recipe.data.packing.enabled, "experts": experts,
        "steps": args.steps, "tokens_per_step": (seen1 - seen0) / args.steps,
        "trained_tokens_per_s": (trained1 - trained0) / seconds, "seen_tokens_per_s": (seen1 - seen0) / seconds,
        "s_per_step": seconds / args.steps,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        "build_s": build_s,
    }
    del trainer, model, counter
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def markdown(results: list[dict], args) -> str:
    import transformers
    import trl

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    shape = "tiny gpt-oss (CPU logic check)" if args.tiny else "gpt-oss-20b shape, random weights"
    lines = [
        f"LoRA r8 all-linear, {shape}, {gpu}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}; {args.steps} timed steps after {args.warmup} warmup, per-mode block and grad accum in the table",
        "",
        "| mode | attention | packing | experts | tokens/step | trained tok/s | seen tok/s | s/step | peak GiB (reserved) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mem = f"{r['peak_mem_gib']:.1f} ({r['peak_reserved_gib']:.1f})" if r["peak_mem_gib"] is not None else "n/a"
        lines.append(
            f"| {r['mode']} | {r['attention']} | {'packed' if r['packing'] else 'unpacked'} | {r['experts']} | "
            f"{r['tokens_per_step']:,.0f} | {r['trained_tokens_per_s']:,.0f} | {r['seen_tokens_per_s']:,.0f} | "
            f"{r['s_per_step']:.3f} | {mem} |"
        )
    if len(results) > 1 and results[0]["mode"] == "reference":
        base = results[0]["trained_tokens_per_s"]
        for r in results[1:]:
            ratio = r["trained_tokens_per_s"] / base
            lines.append(f"\n{r['mode']}: {ratio:.2f}x the published notebook's trained tokens/s")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="reference,default",
                   help=f"comma-separated, of: {', '.join(MODES)} (reference: the published notebook's settings)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    p.add_argument("--examples", type=int, default=400, help="synthetic examples to draw from")
    p.add_argument("--tiny", action="store_true", help="tiny gpt-oss on CPU: checks the script, not the speed")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.examples = min(args.steps, 4), min(args.warmup, 1), min(args.examples, 80)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="ftcli-lora-bench-") as tmp:
        results = []
        for mode in args.modes.split(","):
            results.append(run_mode(mode, args, Path(tmp)))
            print(f"RESULT {json.dumps(results[-1])}", flush=True)  # kept if a later mode runs out of time
    text = markdown(results, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": results, "markdown": text}, indent=2) + "\n")


if __name__ == "__main__":
    main()
