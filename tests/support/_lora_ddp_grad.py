"""Run by tests/e2e/test_lora_loss.py under torchrun (2 CPU processes, gloo): one SFTTrainer step over four
blocks with very different trained-token counts (two per rank, grad_accum 2); rank 0 writes the max
relative difference between the step's (DDP-averaged) LoRA gradient and the gradient of the token mean
over all four blocks, computed in one process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _lora_common import packed_row, tiny_model, tiny_recipe  # noqa: E402


def main(out: Path, accepts_loss_kwargs: bool) -> None:
    from peft import get_peft_model
    from transformers import AutoTokenizer, GptOssForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from ftcli.model.kernels import enable_packed_kernels
    from ftcli.train.loss import count_trained_tokens
    from ftcli.config.recipe import resolve_path
    from ftcli.train.lora.trainer import BlockCollator, block_rows, lora_config, normalize_loss_by_tokens, sft_config_kwargs
    from _lora_common import token_mean_grads as _token_mean_grads

    if not accepts_loss_kwargs:
        GptOssForCausalLM.accepts_loss_kwargs = False
    rng = np.random.default_rng(0)
    rows = [packed_row(rng, [40, 30], 0.1), packed_row(rng, [120, 60], 0.95),
            packed_row(rng, [20], 0.5), packed_row(rng, [90, 10, 50], 0.3)]
    recipe = tiny_recipe("training.grad_accum=2", "training.grad_clip=null", "tracking.enabled=false",
                         "training.checkpoint.enabled=false", "training.max_steps=1")
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, out / "run")
    kwargs.update(disable_tqdm=True, use_cpu=True)
    args = SFTConfig(**kwargs)
    attn, _ = enable_packed_kernels("gpt_oss", "cpu")
    tok = AutoTokenizer.from_pretrained(resolve_path(recipe.model.tokenizer))
    model = tiny_model(attn=attn)
    trainer = SFTTrainer(model=model, args=args, train_dataset=block_rows(rows), data_collator=BlockCollator(rows), processing_class=tok,
                         peft_config=lora_config(recipe.lora, recipe.model, model))
    normalize_loss_by_tokens(trainer)  # and ftcli's loss, as build_trainer
    from ftcli.objectives import OBJECTIVES
    from ftcli.train.lora.trainer import use_objective_loss

    use_objective_loss(trainer, OBJECTIVES["sft"], 64)
    torch.manual_seed(1)  # the same nonzero adapters on both ranks
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    grads, trained = {}, []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, a, s, c, **kw):
            for n, p in trainer.model.named_parameters():
                if p.requires_grad:
                    grads[n] = p.grad.clone()

    trainer.model.register_forward_pre_hook(
        lambda m, a, kw: trained.append(count_trained_tokens(kw["labels"])), with_kwargs=True)
    trainer.add_callback(Grab())
    trainer.train()
    if args.process_index == 0:
        base = tiny_model(attn=attn)
        ref_model = get_peft_model(base, lora_config(recipe.lora, recipe.model, base))
        ref_model.load_state_dict(state)
        ref = _token_mean_grads(ref_model, rows)
        worst = max(((grads[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)
        logged = [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h]  # one step: its loss
        (out / "result.json").write_text(json.dumps({"max_rel_diff": worst, "rank0_trained_tokens": trained,
                                                     "logged_loss": logged, "token_mean_loss": _token_mean_grads.loss}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] == "true")
    import torch.distributed as dist

    from ftcli.train.distributed import exit_worker

    if dist.is_initialized():
        dist.destroy_process_group()
    exit_worker(0)  # result.json is written: skip the interpreter's teardown (gloo can abort there, see exit_worker)
