"""torchrun entry for tests/e2e/test_eval.py: the eval loss of one model under several eval packings.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/support/_eval_worker.py OUT CACHE MODEL_DIR

Loads a trained tiny model (MODEL_DIR, a run's final/) through train_full (FSDP2: rank 0 reads it and
broadcasts the shards, so every world size holds the same weights), then evaluates the same held-out rows packed four ways: bfd at block_len 1024 and 2048 (chunked
loss), one example per block (strategy none), and bfd 1024 with the reference's full-logits loss. Rank 0
writes OUT/evals_{N}.json: per variant the loss, the eval token count, and whether the RNG moved.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(out: Path, cache: str, model_dir: str) -> None:
    from ftcli import data
    from ftcli.model import kernels
    from ftcli.train.distributed import init_distributed, rank0_first
    from ftcli.train.evaluate import Evaluator, prepare_eval
    from ftcli.train.loss import attach_loss
    from ftcli.config.recipe import load_recipe
    from ftcli.model.parallelize import build_model

    torch.set_num_threads(1)
    base = ["eval.holdout=40", "data.max_examples=600", f"data.cache_dir={cache}", "model.init=pretrained",
            f"model.id={model_dir}"]
    world = init_distributed()
    recipe = load_recipe("tiny-qwen-cpu", base)
    attn, _ = kernels.enable_packed_kernels(recipe.model.model_type, world.device)
    model = build_model(recipe.model, recipe.training, world, attn)
    tokenizer = data.load_tokenizer(recipe.model, recipe.data)
    variants = {
        "bfd_1024": ([], "chunked"), "bfd_2048": (["eval.block_len=2048"], "chunked"),
        "one_per_block": (["eval.strategy=none"], "chunked"), "bfd_1024_full_loss": ([], "full"),
    }
    results = {}
    for name, (sets, impl) in variants.items():
        r = load_recipe("tiny-qwen-cpu", base + sets)
        attach_loss(model, impl, 37)
        evaluator = Evaluator(prepare_eval(data.data_spec(r), r.eval, tokenizer, rank0_first), world.rank, world.world_size, world.device)
        rng = torch.get_rng_state()
        res = evaluator.run(model, lambda inputs: model.loss_sum(**inputs), step=0)
        results[name] = {"loss": res.loss, "tokens": res.tokens, "rng_untouched": torch.equal(rng, torch.get_rng_state()),
                         "training_mode": model.training,
                         "blocks": len(evaluator.packed["pkg://assets/tiny_chat.jsonl"])}
    if world.rank == 0:
        (out / f"evals_{world.world_size}.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    from ftcli.train.distributed import exit_worker

    exit_worker(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
