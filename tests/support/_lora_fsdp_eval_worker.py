"""Run by tests/e2e/test_lora_fsdp.py (through tests/support/_lora_fsdp_worker.py, after its steps) or alone under torchrun
(2 CPU processes, gloo): ftcli's eval and greedy samples in
the LoRA path (`ftcli.train.lora.callbacks.EvalCallback`) with the tiny gpt-oss base kept whole per rank (ddp) or
sharded by accelerate's FSDP2 (fsdp). The same seeded nonzero adapters in both runs, and lr 0, so every eval and
the samples see the same adapter: an eval at step 0, one at the last step (1), samples there, keep_best.
Everything lands in OUT/<sharding>/ (metrics.jsonl, samples.jsonl, best/); rank 0 writes OUT/<sharding>.json with
the evals and whether every base weight was a DTensor holding half of itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _lora_common import tiny_model, tiny_recipe  # noqa: E402

SAMPLES = '["What is 2 plus 3?", "Say hi"]'


def main(out: Path, sharding: str) -> None:
    from ftcli.train.distributed import exit_worker

    eval_run(out, sharding)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    exit_worker(0)


def eval_run(out: Path, sharding: str) -> None:
    """The run of the module doc, in this process (tests/support/_lora_fsdp_worker.py takes it after its steps)."""
    from torch.distributed.tensor import DTensor
    from trl import SFTConfig

    from ftcli import data
    from ftcli.train.distributed import rank0_first
    from ftcli.train.evaluate import Evaluator, prepare_eval
    from ftcli.model.kernels import enable_packed_kernels
    from ftcli.train.lora.trainer import build_trainer, sft_config_kwargs, training_blocks

    torch.set_num_threads(1)
    run_dir = out / sharding
    recipe = tiny_recipe("training.max_steps=1", "training.checkpoint.enabled=false", "tracking.enabled=false",
                         "training.checkpoint.keep_best=true", "data.max_examples=200", f"data.cache_dir={out / 'cache'}",
                         "eval.holdout=null", "eval.path=pkg://assets/tiny_chat.jsonl", "eval.max_examples=12",
                         "eval.at_start=true", f"eval.samples={SAMPLES}", "eval.samples_max_new_tokens=5",
                         f"training.sharding={sharding}", output_dir=run_dir)
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, run_dir, sharding)
    kwargs.update(disable_tqdm=True, use_cpu=True, learning_rate=0.0)  # the adapter stays what the seed made it
    args = SFTConfig(**kwargs)  # also starts torch.distributed (gloo)
    run_dir.mkdir(parents=True, exist_ok=True)
    attn, _ = enable_packed_kernels("gpt_oss", "cpu")
    tok = rank0_first(lambda: data.load_tokenizer(recipe.model, recipe.data))
    rows = training_blocks(recipe, tok, rank0_first)
    evaluator = Evaluator(prepare_eval(data.data_spec(recipe), recipe.eval, tok, rank0_first), args.process_index, args.world_size,
                          torch.device("cpu"))
    trainer, step_log = build_trainer(recipe, tiny_model(attn=attn), tok, rows, args, evaluator=evaluator,
                                      run_dir=run_dir, metrics_path=run_dir / "metrics.jsonl" if args.process_index == 0
                                      else None)
    torch.manual_seed(1)  # the same nonzero adapters on both ranks and in both runs
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    trainer.train()
    sharded = {n: p.to_local().numel() < p.numel() for n, p in trainer.model.named_parameters()
               if isinstance(p, DTensor) and "lora_" not in n}
    if args.process_index == 0:
        evals = step_log.eval_callback.evals
        (out / f"{sharding}.json").write_text(json.dumps({"evals": evals.history, "best_step": evals.best_step,
                                                          "sharded": sharded}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
