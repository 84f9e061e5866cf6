"""Packing: split reproduces the published loop's signals exactly; bfd never splits; the block invariants."""

from __future__ import annotations

import numpy as np
import pytest

from ftcli.data.packing import IGNORE_INDEX, make_block, num_trained, pack_bfd, pack_none, pack_split, padding_block
from ftcli.data.stats import DataStats

PAD = 0


def _examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for index, n in enumerate(lengths):
        ids = rng.integers(10, 1000, size=n).astype(np.int32)
        mask = rng.random(n) < 0.6
        out.append((index, ids, mask))
    return out


def reference_split_blocks(examples, block_len, pad_id):
    """The published qwen-b300 loop's packing written out as plainly as possible: concatenate examples
    end to end into blocks of exactly block_len; cut when the buffer overfills; the remainder of a cut
    example starts the next block as a new segment. position_ids restart per segment; cu_seqlens =
    boundaries; seq_idx = segment index; max_length = longest segment; labels -100 on prompt tokens and on
    the first token of every segment after the first. (The last, partial block is padded with a masked
    segment: ftcli's choice.)"""
    blocks, segments, room = [], [], block_len
    for _, ids, mask in examples:
        ids, labels = list(map(int, ids)), [int(t) if m else -100 for t, m in zip(ids, mask)]
        while ids:
            take = min(room, len(ids))
            segments.append((ids[:take], labels[:take]))
            ids, labels, room = ids[take:], labels[take:], room - take
            if room == 0:
                blocks.append(segments)
                segments, room = [], block_len
    if segments:
        segments.append(([pad_id] * room, [-100] * room))
        blocks.append(segments)
    out = []
    for segments in blocks:
        b = {"input_ids": [], "labels": [], "position_ids": [], "seq_idx": [], "cu_seqlens": [0]}
        for k, (ids, labels) in enumerate(segments):
            labels = list(labels)
            if k > 0:
                labels[0] = -100
            b["input_ids"] += ids
            b["labels"] += labels
            b["position_ids"] += list(range(len(ids)))
            b["seq_idx"] += [k] * len(ids)
            b["cu_seqlens"].append(b["cu_seqlens"][-1] + len(ids))
        b["max_length"] = max(len(ids) for ids, _ in segments)
        out.append(b)
    return out


@pytest.mark.parametrize("block_len", [16, 64, 100])
def test_split_reproduces_reference_signals_exactly(block_len):
    lengths = [5, 16, 1, 40, 64, 3, 100, 7, 250, 9, 15, 33]  # shorter, equal to, and several times a block
    examples = _examples(lengths)
    stats = DataStats()
    ours = [make_block(ids, m, segs, block_len, PAD) for ids, m, segs in pack_split(examples, block_len, stats)]
    ref = reference_split_blocks(examples, block_len, PAD)
    assert len(ours) == len(ref) == -(-sum(lengths) // block_len)
    for b, r in zip(ours, ref):
        assert b.input_ids.tolist() == r["input_ids"]
        assert b.labels.tolist() == r["labels"]
        assert b.position_ids.tolist() == r["position_ids"]
        assert b.seq_idx.tolist() == r["seq_idx"]
        assert b.cu_seqlens.tolist() == r["cu_seqlens"]
        assert b.max_seqlen == r["max_length"]
        assert b.cu_seqlens.dtype == np.int32 and b.seq_idx.dtype == np.int32
    starts = np.cumsum([0, *lengths[:-1]])
    cut = sum(1 for n, s in zip(lengths, starts) if s // block_len != (s + n - 1) // block_len)
    assert stats.split == cut


def test_labels_masked_at_every_segment_start_after_the_first():
    ids = np.arange(1, 13, dtype=np.int32)
    block = make_block(ids, np.ones(12, bool), [5, 4, 3], 16, PAD)
    assert block.labels.tolist() == [1, 2, 3, 4, 5, -100, 7, 8, 9, -100, 11, 12, -100, -100, -100, -100]
    assert block.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]
    assert block.seq_idx.tolist() == [0] * 5 + [1] * 4 + [2] * 3 + [3] * 4
    assert block.cu_seqlens.tolist() == [0, 5, 9, 12, 16]
    assert block.max_seqlen == 5
    # label[0] is never used by the (shifting) loss: 4 + 3 + 2 = 9 trained tokens
    assert block.num_trained_tokens == 9 == num_trained(np.ones(12, bool), [5, 4, 3])


def test_padding_segment_is_masked_and_separate():
    block = make_block(np.array([7, 8, 9], np.int32), np.array([0, 1, 1], bool), [3], 8, pad_id=5)
    assert block.input_ids.tolist() == [7, 8, 9, 5, 5, 5, 5, 5]
    assert block.labels.tolist() == [-100, 8, 9, -100, -100, -100, -100, -100]
    assert block.cu_seqlens.tolist() == [0, 3, 8]
    assert block.seq_idx.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert block.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert block.max_seqlen == 5 and block.num_trained_tokens == 2
    pad = padding_block(8, pad_id=5)
    assert pad.num_trained_tokens == 0 and (pad.labels == IGNORE_INDEX).all() and pad.cu_seqlens.tolist() == [0, 8]


def test_num_trained_tokens_is_what_the_shifted_loss_counts():
    torch = pytest.importorskip("torch")
    examples = _examples([30, 12, 50, 7, 64, 3], seed=3)
    for ids, m, segs in pack_split(examples, 32, DataStats()):
        b = make_block(ids, m, segs, 32, PAD)
        shifted = torch.nn.functional.pad(torch.from_numpy(b.labels.astype(np.int64)), (0, 1), value=-100)[1:]
        assert b.num_trained_tokens == int((shifted != -100).sum()) == num_trained(m, segs)


def test_bfd_never_splits_and_counts_truncations_and_drops():
    lengths = [30, 5, 70, 12, 64, 9, 100, 1, 33, 31, 2, 64, 17]
    examples = _examples(lengths, seed=1)
    stats = DataStats()
    packed = list(pack_bfd(examples, 64, buffer=5, overlong="truncate", stats=stats))
    assert stats.truncated == 2 and stats.skipped == {} and stats.split == 0
    got = sorted(
        tuple(ids[a:b].tolist()) for ids, _, segs in packed for a, b in zip(np.cumsum([0, *segs[:-1]]), np.cumsum(segs))
    )
    want = sorted(tuple(ids[:64].tolist()) for _, ids, _ in examples)
    assert got == want  # every example is one whole segment (the overlong ones cut to the block)
    assert all(sum(segs) <= 64 for _, _, segs in packed)
    stats = DataStats()
    packed = list(pack_bfd(examples, 64, buffer=5, overlong="drop", stats=stats))
    assert stats.skipped == {"longer than block": 2} and stats.first_skipped == {"longer than block": [2, 6]}
    assert sum(len(ids) for ids, _, _ in packed) == sum(n for n in lengths if n <= 64)


def test_bfd_packs_within_5_percent_of_the_lower_bound():
    lengths = list(np.random.default_rng(0).integers(1, 60, size=200))
    examples = _examples(lengths, seed=2)
    packed = list(pack_bfd(examples, 64, buffer=200, overlong="truncate", stats=DataStats()))
    assert sum(lengths) == 6377 and -(-6377 // 64) == 100  # no packing can use fewer than 100 blocks
    assert len(packed) == 105
    for ids, mask, segs in packed:
        assert len(ids) == len(mask) == sum(segs)


def test_packing_disabled_keeps_one_example_per_block():
    examples = _examples([5, 9])
    assert [segs for _, _, segs in pack_none(examples)] == [[5], [9]]
