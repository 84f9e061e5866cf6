"""Context parallelism: the packed ops across the boundary between two ranks' slices of one block.

With `training.context_parallel: N` the N ranks of a context-parallel (CP) group train on one packed block
together, each on a contiguous slice of T/N tokens (ftcli.data.collate.slice_model_inputs). A segment may start
on one rank and end on the next; every op that looks along the sequence then needs what lies before its slice:

    block      | a0 a1 a2 a3 a4 a5 | a6 a7 b0 b1 b2 b3 |     T = 12, N = 2; segment a crosses the boundary
    rank       |        0          |        1          |
    positions  |  0  1  2  3  4  5 |  6  7  0  1  2  3 |     sliced from the block: per segment, across it

    full attention     K and V all-gathered over the group (backward: their gradients summed back to the rank that
                       owns them); rank 1's queries a6 a7 see keys a0..a7, b0..b3 see b0..b3: causal per segment
                       in block coordinates, bottom-right aligned (the queries are the last keys of their piece);
                       a sliding window counts in block positions, sinks are per query and unchanged
    causal conv        a halo of the W-1 tokens before the slice (the previous rank's tail, all-gathered), masked
                       where its segment differs: rank 1's a6 sees a3 a4 a5, b0 sees only itself
    gated-delta rule   the state a segment carries over the boundary. The rule is affine in its initial state:
                           S_end = A S_0 + F        o_t = o_t(S_0 = 0) + P_t S_0
                       F, o(0): the rule from a zero state; A, P: the same rule with v = 0 and S_0 = I (the
                       identity, dk x dk per head), which gives A = the transition over the piece, P_t = q_t^T A_t.
                       Every rank computes (F, A) of its last piece, one all-gather shares them, and every rank
                       scans the ranks before it:  S_in(r) = [through(r-1)] A(r-1) S_in(r-1) + F(r-1)  when its
                       first token continues a segment (else 0; through = the whole slice inside that segment),
                       then adds P S_in(r) to its first piece's outputs. Exact (the same sums, chunked from the
                       slice start instead of the segment start), and the state's gradient flows back through the
                       all-gather; no point-to-point send, so activation checkpointing's recompute (the same
                       collectives on every rank, in the same order) and backward stay in lockstep.

Load balancing (`training.context_parallel_balance`): causal attention gives the last slice the most work (its queries
see the most keys). The balanced layout cuts the block into 2N chunks and gives rank r chunks r and 2N-1-r, one after
the other (torchtitan's and ring-flash-attn's zigzag); every rank then computes the same causal triangle for a
document filling the block (benchmarks/cp_balance.py: the slowest rank of Llama-3.1-8B at 128k, CP 8, does 1.61x
the mean work with contiguous slices, 1.00x balanced). The ops above work per chunk: the gathered K/V are put back
in block order, each chunk takes the conv halo of the chunk before it (on another rank, or its own first chunk), and
the gated-delta scan runs over the 2N chunks in block order, the same all-gather carrying two (F, A) per rank.

Every rank of the group runs the same collectives in every layer whatever its data (an all-gather even where no
segment crosses), which FSDP's per-layer collectives need too.

Backends: the gated-delta rule and the conv call the installed kernel (the torch references on CPU, fla /
causal-conv1d on CUDA) for the slice's own work, so fla's kernels carry the state passing on GPU through their
public `initial_state` / `output_final_state`. (fla 0.6's `fla.ops.cp` computes the same (F, A) with dedicated
kernels behind its own context object; it is not used here: it needs several GPUs to check.) Attention on CUDA in half
precision is one torch `varlen_attn` call (queries' and keys' cu_seqlens differ: FlashAttention's bottom-right
causal alignment), gpt-oss's is flex attention under a block mask in block coordinates with the sinks applied
after it (as `ops.flex_sinks`); elsewhere (CPU, float32) the per-piece references (sdpa / eager) run
(benchmarks/cp_gpu.py checks the CUDA paths against the serial kernels on one device).

The ops receive the slice as the model call's keyword argument `CP_KWARG` (a `CPSlice`), which transformers hands
to every attention function, gated-delta rule and conv, like the block's other packing metadata.
`across_slices(op, kernel)` wraps an installed kernel: a call with a `CPSlice` goes through the functions below
(each calls the wrapped kernel for the local work), any other call is the kernel unchanged.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftcli.data.collate import cp_chunks
from ftcli.model.kernels.choose import SINKS_MODULE

CP_KWARG = "ftcli_cp"


@dataclass(frozen=True)
class CPSlice:
    """This rank's part of a block of `cu_seqlens[-1]` tokens, and its CP group. The block is cut into chunks of
    `chunk_len` tokens (N, or 2N when balanced); the rank holds `chunks` (ftcli.data.collate.cp_chunks), one after
    the other in that order.

        contiguous, N = 2   | c0 | c1 |              rank 0: c0         rank 1: c1
        balanced,   N = 2   | c0 | c1 | c2 | c3 |    rank 0: c0 c3      rank 1: c1 c2"""

    group: Any  # torch.distributed ProcessGroup of the N ranks sharing the block
    rank: int  # in the group
    size: int
    cu_seqlens: tuple[int, ...]  # the whole block's segment boundaries
    balanced: bool = False

    @classmethod
    def of(cls, cu_seqlens, rank: int, size: int, group, balanced: bool = False) -> CPSlice:
        """Rank `rank`'s part of a block with segment boundaries `cu_seqlens` (ints) split over `size` ranks."""
        return cls(group, rank, size, tuple(int(c) for c in cu_seqlens), balanced)

    @property
    def chunk_len(self) -> int:
        return self.cu_seqlens[-1] // (self.size * (2 if self.balanced else 1))

    @property
    def chunks(self) -> tuple[int, ...]:
        return cp_chunks(self.rank, self.size, self.balanced)

    def spans(self) -> list[tuple[int, int]]:
        """[start, end) in block coordinates of each of this rank's chunks, in local order."""
        n = self.chunk_len
        return [(c * n, (c + 1) * n) for c in self.chunks]

    def local(self, position: int) -> int:
        """Where block position `position` (inside one of this rank's chunks) sits in the rank's local tokens."""
        n = self.chunk_len
        return self.chunks.index(position // n) * n + position % n

    def positions(self, device=None) -> torch.Tensor:
        """int64 [t]: the block position of each local token."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.spans()])

    def block_order(self, device=None) -> torch.Tensor | None:
        """int64 [T]: for each block position, its index in the all-gather of every rank's local tokens (rank after
        rank); None when that is the block order already (contiguous)."""
        if not self.balanced:
            return None
        n = self.chunk_len
        slot = {c: i for i, c in enumerate(c for r in range(self.size) for c in cp_chunks(r, self.size, True))}
        return torch.cat([torch.arange(slot[c] * n, (slot[c] + 1) * n, device=device) for c in range(2 * self.size)])

    def pieces(self) -> list[tuple[int, int, int]]:
        """(segment start, piece start, piece end) in block coordinates for every segment meeting each of this rank's
        chunks, in local order (the pieces cover the local tokens one after another)."""
        cu = self.cu_seqlens
        return [(s, max(s, a), min(e, b)) for a, b in self.spans() for s, e in zip(cu[:-1], cu[1:])
                if e > a and s < b and e > s]

    def segment_start(self, position: int) -> int:
        """Start of the segment holding block position `position`."""
        return max(s for s in self.cu_seqlens[:-1] if s <= position)

    def continued(self, chunk: int) -> bool:
        """Whether chunk `chunk`'s first token continues a segment begun in an earlier chunk (contiguous: chunk r is
        rank r's slice)."""
        start = chunk * self.chunk_len
        return chunk > 0 and self.segment_start(start) < start

    def through(self, chunk: int) -> bool:
        """Whether chunk `chunk` lies whole inside one segment begun in an earlier chunk."""
        n = self.chunk_len
        return self.continued(chunk) and self.segment_start((chunk + 1) * n - 1) < chunk * n

    def gathered_chunk(self, chunk: int) -> int:
        """Index of chunk `chunk`'s piece in an all-gather of one piece per local chunk (rank after rank)."""
        per_rank = 2 if self.balanced else 1
        for r in range(self.size):
            if chunk in cp_chunks(r, self.size, self.balanced):
                return r * per_rank + cp_chunks(r, self.size, self.balanced).index(chunk)
        raise AssertionError(chunk)


# ---------------------------------------------------------------------------------------- communication
class _GatherSlices(torch.autograd.Function):
    """All-gather equal pieces along dim 0 over `group`; backward sums the gradients of every rank's copy and
    hands each rank the part of its own piece."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[0]
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        if dist.get_backend(group) == "gloo":  # no all_gather_into_tensor on gloo
            dist.all_gather(list(out.chunk(size)), x, group=group)
        else:
            dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":  # no reduce_scatter on gloo
            dist.all_reduce(grad, group=ctx.group)
            return grad.narrow(0, ctx.rank * ctx.n, ctx.n).clone(), None, None, None
        out = grad.new_empty((ctx.n, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None, None, None


def gather_slices(x: torch.Tensor, cp: CPSlice, dim: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order (differentiable)."""
    moved = x.movedim(dim, 0)
    return _GatherSlices.apply(moved, cp.group, cp.rank, cp.size).movedim(0, dim)


def sum_over_group(x: torch.Tensor, cp: CPSlice) -> torch.Tensor:
    """The sum of every rank's `x` (same shape on each), differentiable: each rank's gradient is the sum of the
    gradients of every rank's copy of the result (the group's per-segment sums of a preference loss)."""
    return gather_slices(x[None], cp, 0).sum(0)


def slice_of_block(block, rank: int, size: int, group, device="cpu", balanced: bool = False) -> dict:
    """The model call's kwargs for CP rank `rank`'s slice of `block` (ftcli.data.collate.slice_model_inputs; its two
    chunks when `balanced`), with the slice's place in the block under `CP_KWARG` for the ops below."""
    from ftcli.data.collate import slice_model_inputs

    inputs = slice_model_inputs(block, rank, size, device, balanced=balanced)
    inputs[CP_KWARG] = CPSlice.of(block.cu_seqlens, rank, size, group, balanced)
    return inputs


# ------------------------------------------------------------------------------------------- attention
def _piece_mask(q0: int, q1: int, k0: int, window: int | None, device) -> torch.Tensor:
    """bool [q1 - q0, q1 - k0]: query at block position q attends key k iff k <= q (and q - k < window)."""
    q = torch.arange(q0, q1, device=device)[:, None]
    k = torch.arange(k0, q1, device=device)[None, :]
    allowed = k <= q
    if window:
        allowed &= q - k < window
    return allowed


def _attention_pieces(query, keys, values, cp: CPSlice, scaling, dropout, window, module, sinks: bool):
    """Reference: per segment piece, this rank's queries against the gathered keys of their segment, with the
    causal (and window) mask in block coordinates; sdpa, or gpt-oss's eager attention with its sinks."""
    outs = []
    for s, q0, q1 in cp.pieces():
        mask = _piece_mask(q0, q1, s, window, query.device)
        local = cp.local(q0)
        q = query[:, :, local:local + q1 - q0]
        k, v = keys[:, :, s:q1], values[:, :, s:q1]
        if sinks:
            eager = importlib.import_module(SINKS_MODULE).eager_attention_forward
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
            o, _ = eager(module, q, k, v, additive[None, None], scaling=scaling, dropout=dropout)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                               enable_gqa=True).transpose(1, 2)
        outs.append(o)
    return torch.cat(outs, dim=1), None  # [1, t, H, D]


def _attention_varlen(query, keys, values, cp: CPSlice, scaling, window):
    """CUDA, half precision: one varlen call, queries' cu_seqlens over the slice's pieces and keys' over the pieces
    extended back to their segment starts; FlashAttention's causal mask is bottom-right aligned for
    seqlen_q < seqlen_k, which is the block-coordinate mask above (benchmarks/cp_gpu.py checks it)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if window and "window_size" not in params:
        return None  # torch 2.10: no sliding window in varlen_attn (the caller takes the reference)
    pieces = cp.pieces()
    q = query[0].transpose(0, 1)  # [t, H, D]
    k_rows = torch.cat([keys[0, :, s:q1].transpose(0, 1) for s, _, q1 in pieces])
    v_rows = torch.cat([values[0, :, s:q1].transpose(0, 1) for s, _, q1 in pieces])
    extra = {}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif k_rows.shape[1] != q.shape[1]:  # torch 2.11: no GQA, repeat the kv heads
        k_rows, v_rows = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k_rows, v_rows))
    if "window_size" in params:
        extra["window_size"] = (window - 1 if window else -1, 0)
    else:
        extra["is_causal"] = True
    q_lens = [q1 - q0 for _, q0, q1 in pieces]
    k_lens = [q1 - s for s, _, q1 in pieces]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    out = varlen_attn(q, k_rows.contiguous(), v_rows.contiguous(), cu_q, cu_k, max(q_lens), max(k_lens),
                      scale=scaling, **extra)
    return out[None], None


def _attention_flex_sinks(query, keys, values, cp: CPSlice, scaling, window, sinks):
    """gpt-oss on CUDA: flex attention of this rank's queries over the keys up to the slice's end, under a block mask
    in block coordinates (same segment, causal, window), then the sinks as `ops.flex_sinks` applies them."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ftcli.model.kernels.ops import _flex

    cu = torch.tensor(cp.cu_seqlens, dtype=torch.long, device=query.device)
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=query.device), cu[1:] - cu[:-1])
    position = cp.positions(query.device)  # block position of each local query

    def mask_mod(b, h, q_idx, kv_idx):
        q = position[q_idx]
        keep = (doc[q] == doc[kv_idx]) & (kv_idx <= q)
        if window:
            keep = keep & (q - kv_idx < window)
        return keep

    t, end = query.shape[2], max(b for _, b in cp.spans())
    block_mask = create_block_mask(mask_mod, None, None, t, end, device=query.device,
                                   _compile=query.device.type == "cuda")
    out, lse = _flex(query, keys[:, :, :end].contiguous(), values[:, :, :end].contiguous(), block_mask, scaling)
    if sinks is not None:  # softmax over [scores, sink]: each weight shrinks by sigmoid(lse - sink)
        out = out.float() * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None]
    return out.to(query.dtype).transpose(1, 2), None


def attention_across(kernel, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention function's call over this rank's slice: queries [1, H, t, D] local, keys and values gathered
    (and put in block order)."""
    cp: CPSlice = kwargs.pop(CP_KWARG)
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("context parallelism takes packed blocks (batch size 1, no attention mask)")
    gathered = gather_slices(torch.stack([key, value]), cp, 3)  # one collective for both
    order = cp.block_order(query.device)
    keys, values = (gathered if order is None else gathered.index_select(3, order)).unbind(0)  # in block order
    sinks = getattr(module, "sinks", None) is not None
    window = getattr(module, "sliding_window", None) if sinks else kwargs.get("sliding_window")
    if kwargs.get("softcap") is not None:
        raise ValueError("packed attention has no logit soft-capping; set attn_logit_softcapping to null")
    name = getattr(kernel, "__name__", "")
    if query.is_cuda and not sinks and name == "torch_varlen" and query.dtype in (torch.float16, torch.bfloat16) \
            and not dropout:
        out = _attention_varlen(query, keys, values, cp, scaling, window)
        if out is not None:
            return out
    if query.is_cuda and sinks and name == "flex_sinks" and not dropout:
        return _attention_flex_sinks(query, keys, values, cp, scaling, window, kwargs.get("s_aux"))
    return _attention_pieces(query, keys, values, cp, scaling, dropout, window, module, sinks)


# ---------------------------------------------------------------------------------------------- conv
def conv_across(kernel, hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    """The causal conv (x [1, D, t]) of this rank's chunks, each with the last W-1 tokens of the chunk before it
    (the halo) put in front of it: one kernel call over | halo | chunk | (halo | chunk |), the halos' outputs dropped
    (a chunk's first token sees its halo and nothing before it, the window being W)."""
    cp: CPSlice = kwargs.pop(CP_KWARG)
    halo = weight.shape[-1] - 1
    n = cp.chunk_len
    if n < halo or halo == 0:
        raise ValueError(f"context parallelism: a slice of {n} tokens for a conv halo of {halo}")
    tails = torch.cat([hidden_states[..., (k + 1) * n - halo:(k + 1) * n] for k in range(len(cp.chunks))], dim=-1)
    tails = gather_slices(tails.movedim(-1, 0), cp, 0)  # [chunks * halo, 1, D], one piece per chunk, rank order
    starts = torch.tensor(cp.cu_seqlens[:-1], dtype=torch.long)
    parts, idx_parts = [], []
    for k, c in enumerate(cp.chunks):
        # chunk 0 too takes a halo (the last chunk's tail) under a segment id of its own, so every rank's output
        # depends on the gathered tails and every rank joins the gather's backward (a collective)
        g = cp.gathered_chunk((c - 1) % (len(cp.chunks) * cp.size))
        parts += [tails[g * halo:(g + 1) * halo].movedim(0, -1), hidden_states[..., k * n:(k + 1) * n]]
        if c == 0:
            before_idx = torch.full((halo,), -1, dtype=seq_idx.dtype, device=seq_idx.device)
        else:
            positions = torch.arange(c * n - halo, c * n)
            before_idx = (torch.searchsorted(starts, positions, right=True) - 1).to(seq_idx.device, seq_idx.dtype)
        idx_parts += [before_idx[None], seq_idx[:, k * n:(k + 1) * n]]
    out = kernel(torch.cat(parts, dim=-1), weight, bias, activation=activation, seq_idx=torch.cat(idx_parts, dim=-1),
                 **kwargs)
    return torch.cat([out[..., k * (n + halo) + halo:(k + 1) * (n + halo)] for k in range(len(cp.chunks))], dim=-1)


# ---------------------------------------------------------------------------------------- gated delta
def gated_delta_across(kernel, query, key, value, g, beta, chunk_size=64, initial_state=None,
                       output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """The gated-delta rule over this rank's slice with the state carried in from the ranks before (module doc).
    `cu_seqlens` are the slice's own (local) boundaries; `kernel` the installed rule (torch reference or fla)."""
    cp: CPSlice = kwargs.pop(CP_KWARG)
    if initial_state is not None or query.shape[0] != 1:
        raise ValueError("context parallelism takes packed blocks (batch size 1, no recurrent cache)")
    rule = functools.partial(kernel, chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    out, finals = rule(query, key, value, g=g, beta=beta, output_final_state=True, cu_seqlens=cu_seqlens, **kwargs)
    heads, dk, dv = value.shape[2], key.shape[-1], value.shape[-1]
    n, pieces = cp.chunk_len, cp.pieces()
    eye = torch.eye(dk, dtype=torch.float32, device=query.device).expand(1, heads, dk, dk).contiguous()
    shared_parts, responses = [], {}
    for k, c in enumerate(cp.chunks):  # per local chunk: its last piece's state from a zero state (F), and the
        last = next(i for i, (_, _, q1) in enumerate(pieces) if q1 == (c + 1) * n)  # transition where through(c) (A)
        last_final = finals[last].float()  # [H, dk, dv]
        transition = last_final.new_zeros(heads, dk, dk)
        if cp.continued(c):  # the chunk's first piece's response to its initial state: v = 0, S_0 = I
            first_len = next(q1 - q0 for _, q0, q1 in pieces if q0 == c * n)
            sl = slice(k * n, k * n + first_len)
            zeros = query.new_zeros(1, first_len, heads, dk)
            response, first_transition = rule(query[:, sl], key[:, sl], zeros, g=g[:, sl], beta=beta[:, sl],
                                              initial_state=eye, output_final_state=True)
            responses[k] = response
            if cp.through(c):
                transition = first_transition[0].float()
        shared_parts.append(torch.cat([last_final, transition], dim=-1))
    # one collective for all; every rank's output depends on it (a rank whose chunks start segments adds 0 x the
    # gathered states), so every rank joins its backward
    shared = gather_slices(torch.stack(shared_parts), cp, 0)  # [N x chunks, H, dk, dv + dk], rank order
    if not responses:
        return out + (shared.sum() * 0).to(out.dtype), None
    states, state = {}, last_final.new_zeros(heads, dk, dv)  # the state entering each chunk, scanned in block order
    for c in range(1, max(cp.chunks) + 1):
        if not cp.continued(c):
            state = torch.zeros_like(state)
            continue
        before = shared[cp.gathered_chunk(c - 1)]
        state = (before[..., dv:] @ state if cp.through(c - 1) else 0) + before[..., :dv]
        states[c] = state
    parts, at = [], 0
    for k, response in sorted(responses.items()):
        start = k * n
        correction = torch.einsum("bthk,hkv->bthv", response.float(), states[cp.chunks[k]])
        parts += [out[:, at:start], (out[:, start:start + response.shape[1]].float() + correction).to(out.dtype)]
        at = start + response.shape[1]
    return torch.cat([*parts, out[:, at:]], dim=1), None


# ------------------------------------------------------------------------------------------- wrapping
_ACROSS = {"attention": attention_across, "gated_delta_rule": gated_delta_across, "causal_conv1d": conv_across}


def across_slices(op: str, kernel):
    """`kernel` (an installed packed kernel of `op`) that routes a call carrying a `CPSlice` through the op's
    context-parallel version above; any other call goes to `kernel` unchanged."""
    across = torch.compiler.disable(_ACROSS[op])  # collectives and per-segment loops: eager in a compiled layer

    @functools.wraps(kernel)
    def wrapped(*args, **kwargs):
        if kwargs.get(CP_KWARG) is None:
            kwargs.pop(CP_KWARG, None)
            return kernel(*args, **kwargs)
        return across(kernel, *args, **kwargs)

    wrapped.__wrapped_kernel__ = kernel
    return wrapped
