"""GPU check of ftcli's packed kernels: the fast bf16 backends against the exact fp32 references.

For each model family, at the real width (the published models' configs) and one layer of each kind:

    qwen3_5_text  27B width: 1 gated-delta layer + 1 full-attention layer, 32,768-token block
    gpt_oss       20b width: 1 sliding-window layer + 1 full layer (sinks, 32 experts, top-4), 16,384-token
                  block (its fp32 eager reference keeps every segment's H x L x L weights for backward)
    llama, qwen3, qwen3_moe, gemma3_text   Llama-3.1-8B, Qwen3-8B, Qwen3-30B-A3B, Gemma-3-12B widths, 2 layers
                  (Gemma: 1 sliding-window layer (1024) + 1 global), 16,384-token block (DENSE_WIDTHS)

one packed block (--tokens overrides both) in --segments segments (one of length 1, one shorter than the conv
width, the last one padding without loss) goes forward and backward through

    ref       fp32, `enable_packed_kernels(..., reference=True)`: per-segment torch references
    fast      bf16, `enable_packed_kernels(...)`: what training uses on this machine
    separate  bf16 fast backends, every segment alone (the packing invariant itself)

and the script checks, each as a relative error ||x - ref|| / ||ref|| <= --tol (2e-2):
logits and all gradients of fast vs ref, and of fast packed vs fast separate (each segment alone at the
front of an otherwise padding block of the same length; gradients summed over the segments), plus
every op alone (output and input gradients) on random inputs of the model's shapes.
MoE routing is recorded on the fast run and replayed in the others (bf16 flips near-tied experts,
which is not kernel error). It also times fast fwd+bwd. Both models start from the same weights (the fp32
reference holds the bf16-rounded values, so weight rounding is not counted as kernel error) and the same
fp32 rotary buffers (as in training). The vocab is cut to 32,768 (the kernels do not depend on it; the
real 248k vocab alone would need 32 GB of fp32 logits). Prints a markdown table for BENCHMARKS.md; exits 1
when a check fails, or when a fast backend turns out to be a CPU reference on CUDA (unless --allow-reference).

H200 (from the project root, .gpu staged with ../shared/gpu/stage.sh and carried):
    source .gpu/activate.sh && python benchmarks/packed_kernels_gpu.py
Logic check on a CPU machine (tiny widths, same code path):
    python benchmarks/packed_kernels_gpu.py --small --device cpu
"""

from __future__ import annotations

import argparse
import copy
import importlib
import random
import sys
import time
from pathlib import Path

import common
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftcli.model import kernels  # noqa: E402

VOCAB = 32768
REFERENCE_BACKENDS = {"sdpa_segments", "eager_segments", "torch_segments"}


def qwen_config(small: bool):
    from transformers import Qwen3_5TextConfig

    width = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32) if small else \
        dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128)
    return Qwen3_5TextConfig(
        vocab_size=VOCAB, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}, **width,
    )


def gpt_oss_config(small: bool):
    from transformers import GptOssConfig

    width = dict(hidden_size=64, intermediate_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                 num_local_experts=4, num_experts_per_tok=2, sliding_window=16) if small else \
        dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
             num_local_experts=32, num_experts_per_tok=4, sliding_window=128)
    return GptOssConfig(vocab_size=VOCAB, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                        attention_bias=True, tie_word_embeddings=False, use_cache=False, **width)


# The dense families (ftcli/families/: llama, qwen3, qwen3_moe, gemma3): real widths, 2 layers (Gemma 3: one
# sliding-window layer and one global one), one packed attention op each.
DENSE_WIDTHS = {
    "llama": ("Llama-3.1-8B width", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192})),
    "qwen3": ("Qwen3-8B width", dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6)),
    "qwen3_moe": ("Qwen3-30B-A3B width", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                              num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                              num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                              rms_norm_eps=1e-6)),
    "gemma3_text": ("Gemma-3-12B width", dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                                              num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                                              sliding_window=1024, layer_types=["sliding_attention", "full_attention"],
                                              rms_norm_eps=1e-6)),
}
SMALL_DENSE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16)


def dense_config(model_type: str, small: bool):
    from transformers import AutoConfig

    width = dict(DENSE_WIDTHS[model_type][1])
    if small:
        width.update({k: v for k, v in SMALL_DENSE.items() if k in width})
    return AutoConfig.for_model(model_type, vocab_size=VOCAB, num_hidden_layers=2, tie_word_embeddings=False,
                                use_cache=False, **width)


def segment_lengths(tokens: int, segments: int, seed: int) -> list[int]:
    """`segments` lengths summing to `tokens`: a 1-token and a 3-token segment among lognormal ones, the
    last segment (padding) whatever is left. `segments=1`: one sequence and the padding (the control that
    tells packed-kernel error from the model's own bf16-vs-fp32 drift: nothing is packed)."""
    if segments == 1:
        pad = max(1, tokens // 64)
        return [tokens - pad, pad]
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0.0, 0.7) for _ in range(segments - 3)]
    budget = tokens - 4 - max(1, tokens // (4 * segments))  # leave some padding at the end
    lengths = [max(1, int(budget * w / sum(weights))) for w in weights]
    lengths[2:2] = [1, 3]
    lengths.append(tokens - sum(lengths))
    assert lengths[-1] >= 1 and sum(lengths) == tokens, lengths
    return lengths


def packed_block(lengths: list[int], device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    batch = dict(
        input_ids=torch.randint(0, VOCAB, (1, int(lens.sum())), generator=g),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
        seq_idx=torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lens)[None],
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def block_loss(logits, input_ids, lengths, with_padding_last=True) -> torch.Tensor:
    """Sum of next-token cross-entropies inside every segment (fp32), the padding segment excluded."""
    total, start = logits.new_zeros((), dtype=torch.float32), 0
    for i, n in enumerate(lengths):
        if n > 1 and not (with_padding_last and i == len(lengths) - 1):
            seg = logits[0, start : start + n - 1].float()
            total = total + F.cross_entropy(seg, input_ids[0, start + 1 : start + n], reduction="sum")
        start += n
    return total


def fwd_bwd(model, batch, lengths):
    model.zero_grad(set_to_none=True)
    logits = model(**batch, use_cache=False).logits
    block_loss(logits, batch["input_ids"], lengths).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def separate_fwd_bwd(model, batch, lengths, tape):
    """Every (non-padding) segment alone, gradients summed in fp32: what packing must reproduce.

    "Alone" = first in a block of the same length, the rest one padding segment: the kernels see the
    same shapes in every run (no JIT compile per segment length) and nothing precedes the segment."""
    summed: dict[str, torch.Tensor] = {}
    ids, total = batch["input_ids"], batch["input_ids"].shape[1]
    pieces, start = [], 0
    for n in lengths[:-1]:
        dev = ids.device
        # the segment first, then the block's other tokens as one padding segment (routing moves with them)
        order = torch.cat([torch.arange(start, start + n), torch.arange(0, start), torch.arange(start + n, total)])
        order = order.to(dev)
        alone = ids[:, order]
        cu = torch.tensor([0, n, total], dtype=torch.int32, device=dev)
        handles = tape.replay(model, order) if tape.indices else []
        positions = torch.cat([torch.arange(n), torch.arange(total - n)])[None].to(dev)
        seq_idx = (torch.arange(total, device=dev) >= n).to(torch.int32)[None]
        longest = max(n, total - n)
        logits = model(input_ids=alone, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=longest, max_length_k=longest, seq_idx=seq_idx, use_cache=False).logits
        unhook(handles)
        if n > 1:
            model.zero_grad(set_to_none=True)
            block_loss(logits[:, :n], alone[:, :n], [n], with_padding_last=False).backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    summed[name] = summed.get(name, 0) + p.grad.float()
        pieces.append(logits[:, :n].detach())
        start += n
    return torch.cat(pieces, dim=1), summed


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def grad_errors(grads: dict, ref: dict) -> tuple[float, float, str]:
    """(all gradients together, worst single parameter, its name), relative to `ref`."""
    assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
    diff = sum((grads[n].float() - ref[n].float()).norm() ** 2 for n in ref) ** 0.5
    total = (diff / (sum(ref[n].float().norm() ** 2 for n in ref) ** 0.5)).item()
    worst, name = max((rel(grads[n], ref[n]), n) for n in ref)
    return total, worst, name


def timed(fn, device, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call (kernel JIT compiles happen there)."""
    times = sorted(common.timed(fn, warmup=1, repeats=repeats, device=device)[1])
    return times[len(times) // 2]


def op_error(fast_fn, ref_fn, inputs: dict, seed: int) -> tuple[float, float, str]:
    """One op, same inputs: fast in its dtype vs reference in fp32. Returns (output error, worst input-
    gradient error, that input) for a random linear loss on the output."""
    results = []
    for fn, dtype in ((ref_fn, torch.float32), (fast_fn, None)):
        leaves = {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach())
                  for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        for k, v in leaves.items():
            v.requires_grad_(v.is_floating_point())
        out = fn(**{**inputs, **leaves})
        out = out[0] if isinstance(out, tuple) else out
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
        (out.float() * weight).sum().backward()
        results.append((out.detach(), {k: v.grad for k, v in leaves.items() if v.grad is not None}))
    (ref_out, ref_grads), (out, grads) = results
    worst, name = max((rel(grads[k], ref_grads[k]), k) for k in ref_grads)
    return rel(out, ref_out), worst, name


def op_checks(model_type, fast_fns: dict, ref_fns: dict, fast, batch, seed: int) -> list[tuple[str, float, float, str]]:
    """Every packed op of one layer kind, fed realistic random inputs of this model's shapes."""
    from transformers import AttentionInterface

    gen = torch.Generator().manual_seed(seed)
    dev = batch["input_ids"].device
    t = batch["input_ids"].shape[1]
    meta = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids")}
    cfg = fast.config
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)  # noqa: E731
    rows = []
    for i, layer in enumerate(fast.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        kind = (getattr(cfg, "layer_types", None) or ["full_attention"] * (i + 1))[i]
        q = randn(1, cfg.num_attention_heads, t, cfg.head_dim)
        k, v = randn(1, cfg.num_key_value_heads, t, cfg.head_dim), randn(1, cfg.num_key_value_heads, t, cfg.head_dim)
        extra = {"s_aux": attn.sinks, "sliding_window": attn.sliding_window} if model_type == "gpt_oss" else \
            {"sliding_window": attn.sliding_window} if getattr(attn, "sliding_window", None) else {}
        fns = {name: (lambda fn: lambda **kw: fn(attn, **kw))(AttentionInterface()[impl])
               for name, impl in (("fast", fast_fns["attention"]), ("ref", ref_fns["attention"]))}
        err = op_error(fns["fast"], fns["ref"], dict(query=q, key=k, value=v, attention_mask=None,
                                                     scaling=attn.scaling, **meta, **extra), seed)
        rows.append((f"attention ({kind})", *err))
    if kernels.MODEL_FAMILIES[model_type] == "qwen3_5":
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        gdn = dict(query=randn(1, t, hk, dk), key=randn(1, t, hk, dk), value=randn(1, t, hv, dv),
                   g=F.logsigmoid(randn(1, t, hv).float() + 4.0), beta=randn(1, t, hv).sigmoid(),
                   use_qk_l2norm_in_kernel=True, cu_seqlens=batch["cu_seq_lens_q"])
        err = op_error(fast_fns["gated_delta_rule"], ref_fns["gated_delta_rule"], gdn, seed)
        rows.append(("gated_delta_rule", *err))
        channels = 2 * hk * dk + hv * dv
        conv = dict(hidden_states=randn(1, t, channels).transpose(1, 2), bias=None, activation=cfg.hidden_act,
                    weight=randn(channels, cfg.linear_conv_kernel_dim), seq_idx=batch["seq_idx"])
        rows.append(("causal_conv1d", *op_error(fast_fns["causal_conv1d"], ref_fns["causal_conv1d"], conv, seed)))
    return rows


class RoutingTape:
    """MoE top-k routing recorded on the fast run and replayed elsewhere (fp32 reference, separate runs).

    Near-tied router logits pick different experts in bf16 and fp32; a flipped token changes its whole
    MLP output, which is noise for a kernel check. Replaying the fast run's choices (the weights are still
    recomputed from each run's own router logits) keeps only the kernels' error in the comparison."""

    def __init__(self):
        self.indices: list[torch.Tensor] = []

    @staticmethod
    def _routers(model):
        return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]

    def record(self, model):
        self.indices.clear()

        def hook(module, args, out):
            self.indices.append(out[-1].detach())

        return [r.register_forward_hook(hook) for r in self._routers(model)]

    def replay(self, model, order: torch.Tensor | None = None):
        """Replay the recorded choices (token t gets those recorded for token order[t])."""

        def make(i):
            def hook(module, args, out):
                # transformers 5.x returns (logits, top-k weights, indices), 4.5x (dense weights, indices)
                indices = self.indices[i] if order is None else self.indices[i][order]
                hidden = args[0].reshape(-1, module.weight.shape[1])
                logits = F.linear(hidden, module.weight, getattr(module, "bias", None))  # Qwen3-MoE: no bias
                scores = torch.softmax(logits.gather(-1, indices), dim=-1, dtype=logits.dtype)
                if len(out) == 3:
                    return logits, scores, indices
                return torch.zeros_like(logits).scatter(1, indices, scores), indices

            return hook

        return [r.register_forward_hook(make(i)) for i, r in enumerate(self._routers(model))]


def unhook(handles):
    for h in handles:
        h.remove()


def installed_functions(model_type: str, attn: str) -> dict:
    fns = {"attention": attn}
    if kernels.MODEL_FAMILIES[model_type] == "qwen3_5":
        module = importlib.import_module(kernels.QWEN35_MODULE)
        fns.update(gated_delta_rule=module.torch_chunk_gated_delta_rule, causal_conv1d=module.causal_conv1d_fn)
    return fns


def check(label: str, model_type: str, config, tokens: int, args) -> dict:
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    lengths = segment_lengths(tokens, args.segments, args.seed)
    batch = packed_block(lengths, device, args.seed)

    torch.manual_seed(args.seed)
    with torch.device(device):
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # the reference holds exactly the bf16 weights
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    fast = copy.deepcopy(ref).to(torch.bfloat16)
    # `.to()` also rounds the rotary inv_freq buffers to bf16, which from_pretrained(dtype=bf16) and ftcli's
    # trainers never do: at position p that rounding moves the angle by up to p * 2e-3 rad (gpt-oss's
    # whole-model error went from 2.4e-2 to 8.0e-2 on CPU with it). Training keeps them fp32; so does the check.
    for fast_module, ref_module in zip(fast.modules(), ref.modules()):
        for name, buffer in ref_module.named_buffers(recurse=False):
            fast_module._buffers[name] = buffer.clone()
    keep_fp32 = getattr(fast, "_keep_in_fp32_modules", None) or []
    for name, module in fast.named_modules():
        if any(name.endswith(k) for k in keep_fp32):
            module.float()
    ref.train()
    fast.train()

    tape = RoutingTape()
    attn, backends = kernels.enable_packed_kernels(model_type, device)
    fast_fns = installed_functions(model_type, attn)
    fast.set_attn_implementation(attn)
    print(f"{label}: {'; '.join(f'{b.op}={b.name} ({b.reason})' for b in backends)}")
    handles = tape.record(fast)
    started = time.perf_counter()
    fast_logits, fast_grads = fwd_bwd(fast, batch, lengths)
    unhook(handles)
    fast_grads = {n: g.detach().clone() for n, g in fast_grads.items()}

    attn, ref_backends = kernels.enable_packed_kernels(model_type, device, reference=True)
    ref_fns = installed_functions(model_type, attn)
    installed = {op: fn if isinstance(fn, str) else fn.__name__ for op, fn in fast_fns.items()}
    print(f"{label}: installed {installed}; reference: {', '.join(b.name for b in ref_backends)}")
    ref.set_attn_implementation(attn)
    handles = tape.replay(ref)
    t0 = time.perf_counter()
    ref_logits, ref_grads = fwd_bwd(ref, batch, lengths)
    common.sync(device)
    ref_seconds = time.perf_counter() - t0
    unhook(handles)
    logits_err = rel(fast_logits, ref_logits)
    print(f"{label}: fast + fp32 reference runs done after {time.perf_counter() - started:.0f} s", flush=True)
    grad_err, grad_worst, grad_worst_name = grad_errors(fast_grads, ref_grads)
    del ref, ref_grads, ref_logits
    if device.type == "cuda":
        torch.cuda.empty_cache()

    kernels.enable_packed_kernels(model_type, device)
    sep_logits, sep_grads = separate_fwd_bwd(fast, batch, lengths, tape)
    sep_logits_err = rel(fast_logits[:, : sep_logits.shape[1]], sep_logits)
    sep_grad_err, _, _ = grad_errors(fast_grads, sep_grads)
    del sep_grads, fast_grads, sep_logits
    print(f"{label}: separate runs done after {time.perf_counter() - started:.0f} s", flush=True)

    ops = op_checks(model_type, fast_fns, ref_fns, fast, batch, args.seed)
    for op, out_err, in_err, in_name in ops:
        print(f"{label}: op {op}: output error {out_err:.1e}, worst input-gradient error {in_err:.1e} ({in_name})")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(lambda: fwd_bwd(fast, batch, lengths), device, args.repeats)
    peak = f"{common.peak_gib(device):.1f}" if device.type == "cuda" else "-"
    print(f"{label}: worst single-parameter gradient error vs fp32 {grad_worst:.1e} ({grad_worst_name}; "
          "informational: small parameters carry more bf16 noise)")

    checks = [("logits vs fp32 ref", logits_err), ("gradients vs fp32 ref", grad_err),
              ("logits packed vs separate", sep_logits_err), ("gradients packed vs separate", sep_grad_err)]
    checks += [(f"op {op} output", out_err) for op, out_err, _, _ in ops]
    checks += [(f"op {op} d{name}", in_err) for op, _, in_err, name in ops]
    failures = [f"{what} {err:.2e} > {args.tol:g}" for what, err in checks if not err <= args.tol]  # NaN fails
    slow = [b for b in backends if b.name in REFERENCE_BACKENDS]
    if device.type == "cuda" and slow and not args.allow_reference:
        failures.append("fast path uses CPU references: " + ", ".join(f"{b.op}={b.name} ({b.reason})" for b in slow))
    del fast
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(label=label, tokens=tokens, segments=len(lengths), backends=", ".join(b.name for b in backends),
                logits_err=logits_err, grad_err=grad_err, sep_logits_err=sep_logits_err, sep_grad_err=sep_grad_err,
                op_err=max(max(o, i) for _, o, i, _ in ops), seconds=seconds, ref_seconds=ref_seconds, peak=peak,
                failures=failures)


def table_row(r: dict) -> str:
    return (f"| {r['label']} | {r['tokens']} / {r['segments']} | {r['backends']} | {r['logits_err']:.1e} "
            f"| {r['grad_err']:.1e} | {r['sep_logits_err']:.1e} / {r['sep_grad_err']:.1e} | {r['op_err']:.1e} "
            f"| {r['seconds'] * 1e3:.0f} ms | {r['tokens'] / r['seconds']:,.0f} | {r['ref_seconds'] * 1e3:.0f} ms "
            f"| {r['peak']} | {'PASS' if not r['failures'] else 'FAIL'} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny widths: checks this script's logic on CPU")
    parser.add_argument("--tokens", type=int, default=None,
                        help="block length (qwen 32768, gpt-oss 16384; --small: 512)")
    parser.add_argument("--segments", type=int, default=25)
    parser.add_argument("--tol", type=float, default=2e-2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", choices=["qwen3_5", "gpt_oss", *DENSE_WIDTHS], default=None)
    parser.add_argument("--allow-reference", action="store_true", help="do not fail when CUDA falls back to references")
    args = parser.parse_args(argv)
    if args.small:
        args.segments = min(args.segments, 8)

    import logging

    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    width = "tiny" if args.small else "real"
    print(f"device: {where}; torch {torch.__version__}; {width} widths; {args.segments} segments per block")
    tokens = lambda default: args.tokens or (512 if args.small else default)  # noqa: E731

    rows = []
    wanted = lambda name: args.only is None or name in args.only  # noqa: E731
    if wanted("qwen3_5"):
        rows.append(check(f"qwen3_5_text {'tiny' if args.small else '27B width'}", "qwen3_5_text",
                          qwen_config(args.small), tokens(32768), args))
        print(f"ROW {table_row(rows[-1])}", flush=True)  # kept if the next model runs out of time
    if wanted("gpt_oss"):
        rows.append(check(f"gpt_oss {'tiny' if args.small else '20b width'}", "gpt_oss",
                          gpt_oss_config(args.small), tokens(16384), args))
        print(f"ROW {table_row(rows[-1])}", flush=True)
    for model_type, (width, _) in DENSE_WIDTHS.items():
        if wanted(model_type):
            rows.append(check(f"{model_type} {'tiny' if args.small else width}", model_type,
                              dense_config(model_type, args.small), tokens(16384), args))
            print(f"ROW {table_row(rows[-1])}", flush=True)

    print()
    print(f"Command: `python benchmarks/packed_kernels_gpu.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
          f" on {where}, torch {torch.__version__}; 2 layers, vocab {VOCAB}.")
    print()
    print("| model | tokens / segments | fast backends | logits vs fp32 | grads vs fp32 | packed vs separate "
          "(logits / grads) | worst op error | fast fwd+bwd | tokens/s | fp32 ref fwd+bwd | peak GiB | result |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(table_row(r))
    failures = [f"{r['label']}: {f}" for r in rows for f in r["failures"]]
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
