"""`ftcli train`: prepare the run dir, start torchrun, and in each worker hand over to the trainer.

    ftcli train --recipe R            (no RANK in the environment: the launcher)
      -> refusal rule + <run>/recipe.yaml            ftcli.rundir.prepare_run_dir
      -> tokenizer, data tokenized + packed into the on-disk cache (errors are one line here)
      -> torchrun --nproc_per_node=<GPUs | training.cpu_processes> -m ftcli train --recipe <run>/recipe.yaml
           (inside torchrun, RANK is set: the worker)
           -> method full: ftcli.train_full.train(recipe, run_dir, resume)
              method lora: ftcli.train_lora.train(recipe, run_dir, resume)

The launcher runs torchrun's agent in this process (`torch.distributed.run.run`), the same code the
`torchrun` command runs, so a failed worker ends in one line and an exit code rather than the agent's
traceback. Multi-node: on Databricks AI Runtime (NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT set)
the launcher passes them on; anywhere else, run `torchrun --nnodes ... -m ftcli train --recipe R` on
every node yourself: the workers read everything from the environment and the recipe.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ftcli.errors import TrainingStopped, UserError
from ftcli.rundir import RECIPE_FILE, is_own_run, prepare_run_dir, recipe_differences, run_dir_of


def _inside_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_train(recipe, *, resume: str | None, force: bool) -> None:
    if recipe.training.method == "full" and not recipe.data.packing.enabled:
        raise UserError("training.method=full trains on packed blocks; set data.packing.enabled=true")
    if _inside_torchrun():
        _worker(recipe, resume=resume, force=force)
    else:
        _launch(recipe, resume=resume, force=force)


# ------------------------------------------------------------------------------------------ launcher
def _processes_per_node(recipe) -> tuple[int, str]:
    import torch

    if os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"]), "GPU"
    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU"
    return recipe.training.cpu_processes, "CPU process"


def _launch(recipe, *, resume: str | None, force: bool) -> None:
    run_dir = run_dir_of(recipe)
    if resume is not None and is_own_run(run_dir, recipe):
        changed = recipe_differences(run_dir, recipe)
        if changed:
            print(f"warning: resuming with a recipe that differs from the run's at: {', '.join(changed)}",
                  file=sys.stderr)
    if resume not in (None, "latest"):
        resume = str(Path(resume).resolve())
    from ftcli.model_check import check_model_config

    check_model_config(recipe)  # a config that builds no model fails here, before the run dir is touched
    run_dir = prepare_run_dir(recipe, force=force, resume=resume)
    _preflight(recipe)
    nproc, unit = _processes_per_node(recipe)
    if unit == "CPU process":
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("PYTHONSAFEPATH", "1")  # `-m ftcli` must not pick up a folder named ftcli in the cwd
    os.environ["FTCLI_LAUNCHED"] = "1"

    torchrun_args = [f"--nproc_per_node={nproc}"]
    num_nodes = int(os.environ.get("NUM_NODES", "1"))
    if num_nodes > 1:
        torchrun_args += [
            f"--nnodes={num_nodes}", f"--node_rank={os.environ['NODE_RANK']}",
            f"--master_addr={os.environ['MASTER_ADDR']}", f"--master_port={os.environ['MASTER_PORT']}",
        ]
    else:
        torchrun_args += ["--standalone"]
    worker = ["-m", "ftcli", "train", "--recipe", str(run_dir / RECIPE_FILE)]
    if resume is not None:
        worker += ["--resume", resume]
    print(f"ftcli train: {recipe.name} ({recipe.training.method}) on {num_nodes} x {nproc} {unit}(s), "
          f"run dir {run_dir}", file=sys.stderr)

    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ftcli.rundir import CHECKPOINTS

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the failure is reported below
    try:
        run(parse_args([*torchrun_args, *worker]))
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        ranks = sorted(e.failures)  # global ranks
        ckpts = run_dir / CHECKPOINTS
        hint = " (--resume continues from the last checkpoint)" if ckpts.is_dir() and any(ckpts.iterdir()) else ""
        raise UserError(
            f"training stopped: rank(s) {', '.join(map(str, ranks))} exited with code(s) "
            f"{', '.join(map(str, codes))}; the reason is printed above{hint}"
        ) from None


def _preflight(recipe) -> None:
    """What every worker would fail on in the same way, checked once here: one line, no torchrun noise."""
    from ftcli import data

    if recipe.training.method == "full" and recipe.training.loss.impl == "liger":
        from ftcli.loss import liger_loss

        liger_loss()
    tokenizer = data.load_tokenizer(recipe)  # hub id / revision / path and chat template
    data.prepare_blocks(recipe, tokenizer)  # tokenize + pack into the on-disk cache, which the workers open


# -------------------------------------------------------------------------------------------- worker
def _worker(recipe, *, resume: str | None, force: bool) -> None:
    run_dir = run_dir_of(recipe)
    rank = int(os.environ["RANK"])
    if os.environ.get("FTCLI_LAUNCHED") != "1" and rank == 0:
        prepare_run_dir(recipe, force=force, resume=resume)  # torchrun started by hand: same refusal rule
    if recipe.training.method == "lora":
        from ftcli.train_lora import train
    else:
        from ftcli.train_full import train
    try:
        train(recipe, run_dir, resume)
    except TrainingStopped:
        if rank != 0:
            raise SystemExit(2) from None  # rank 0 reports it; every rank decided the same
        raise

