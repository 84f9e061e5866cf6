"""The LoRA path trains on exactly the blocks `ftcli pack-preview --dump` writes: TRL gets them
pre-tokenized and its data loader hands them to the model unchanged (no re-tokenizing, no re-packing)."""

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
    from ftcli.train.lora.trainer import collate_rows, lora_config, sft_config_kwargs, training_rows

    overrides = ["data.packing.enabled=false", "data.max_length=96"] if packing == "unpacked" else []
    recipe = _recipe(tmp_path, *overrides, "tracking.enabled=false")
    dumped = _dump(recipe, tmp_path / "dump.jsonl")
    tokenizer = load_tokenizer(recipe)
    rows = training_rows(recipe, tokenizer)
    assert len(rows) == len(dumped) > 10
    if packing == "unpacked":
        assert max(len(r) for r in rows["input_ids"]) == 96  # truncated to data.max_length, one example per row

    # row i is block i of the dump, and one row collates to exactly block_to_model_inputs(block)
    packed = prepare_blocks(recipe, tokenizer)
    for i, rec in dumped.items():
        for key in ("input_ids", "labels", "position_ids"):
            assert rows[i][key].tolist() == rec[key], (i, key)
        got, want = collate_rows([rows[i]]), block_to_model_inputs(packed[i])
        assert got.keys() == want.keys()
        for key in want:
            assert (torch.equal(got[key], want[key]) if torch.is_tensor(want[key]) else got[key] == want[key]), key
            if torch.is_tensor(want[key]):
                assert got[key].dtype == want[key].dtype, key

    # what TRL's data loader yields (shuffled) is the same multiset of blocks
    kwargs = sft_config_kwargs(recipe, tmp_path / "run")
    kwargs.update(disable_tqdm=True)
    model = tiny_model()
    trainer = SFTTrainer(model=model, args=SFTConfig(**kwargs), train_dataset=rows, data_collator=collate_rows,
                         processing_class=tokenizer, peft_config=lora_config(recipe, model))
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == len(dumped)
    seen = sorted(tuple(b["input_ids"][0].tolist()) + tuple(b["labels"][0].tolist()) for b in batches)
    expected = sorted(tuple(r["input_ids"]) + tuple(r["labels"]) for r in dumped.values())
    assert seen == expected
    for b in batches:  # position_ids / cu_seq_lens travel with every batch (padding-free packed attention)
        assert {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"} <= b.keys()
        assert "attention_mask" not in b


def test_rows_laid_end_to_end_never_predict_across_rows():
    from ftcli.train.lora.trainer import collate_rows

    a = {"input_ids": [5, 6, 7, 8], "labels": [5, -100, 7, 8], "position_ids": [0, 1, 2, 3]}
    b = {"input_ids": [9, 10, 11], "labels": [9, 10, 11], "position_ids": [0, 1, 2]}
    out = collate_rows([a, b])
    assert out["labels"].tolist() == [[5, -100, 7, 8, -100, 10, 11]]
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 7] and out["cu_seq_lens_q"].dtype == torch.int32
    assert out["seq_idx"].tolist() == [[0, 0, 0, 0, 1, 1, 1]] and out["max_length_q"] == 4
