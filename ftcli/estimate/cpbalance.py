"""Context parallelism's causal imbalance (`training.context_parallel_balance`): how much of one packed block's causal
attention each rank of a context-parallel group computes, with contiguous slices and with the balanced (zigzag)
layout, and each rank's forward FLOPs. Pure arithmetic, no torch: `plan` says it, benchmarks/cp_balance.py prints
it per model.

    contiguous, N = 2   | c0 | c1 |              rank 0: c0         rank 1: c1 (its queries see every key: 3/4)
    balanced,   N = 2   | c0 | c1 | c2 | c3 |    rank 0: c0 c3      rank 1: c1 c2 (each half the triangle)

    pairs        the (query, key) pairs a full-attention layer computes for a rank's queries: per segment piece of
                 its chunks, queries q0..q1-1 see keys s..q (the causal triangle of their segment, from its start s);
                 the pieces are those ftcli.model.kernels.cp.CPSlice.pieces() gives the attention kernels
    dense        2 x (non-embedding parameters + LM head) per token: the same on every rank (T / N tokens each)
    gated delta  Qwen3.5's linear-attention layers, per token and value head: 6 dk dv (state update and readout) +
                 2 x 64 (dk + dv) (the chunked kernel's in-chunk terms, chunk 64): the same on every rank
    attention    4 x query width per pair, per full-attention layer

The slowest rank is what the step waits for (compute only: no communication, no recomputation). One document filling
the block is the worst case (long-context data); short documents packed leave little triangle to balance.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftcli.estimate import memory

GDN_CHUNK = 64


def rank_pieces(cu_seqlens: list[int] | tuple[int, ...], rank: int, size: int,
                balanced: bool) -> list[tuple[int, int, int]]:
    """(segment start, piece start, piece end) in block coordinates for every segment meeting each chunk rank `rank`
    of `size` holds, in its local order: chunk `rank` of `size` (contiguous) or chunks `rank` and 2 size - 1 - rank of
    2 size (balanced: ftcli.data.collate.cp_chunks)."""
    cu = tuple(int(c) for c in cu_seqlens)
    chunks = (rank, 2 * size - 1 - rank) if balanced else (rank,)
    n = cu[-1] // (size * (2 if balanced else 1))
    return [(s, max(s, c * n), min(e, (c + 1) * n)) for c in chunks for s, e in zip(cu[:-1], cu[1:])
            if e > c * n and s < (c + 1) * n and e > s]


def causal_pairs(pieces: list[tuple[int, int, int]]) -> int:
    """(query, key) pairs of these pieces: queries q0..q1-1 of a segment starting at s see keys s..q."""
    total = 0
    for s, q0, q1 in pieces:
        a, b = q0 - s + 1, q1 - s
        total += (a + b) * (b - a + 1) // 2
    return total


def documents(tokens: int, doc: int | None = None) -> list[int]:
    """cu_seqlens of a block of `tokens` packed with documents of `doc` tokens (None: one fills the block)."""
    return sorted({*range(0, tokens, doc or tokens), tokens})


def rank_attention_pairs(tokens: int, size: int, balanced: bool, doc: int | None = None) -> list[int]:
    """Causal (query, key) pairs of each of `size` ranks on one block (`documents(tokens, doc)`)."""
    cu = documents(tokens, doc)
    return [causal_pairs(rank_pieces(cu, r, size, balanced)) for r in range(size)]


def rank_flops(shape: memory.ModelShape, tokens: int, size: int, balanced: bool, doc: int | None = None,
               linear: tuple[int, int, int] | None = None) -> tuple[list[float], float]:
    """Forward FLOPs of each of the `size` ranks on one block, and attention's share of the whole block's FLOPs.
    `linear`: (key head dim, value head dim, value heads) of the gated-delta layers, where the model has them."""
    kinds = shape.layer_kinds or ("full_attention",) * shape.layers
    full = sum(1 for k in kinds if k == "full_attention")
    q_dim, _ = memory.attention_dims(shape)
    dense_per_token = 2 * (sum(shape.layer_params) + shape.hidden * shape.vocab)
    if linear is not None:
        dk, dv, heads = linear
        dense_per_token += (len(kinds) - full) * heads * (6 * dk * dv + 2 * GDN_CHUNK * (dk + dv))
    attention = [full * 4 * q_dim * pairs for pairs in rank_attention_pairs(tokens, size, balanced, doc)]
    out = [dense_per_token * tokens / size + a for a in attention]
    return out, sum(attention) / sum(out)


@dataclass(frozen=True)
class CPBalance:
    """The slowest rank's share of one block's causal attention, one document filling the block (`plan`)."""

    tokens: int  # the block
    cp: int  # ranks sharing it
    balanced: bool  # the recipe's training.context_parallel_balance
    contiguous_share: float  # the slowest rank's share with contiguous slices
    balanced_share: float  # with the zigzag layout

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "context_parallel": self.cp, "balanced": self.balanced,
                "slowest_rank_attention_share": {"contiguous": round(self.contiguous_share, 6),
                                                 "balanced": round(self.balanced_share, 6)}}

    def text(self) -> str:
        on = "on" if self.balanced else "off: training.context_parallel_balance=true balances it"
        return (f"context-parallel balance, {self.cp} ranks on a {self.tokens:,}-token block one document fills: the "
                f"slowest rank computes {self.contiguous_share:.1%} of the causal attention with contiguous slices, "
                f"{self.balanced_share:.1%} balanced (an even share: {1 / self.cp:.1%}); the recipe's balance: {on}")


def cp_balance(tokens: int, cp: int, balanced: bool) -> CPBalance:
    shares = []
    for zigzag in (False, True):
        pairs = rank_attention_pairs(tokens, cp, zigzag)
        shares.append(max(pairs) / sum(pairs))
    return CPBalance(tokens=tokens, cp=cp, balanced=balanced, contiguous_share=shares[0], balanced_share=shares[1])
