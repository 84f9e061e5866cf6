"""training.preference.reference=precomputed's store (ftcli.data.reference, ftcli.train.reference): computed once and
read back exactly, keyed by the blocks and the reference model, checked before use and rebuilt with one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftcli.data.cache import BlockWriter, PackedDataset, cache_key
from ftcli.data.reference import ReferencedBlocks, store_path, store_problem
from ftcli.data.stats import DataStats
from ftcli.train.reference import precomputed_reference

IDENTITY = {"init": "random", "config_sha256": "ab", "seed": 0}


def _packed(root, seed=0, blocks=5) -> PackedDataset:
    """A pack cache entry of `blocks` preference blocks, 2 or 3 pairs each, random tokens."""
    rng = np.random.default_rng(seed)
    parts = {"test": seed, "blocks": blocks}
    final = root / "packed" / cache_key(parts)
    writer = BlockWriter(final)
    for _ in range(blocks):
        seg_lens = [int(n) for n in rng.integers(3, 9, size=2 * int(rng.integers(2, 4)))]
        ids = rng.integers(1, 50, size=sum(seg_lens)).astype(np.int32)
        writer.add(ids, rng.random(len(ids)) < 0.7, seg_lens, [i % 2 for i in range(len(seg_lens))])
    writer.commit({"format_version": 1, "key": final.name, "key_parts": parts, "block_len": 64, "pad_id": 0,
                   "max_example_len": 48, "stats": DataStats().to_dict()})
    return PackedDataset(final)


class FakeReference:
    """Per-segment 'log-prob': minus the sum of the segment's input ids (exact in float32); counts its forwards."""

    def __init__(self):
        self.forwards = 0

    def __call__(self, inputs):
        self.forwards += 1
        ids, seg = inputs["input_ids"].reshape(-1).float(), inputs["seq_idx"].reshape(-1).long()
        return -torch.zeros(inputs["num_segments"]).index_add(0, seg, ids)


def _expected(block) -> np.ndarray:
    return -np.bincount(block.seq_idx, weights=block.input_ids, minlength=len(block.cu_seqlens) - 1)


def _precompute(packed, fake, lines, identity=IDENTITY):
    return precomputed_reference({"train": packed}, identity, fake, rank=0, world_size=1, device="cpu",
                                 say=lines.append)["train"]


def test_stored_reference_is_read_back_with_every_block(tmp_path):
    packed, fake, lines = _packed(tmp_path), FakeReference(), []
    blocks = _precompute(packed, fake, lines)
    assert fake.forwards == len(packed) == 5 and isinstance(blocks, ReferencedBlocks)
    assert len(lines) == 1 and "5 blocks" in lines[0] and str(tmp_path / "reference") in lines[0]
    for i in range(len(packed)):
        b = blocks.block(i)
        assert b.reference_logps.dtype == np.float32 and len(b.reference_logps) == len(b.cu_seqlens) - 1
        np.testing.assert_array_equal(b.reference_logps, _expected(b).astype(np.float32))
        assert b.reference_logps[-1] == 0.0 and (b.input_ids == packed.block(i).input_ids).all()  # padding segment
    assert len(blocks) == len(packed) and blocks.key == packed.key

    again = FakeReference()
    _precompute(packed, again, lines)  # a second run reads the store: no forward
    assert again.forwards == 0 and lines[-1] == f"reference log-probs (train): read from {store_path(packed, IDENTITY)}"


def test_another_reference_or_other_blocks_never_read_the_store(tmp_path):
    packed = _packed(tmp_path)
    _precompute(packed, FakeReference(), [])
    other_model = {**IDENTITY, "seed": 1}
    other_blocks = _packed(tmp_path, seed=1)
    assert store_path(packed, other_model) != store_path(packed, IDENTITY)
    assert store_path(other_blocks, IDENTITY) != store_path(packed, IDENTITY)
    # the store copied under the name another model's or other blocks' store would have is refused
    assert store_problem(store_path(packed, IDENTITY), packed, other_model) == \
        "it was written for other blocks or another reference model"
    assert store_problem(store_path(packed, IDENTITY), other_blocks, IDENTITY) == \
        "it was written for other blocks or another reference model"
    fake = FakeReference()
    _precompute(packed, fake, [], other_model)
    assert fake.forwards == len(packed)  # computed again for the other model


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / "logps.bin").write_bytes(b"\0" * (p / "logps.bin").stat().st_size), "does not match the checksum"),
    (lambda p: (p / "logps.bin").write_bytes(b"\0" * 4), "logps.bin has 4 bytes"),
    (lambda p: (p / "meta.json").write_text("{"), "its meta.json is unreadable"),
])
def test_a_corrupt_store_is_rebuilt_with_one_line(tmp_path, damage, reason):
    packed = _packed(tmp_path)
    _precompute(packed, FakeReference(), [])
    path = store_path(packed, IDENTITY)
    damage(path)
    fake, lines = FakeReference(), []
    blocks = _precompute(packed, fake, lines)
    assert fake.forwards == len(packed) and store_problem(path, packed, IDENTITY) is None
    assert lines[0].startswith(f"note: the reference store {path} is not used: ") and reason in lines[0]
    assert lines[0].endswith("; rebuilding it") and len(lines) == 2
    np.testing.assert_array_equal(blocks.block(2).reference_logps, _expected(blocks.block(2)).astype(np.float32))



def test_a_lora_run_over_a_sharded_base_refuses_a_precomputed_reference_in_one_line():
    """A LoRA run's precomputed reference is its base's log-probs, computed before the trainer starts: a base that
    only accelerate's FSDP2 makes whole (training.sharding=fsdp) cannot compute them then."""
    from ftcli.config.errors import UserError
    from ftcli.config.recipe import load_recipe
    from ftcli.train.lora.trainer import read_stored_reference

    recipe = load_recipe("tiny-dpo-cpu", ["training.method=lora", "training.precision={}",
                                          "training.preference.reference=precomputed"])
    with pytest.raises(UserError, match=r"^training.preference.reference=precomputed needs a whole base per process "
                                        r"\(training.sharding=ddp; this run's is fsdp\): set "
                                        r"training.preference.reference=model$"):
        read_stored_reference(recipe, None, None, "fsdp", torch.device("cpu"))


@pytest.mark.parametrize("init, master, param, held", [
    ("pretrained", "float32", "bfloat16", "bfloat16"),  # the shipped DPO recipes: the copy holds bf16, half of fp32
    ("pretrained", "float32", "float32", "float32"),
    ("pretrained", "bfloat16", "bfloat16", "bfloat16"),
    ("random", "float32", "bfloat16", "float32"),  # a random init draws in the master dtype, as the policy does
])
def test_the_frozen_reference_is_held_in_the_compute_dtype(tmp_path, init, master, param, held):
    from ftcli.config.recipe import load_recipe
    from ftcli.train.reference import frozen_copy_training

    recipe = load_recipe("tiny-dpo-cpu", [f"model.init={init}", f"model.id={tmp_path}",
                                          f"training.precision.master_dtype={master}",
                                          f"training.precision.param_dtype={param}"])
    training = frozen_copy_training(recipe.model, recipe.training)
    assert training.precision.master_dtype == held and recipe.training.precision.master_dtype == master
    assert training.model_dump(exclude={"precision"}) == recipe.training.model_dump(exclude={"precision"})
