"""The grouped expert LoRA (ftcli.model.moe_lora) on the GPU, per experts module, at the real shapes of
Qwen3-30B-A3B (hidden 2048, 128 experts of 768, top-8) and gpt-oss-20b (hidden 2880, 32 experts, top-4).

For one experts module in bf16 (random weights, random routing of --tokens tokens, LoRA factors of rank 8 in
PEFT's layout drawn non-zero) it checks, against a float32 reference on the same device (the experts module
itself in float32 over the folded weight W + s·lhs·rhs):
    - the grouped path (bf16, W a view of the parameter: Qwen3-MoE's `[E, out, in]` goes in transposed),
    - transformers' own experts forward in bf16 over the folded bf16 weight (what PEFT's wrapper computes),
and reports each one's relative error of the output and of the hidden-state gradient, and the time of one
forward + backward (median of --reps after a warm-up).

    python3 benchmarks/moe_lora_gpu.py [--tokens 4096] [--reps 10]
    python3 benchmarks/moe_lora_gpu.py --cpu      # logic check: tiny shapes, float32 "fast" side
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402

SHAPES = {  # family -> config kwargs at the real width (one experts module)
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
    "gpt_oss": dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4),
}
TINY = {"qwen3_moe": dict(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2),
        "gpt_oss": dict(hidden_size=32, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2)}


def experts_module(family: str, kwargs: dict):
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **kwargs)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls
    module = cls(config)
    for p in module.parameters():
        p.data.normal_(0, 0.02)
    return module, config


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _time(fn, reps: int, device) -> float:
    return statistics.median(common.timed(fn, warmup=1, repeats=reps, device=device)[1])


def check(family: str, args, device) -> dict:
    from ftcli.model.moe_lora import expert_sources, grouped_experts, layout_of

    fast = torch.float32 if args.cpu else torch.bfloat16
    module, config = experts_module(family, (TINY if args.cpu else SHAPES)[family])
    layout = layout_of(module)
    num_experts, top_k = module.num_experts, config.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    tokens = args.tokens
    hidden = torch.randn(tokens, config.hidden_size, generator=g)
    logits = torch.randn(tokens, num_experts, generator=g)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    gy = torch.randn(tokens, config.hidden_size, generator=g)
    factors, scaling = {}, 2.0
    for name in ("gate_up_proj", "down_proj"):
        e, a, b = getattr(module, name).shape  # the delta has the parameter's own layout: lhs [E, a, r] @ rhs [E, r, b]
        factors[name] = (torch.randn(e, a, 8, generator=g) * 0.05, torch.randn(e, 8, b, generator=g) * 0.05, scaling)

    def folded(dtype):
        m = copy.deepcopy(module).to(device=device, dtype=dtype)
        if hasattr(m, "config"):  # transformers' dispatch: grouped_mm where a trainer on the GPU runs it
            m.config = copy.copy(m.config)
            m.config._experts_implementation = "grouped_mm" if dtype == torch.bfloat16 else "eager"
        with torch.no_grad():
            for name, (lhs, rhs, s) in factors.items():
                p = getattr(m, name)
                p.copy_((p.float() + s * (lhs.to(device) @ rhs.to(device))).to(dtype))
        return m

    def run_module(m, dtype):
        x = hidden.to(device=device, dtype=dtype).requires_grad_(True)
        y = m(x, index.to(device), weights.to(device=device, dtype=dtype))
        (gx,) = torch.autograd.grad(y, x, gy.to(device=device, dtype=dtype))
        return y, gx

    ref_y, ref_gx = run_module(folded(torch.float32), torch.float32)
    peft_like = folded(fast)
    peft_y, peft_gx = run_module(peft_like, fast)

    base = copy.deepcopy(module).to(device=device, dtype=fast)
    sources = expert_sources(base, layout)
    dev_factors = {n: (lhs.to(device), rhs.to(device), s) for n, (lhs, rhs, s) in factors.items()}

    def run_grouped():
        x = hidden.to(device=device, dtype=fast).requires_grad_(True)
        y = grouped_experts(base, sources, dev_factors, x, index.to(device), weights.to(device=device, dtype=fast),
                            layout)
        (gx,) = torch.autograd.grad(y, x, gy.to(device=device, dtype=fast))
        return y, gx

    grouped_y, grouped_gx = run_grouped()
    row = {"family": family, "layout": layout.weights, "tokens": tokens, "experts": num_experts, "top_k": top_k,
           "grouped_y": _rel(grouped_y, ref_y), "grouped_gx": _rel(grouped_gx, ref_gx),
           "module_y": _rel(peft_y, ref_y), "module_gx": _rel(peft_gx, ref_gx),
           "grouped_s": _time(run_grouped, args.reps, device),
           "module_s": _time(lambda: run_module(peft_like, fast), args.reps, device)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--families", default="qwen3_moe,gpt_oss")
    args = ap.parse_args()
    if args.cpu:
        args.tokens, args.reps = 64, 2
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; relative errors against the float32 experts module over the folded "
          f"weight; fwd+bwd median of {args.reps}", flush=True)
    print("| family | W layout | tokens | experts (top-k) | grouped: out / grad err | module over folded bf16: "
          "out / grad err | grouped fwd+bwd ms | module fwd+bwd ms |\n|---|---|---:|---|---|---|---:|---:|")
    for family in args.families.split(","):
        try:
            r = check(family, args, device)
        except Exception as e:  # noqa: BLE001 - one family failing must not lose the other's row
            print(f"| {family} | error: {type(e).__name__}: {str(e).splitlines()[0][:300]} |", flush=True)
            continue
        print(f"| {r['family']} | {r['layout']} | {r['tokens']} | {r['experts']} ({r['top_k']}) | "
              f"{r['grouped_y']:.2e} / {r['grouped_gx']:.2e} | {r['module_y']:.2e} / {r['module_gx']:.2e} | "
              f"{1e3 * r['grouped_s']:.2f} | {1e3 * r['module_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
