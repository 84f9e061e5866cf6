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

Preference pairs (`pack_pairs`): a pair is two segments side by side in one block, chosen then rejected,
never split across blocks (bfd over whole pairs; the pipeline cuts an overlong pair to the block first,
`preference.fit_pair`, or drops it). `Block.roles` says which segment is which:

    input_ids     p  p  c  c | p  p  r  r  r | p  c | p  r | pad
    roles         0            1              0      1      -1     per segment: 0 chosen, 1 rejected, -1 none
    Block.pairs   [[0, 1], [2, 3]]                                 (chosen segment, rejected segment) per pair

Every segment is isolated exactly as an SFT example (positions, cu_seqlens and seq_idx restart), so a
side's log-prob in the block is the log-prob of that side run alone.
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
    roles: np.ndarray | None = None  # int8 [S] for preference blocks: 0 chosen, 1 rejected, -1 padding
    reference_logps: np.ndarray | None = None  # float32 [S]: the reference's summed log-prob of every segment,
    # when precomputed (ftcli.data.reference; training.preference.reference=precomputed)

    @property
    def pairs(self) -> np.ndarray:
        """int64 [P, 2]: (chosen segment, rejected segment) of every pair in the block (P = 0 for SFT)."""
        if self.roles is None:
            return np.zeros((0, 2), dtype=np.int64)
        chosen, rejected = np.flatnonzero(self.roles == 0), np.flatnonzero(self.roles == 1)
        assert len(chosen) == len(rejected) and (rejected == chosen + 1).all(), "a pair is two adjacent segments"
        return np.stack([chosen, rejected], axis=1).astype(np.int64)


def num_trained(mask: np.ndarray, seg_lens: list[int]) -> int:
    """Trained tokens of a block as the loss sees them (label[0] unused, segment starts masked)."""
    if len(mask) < 2:
        return 0
    starts = np.cumsum(seg_lens[:-1], dtype=np.int64)
    starts = starts[starts < len(mask)]
    return int(mask[1:].sum()) - int(mask[starts].sum())


def make_block(
    input_ids: np.ndarray, mask: np.ndarray, seg_lens: list[int], block_len: int, pad_id: int, index: int = -1,
    roles: np.ndarray | None = None,
) -> Block:
    """Build the block arrays (pictured in the module docstring); pads to block_len with its own segment.
    `roles` (preference blocks): int8 per real segment, 0 chosen / 1 rejected; the padding segment gets -1."""
    n = len(input_ids)
    seg_lens = [int(s) for s in seg_lens]
    if roles is not None:
        roles = np.asarray(roles, dtype=np.int8)
        assert len(roles) == len(seg_lens)
        if n < block_len:
            roles = np.concatenate([roles, np.full(1, -1, dtype=np.int8)])
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
        roles=roles,
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


def _bins(lengths: list[int], block_len: int) -> list[list[int]]:
    """Best-fit decreasing: the items (by length) of each block, longest first into the fullest block it fits."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])  # stable: ties keep arrival order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin) sorted: the first with room >= n is the best fit
    for k in order:
        n = lengths[k]
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
    return bins


def _best_fit(items: list[tuple[np.ndarray, np.ndarray]], block_len: int) -> Iterator[Packed]:
    for members in _bins([len(ids) for ids, _ in items], block_len):
        yield (
            np.concatenate([items[k][0] for k in members]),
            np.concatenate([items[k][1] for k in members]),
            [len(items[k][0]) for k in members],
        )


def pack_none(examples: Iterable[tuple[int, np.ndarray, np.ndarray]]) -> Iterator[Packed]:
    """Packing disabled: one example per (unpadded, variable-length) block."""
    for _, ids, mask in examples:
        yield ids, mask, [len(ids)]


PackedPairs = tuple[np.ndarray, np.ndarray, list[int], list[int]]  # Packed + the role of every segment
EncodedSides = tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # index, chosen ids/mask, rejected ids/mask


def pack_pairs(pairs: Iterable[EncodedSides], block_len: int | None, buffer: int) -> Iterator[PackedPairs]:
    """Preference pairs -> blocks of whole pairs, each pair's two sides adjacent (chosen first). block_len
    None (packing off): one pair per block. Best-fit decreasing over each buffer of pairs, as `pack_bfd`
    does for examples; every pair must already fit a block (the pipeline cuts or drops the others)."""
    pending: list[EncodedSides] = []

    def flush() -> Iterator[PackedPairs]:
        for members in _bins([len(p[1]) + len(p[3]) for p in pending], block_len):
            yield _pair_block([pending[k] for k in members])

    for item in pairs:
        if block_len is None:
            yield _pair_block([item])
            continue
        assert len(item[1]) + len(item[3]) <= block_len, "the pipeline fits every pair to the block first"
        pending.append(item)
        if len(pending) == buffer:
            yield from flush()
            pending = []
    if pending:
        yield from flush()


def _pair_block(members: list[EncodedSides]) -> PackedPairs:
    ids = np.concatenate([a for _, c_ids, _, r_ids, _ in members for a in (c_ids, r_ids)])
    mask = np.concatenate([a for _, _, c_mask, _, r_mask in members for a in (c_mask, r_mask)])
    segs = [len(a) for _, c_ids, _, r_ids, _ in members for a in (c_ids, r_ids)]
    return ids, mask, segs, [0, 1] * len(members)
