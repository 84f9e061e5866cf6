"""training.fused_ops, op by op, at the Qwen3.8-27B width on one GPU: each fused module (ftcli.features.fused_ops, with
liger-kernel's and fla's Triton kernels) against transformers' eager module on the same bf16 inputs.

For each op it prints the error of the eager bf16 module and of the fused one against the eager module run
in float32 (output and every input / weight gradient; max |diff| / max |reference|), and the forward +
backward time of each (CUDA events, median of --reps after 3 warm-ups). A fused op passes when its error is
at most 2x the eager bf16 error plus 1e-3 (both round to bf16; the fused kernels keep float32 inside).

    op           module                      tokens x features at the 27B width (one 32k block)
    rms_norm     Qwen3_5RMSNorm(5120)        32768 x 5120
    swiglu       Qwen3_5MLP(5120 -> 17408)   32768 x 5120 in (the three GEMMs are the same in both)
    gated_norm   Qwen3_5RMSNormGated(128)    32768 x 48 heads x 128 (the gated-delta output, per head)

H200 (project root, .gpu carried): python3 benchmarks/fused_ops_gpu.py --tokens 32768
CPU logic check with the tests' torch stand-ins for the kernels: python benchmarks/fused_ops_gpu.py --stand-ins
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
CONFIG = HERE / "configs" / "qwen3_8-27b-text.json"


def modules(tiny: bool):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP, Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    raw = json.loads(CONFIG.read_text())
    raw.update(num_hidden_layers=4, layer_types=raw["layer_types"][:4])
    if tiny:
        raw.update(hidden_size=64, intermediate_size=160, linear_value_head_dim=16, linear_num_value_heads=4)
    cfg = Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    norm = Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    gated = Qwen3_5RMSNormGated(cfg.linear_value_head_dim, eps=cfg.rms_norm_eps)
    mlp = Qwen3_5MLP(cfg, cfg.intermediate_size)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)  # Qwen3.5 inits these to 0 / 1: move them so that an offset error shows
        gated.weight.normal_(1, 0.3)
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.normal_(0, 0.02)
    heads = cfg.linear_num_value_heads
    return cfg, {"rms_norm": (norm, [cfg.hidden_size]), "swiglu": (mlp, [cfg.hidden_size]),
                 "gated_norm": (gated, [heads, cfg.linear_value_head_dim], [heads, cfg.linear_value_head_dim])}


def run(module, inputs, grad_out):
    for x in inputs:
        x.grad = None
    module.zero_grad(set_to_none=True)
    out = module(*inputs)
    out.backward(grad_out)
    return [out.detach().float()] + [x.grad.float() for x in inputs] + [p.grad.float() for p in module.parameters()]


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def timed(fn, reps: int, device) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--stand-ins", action="store_true", help="CPU: the tests' torch stand-ins, tiny width")
    args = parser.parse_args()
    from ftcli.features.fused_modules import FUSED_MODULES
    from ftcli.features.fused_ops import FUSED_OPS, load_kernels

    if args.stand_ins:
        sys.path.insert(0, str(HERE.parent / "tests" / "unit" / "features"))
        from test_fused_ops import STAND_INS as kernels
        device, tokens = torch.device("cpu"), 256
    else:
        kernels, device, tokens = load_kernels(FUSED_OPS), torch.device("cuda"), args.tokens
    cfg, table = modules(args.stand_ins)
    print(f"fused ops vs transformers' eager modules: {tokens} tokens, hidden {cfg.hidden_size}, intermediate "
          f"{cfg.intermediate_size}, gated-delta output {cfg.linear_num_value_heads} x {cfg.linear_value_head_dim}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}\n")
    print("| op | eager bf16 err (out / worst grad) | fused err (out / worst grad) | eager fwd+bwd ms | fused fwd+bwd ms "
          "| saved ms | result |\n|---|---:|---:|---:|---:|---:|---|")
    failed = 0
    for op in FUSED_OPS:
        module, *shapes = table[op]
        gen = torch.Generator(device="cpu").manual_seed(1)
        inputs32 = [torch.randn(tokens, *s, generator=gen).to(device) for s in shapes]
        if op == "gated_norm":
            inputs32[0] = inputs32[0] * 0.5
        reference = module.to(device=device, dtype=torch.float32)
        ref_in = [x.clone().requires_grad_(True) for x in inputs32]
        gen_out = torch.Generator(device="cpu").manual_seed(2)  # each op's output has its first input's shape
        grad_out = torch.randn(inputs32[0].shape, generator=gen_out).to(device)
        ref = run(reference, ref_in, grad_out)
        eager = copy.deepcopy(module).to(dtype=torch.bfloat16)
        fused = FUSED_MODULES[op](copy.deepcopy(eager), getattr(kernels, op))
        results = {}
        for name, m in (("eager", eager), ("fused", fused)):
            xs = [x.to(torch.bfloat16).requires_grad_(True) for x in inputs32]
            got = run(m, xs, grad_out.to(torch.bfloat16))
            errs = [rel(g, r) for g, r in zip(got, ref)]
            results[name] = (errs[0], max(errs[1:]), timed(lambda m=m, xs=xs: run(m, xs, grad_out.to(torch.bfloat16)),
                                                             args.reps, device))
        (eo, eg, et), (fo, fg, ft) = results["eager"], results["fused"]
        ok = fo <= 2 * eo + 1e-3 and fg <= 2 * eg + 1e-3
        failed += not ok
        print(f"| {op} | {eo:.1e} / {eg:.1e} | {fo:.1e} / {fg:.1e} | {et:.2f} | {ft:.2f} | {et - ft:.2f} | "
              f"{'PASS' if ok else 'FAIL'} |", flush=True)
        del reference, eager, fused
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'all fused ops within tolerance' if not failed else f'{failed} fused op(s) FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
