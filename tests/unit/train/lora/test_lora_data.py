"""The LoRA path trains on exactly the blocks `ftcli pack-preview --dump` writes: TRL's dataset holds their indices
and its data loader hands the blocks to the model unchanged (no re-tokenizing, no re-packing, no token columns)."""

from __future__ import annotations

import json

import pytest
import torch

from _lora_common import tiny_model, tiny_recipe


def _dump(recipe, path):
    from ftcli.commands.preview import run_preview

    run_preview(recipe, blocks=0, examples=None, as_json=True, dump=path, strict=False)
    return {rec["index"]: rec for rec in map(json.loads, path.read_text().splitlines())}


def _recipe(tmp_path, *overrides):
    return tiny_recipe("data.max_examples=120", f"data.cache_dir={tmp_path / 'cache'}", *overrides)


@pytest.mark.parametrize("packing", ["packed", "unpacked"])
def test_trl_batches_are_the_pack_preview_blocks(tmp_path, packing):
    from trl import SFTConfig, SFTTrainer

    from ftcli.data import block_to_model_inputs, load_tokenizer, prepare_blocks
    from ftcli.train.lora.trainer import (BlockCollator, block_rows, collate_blocks, lora_config, sft_config_kwargs,
                                          training_blocks)

    overrides = ["data.packing.enabled=false", "data.max_length=96"] if packing == "unpacked" else []
    recipe = _recipe(tmp_path, *overrides, "tracking.enabled=false")
    dumped = _dump(recipe, tmp_path / "dump.jsonl")
    tokenizer = load_tokenizer(recipe.model, recipe.data)
    blocks = training_blocks(recipe, tokenizer)
    assert len(blocks) == len(dumped) > 10
    if packing == "unpacked":
        assert max(int(b.cu_seqlens[1]) for b in (blocks[i] for i in range(len(blocks)))) == 96  # one example each

    # block i is block i of the dump, and one block collates to exactly block_to_model_inputs(block)
    packed = prepare_blocks(recipe, tokenizer)
    for i, rec in dumped.items():
        for key in ("input_ids", "labels", "position_ids"):
            assert blocks[i].__getattribute__(key).tolist() == rec[key], (i, key)
        got, want = collate_blocks([blocks[i]]), block_to_model_inputs(packed[i])
        assert got.keys() == want.keys()
        for key in want:
            assert (torch.equal(got[key], want[key]) if torch.is_tensor(want[key]) else got[key] == want[key]), key
            if torch.is_tensor(want[key]):
                assert got[key].dtype == want[key].dtype, key

    # TRL's dataset holds block indices only; what its data loader yields (shuffled) is the same multiset of blocks
    rows = block_rows(blocks)
    assert rows.column_names == ["block"]
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, tmp_path / "run")
    kwargs.update(disable_tqdm=True)
    model = tiny_model()
    trainer = SFTTrainer(model=model, args=SFTConfig(**kwargs), train_dataset=rows, data_collator=BlockCollator(blocks),
                         processing_class=tokenizer, peft_config=lora_config(recipe.lora, recipe.model, model))
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == len(dumped)
    seen = sorted(tuple(b["input_ids"][0].tolist()) + tuple(b["labels"][0].tolist()) for b in batches)
    expected = sorted(tuple(r["input_ids"]) + tuple(r["labels"]) for r in dumped.values())
    assert seen == expected
    for b in batches:  # position_ids / cu_seq_lens travel with every batch (padding-free packed attention)
        assert {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"} <= b.keys()
        assert "attention_mask" not in b


def test_blocks_laid_end_to_end_never_predict_across_blocks():
    import numpy as np

    from ftcli.data import make_block
    from ftcli.train.lora.trainer import collate_blocks

    a = make_block(np.array([5, 6, 7, 8]), np.array([True, False, True, True]), [4], 4, pad_id=0)
    b = make_block(np.array([9, 10, 11]), np.array([True, True, True]), [3], 3, pad_id=0)
    out = collate_blocks([a, b])
    assert out["labels"].tolist() == [[5, -100, 7, 8, -100, 10, 11]]
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 7] and out["cu_seq_lens_q"].dtype == torch.int32
    assert out["seq_idx"].tolist() == [[0, 0, 0, 0, 1, 1, 1]] and out["max_length_q"] == 4
