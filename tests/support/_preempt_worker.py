"""torchrun entry for tests/e2e/test_resume_world_size.py: the FSDP2 trainer with the blocks it trains recorded.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/support/_preempt_worker.py OUT TAG RECIPE_YAML
        [--resume latest] [--sigterm-at-block K]

runs ftcli.train.full.train on the recipe (its output.dir is the run dir) through its `blocks` seam. Every
rank writes OUT/TAG_rank{r}.json: the packed-block index of every block it pulled, in order (-1: a
rank-balancing padding block), and how the run ended (its TrainResult steps, or the step it stopped at).
--sigterm-at-block K: rank 0 sends itself SIGTERM when it pulls its K-th block, so the stop flag is set on
rank 0 only while that step runs (the all-reduce of ftcli.train.preempt must stop every rank after it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("tag")
    parser.add_argument("recipe")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--sigterm-at-block", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    from ftcli.train import full as train_full
    from ftcli.train.preempt import Stopped
    from ftcli.config.recipe import load_recipe

    rank = int(os.environ["RANK"])
    recipe = load_recipe(args.recipe)
    pulled: list[int] = []

    def recorded(stream):
        for block in stream:
            pulled.append(int(block.index))
            if rank == 0 and len(pulled) == args.sigterm_at_block:
                os.kill(os.getpid(), signal.SIGTERM)
            yield block

    try:
        ended = {"steps": train_full.train(recipe, recipe.output_dir, args.resume, blocks=recorded).steps}
    except Stopped as e:
        ended = {"stopped_at": e.step, "signal": e.signum, "checkpoint": e.checkpoint}
    (args.out / f"{args.tag}_rank{rank}.json").write_text(json.dumps({"blocks": pulled, **ended}))


if __name__ == "__main__":
    main()
    from ftcli.train.distributed import exit_worker

    exit_worker(0)  # the record is written: skip the interpreter's teardown (gloo can abort there, see exit_worker)
