"""LoRA steps over a kept-MXFP4 base vs the same steps over its dequantized bf16 base (model.quantization=mxfp4).

One random gpt-oss model at the 20b width (benchmarks/gpt-oss-20b.json; `--shape 120b`: the 120b's config, 128
experts, ftcli/assets/models/openai--gpt-oss-120b.json), cut to --layers, its expert weights
quantized to MXFP4 and written back dequantized, so both bases hold the same values exactly. Then the same
PEFT LoRA (the gpt-oss-h100 recipe's r 8 on attention, plus both expert parameters, dropout 0), the same initial adapter
and the same packed block, AdamW on the adapter, full activation checkpointing, autocast bf16:
  fp32          the oracle: the same values in float32, no autocast, the grouped path (an exact loop on CUDA)
  bf16          PEFT's ParamWrapper over bf16 expert parameters (W + s·A·B folded every forward)
  bf16-grouped  ftcli.model.moe_lora's grouped unmerged expert LoRA over the same bf16 parameters
  mxfp4         the experts kept as uint8 blocks + scales, the same grouped path dequantizing per chunk
Prints losses per step, the first step's LoRA gradients against the fp32 oracle's (relative error of all of them
together, and the worst single LoRA tensor's; the initial adapter is rounded to bf16 once, so every base starts
from the same values), s/step (median of the steps after the first), peak GiB
(torch max_memory_allocated).

    python benchmarks/mxfp4_lora_gpu.py --layers 4 --steps 4          # one H200
    python benchmarks/mxfp4_lora_gpu.py --shape 120b --layers 4       # the 120b width
    python benchmarks/mxfp4_lora_gpu.py --cpu                         # tiny shape, float32, to check it runs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import common
import torch

REPO = Path(__file__).resolve().parents[1]


def build(args, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.cpu:
        cfg = json.loads((REPO / "ftcli" / "assets" / "tiny-gpt-oss.json").read_text())
        attn = "eager"
    else:
        from ftcli.model.kernels import enable_packed_kernels

        source = {"20b": REPO / "benchmarks" / "gpt-oss-20b.json",
                  "120b": REPO / "ftcli" / "assets" / "models" / "openai--gpt-oss-120b.json"}[args.shape]
        cfg = json.loads(source.read_text())
        cfg.pop("quantization_config", None)  # random bf16 weights, quantized below
        attn, _ = enable_packed_kernels("gpt_oss", device)
    cfg["num_hidden_layers"] = args.layers
    cfg["layer_types"] = [cfg["layer_types"][i % len(cfg["layer_types"])] for i in range(args.layers)]
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model, attn


def exact_mxfp4(model, dtype):
    """Quantize every expert weight; write the dequantized values back; return the blocks + scales per module."""
    from ftcli.model.mxfp4 import EXPERT_PARAMS, quantize_mxfp4
    from ftcli.model.mxfp4_lora import dequantize_expert

    kept = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            tensors = {}
            for p in EXPERT_PARAMS:
                param = getattr(module, p)
                blocks, scales = quantize_mxfp4(param.data)
                for e in range(param.shape[0]):
                    param.data[e] = dequantize_expert(blocks[e], scales[e], dtype).t()
                tensors[f"{p}_blocks"], tensors[f"{p}_scales"] = blocks, scales
            kept[name] = tensors
    return kept


def run(model, batch, args, device, tag):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    losses, times, grads = [], [], {}
    for step in range(args.steps):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and tag != "fp32"):
            loss = model(**batch).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = common.peak_gib() if cuda else 0.0
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    row = {"base": tag, "losses": [round(x, 5) for x in losses], "s_per_step": round(step, 3),
           "tok_per_s": round(batch["input_ids"].numel() / step), "start_gib": round(start_gib, 2),
           "peak_gib": round(peak, 2)}
    print(json.dumps(row), flush=True)
    return row, grads


def grad_errors(ref: dict, other: dict) -> tuple[float, float, str]:
    """Relative error of all LoRA gradients together, and the worst single tensor's (its name)."""
    num = sum(float((other[n] - g).pow(2).sum()) for n, g in ref.items())
    den = sum(float(g.pow(2).sum()) for g in ref.values())
    worst = max(ref, key=lambda n: float((other[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)))
    return (num / den) ** 0.5, float((other[worst] - ref[worst]).norm() / ref[worst].norm().clamp_min(1e-30)), worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--shape", choices=("20b", "120b"), default="20b")
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    if args.cpu:
        args.layers, args.block, args.steps = 2, 64, 2
    from peft import get_peft_model

    from ftcli.config.recipe import load_recipe
    from ftcli.model.moe_lora import install_grouped_experts
    from ftcli.model.mxfp4_lora import keep_experts_mxfp4, kept_mxfp4_bytes
    from ftcli.train.lora.config import lora_config

    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    # LoRA on attention and both expert parameters; no dropout (PEFT has none for expert parameters, and a dropout
    # mask drawn per run would make the gradients differ by more than the bases do)
    recipe = load_recipe("gpt-oss-h100", ["lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
                                          "lora.dropout=0"])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(20, 1000, (1, args.block), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(args.block, device=device)[None]}
    rows, grads, init = [], [], None
    # the same seed builds the same model each time (one at a time on the device)
    for tag in ("fp32", "bf16", "bf16-grouped", "mxfp4"):
        t0 = time.perf_counter()
        base_dtype = torch.float32 if tag == "fp32" else dtype
        model, attn = build(args, device, base_dtype)
        kept = exact_mxfp4(model, base_dtype)
        if tag == "mxfp4":
            for name, tensors in kept.items():
                keep_experts_mxfp4(model.get_submodule(name), tensors, base_dtype, device)
        del kept
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        peft_model = get_peft_model(model, lora_config(recipe.lora, recipe.model, model))
        if tag != "bf16":
            assert install_grouped_experts(peft_model) == args.layers
        if tag == "mxfp4":
            print(f"kept MXFP4 buffers: {kept_mxfp4_bytes(peft_model) / 2**30:.2f} GiB", flush=True)
        if init is None:
            torch.manual_seed(2)
            init = {}
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.data.normal_(0, 1e-3)  # B starts at zero in PEFT; non-zero here so the delta counts at once
                if p.requires_grad:
                    init[name] = p.detach().to(torch.bfloat16).float()
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                p.data.copy_(init[name])
        print(f"{tag}: built {args.layers} layers ({attn}) in {time.perf_counter() - t0:.1f} s", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row, step1_grads = run(peft_model, batch, args, device, tag)
        rows.append(row)
        grads.append(step1_grads)
        del peft_model, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    diffs = [abs(a - b) / abs(a) for r in rows[2:] for a, b in zip(rows[1]["losses"], r["losses"])]
    print(f"{args.shape} width, {args.layers} layers, {args.block}-token block, {dtype}")
    print(common.table(
        ["base", "losses", "step-1 LoRA grads vs fp32: all / worst tensor", "s/step", "tok/s", "GiB at start",
         "peak GiB"],
        [[r["base"], ", ".join(f"{x:.4f}" for x in r["losses"]),
          "-" if g is grads[0] else "{:.2e} / {:.2e} ({})".format(*grad_errors(grads[0], g)),
          r["s_per_step"], f"{r['tok_per_s']:,}", r["start_gib"], r["peak_gib"]] for r, g in zip(rows, grads)]))
    err = grad_errors(grads[1], grads[2])
    print(f"bf16-grouped vs bf16 (PEFT folded) step-1 LoRA grads: {err[0]:.2e} all, {err[1]:.2e} worst ({err[2]})")
    err = grad_errors(grads[2], grads[3])
    print(f"mxfp4 vs bf16-grouped step-1 LoRA grads: {err[0]:.2e} all, {err[1]:.2e} worst ({err[2]})")
    print(f"max relative loss difference among the bf16-compute bases: {max(diffs):.2e}")


if __name__ == "__main__":
    main()
