"""Run by tests/e2e/test_lora_fsdp.py under torchrun (2 CPU processes, gloo), or in its process (one rank): SFTTrainer
steps of the tiny gpt-oss (or Qwen3-MoE) with LoRA on attention and experts, the base kept whole per rank (ddp) or
sharded by FSDP2 (fsdp), over four blocks with very different trained-token counts (two per rank, grad_accum 2).
A third argument lists the runs to make one after the other (a fresh trainer each): `eval` (the eval-and-samples
run of tests/support/_lora_fsdp_eval_worker.py) or a spec of `step` (default fp32). Rank 0 writes, per run, with TAG
<sharding>-<spec> (1rank-<spec> out of torchrun): OUT/grads-TAG.pt, the first step's LoRA gradients (gathered to
full tensors under FSDP2), OUT/adapter-TAG.pt, the adapter after the run, OUT/sharded-TAG.json, whether each base
weight was sharded, and OUT/loss-TAG.json: the logged losses, how many forwards went through the grouped expert
GEMMs (`GroupedLoraMatmul`) and, for bf16 (the model and the run bfloat16: FSDP2 mixed precision, one step), ftcli's
eval loss sum after the step (`attach_loss_sum`) on each of the four blocks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _lora_common import packed_row  # noqa: E402


def main(out: Path, sharding: str, dtypes: str = "fp32") -> None:
    for dtype in dtypes.split(","):  # one after the other in this process (a fresh trainer each)
        if dtype == "eval":
            from _lora_fsdp_eval_worker import eval_run

            eval_run(out, sharding)
        else:
            step(out, sharding, dtype)
    if torch.distributed.is_initialized():  # leave together, as `ftcli train` does
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    from ftcli.train.distributed import exit_worker

    exit_worker(0)


STEPS = 3  # the steps of a float32 run (its gradients are the first step's); a bf16 run takes one


def step(out: Path, sharding: str, spec: str) -> None:
    """One run of the module doc; `spec` is `fp32` or `bf16`, optionally with `+qwen3` (the tiny Qwen3-MoE, else
    the tiny gpt-oss), `+peft` (lora.experts=peft: PEFT's folded expert LoRA, else the grouped one) and `+ac`
    (training.activation_checkpointing=full). On one rank (no torchrun) grad_accum is 4: the same four blocks per
    step."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig

    from ftcli.config.recipe import load_recipe, resolve_path
    from ftcli.model.build import load_model
    from ftcli.model.kernels import enable_packed_kernels
    from ftcli.model.moe_lora import GroupedLoraMatmul
    from ftcli.train.lora.trainer import build_trainer, sft_config_kwargs

    dtype, *flags = spec.split("+")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rng = np.random.default_rng(0)
    rows = [packed_row(rng, [40, 30], 0.1), packed_row(rng, [120, 60], 0.95),
            packed_row(rng, [20], 0.5), packed_row(rng, [90, 10, 50], 0.3)]
    name = "tiny-qwen3-moe-cpu" if "qwen3" in flags else "tiny-gpt-oss-cpu"
    recipe = load_recipe(name, [
        f"training.grad_accum={4 // world}", "training.grad_clip=null", "tracking.enabled=false",
        "training.checkpoint.enabled=false", "training.log_every=1",
        f"training.max_steps={1 if dtype == 'bf16' else STEPS}",
        f"training.sharding={sharding}", f"lora.experts={'peft' if 'peft' in flags else 'grouped'}",
        f"training.activation_checkpointing={'full' if 'ac' in flags else 'none'}",
        *(["model.dtype=bfloat16"] if dtype == "bf16" else [])])
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, out / "run", sharding)
    kwargs.update(disable_tqdm=True, use_cpu=True)
    args = SFTConfig(**kwargs)
    attn, _ = enable_packed_kernels(recipe.model.model_type, "cpu")
    tok = AutoTokenizer.from_pretrained(resolve_path(recipe.model.tokenizer))
    torch.manual_seed(0)
    model = load_model(recipe.model, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                       attn_implementation=attn)
    trainer, _ = build_trainer(recipe, model, tok, rows, args)
    torch.manual_seed(1)  # the same nonzero adapters on both ranks and in every run
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    grads, sharded = {}, {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, a, s, c, **kw):
            if s.global_step:  # the first step's gradients
                return
            for n, p in trainer.model.named_parameters():
                if isinstance(p, DTensor) and "lora_" not in n:
                    sharded[n] = p.to_local().numel() < p.numel()
                if p.requires_grad:
                    g = p.grad
                    grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()

    trainer.add_callback(Grab())
    calls, forward = [], GroupedLoraMatmul.forward  # the grouped expert GEMMs' forwards, counted
    GroupedLoraMatmul.forward = staticmethod(lambda *a: calls.append(1) or forward(*a))
    try:
        trainer.train()
    finally:
        GroupedLoraMatmul.forward = staticmethod(forward)
    adapter = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
               for n, p in trainer.model.named_parameters() if p.requires_grad}
    evals = []
    if dtype == "bf16":  # the eval loss after the step, on every block, every rank taking part (FSDP gathers)
        from ftcli.train.lora.callbacks import attach_loss_sum
        from ftcli.train.lora.trainer import collate_blocks

        attach_loss_sum(trainer.model, 64)
        with torch.no_grad():
            sums = [trainer.model.loss_sum(**collate_blocks([r])) for r in rows]
        evals = [{"dtype": str(x.dtype), "value": float(x)} for x in sums]
    if args.process_index == 0:
        tag = f"{sharding if world > 1 else '1rank'}-{spec}"
        clean = lambda tensors: {n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""): t
                                 for n, t in tensors.items()}
        torch.save(clean(grads), out / f"grads-{tag}.pt")
        torch.save(clean(adapter), out / f"adapter-{tag}.pt")
        (out / f"sharded-{tag}.json").write_text(json.dumps(sharded))
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        (out / f"loss-{tag}.json").write_text(json.dumps({"train": losses, "eval_sums": evals,
                                                                   "grouped": len(calls)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
