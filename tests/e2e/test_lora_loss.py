"""LoRA loss normalization: an optimizer step minimizes (sum of token losses) / (trained tokens of the
whole step), whatever the accumulation split and whatever the model class declares about loss kwargs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _lora_common import packed_row, tiny_model, tiny_recipe, token_mean_grads as _token_mean_grads


def _rows():
    rng = np.random.default_rng(0)
    # very different trained-token counts: ~6 vs ~170
    return [packed_row(rng, [40, 30], 0.1), packed_row(rng, [120, 60], 0.95)]


def _trainer(tmp_path, rows, model):
    from trl import SFTConfig, SFTTrainer

    from ftcli.train.lora.trainer import BlockCollator, block_rows, lora_config, sft_config_kwargs

    recipe = tiny_recipe("training.grad_accum=2", "training.grad_clip=null", "tracking.enabled=false",
                         "training.checkpoint.enabled=false", "training.max_steps=1")
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, tmp_path)
    kwargs.update(disable_tqdm=True, logging_first_step=False)
    from transformers import AutoTokenizer

    from ftcli.config.recipe import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path(recipe.model.tokenizer))
    return SFTTrainer(model=model, args=SFTConfig(**kwargs), train_dataset=block_rows(rows), data_collator=BlockCollator(rows),
                      processing_class=tok, peft_config=lora_config(recipe.lora, recipe.model, model))


def _reference_copy(trainer, attn):
    """An independent PEFT model with the trainer's weights (a deepcopy would share TRL's patched forward)."""
    from peft import get_peft_model

    from ftcli.train.lora.trainer import lora_config

    model = tiny_model(attn=attn)
    model = get_peft_model(model, lora_config(tiny_recipe().lora, tiny_recipe().model, model))
    model.load_state_dict(trainer.model.state_dict())
    return model


def _trainer_step_grads(trainer):
    from transformers import TrainerCallback

    grads = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for n, p in trainer.model.named_parameters():
                if p.requires_grad:
                    grads[n] = p.grad.clone()

    trainer.add_callback(Grab())
    trainer.train()
    return grads


def _worst_grad_diff_vs_token_mean(tmp_path, *, accepts_loss_kwargs: bool, normalize: bool) -> float:
    """One grad-accum step of the trainer vs the token-mean reference: max relative grad difference."""
    from ftcli.model.kernels import enable_packed_kernels
    from ftcli.objectives import OBJECTIVES
    from ftcli.train.lora.trainer import normalize_loss_by_tokens, use_objective_loss

    attn, _ = enable_packed_kernels("gpt_oss", "cpu")
    rows = _rows()
    trainer = _trainer(tmp_path, rows, tiny_model(attn=attn))
    assert trainer.model_accepts_loss_kwargs is accepts_loss_kwargs
    if normalize:  # as build_trainer: the token normalization and ftcli's loss
        normalize_loss_by_tokens(trainer)
        use_objective_loss(trainer, OBJECTIVES["sft"], 64)
    # LoRA B starts at zero, so give the adapters a nonzero state shared by both computations
    torch.manual_seed(1)
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    ref = _token_mean_grads(_reference_copy(trainer, attn), rows)
    got = _trainer_step_grads(trainer)
    assert got.keys() == ref.keys() and len(got) > 0
    if normalize:  # the logged loss is ftcli's global-token loss of the step (the full loop's algebra)
        logged = [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h]  # one step: its loss
        assert len(logged) == 1 and abs(logged[0] - _token_mean_grads.loss) < 1e-5 * _token_mean_grads.loss, logged
    return max(((got[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)


@pytest.mark.parametrize("accepts_loss_kwargs", [True, False], ids=["gpt_oss", "accepts_loss_kwargs_false"])
def test_grad_accum_gradient_equals_token_mean(tmp_path, monkeypatch, accepts_loss_kwargs):
    from transformers import GptOssForCausalLM

    if not accepts_loss_kwargs:  # like Qwen3_5ForConditionalGeneration
        monkeypatch.setattr(GptOssForCausalLM, "accepts_loss_kwargs", False, raising=False)
    worst = _worst_grad_diff_vs_token_mean(tmp_path, accepts_loss_kwargs=accepts_loss_kwargs, normalize=True)
    print(f"max relative grad diff vs token mean: {worst:.2e}")
    assert worst < 1e-4, worst


def test_without_fix_accepts_loss_kwargs_false_weighs_micro_batches_equally(tmp_path, monkeypatch):
    """What `normalize_loss_by_tokens` fixes: transformers averages per-micro-batch means, so the
    gradient is off from the token mean by a large factor when blocks train very different token counts."""
    from transformers import GptOssForCausalLM

    monkeypatch.setattr(GptOssForCausalLM, "accepts_loss_kwargs", False, raising=False)
    worst = _worst_grad_diff_vs_token_mean(tmp_path, accepts_loss_kwargs=False, normalize=False)
    print(f"without the fix: max relative grad diff vs token mean: {worst:.2e}")
    assert worst > 0.1, worst


def test_loss_normalized_by_global_tokens_across_2_ranks(tmp_path):
    """2 gloo ranks x grad_accum 2, four blocks with 6..170 trained tokens, on a model class that says
    accepts_loss_kwargs=False (like Qwen3_5ForConditionalGeneration): the DDP-averaged gradient of one
    step equals the gradient of the token mean over all four blocks."""
    script = Path(__file__).parents[1] / "support" / "_lora_ddp_grad.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         str(tmp_path), "false"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    print(f"2 ranks: max relative grad diff vs token mean: {result['max_rel_diff']:.2e}; "
          f"rank 0 trained tokens per micro-batch: {result['rank0_trained_tokens']}")
    assert len(result["rank0_trained_tokens"]) == 2
    assert result["max_rel_diff"] < 1e-4
    # the logged loss: ftcli's loss over the four blocks of both ranks / their trained tokens (one loss, the full
    # loop's algebra), not a rank's or a micro-batch's mean
    (logged,) = result["logged_loss"]
    assert abs(logged - result["token_mean_loss"]) < 1e-5 * result["token_mean_loss"], result
