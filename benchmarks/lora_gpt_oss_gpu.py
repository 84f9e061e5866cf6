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
    default-compile          the default with training.compile=true: each decoder layer compiled whole
                             (ftcli.features.compile; flex attention's block masks built before the layers)
    default-regions          the default with training.compile=regions (LoRA linears, norms, MoE MLP compiled)
    default-trl-compile      the default with TRL's whole-model torch_compile (what compile: true was before)
    default-nodrop           the default with lora.dropout=0 (the recipe keeps the published 0.05)
    default-compile-nodrop   both
    default-compile-log10    default-compile logging every 10th step (the recipe logs every step; losses: logged ones)
    default-compile-nosync   default-compile without TRL's mid-step metric syncs (measurement only: its entropy and
                             accuracy metrics read zeros)

In every mode data.max_length is the mode's block length (2,048 for `reference`, as in the published notebook).
Each mode builds its model, runs --warmup steps (flex compiles there), then times --steps optimizer
steps (warmup_s: the warmup's seconds, compiles included). Reported: trained tokens/s (the tokens with loss), seen tokens/s (all tokens through the model,
padding included), s/step, and peak GPU memory over the whole mode (torch max_memory_allocated).

H200 (project root; .gpu staged with ../shared/gpu/stage.sh and carried):
    source .gpu/activate.sh && python benchmarks/lora_gpt_oss_gpu.py --out $OUT/lora_gpt_oss.json
Issue 29 item 3 (the compile modes; carry [".gpu", ".gpu-ao", "<copy of ftcli/ and benchmarks/>"]; the first
compiled step builds one graph per attention kind and first-layer variant, fwd + bwd with flex attention: minutes):
    source .gpu/activate.sh && tar -xJf .gpu-ao/transformers-5.24.0-full.tar.xz -C /tmp/gpu-site \
      && python benchmarks/lora_gpt_oss_gpu.py --modes default,default-compile,default-nodrop,default-compile-nodrop \
           --steps 8 --warmup 3 --profile default-compile --deadline 420
CPU logic check (tiny gpt-oss, same code path; numbers mean nothing):
    python benchmarks/lora_gpt_oss_gpu.py --tiny
    python benchmarks/lora_gpt_oss_gpu.py --tiny --modes default,default-compile,default-regions,default-trl-compile
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

import common
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# block: tokens per micro-batch (max_length when unpacked); ga: gradient accumulation steps.
# The published notebook ran transformers' default experts implementation, which is grouped_mm on CUDA;
# "reference-eager-experts" shows what the per-expert Python loop would cost.
MODES = {
    "default": {"attn": "auto", "packing": True, "experts": "grouped_mm"},  # gpt-oss-h100's block, ga, checkpointing
    "reference": {"attn": "eager", "packing": False, "experts": "grouped_mm", "block": 2048, "ga": 2, "ac": "full"},
    # issue 29 item 3: the default's host gaps. training.compile (ftcli.features.compile): each decoder layer one
    # graph (flex attention, LoRA linears, router, grouped experts), or only its regions (LoRA linears, norms, MoE
    # MLP); TRL's whole-model torch_compile; lora.dropout=0 (the recipe keeps the published 0.05)
    "default-compile": {"attn": "auto", "packing": True, "experts": "grouped_mm", "compile": True},
    "default-regions": {"attn": "auto", "packing": True, "experts": "grouped_mm", "compile": "regions"},
    "default-trl-compile": {"attn": "auto", "packing": True, "experts": "grouped_mm", "trl_compile": True},
    "default-nodrop": {"attn": "auto", "packing": True, "experts": "grouped_mm", "dropout": 0},
    "default-compile-nodrop": {"attn": "auto", "packing": True, "experts": "grouped_mm", "compile": True,
                               "dropout": 0},
    # the step's end without transformers' per-step log (its loss and grad-norm .item() drain the GPU queue)
    "default-compile-log10": {"attn": "auto", "packing": True, "experts": "grouped_mm", "compile": True, "log": 10},
    # measurement only: TRL's per-micro-batch metrics (entropy, token accuracy, token count: 4 host syncs between
    # the forward and the backward) gathered as CPU zeros, so the host never waits for the GPU mid-step
    "default-compile-nosync": {"attn": "auto", "packing": True, "experts": "grouped_mm", "compile": True,
                               "nosync": True},
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
    # LoRA on the experts too (lora.target_parameters: gate_up_proj, down_proj; dropout 0), the default's blocks:
    # PEFT's folded ParamWrapper vs ftcli's grouped unmerged expert LoRA (ftcli.model.moe_lora), bf16 base
    "experts-peft": {"attn": "auto", "packing": True, "experts": "grouped_mm", "lora_experts": "peft"},
    "experts-grouped": {"attn": "auto", "packing": True, "experts": "grouped_mm", "lora_experts": "grouped"},
    "experts-grouped-ac": {"attn": "auto", "packing": True, "experts": "grouped_mm", "lora_experts": "grouped",
                           "ac": "full"},
    # the same base's experts quantized to MXFP4 on the GPU and kept so (model.quantization=mxfp4's layout), full AC
    "mxfp4-grouped-ac": {"attn": "auto", "packing": True, "experts": "grouped_mm", "lora_experts": "grouped",
                         "ac": "full", "mxfp4": "quantize"},
    # gpt-oss-120b (all 36 layers unless --layers): random MXFP4 blocks and scales drawn on the GPU (no bf16
    # experts ever), the gpt-oss-120b-1gpu recipe's LoRA and checkpointing, one 4k block per step
    "120b-mxfp4-ac": {"attn": "auto", "packing": True, "experts": "grouped_mm", "lora_experts": "grouped",
                      "ac": "full", "mxfp4": "random", "ga": 1, "shape": "120b"},
}
EXPERT_TARGETS = "[mlp.experts.gate_up_proj,mlp.experts.down_proj]"


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
    if "compile" in m:
        sets += [f"training.compile={str(m['compile']).lower()}"]
    if "dropout" in m:
        sets += [f"lora.dropout={m['dropout']}"]
    if "lora_experts" in m:
        sets += [f"lora.target_parameters={EXPERT_TARGETS}", "lora.dropout=0", f"lora.experts={m['lora_experts']}"]
    if m.get("shape") == "120b" and not args.tiny:
        sets += ["model.config=pkg://assets/models/openai--gpt-oss-120b.json"]
    if args.layers:
        sets += [f"model.config_overrides.num_hidden_layers={args.layers}"]
    if args.tiny:
        sets += ["model.dtype=float32", "training.optimizer.fused=false"]
    return load_recipe("gpt-oss-h100", sets)


def quantize_experts_in_place(model) -> None:
    """Every expert weight quantized to MXFP4 on its device and kept so (the bf16 parameter freed)."""
    from ftcli.model.mxfp4 import EXPERT_PARAMS, quantize_mxfp4
    from ftcli.model.mxfp4_lora import keep_experts_mxfp4

    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            tensors = {}
            for p in EXPERT_PARAMS:
                param = getattr(module, p)
                tensors[f"{p}_blocks"], tensors[f"{p}_scales"] = quantize_mxfp4(param.data)
            dtype, device = param.dtype, param.device
            keep_experts_mxfp4(module, tensors, dtype, device)


def random_kept_mxfp4(recipe, attn, device):
    """A random gpt-oss whose experts are random MXFP4 blocks + scales drawn on `device` (bytes uniform over the
    e2m1 codes, scales 2^-9..2^-6 so the weights sit near N(0, 0.02)); the rest drawn as transformers' init
    would (normal(0, initializer_range) for matrices, ones for norms, zeros for biases and sinks)."""
    from transformers import AutoModelForCausalLM

    from ftcli.model.build import DTYPES, load_config
    from ftcli.model.mxfp4 import EXPERT_PARAMS, GROUP
    from ftcli.model.mxfp4_lora import keep_experts_mxfp4, rebuild_meta_buffers

    config = load_config(recipe.model)
    config.use_cache = False
    dtype = DTYPES[recipe.model.dtype]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **({"attn_implementation": attn} if attn else {}))
    g = torch.Generator(device=device).manual_seed(0)
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            tensors = {}
            for p in EXPERT_PARAMS:
                num_experts, fan_in, fan_out = getattr(module, p).shape
                shape = (num_experts, fan_out, fan_in // GROUP)
                tensors[f"{p}_blocks"] = torch.randint(0, 256, (*shape, 16), generator=g, device=device,
                                                       dtype=torch.uint8)
                tensors[f"{p}_scales"] = torch.randint(118, 122, shape, generator=g, device=device, dtype=torch.uint8)
            keep_experts_mxfp4(module, tensors, dtype, device)
    std = getattr(config, "initializer_range", 0.02)
    for name, module in model.named_modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            value = torch.empty(param.shape, dtype=param.dtype, device=device)
            if "norm" in name.rsplit(".", 1)[-1] or "norm" in pname:
                value.fill_(1.0)
            elif param.dim() >= 2:
                value.normal_(0, std, generator=g)
            else:
                value.zero_()
            setattr(module, pname, torch.nn.Parameter(value, requires_grad=param.requires_grad))
    rebuild_meta_buffers(model, device)
    model.tie_weights()
    return model.eval()


def run_mode(mode: str, args, work: Path) -> dict:
    from transformers import TrainerCallback
    from trl import SFTConfig

    from ftcli import data
    from ftcli.model.build import load_model
    from ftcli.model.moe_lora import grouped_experts_forward
    from ftcli.model.mxfp4_lora import kept_mxfp4_bytes
    from ftcli.train.lora.trainer import _attn_implementation, build_trainer, sft_config_kwargs, training_blocks

    recipe = mode_recipe(mode, args, work)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    attn = _attn_implementation(recipe, device)
    tokenizer = data.load_tokenizer(recipe.model, recipe.data)
    rows = training_blocks(recipe, tokenizer)

    torch.manual_seed(0)
    if device.type == "cuda":
        torch.zeros(1, device=device)  # reset_peak_memory_stats raises "Invalid device argument" before CUDA is up
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # allocated and reserved peaks
    t_build = time.perf_counter()
    m = MODES[mode]
    if m.get("mxfp4") == "random":
        model = random_kept_mxfp4(recipe, attn, device)
    else:
        model = load_model(recipe.model, attn_implementation=attn, device=device)
    if m.get("mxfp4") == "quantize":
        quantize_experts_in_place(model)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the bf16 draw of the "quantize" mode is not the training peak
    start_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    experts = m["experts"]
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation(experts)
        except (ValueError, ImportError) as e:  # e.g. grouped_mm unavailable on this torch / device
            print(f"{mode}: experts_implementation={experts} refused ({str(e).splitlines()[0]}); keeping the default")
    experts = getattr(model.config, "_experts_implementation", None) or "eager"
    if m.get("lora_experts") == "grouped":
        experts = "ftcli grouped" + (" (MXFP4)" if m.get("mxfp4") else "")
    elif m.get("lora_experts") == "peft":
        experts += " + PEFT ParamWrapper"
    build_s = time.perf_counter() - t_build

    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, work / mode)
    kwargs.update(report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=m.get("log", 1),
                  use_cpu=device.type == "cpu")
    if m.get("trl_compile"):
        kwargs["torch_compile"] = True  # TRL / transformers compile the whole model (what compile: true was before)
    trainer, counter = build_trainer(recipe, model, tokenizer, rows, SFTConfig(**kwargs))
    if m.get("nosync"):  # TRL's compute_loss only reads its metrics through this (trl 1.16); one process here
        trainer.accelerator.gather_for_metrics = lambda x, **kw: torch.zeros_like(x, device="cpu")
    grouped = sum(getattr(mod.forward, "func", None) is grouped_experts_forward for mod in trainer.model.modules())
    kept = kept_mxfp4_bytes(trainer.model) / 2**30
    print(f"{mode}: built in {time.perf_counter() - t_build:.1f} s; {grouped} experts modules grouped, "
          f"{kept:.2f} GiB kept MXFP4, {start_gib or 0:.2f} GiB allocated before the trainer", flush=True)

    marks = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            marks[0] = (time.perf_counter(), 0, 0)

        def on_step_end(self, a, state, control, **kw):
            if state.global_step in (args.warmup, args.warmup + args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                marks[state.global_step] = (time.perf_counter(), counter.trained, counter.seen)

    if mode in args.profile:
        trainer.callback_handler.callbacks.insert(0, Profile(args.warmup, device))
    trainer.add_callback(Clock())
    from torch._dynamo.utils import counters  # dynamo's own tally: graph breaks (by reason) and graphs built

    breaks_before, graphs_before = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    trainer.train()
    breaks = {k: v - breaks_before.get(k, 0) for k, v in counters["graph_break"].items() if v > breaks_before.get(k, 0)}
    for reason, n in sorted(breaks.items(), key=lambda kv: -kv[1])[:3]:
        print(f"{mode}: graph break x{n}: {reason.splitlines()[0][:160]}", flush=True)
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    (t0, trained0, seen0), (t1, trained1, seen1) = marks[args.warmup], marks[args.warmup + args.steps]
    seconds = t1 - t0
    result = {
        "mode": mode, "attention": attn or "default", "packing": recipe.data.packing.enabled, "experts": experts,
        "steps": args.steps, "tokens_per_step": (seen1 - seen0) / args.steps,
        "trained_tokens_per_s": (trained1 - trained0) / seconds, "seen_tokens_per_s": (seen1 - seen0) / seconds,
        "s_per_step": seconds / args.steps,
        "peak_mem_gib": common.peak_gib(device),
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        "build_s": build_s, "warmup_s": t0 - marks[0][0], "losses": losses, "graph_breaks": sum(breaks.values()),
        "graphs": counters["stats"]["unique_graphs"] - graphs_before, "grouped_modules": grouped, "kept_mxfp4_gib": kept,
        "start_gib": start_gib, "layers": model.config.num_hidden_layers,
    }
    del trainer, model, counter
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def kernel_category(name: str) -> str:
    n = name.lower()
    if "flex" in n or "attention" in n or "fmha" in n or "triton_tem" in n:
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas", "grouped_mm", "matmul", "splitk")):
        return "gemm"
    if any(k in n for k in ("index", "gather", "scatter", "sort", "radix", "histc", "bincount", "cumsum", "nonzero")):
        return "routing/index"
    if "memcpy" in n or "memset" in n or "copy" in n or "cat" in n:
        return "copy"
    if "reduce" in n or "norm" in n or "softmax" in n or "sum" in n:
        return "reduce/norm"
    return "elementwise/other"


class Profile:
    """A TrainerCallback-like hook: torch.profiler over optimizer step `step`; prints kernel time by category
    and the top kernels (before the timed window starts)."""

    def __init__(self, step: int, device) -> None:
        self.step, self.device, self.prof = step, device, None

    def __getattr__(self, name):  # the callback events this hook does not use
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 == self.step:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if self.prof is None or state.global_step != self.step:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        wall = (time.perf_counter() - self.started) * 1e3
        kernels = [e for e in self.prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in kernels) / 1e3 or 1e-9
        by_cat: dict[str, float] = {}
        for e in kernels:
            cat = kernel_category(e.key)
            by_cat[cat] = by_cat.get(cat, 0.0) + e.self_device_time_total / 1e3
        print(f"PROFILE step {self.step}: {total:.1f} ms of kernels in {wall:.1f} ms (profiled) wall, "
              f"{sum(e.count for e in kernels)} kernel launches; " + ", ".join(
            f"{k} {v:.1f} ms ({100 * v / total:.0f}%)" for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])),
            flush=True)
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:18]:
            print(f"PROFILE   {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<5} {kernel_category(e.key):14} "
                  f"{e.key[:110]}", flush=True)
        self.prof = None


def markdown(results: list[dict], args) -> str:
    import transformers
    import trl

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    shape = "tiny gpt-oss (CPU logic check)" if args.tiny else "gpt-oss-20b shape, random weights"
    lines = [
        f"LoRA r8 all-linear, {shape}, {gpu}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}; {args.steps} timed steps after {args.warmup} warmup, per-mode block and grad accum in the table",
        "",
        "| mode | layers | attention | packing | experts | tokens/step | trained tok/s | seen tok/s | s/step "
        "| GiB at start | peak GiB (reserved) | graphs (breaks) | warmup s | losses |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        mem = f"{r['peak_mem_gib']:.1f} ({r['peak_reserved_gib']:.1f})" if r["peak_mem_gib"] is not None else "n/a"
        start = f"{r['start_gib']:.1f}" if r.get("start_gib") is not None else "n/a"
        lines.append(
            f"| {r['mode']} | {r['layers']} | {r['attention']} | {'packed' if r['packing'] else 'unpacked'} | "
            f"{r['experts']} | {r['tokens_per_step']:,.0f} | {r['trained_tokens_per_s']:,.0f} | "
            f"{r['seen_tokens_per_s']:,.0f} | {r['s_per_step']:.3f} | {start} | {mem} | "
            f"{r.get('graphs', 0)} ({r.get('graph_breaks', 0)}) | {r.get('warmup_s', 0):.0f} | "
            f"{', '.join(f'{x:.4f}' for x in r['losses'])} |"
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
    p.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (0: the shape's own)")
    p.add_argument("--profile", default="", help="comma-separated modes to profile (kernels by category) at the "
                   "last warmup step")
    p.add_argument("--deadline", type=float, default=0, help="seconds: start no further mode after this much wall")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.examples = min(args.steps, 4), min(args.warmup, 1), min(args.examples, 80)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="ftcli-lora-bench-") as tmp:
        results = []
        args.profile = set(filter(None, args.profile.split(",")))
        started = time.perf_counter()
        for mode in args.modes.split(","):
            if args.deadline and time.perf_counter() - started > args.deadline:
                print(f"SKIPPED {mode}: past --deadline {args.deadline:.0f} s", flush=True)
                continue
            results.append(run_mode(mode, args, Path(tmp)))
            print(f"RESULT {json.dumps(results[-1])}", flush=True)  # kept if a later mode runs out of time
    text = markdown(results, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": results, "markdown": text}, indent=2) + "\n")


if __name__ == "__main__":
    main()
