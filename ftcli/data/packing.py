"""Packing: examples -> fixed-length blocks with block-diagonal attention (one block = one model call).

A block of block_len = 12 holding two examples (s/u = system/user tokens, a = assistant tokens) and the
trailing padding (p = the tokenizer's pad id), each its own segment:

    input_ids     s  u  u  a  a  a | s  u  a  a | p  p
    seq_idx       0  0  0  0  0  0   1  1  1  1   2  2     int32: the gated-delta conv's boundaries
    position_ids  0  1  2  3  4  5   0  1  2  3   0  1     restart in every segment
    labels        -  -  -  a  a  a   -  -  a  a   -  -     - = -100; unshifted (see below)
    cu_seqlens    [0, 6, 10, 12]                           int32: the varlen attention's boundaries
    max_seqlen    6                  num_trained_tokens 5

    attention (x = may attend; block-diagonal and causal):
                  s u u a a a s u a a p p
              s   x . . . . . . . . . . .
              u   x x . . . . . . . . . .
              u   x x x . . . . . . . . .
              a   x x x x . . . . . . . .
              a   x x x x x . . . . . . .
              a   x x x x x x . . . . . .
              s   . . . . . . x . . . . .
              u   . . . . . . x x . . . .
              a   . . . . . . x x x . . .
              a   . . . . . . x x x x . .
              p   . . . . . . . . . . x .
              p   . . . . . . . . . . x x

Labels follow the Hugging Face convention: they are NOT shifted. The model predicts label[t] from the
logits at t-1 (its loss drops label[0] and the last logit). So label[t] at the first token of a segment
would be predicted from the previous segment's last token: it is -100 for every segment after the
first. label[0] of the block is never used by the loss; `num_trained_tokens` counts exactly the labels
the loss uses, `labels[1:] != -100`.

Strategies:
* split (the published qwen-b300 example's packing): concatenate examples; when the block is full,
  cut. The rest of a cut example starts the next block as a new segment (positions from 0; its first
  label is label[0], unused).
* bfd: best-fit decreasing over a buffer of `bfd_buffer` examples: longest first, each into the fullest
  open block it fits; no example is ever split. An example longer than a block is truncated to the
  block or dropped (`overlong`), counted either way.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from ftcli.data.stats import DataStats

IGNORE_INDEX = -100  # the label of a token without loss (the Hugging Face convention); the one definition
Packed = tuple[np.ndarray, np.ndarray, list[int]]  # (input_ids int32, loss mask bool, segment lengths)


@dataclass
class Block:
    """One packed block; arrays of length T = block_len (cu_seqlens: S + 1 for S segments)."""

    input_ids: np.ndarray  # int32 [T]
    labels: np.ndarray  # int32 [T], -100 where not trained; unshifted (HF convention)
    position_ids: np.ndarray  # int32 [T], from 0 in every segment
    seq_idx: np.ndarray  # int32 [T], segment index of every token
    cu_seqlens: np.ndarray  # int32 [S + 1], segment boundaries
    max_seqlen: int  # longest segment
    num_trained_tokens: int  # labels[1:] != -100: the tokens the loss averages over
    index: int = -1  # position in the packed dataset; -1 for a rank-balancing padding block


def num_trained(mask: np.ndarray, seg_lens: list[int]) -> int:
    """Trained tokens of a block as the loss sees them (label[0] unused, segment starts masked)."""
    if len(mask) < 2:
        return 0
    starts = np.cumsum(seg_lens[:-1], dtype=np.int64)
    starts = starts[starts < len(mask)]
    return int(mask[1:].sum()) - int(mask[starts].sum())


def make_block(
    input_ids: np.ndarray, mask: np.ndarray, seg_lens: list[int], block_len: int, pad_id: int, index: int = -1
) -> Block:
    """Build the block arrays (pictured in the module docstring); pads to block_len with its own segment."""
    n = len(input_ids)
    seg_lens = [int(s) for s in seg_lens]
    if n < block_len:
        input_ids = np.concatenate([input_ids, np.full(block_len - n, pad_id, dtype=np.int32)])
        mask = np.concatenate([mask, np.zeros(block_len - n, dtype=bool)])
        seg_lens = seg_lens + [block_len - n]
    lens = np.asarray(seg_lens, dtype=np.int32)
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    labels = np.where(mask, input_ids, IGNORE_INDEX).astype(np.int32)
    labels[cu[1:-1]] = IGNORE_INDEX  # no prediction across a segment boundary
    position_ids = (np.arange(len(input_ids), dtype=np.int32) - np.repeat(cu[:-1], lens)).astype(np.int32)
    seq_idx = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
    return Block(
        input_ids=np.asarray(input_ids, dtype=np.int32),
        labels=labels,
        position_ids=position_ids,
        seq_idx=seq_idx,
        cu_seqlens=cu,
        max_seqlen=int(lens.max()) if len(lens) else 0,
        num_trained_tokens=int((labels[1:] != IGNORE_INDEX).sum()),
        index=index,
    )


def padding_block(block_len: int, pad_id: int) -> Block:
    """An all-masked block (num_trained_tokens == 0) that evens out the ranks' last round."""
    return make_block(np.zeros(0, np.int32), np.zeros(0, bool), [], block_len, pad_id)


def pack_split(
    examples: Iterable[tuple[int, np.ndarray, np.ndarray]], block_len: int, stats: DataStats
) -> Iterator[Packed]:
    """The published qwen-b300 example's packing: concatenate, cut at the block edge, carry the rest into the
    next block."""
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    segs: list[int] = []
    fill = 0
    for _, ids, mask in examples:
        pos, pieces = 0, 0
        while pos < len(ids):
            take = min(block_len - fill, len(ids) - pos)
            ids_parts.append(ids[pos : pos + take])
            mask_parts.append(mask[pos : pos + take])
            segs.append(take)
            fill, pos, pieces = fill + take, pos + take, pieces + 1
            if fill == block_len:
                yield np.concatenate(ids_parts), np.concatenate(mask_parts), segs
                ids_parts, mask_parts, segs, fill = [], [], [], 0
        stats.split += pieces > 1
    if fill:
        yield np.concatenate(ids_parts), np.concatenate(mask_parts), segs


def pack_bfd(
    examples: Iterable[tuple[int, np.ndarray, np.ndarray]],
    block_len: int,
    buffer: int,
    overlong: str,
    stats: DataStats,
) -> Iterator[Packed]:
    """Best-fit decreasing per buffer of examples; never splits an example."""
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    for index, ids, mask in examples:
        if len(ids) > block_len:
            if overlong == "drop":
                stats.skip(index, "longer than block", f"{len(ids)} tokens > block_len {block_len}")
                stats.trained_lost_overlong += int(mask.sum())
                continue
            stats.trained_lost_truncation += int(mask[block_len:].sum())
            ids, mask = ids[:block_len], mask[:block_len]
            if not mask.any():  # counted once: as skipped, not also as truncated
                stats.skip(index, "zero trained tokens", "no trained token within the first block_len tokens")
                continue
            stats.truncated += 1
        pending.append((ids, mask))
        if len(pending) == buffer:
            yield from _best_fit(pending, block_len)
            pending = []
    if pending:
        yield from _best_fit(pending, block_len)


def _best_fit(items: list[tuple[np.ndarray, np.ndarray]], block_len: int) -> Iterator[Packed]:
    order = sorted(range(len(items)), key=lambda k: -len(items[k][0]))  # stable: ties keep arrival order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin) sorted: the first with room >= n is the best fit
    for k in order:
        n = len(items[k][0])
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            room, b = free.pop(j)
            bins[b].append(k)
            if room - n:
                bisect.insort(free, (room - n, b))
        else:
            bins.append([k])
            if block_len - n:
                bisect.insort(free, (block_len - n, len(bins) - 1))
    for members in bins:
        yield (
            np.concatenate([items[k][0] for k in members]),
            np.concatenate([items[k][1] for k in members]),
            [len(items[k][0]) for k in members],
        )


def pack_none(examples: Iterable[tuple[int, np.ndarray, np.ndarray]]) -> Iterator[Packed]:
    """Packing disabled: one example per (unpadded, variable-length) block."""
    for _, ids, mask in examples:
        yield ids, mask, [len(ids)]
