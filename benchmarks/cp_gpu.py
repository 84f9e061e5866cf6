"""GPU check of context parallelism's packed ops (ftcli.model.kernels.cp) on ONE device: the N ranks of a CP group
simulated one after another, against the serial kernel on the whole block.

The simulation runs ftcli's own CP functions (`gated_delta_across`, `conv_across`, `attention_across`) with the
group's one collective, `cp.gather_slices`, replaced by a two-pass stand-in (`VirtualGroup`): pass 1 runs every
virtual rank and records what it hands the all-gather; pass 2 runs every rank again and gives it the concatenation
of the recorded pieces, as the all-gather would. Gradients flow through the recorded pieces to the rank that made
them, so the summed backward of pass 2 is the CP backward. Each op, at the real width of Qwen3.8-27B
(gated delta: 16 key / 48 value heads of 128; conv: 10,240 channels, width 4; attention: 24 query / 4 key-value
heads of 256; gpt-oss-20b's attention: 64 / 8 heads of 64 with learned sinks, full and window 128), on one packed block of --tokens tokens whose segments cross every slice boundary (one segment runs
through a whole slice), for N in --cp:

    out, grads   ||cp - serial|| / ||serial|| of the output and of every input gradient (bf16 kernels on CUDA;
                 the check passes below --tol, 2e-2, the bound of benchmarks/packed_kernels_gpu.py)
    ms           forward + backward: the serial kernel on the whole block; CP: the slowest virtual rank's own
                 work in pass 2 (its local kernels plus the state scan; no communication: one device)

Backends: what `decide_backends` picks here (fla's chunked gated-delta rule, causal-conv1d or fla's conv, torch
varlen_attn for attention: the CP attention calls varlen_attn with the keys' cu_seqlens reaching back to each
segment's start, which relies on FlashAttention's bottom-right-aligned causal mask, this checks it; gpt-oss: flex
attention with the sinks, the CP version under a block-coordinate mask).

Memory (--memory): one full-attention layer's CP attention (queries of one slice of T/N tokens, keys and values of
all T) forward + backward, the measured peak above the layer's inputs against the memory model's per-layer term
(ftcli.estimate.memory.cp_buffer_bytes with full checkpointing counts two such sets, this measures one layer's
gathered set and its gradient).

H200 (from the project root, .gpu staged with ../shared/gpu/stage.sh and carried: fla 0.6 + tilelang; causal-conv1d
optional):
    source .gpu/activate.sh && python benchmarks/cp_gpu.py --tokens 32768 --cp 2 4 8 --memory
CPU logic check (fp32 torch references, tiny widths, the same code path):
    python benchmarks/cp_gpu.py --device cpu --small --tokens 512 --cp 2 4

Each N runs both layouts where the block splits into 2N chunks of 64: contiguous slices and balanced (zigzag: rank r
holds chunks r and 2N-1-r, training.context_parallel_balance).

ftcli's state passing against fla's (`fla.ops.cp`, gated delta), over real ranks (one process per GPU, NCCL; fla
must be importable, else only ftcli's rows print), the slowest rank's fwd+bwd ms beside the errors against the
serial rule, so a device session can decide whether ftcli should call fla's CP kernels instead:
    source .gpu/activate.sh && torchrun --standalone --nproc_per_node=2 benchmarks/cp_gpu.py --state-passing \
        --tokens 32768
    (CPU logic check: torchrun --standalone --nproc_per_node=2 benchmarks/cp_gpu.py --state-passing --device cpu
     --small --tokens 512)
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import common
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftcli.model import kernels  # noqa: E402
from ftcli.model.kernels import cp as cp_ops  # noqa: E402
from ftcli.model.kernels.cp import CP_KWARG, CPSlice  # noqa: E402

WIDTH = {  # Qwen3.8-27B (REFERENCE.md section 2)
    False: dict(k_heads=16, v_heads=48, dk=128, dv=128, channels=2 * 16 * 128 + 48 * 128, conv=4, q_heads=24,
                kv_heads=4, head_dim=256),
    True: dict(k_heads=2, v_heads=4, dk=16, dv=16, channels=96, conv=4, q_heads=4, kv_heads=2, head_dim=16),
}


class VirtualGroup:
    """The all-gather of N ranks run one after another on one device (two passes: the module doc)."""

    def __init__(self):
        self.recorded: dict[int, torch.Tensor] = {}
        self.replay = False

    def gather(self, x: torch.Tensor, cp: CPSlice, dim: int) -> torch.Tensor:
        if not self.replay:
            self.recorded[cp.rank] = x
            shape = list(x.shape)
            shape[dim] *= cp.size
            return x.new_zeros(shape)  # pass 1: the result is thrown away
        return torch.cat([self.recorded[r] for r in range(cp.size)], dim=dim)


def segments(tokens: int, n: int) -> list[int]:
    """Segment lengths that cross every boundary of n slices: one runs through slice 1 whole (n > 2), the last
    boundary is crossed 2 tokens into a segment (inside the conv halo), one segment is a single token."""
    slice_len = tokens // n
    cuts = {0, tokens, slice_len // 2, slice_len // 2 + 1, 2 * slice_len + slice_len // 3}
    if n > 1:
        cuts.add((n - 1) * slice_len - 2)
    cuts = sorted(c for c in cuts if 0 <= c <= tokens)
    return [b - a for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def local_cu(s: CPSlice, device) -> torch.Tensor:
    """The rank's own cu_seqlens: its segment pieces one after another (what slice_model_inputs builds)."""
    lengths = [q1 - q0 for _, q0, q1 in s.pieces()]
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def timed(fn, device) -> tuple[object, float]:
    """(fn's result, its milliseconds): one call, no warm-up."""
    out, seconds = common.timed(fn, device=device)
    return out, seconds[0] * 1e3


def run_cp(op, kernel, inputs: dict, dims: dict, cu: list[int], n: int, extra, out_dim: int, device, balanced=False):
    """`op` (a cp.*_across function) over n virtual ranks: (the ranks' outputs in block order along the token dim,
    the slowest rank's pass-2 forward ms). `inputs`: name -> whole-block leaf tensor; `dims`: name -> its token
    dim; `extra(slice, local inputs)`: the call's other arguments; `balanced`: two chunks per rank (zigzag)."""
    group = VirtualGroup()
    original = cp_ops.gather_slices
    cp_ops.gather_slices = group.gather
    try:
        def rank_call(r):
            s = CPSlice.of(cu, r, n, None, balanced)
            local = {k: v.index_select(dims[k], s.positions(v.device)) for k, v in inputs.items()}
            return op(kernel, **local, **extra(s, local), **{CP_KWARG: s})

        for r in range(n):
            rank_call(r)
        group.replay = True
        outs, slowest = [], 0.0
        for r in range(n):
            out, ms = timed(lambda r=r: rank_call(r), device)
            outs.append(out[0] if isinstance(out, tuple) else out)
            slowest = max(slowest, ms)
    finally:
        cp_ops.gather_slices = original
    order = CPSlice.of(cu, 0, n, None, balanced).block_order(device)
    out = torch.cat(outs, dim=out_dim)
    return (out if order is None else out.index_select(out_dim, order)), slowest


def check_gated_delta(kernel, w, tokens, n, dtype, device, seed=0, balanced=False):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_()

    q, k = rand(1, tokens, w["k_heads"], w["dk"]), rand(1, tokens, w["k_heads"], w["dk"])
    v = rand(1, tokens, w["v_heads"], w["dv"])
    gate = (-torch.rand(1, tokens, w["v_heads"], generator=g) * 0.05).to(device, torch.float32).requires_grad_()
    beta = torch.rand(1, tokens, w["v_heads"], generator=g).to(device, dtype).requires_grad_()
    cu = [0, *torch.tensor(segments(tokens, n)).cumsum(0).tolist()]
    leaves = dict(query=q, key=k, value=v, g=gate, beta=beta)
    grad_out = torch.randn(1, tokens, w["v_heads"], w["dv"], generator=g).to(device, dtype)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)

    def serial():
        out, _ = kernel(q, k, v, g=gate, beta=beta, cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True)
        out.backward(grad_out)
        return out

    return compare(serial, leaves, grad_out, cu, n, device, cp_ops.gated_delta_across, kernel,
                   lambda s, local: {"cu_seqlens": local_cu(s, device), "use_qk_l2norm_in_kernel": True},
                   {name: 1 for name in leaves}, out_dim=1, balanced=balanced)


def check_conv(kernel, w, tokens, n, dtype, device, seed=1, balanced=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(1, w["channels"], tokens, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(w["channels"], w["conv"], generator=g) * 0.5).to(device, dtype).requires_grad_()
    cu = [0, *torch.tensor(segments(tokens, n)).cumsum(0).tolist()]
    seq_idx = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())[None].to(device, torch.int32)
    grad_out = torch.randn(1, w["channels"], tokens, generator=g).to(device, dtype)

    def serial():
        out = kernel(x, weight, None, activation="silu", seq_idx=seq_idx)
        out.backward(grad_out)
        return out

    leaves = dict(hidden_states=x)
    return compare(serial, leaves, grad_out, cu, n, device, cp_ops.conv_across, kernel,
                   lambda s, local: {"weight": weight, "activation": "silu",
                                     "seq_idx": seq_idx.index_select(1, s.positions(device))},
                   {"hidden_states": 2}, out_dim=2, more={"weight": weight}, balanced=balanced)


class _Attn(torch.nn.Module):
    is_causal = True


def check_attention(kernel, w, tokens, n, dtype, device, seed=2, balanced=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    d = w["head_dim"]
    q = torch.randn(1, w["q_heads"], tokens, d, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(1, w["kv_heads"], tokens, d, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(1, w["kv_heads"], tokens, d, generator=g).to(device, dtype).requires_grad_()
    cu = [0, *torch.tensor(segments(tokens, n)).cumsum(0).tolist()]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    module = _Attn()
    grad_out = torch.randn(1, tokens, w["q_heads"], d, generator=g).to(device, dtype)
    lengths = torch.tensor(cu).diff()

    def serial():
        out, _ = kernel(module, q, k, v, None, scaling=d ** -0.5, cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t,
                        max_length_q=int(lengths.max()), max_length_k=int(lengths.max()))
        out.backward(grad_out)
        return out

    def attention(kernel, query, key, value, **kw):
        return cp_ops.attention_across(kernel, module, query, key, value, None, scaling=d ** -0.5, **kw)

    return compare(serial, dict(query=q, key=k, value=v), grad_out, cu, n, device, attention, kernel,
                   lambda s, local: {}, {"query": 2, "key": 2, "value": 2}, out_dim=1, balanced=balanced)


class _SinksAttn(torch.nn.Module):
    """gpt-oss's attention module as the attention functions read it: sinks and the sliding window."""

    is_causal = True

    def __init__(self, heads: int, kv_heads: int, window: int | None, device):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads, device=device))
        self.sliding_window = window
        self.num_key_value_groups = heads // kv_heads  # read by gpt-oss's eager attention (the CPU reference)


def check_sinks_attention(kernel, w, tokens, n, dtype, device, seed=3, window=None, balanced=False):
    """gpt-oss-20b's attention (64 query / 8 key-value heads of 64, learned sinks; window 128 on sliding layers)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    heads, kv_heads, d = (4, 2, 16) if w is WIDTH[True] else (64, 8, 64)
    module = _SinksAttn(heads, kv_heads, window, device)
    q = torch.randn(1, heads, tokens, d, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(1, kv_heads, tokens, d, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(1, kv_heads, tokens, d, generator=g).to(device, dtype).requires_grad_()
    cu = [0, *torch.tensor(segments(tokens, n)).cumsum(0).tolist()]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    grad_out = torch.randn(1, tokens, heads, d, generator=g).to(device, dtype)

    def serial():
        out, _ = kernel(module, q, k, v, None, scaling=d ** -0.5, cu_seq_lens_q=cu_t, s_aux=module.sinks)
        out.backward(grad_out)
        return out

    def attention(kernel, query, key, value, **kw):
        return cp_ops.attention_across(kernel, module, query, key, value, None, scaling=d ** -0.5,
                                       s_aux=module.sinks, **kw)

    return compare(serial, dict(query=q, key=k, value=v), grad_out, cu, n, device, attention, kernel,
                   lambda s, local: {}, {"query": 2, "key": 2, "value": 2}, out_dim=1, more={"sinks": module.sinks},
                   balanced=balanced)


def compare(serial, leaves, grad_out, cu, n, device, op, kernel, extra, dims, out_dim, more=None, balanced=False):
    """(out rel err, worst input-grad rel err, serial ms, CP slowest-rank ms). Everything runs twice: the first
    round compiles and autotunes for the shapes (on CUDA it took seconds), the second is the one measured."""
    more = more or {}
    everything = {**leaves, **more}
    for _ in range(2):
        out_serial, serial_ms = timed(serial, device)
        grads_serial = {name: t.grad.clone() for name, t in everything.items()}
        for t in everything.values():
            t.grad = None

        out_cp, cp_ms = run_cp(op, kernel, leaves, dims, cu, n, extra, out_dim, device, balanced)
        _, backward_ms = timed(lambda: out_cp.backward(grad_out), device)
        cp_ms += backward_ms / n  # the ranks' backward runs as one graph here: each rank's share
        worst = max(rel(t.grad, grads_serial[name]) for name, t in everything.items())
        for t in everything.values():
            t.grad = None
    return rel(out_cp.detach(), out_serial.detach()), worst, serial_ms, cp_ms


def memory_check(kernel, w, tokens, n, dtype, device) -> tuple[float, float]:
    """(measured GiB above the inputs, the memory model's GiB) for one layer's CP attention on one slice."""
    from ftcli.estimate import memory

    d = w["head_dim"]
    s = CPSlice.of([0, tokens], n - 1, n, None)  # the last slice: its queries see every key
    t = tokens // n
    start, end = s.spans()[0]
    q = torch.randn(1, w["q_heads"], t, d, device=device, dtype=dtype, requires_grad=True)
    keys = torch.randn(1, w["kv_heads"], tokens, d, device=device, dtype=dtype, requires_grad=True)
    values = torch.randn_like(keys, requires_grad=True)
    group = VirtualGroup()
    group.replay = True
    group.recorded = {r: torch.stack([keys, values])[:, :, :, r * t:(r + 1) * t] for r in range(n)}
    original = cp_ops.gather_slices
    cp_ops.gather_slices = group.gather
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        out, _ = cp_ops.attention_across(kernel, _Attn(), q, keys[:, :, start:end], values[:, :, start:end],
                                         None, scaling=d ** -0.5, **{CP_KWARG: s})
        out.backward(torch.ones_like(out))
    finally:
        cp_ops.gather_slices = original
    torch.cuda.synchronize()
    measured = (torch.cuda.max_memory_allocated() - base) / memory.GiB
    q_dim, kv_dim = w["q_heads"] * d, w["kv_heads"] * d
    model = 2 * 2 * tokens * (q_dim + kv_dim) * 2 / memory.GiB  # one gathered set + its gradient, bf16
    return measured, model


def state_passing(args) -> int:
    """--state-passing, under torchrun (one process per GPU, NCCL; or gloo on CPU for a logic check): the gated-delta
    rule of one block split over the real ranks, ftcli's state passing (`cp.gated_delta_across` over the installed
    rule, contiguous and balanced) and, when fla is importable, fla's own (`chunk_gated_delta_rule(...,
    cp_context=fla.ops.cp.build_cp_context(cu_seqlens, group))`, contiguous only), both against the serial rule on
    the whole block (each rank runs it and keeps its part): output and input-gradient errors, and forward + backward
    ms of the slowest rank (median of --repeats, after one warm-up)."""
    import torch.distributed as dist

    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    w = WIDTH[args.small]
    backends = {b.op: b for b in kernels.decide_backends("qwen3_5_text", device)}
    kernels.install_backends("qwen3_5_text", list(backends.values()))  # the module globals the torch rule reads
    backend = backends["gated_delta_rule"]
    from ftcli.model.kernels.ops import KERNELS

    kernel = KERNELS["gated_delta_rule"][backend.name]
    g = torch.Generator(device="cpu").manual_seed(0)  # the same block on every rank

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    tokens = args.tokens
    q, k = rand(1, tokens, w["k_heads"], w["dk"]), rand(1, tokens, w["k_heads"], w["dk"])
    v = rand(1, tokens, w["v_heads"], w["dv"])
    gate = (-torch.rand(1, tokens, w["v_heads"], generator=g) * 0.05).to(device, torch.float32)
    beta = torch.rand(1, tokens, w["v_heads"], generator=g).to(device, dtype)
    grad_out = rand(1, tokens, w["v_heads"], w["dv"])
    cu = [0, *torch.tensor(segments(tokens, n)).cumsum(0).tolist()]
    whole = dict(query=q, key=k, value=v, g=gate, beta=beta)

    def leaves(positions):
        return {name: t.index_select(1, positions).detach().requires_grad_() for name, t in whole.items()}

    serial_in = {name: t.detach().requires_grad_() for name, t in whole.items()}
    serial_out, _ = kernel(**serial_in, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                           use_qk_l2norm_in_kernel=True)
    serial_out.backward(grad_out)

    def ftcli_call(balanced):
        s = CPSlice.of(cu, rank, n, dist.group.WORLD, balanced)
        local = leaves(s.positions(device))
        out, _ = cp_ops.gated_delta_across(kernel, **local, cu_seqlens=local_cu(s, device),
                                           use_qk_l2norm_in_kernel=True, **{CP_KWARG: s})
        return s.positions(device), local, out

    def fla_call():
        from fla.ops.cp import build_cp_context
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        s = CPSlice.of(cu, rank, n, None)
        local = leaves(s.positions(device))
        context = build_cp_context(torch.tensor(cu, dtype=torch.long, device=device), dist.group.WORLD)
        out, _ = chunk_gated_delta_rule(local["query"], local["key"], local["value"], g=local["g"],
                                        beta=local["beta"], use_qk_l2norm_in_kernel=True, cp_context=context)
        return s.positions(device), local, out

    variants = {"ftcli, contiguous": lambda: ftcli_call(False)}
    if tokens % (2 * n * 64) == 0:
        variants["ftcli, balanced"] = lambda: ftcli_call(True)
    try:
        import fla.ops.cp  # noqa: F401

        variants["fla.ops.cp, contiguous"] = fla_call
        fla_note = ""
    except ImportError as e:
        fla_note = f"fla.ops.cp not importable here ({e}): ftcli's state passing only"
    rows = []
    for label, call in variants.items():
        def step():
            positions, local, out = call()
            out.backward(grad_out.index_select(1, positions))
            return positions, local, out

        try:
            step()  # warm-up (autotuning, the collectives' first use)
        except (TypeError, ValueError, NotImplementedError) as e:  # an fla version with another CP API: every rank
            rows.append([label, n, "-", "-", "-", f"not run: {type(e).__name__}: {str(e)[:120]}"])
            continue
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            (positions, local, out), seconds = common.timed(step, device=device)
            times.append(seconds[0] * 1e3)
        errors = [rel(out.detach(), serial_out.detach().index_select(1, positions))]
        errors += [rel(t.grad, serial_in[name].grad.index_select(1, positions)) for name, t in local.items()]
        worst = torch.tensor([errors[0], max(errors[1:]), sorted(times)[len(times) // 2]], dtype=torch.float64,
                             device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rows.append([label, n, f"{worst[0]:.2e}", f"{worst[1]:.2e}", f"{worst[2]:.2f}",
                     "yes" if max(worst[0], worst[1]) <= args.tol else "NO"])
    if rank == 0:
        print(f"gated-delta state passing over {n} ranks ({device.type}, {dtype}), {tokens:,} tokens, backend "
              f"{backend.name}; segments {cu}")
        if fla_note:
            print(fla_note)
        print(common.table(["state passing", "CP", "out rel err", "worst grad rel err",
                            "fwd+bwd ms (slowest rank, median)", "ok"], rows))
    failed = any(r[-1] != "yes" for r in rows)
    dist.destroy_process_group()
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny widths (a CPU logic check)")
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--state-passing", action="store_true",
                    help="under torchrun: ftcli's gated-delta state passing against fla.ops.cp over real ranks")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.state_passing:
        return state_passing(args)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    w = WIDTH[args.small]
    backends = {b.op: b for b in kernels.decide_backends("qwen3_5_text", device)}
    kernels.install_backends("qwen3_5_text", list(backends.values()))  # the module globals the torch rule reads
    from ftcli.model.kernels.ops import KERNELS

    attention_name = backends["attention"].name
    if attention_name == "flash_attn_varlen":  # CP calls torch's varlen_attn instead (install.cp_backend)
        attention_name = "torch_varlen"
    sinks_name = {b.op: b for b in kernels.decide_backends("gpt_oss", device)}["attention"].name
    chosen = {"gated delta": ("gated_delta_rule", backends["gated_delta_rule"].name, check_gated_delta),
              "causal conv": ("causal_conv1d", backends["causal_conv1d"].name, check_conv),
              "attention": ("attention", attention_name, check_attention),
              "gpt-oss attention, sinks": ("attention", sinks_name, check_sinks_attention),
              "gpt-oss attention, sinks, window 128": ("attention", sinks_name,
                                                       functools.partial(check_sinks_attention, window=128))}
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}, "
          f"{args.tokens:,} tokens, torch {torch.__version__}")
    print("| op | backend | CP | layout | out rel err | worst grad rel err | serial fwd+bwd ms | CP ms per rank (slowest forward + backward / N) | ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False
    for label, (op, name, check) in chosen.items():
        kernel = KERNELS[op][name]
        for n in args.cp:
            for balanced in (False, True) if args.tokens % (2 * n * 64) == 0 else (False,):
                out_err, grad_err, serial_ms, cp_ms = check(kernel, w, args.tokens, n, dtype, device, balanced=balanced)
                ok = out_err <= args.tol and grad_err <= args.tol
                failed |= not ok
                print(f"| {label} | {name} | {n} | {'balanced' if balanced else 'contiguous'} | {out_err:.2e} | "
                      f"{grad_err:.2e} | {serial_ms:.1f} | {cp_ms:.1f} | {'yes' if ok else 'NO'} |", flush=True)
    if args.memory and device.type == "cuda":
        print("\n| CP | slice tokens | measured GiB (one layer's CP attention, fwd+bwd) | memory model GiB |")
        print("|---|---|---|---|")
        for n in args.cp:
            measured, model = memory_check(KERNELS["attention"][attention_name], w, args.tokens, n, dtype, device)
            print(f"| {n} | {args.tokens // n:,} | {measured:.2f} | {model:.2f} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
