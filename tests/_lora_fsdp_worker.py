"""Run by tests/test_lora_fsdp.py under torchrun (2 CPU processes, gloo): one SFTTrainer step of the tiny gpt-oss
with LoRA on attention and experts, the base kept whole per rank (ddp) or sharded by FSDP2 (fsdp), over four
blocks with very different trained-token counts (two per rank, grad_accum 2). Rank 0 saves the step's LoRA
gradients (gathered to full tensors under FSDP2) to OUT/grads-<sharding>.pt, and whether the base weights
were sharded. A third argument lists the steps to take one after the other, from `fp32`, `bf16` and `eval`
(default fp32; `eval`: the eval-and-samples run of tests/_lora_fsdp_eval_worker.py): with bf16 the model and the run are bfloat16 (FSDP2 mixed precision) and the files are
OUT/grads-<sharding>-bf16.pt plus OUT/loss-<sharding>-bf16.json: the step's logged loss and, after the step,
ftcli's eval loss sum (`attach_eval_loss`) on each of the four blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _lora_common import packed_row, tiny_model, tiny_recipe  # noqa: E402


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


def step(out: Path, sharding: str, dtype: str) -> None:
    import datasets
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig

    from ftcli.model.kernels import enable_packed_kernels
    from ftcli.config.recipe import resolve_path
    from ftcli.train.lora.trainer import build_trainer, sft_config_kwargs

    rng = np.random.default_rng(0)
    rows = [packed_row(rng, [40, 30], 0.1), packed_row(rng, [120, 60], 0.95),
            packed_row(rng, [20], 0.5), packed_row(rng, [90, 10, 50], 0.3)]
    recipe = tiny_recipe("training.grad_accum=2", "training.grad_clip=null", "tracking.enabled=false",
                         "training.checkpoint.enabled=false", "training.max_steps=1", f"training.sharding={sharding}",
                         # bf16: the DDP side through PEFT's folded expert LoRA too (FSDP's path), so that only the
                         # sharding differs; float32: DDP's grouped expert LoRA against FSDP's folded one
                         *(["model.dtype=bfloat16", "lora.experts=peft"] if dtype == "bf16" else []))
    kwargs = sft_config_kwargs(recipe, out / "run", sharding)
    kwargs.update(disable_tqdm=True, use_cpu=True)
    args = SFTConfig(**kwargs)
    attn, _ = enable_packed_kernels("gpt_oss", "cpu")
    ds = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]}).with_format("numpy")
    tok = AutoTokenizer.from_pretrained(resolve_path(recipe.model.tokenizer))
    trainer, _ = build_trainer(recipe, tiny_model(attn=attn, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32), tok, ds, args)
    torch.manual_seed(1)  # the same nonzero adapters on both ranks and in both runs
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    grads, sharded = {}, {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, a, s, c, **kw):
            for n, p in trainer.model.named_parameters():
                if isinstance(p, DTensor) and "lora_" not in n:
                    sharded[n] = p.to_local().numel() < p.numel()
                if p.requires_grad:
                    g = p.grad
                    grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()

    trainer.add_callback(Grab())
    trainer.train()
    evals = []
    if dtype == "bf16":  # the eval loss after the step, on every block, every rank taking part (FSDP gathers)
        from ftcli.train.lora.callbacks import attach_eval_loss
        from ftcli.train.lora.trainer import collate_rows

        attach_eval_loss(trainer.model, 64)
        with torch.no_grad():
            sums = [trainer.model.loss_sum(**collate_rows([r])) for r in rows]
        evals = [{"dtype": str(x.dtype), "value": float(x)} for x in sums]
    if args.process_index == 0:
        tag = sharding if dtype == "fp32" else f"{sharding}-{dtype}"
        torch.save({n.replace("_fsdp_wrapped_module.", ""): g for n, g in grads.items()}, out / f"grads-{tag}.pt")
        (out / f"sharded-{tag}.json").write_text(json.dumps(sharded))
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        (out / f"loss-{tag}.json").write_text(json.dumps({"train": losses, "eval_sums": evals}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
