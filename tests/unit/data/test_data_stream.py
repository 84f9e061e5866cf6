"""BlockStream: equal, disjoint, complete shares per rank; exact resume; the model-call kwargs."""

from __future__ import annotations

import numpy as np
import pytest
from _data_common import recipe, tokenizer

from ftcli.data import BlockStream, block_to_model_inputs, prepare_blocks
from ftcli.config.errors import UserError


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    r = recipe(
        tmp_path_factory.mktemp("stream"), data__source="synthetic", data__synthetic__num_examples=150,
        data__synthetic__mean_tokens=90, data__synthetic__max_tokens=600, data__packing__block_len=256,
    )
    return prepare_blocks(r, tokenizer("qwen"))


def _blocks(stream):
    return [(b.index, b.num_trained_tokens) for b in stream]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_equal_blocks_per_rank_and_union_is_the_single_rank_set(packed, world_size):
    n = len(packed)
    assert n == 53
    single = _blocks(BlockStream(packed, 0, 1, seed=3))
    per_rank = [_blocks(BlockStream(packed, r, world_size, seed=3)) for r in range(world_size)]
    lengths = {len(blocks) for blocks in per_rank}
    assert lengths == {-(-n // world_size)} == {len(BlockStream(packed, 0, world_size))}
    real = sorted(b for blocks in per_rank for b in blocks if b[0] >= 0)
    assert real == sorted(single) and sorted(i for i, _ in single) == list(range(n))  # no drop, no repeat
    pads = [b for blocks in per_rank for b in blocks if b[0] < 0]
    assert len(pads) == world_size * -(-n // world_size) - n and all(t == 0 for _, t in pads)
    assert sum(t for blocks in per_rank for _, t in blocks) == int(packed.block_trained.sum())


def test_shuffle_is_seeded_and_covers_every_block_each_epoch(packed):
    a = [i for i, _ in _blocks(BlockStream(packed, 0, 1, epochs=2.5, seed=1))]
    b = [i for i, _ in _blocks(BlockStream(packed, 0, 1, epochs=2.5, seed=1))]
    c = [i for i, _ in _blocks(BlockStream(packed, 0, 1, epochs=2.5, seed=2))]
    n = len(packed)
    assert a == b and a != c and len(a) == 132  # floor(2.5 * 53)
    assert sorted(a[:n]) == sorted(a[n : 2 * n]) == list(range(n)) and a[:n] != a[n : 2 * n]
    assert [i for i, _ in _blocks(BlockStream(packed, 0, 1, shuffle=False))] == list(range(n))


def test_resume_yields_same_blocks(packed):
    full = _blocks(BlockStream(packed, 1, 3, epochs=2, seed=5))
    stream = BlockStream(packed, 1, 3, epochs=2, seed=5)
    it = iter(stream)
    head = [(b.index, b.num_trained_tokens) for _, b in zip(range(10), it)]
    state = stream.state_dict()
    resumed = BlockStream(packed, 1, 3, epochs=2, seed=5)
    resumed.load_state_dict(state)
    assert resumed.remaining == len(full) - 10
    assert head + _blocks(resumed) == full


def test_resume_with_another_world_size_continues_without_drop_or_repeat(packed):
    streams = [BlockStream(packed, r, 2, seed=4) for r in range(2)]
    iters = [iter(s) for s in streams]
    seen = [next(it).index for _ in range(7) for it in iters]  # 7 steps on 2 ranks
    state = streams[0].state_dict()
    assert state == streams[1].state_dict() and state["consumed"] == 14
    rest = []
    for r in range(3):
        s = BlockStream(packed, r, 3, seed=4)
        s.load_state_dict(state)
        rest += [b.index for b in s]
    real = [i for i in seen + rest if i >= 0]
    assert sorted(real) == list(range(len(packed)))


def test_stream_state_is_global_blocks_whatever_the_world_size(packed):
    """After 3 rounds, 2 ranks and 3 ranks have consumed 6 and 9 global blocks: the state is that number
    (every rank the same), and a resumed stream on any world size starts at that global position."""
    two = [BlockStream(packed, r, 2, seed=4) for r in range(2)]
    for s in two:
        it = iter(s)
        [next(it) for _ in range(3)]
    assert [s.state_dict()["consumed"] for s in two] == [6, 6]
    one = BlockStream(packed, 0, 1, seed=4)
    one.load_state_dict(two[1].state_dict())
    assert next(iter(one)).index == BlockStream(packed, 0, 1, seed=4).global_block(6)
    for bad in (-1, len(packed) + 1, "6", None):
        with pytest.raises(UserError, match=f"cannot resume the data stream: {bad!r} blocks consumed in the "
                                            f"checkpoint, the run has {len(packed)}"):
            one.load_state_dict({**two[0].state_dict(), "consumed": bad})


def test_resume_refuses_changed_data(packed):
    state = BlockStream(packed, 0, 2, seed=1).state_dict()
    with pytest.raises(UserError, match="seed was 1 in the checkpoint, now 2"):
        BlockStream(packed, 0, 2, seed=2).load_state_dict(state)


def test_block_to_model_inputs_are_the_reference_kwargs(packed):
    block = packed.block(0)
    kw = block_to_model_inputs(block)
    t = len(block.input_ids)
    assert set(kw) == {
        "input_ids", "labels", "position_ids", "seq_idx",
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
        "fla_cu_seqlens", "fla_chunk_indices", "trained_positions",  # per-block tensors (ftcli.data.collate)
    }
    assert kw["input_ids"].shape == kw["labels"].shape == kw["position_ids"].shape == kw["seq_idx"].shape == (1, t)
    assert str(kw["input_ids"].dtype) == "torch.int64" and str(kw["seq_idx"].dtype) == "torch.int32"
    assert str(kw["cu_seq_lens_q"].dtype) == "torch.int32" and kw["cu_seq_lens_q"] is kw["cu_seq_lens_k"]
    assert kw["cu_seq_lens_q"].tolist() == block.cu_seqlens.tolist() and kw["cu_seq_lens_q"][-1] == t == 256
    assert kw["max_length_q"] == kw["max_length_k"] == block.max_seqlen == int(np.diff(block.cu_seqlens).max())
    assert kw["labels"][0].tolist() == block.labels.tolist()
