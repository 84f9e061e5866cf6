"""LoRA steps over a kept-MXFP4 base vs the same steps over its dequantized bf16 base (model.quantization=mxfp4).

One random gpt-oss model at the 20b width (benchmarks/gpt-oss-20b.json, cut to --layers), its expert weights
quantized to MXFP4 and written back dequantized, so both bases hold the same values exactly. Then the same
PEFT LoRA (the gpt-oss-h100 recipe's: r 8 on attention and both expert parameters), the same initial adapter
and the same packed block, AdamW on the adapter, full activation checkpointing, autocast bf16:
  bf16          PEFT's ParamWrapper over bf16 expert parameters (W + s·A·B folded every forward)
  bf16-grouped  ftcli.model.moe_lora's grouped unmerged expert LoRA over the same bf16 parameters
  mxfp4         the experts kept as uint8 blocks + scales, the same grouped path dequantizing per chunk
Prints losses per step, s/step (median of the steps after the first), peak GiB (torch max_memory_allocated).

    python benchmarks/mxfp4_lora_gpu.py --layers 4 --steps 4          # one H200
    python benchmarks/mxfp4_lora_gpu.py --cpu                         # tiny shape, float32, to check it runs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def build(args, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.cpu:
        cfg = json.loads((REPO / "ftcli" / "assets" / "tiny-gpt-oss.json").read_text())
        attn = "eager"
    else:
        from ftcli.model.kernels import enable_packed_kernels

        cfg = json.loads((REPO / "benchmarks" / "gpt-oss-20b.json").read_text())
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
    losses, times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    row = {"base": tag, "losses": [round(x, 5) for x in losses], "s_per_step": round(step, 3),
           "tok_per_s": round(batch["input_ids"].numel() / step), "start_gib": round(start_gib, 2),
           "peak_gib": round(peak, 2)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
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
    recipe = load_recipe("gpt-oss-h100")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(20, 1000, (1, args.block), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(args.block, device=device)[None]}
    rows, init = [], None
    for tag in ("bf16", "bf16-grouped", "mxfp4"):  # the same seed builds the same model twice (one at a time on the device)
        t0 = time.perf_counter()
        model, attn = build(args, device, dtype)
        kept = exact_mxfp4(model, dtype)
        if tag == "mxfp4":
            for name, tensors in kept.items():
                keep_experts_mxfp4(model.get_submodule(name), tensors, dtype, device)
        del kept
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        peft_model = get_peft_model(model, lora_config(recipe, model))
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
                    init[name] = p.detach().clone()
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                p.data.copy_(init[name])
        print(f"{tag}: built {args.layers} layers ({attn}) in {time.perf_counter() - t0:.1f} s", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(run(peft_model, batch, args, device, tag))
        del peft_model, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    diffs = [abs(a - b) / abs(a) for r in rows[1:] for a, b in zip(rows[0]["losses"], r["losses"])]
    print(f"| base | losses | s/step | tok/s | GiB at start | peak GiB |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['base']} | {', '.join(f'{x:.4f}' for x in r['losses'])} | {r['s_per_step']} | {r['tok_per_s']:,} "
              f"| {r['start_gib']} | {r['peak_gib']} |")
    print(f"max relative loss difference: {max(diffs):.2e}")


if __name__ == "__main__":
    main()
