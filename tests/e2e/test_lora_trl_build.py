"""The LoRA path as TRL builds it (each test builds an SFTConfig or an SFTTrainer: TRL's import alone is seconds per
process, so these live here and not in the unit tier, beside tests/unit/train/lora/): the tiny recipe's kwargs
survive SFTConfig's post-init; TRL's data loader hands the model exactly the blocks `ftcli pack-preview --dump`
writes (its dataset holds their indices: no re-tokenizing, no re-packing, no token columns); the LoRA trainer's lr
schedule equals the full path's at every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _lora_common import tiny_model, tiny_recipe

RUN = Path("/runs/x")


def test_tiny_sft_config_builds_and_keeps_values():
    """The tiny recipe's kwargs build a real SFTConfig here (CPU, float32) and the values survive
    TrainingArguments' post-init (e.g. the warmup ratio and the deprecated gradient_checkpointing alias)."""
    from trl import SFTConfig

    from ftcli.train.lora.trainer import sft_config_kwargs

    r = tiny_recipe()
    kw = sft_config_kwargs(r.training, r.model, r.name, RUN)
    assert {k: kw[k] for k in ("optim", "learning_rate", "warmup_steps", "lr_scheduler_kwargs", "bf16", "fp16",
                               "activation_checkpointing", "activation_checkpointing_kwargs", "logging_steps",
                               "save_steps", "save_total_limit", "gradient_accumulation_steps")} == {
        "optim": "adamw_torch", "learning_rate": 3e-3, "warmup_steps": 0.03,
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "bf16": False, "fp16": False,
        "activation_checkpointing": False, "activation_checkpointing_kwargs": None, "logging_steps": 10,
        "save_steps": 50, "save_total_limit": 2, "gradient_accumulation_steps": 1,
    }
    args = SFTConfig(**kw)
    assert args.warmup_steps == 0.03 and args.get_warmup_steps(200) == 6
    assert args.gradient_checkpointing is False and args.bf16 is False
    assert args.lr_scheduler_type == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert args.average_tokens_across_devices is True and args.dataset_kwargs == {"skip_prepare_dataset": True}


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


@pytest.mark.parametrize("schedule", [
    "{name: cosine, warmup: 0.1, min_lr_ratio: 0.1}",  # the case: TRL's cosine ignored min_lr_ratio
    "{name: cosine_with_min_lr, warmup: 3, min_lr_ratio: 0.2}",
    "{name: linear, warmup: 0, min_lr_ratio: 0.5}",
])
def test_lora_and_full_schedules_give_the_same_lr_at_every_step(schedule, tmp_path):
    """The LoRA trainer's scheduler (what TRL steps) and the full path's (a LambdaLR over lr_factor, as
    FullRun builds it) give the same lr at every step of a recipe, warmup and min_lr_ratio included."""
    from trl import SFTConfig

    from ftcli.data import load_tokenizer
    from ftcli.train.full import lr_factor
    from ftcli.train.lora.trainer import build_trainer, sft_config_kwargs, training_blocks

    steps = 30
    recipe = tiny_recipe(f"training.schedule={schedule}", f"training.max_steps={steps}", "data.max_examples=20",
                         f"data.cache_dir={tmp_path / 'cache'}", "tracking.enabled=false")
    tokenizer = load_tokenizer(recipe.model, recipe.data)
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, tmp_path / "run")
    args = SFTConfig(**{**kwargs, "disable_tqdm": True}, use_cpu=True)
    trainer, _ = build_trainer(recipe, tiny_model(), tokenizer, training_blocks(recipe, tokenizer), args)
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    peak = recipe.training.optimizer.lr
    full = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak),
                                             lambda s: lr_factor(s, steps, recipe.training.schedule))
    lora_lrs, full_lrs = [], []
    for _ in range(steps):
        lora_lrs.append(trainer.lr_scheduler.get_last_lr()[0])
        full_lrs.append(full.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        full.optimizer.step()
        full.step()
    assert lora_lrs == full_lrs
    ratio = recipe.training.schedule.min_lr_ratio  # decays to it (transformers' cosine: to ~0)
    assert peak * ratio * (1 - 1e-9) <= min(lora_lrs) == lora_lrs[-1] < peak * ratio * 1.05
    warmup = [lr for lr in lora_lrs if lr < lora_lrs[-1]]
    assert all(lr > 0 for lr in lora_lrs) and warmup == sorted(warmup)  # warmup starts above 0
