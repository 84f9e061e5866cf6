"""What a `--resume` may change: the launcher compares the recipe with the run's saved <run>/recipe.yaml
(the recipe its checkpoints were written with) before anything is written, and refuses in one line.

    applied      where and how often the run saves, logs and evaluates, how it is tracked, where it runs
                 (APPLIED_ON_RESUME: tracking.*, compute.*, training.checkpoint cadence, training.log_every,
                 training.cpu_processes and training.context_parallel(_balance) (the checkpoint reshards),
                 recomputation and compile settings, ...):
                 resumed with the new values, said in one warning line
    refused      everything else. Two kinds, named in the error:
                 - the model, the data, the method, LoRA: they change parameter shapes or which blocks a step
                   reads, so the checkpoint cannot continue the run (a load would fail, or train on other data)
                 - the optimizer and the schedule (training.optimizer.*, training.schedule.*, epochs,
                   max_steps, grad_accum, grad_clip, precision, seed): the checkpoint holds the optimizer state
                   and the schedule position of the old values, and DCP restores the old learning rate over
                   the new one; ftcli refuses them rather than apply half of the change. Start a new run
                   (another output.dir, model.id=<run>/final) to train on with other values.
    the global batch  a full-path checkpoint resumes on any number of ranks that trains the same blocks per
                 optimizer step (ranks x training.grad_accum, its meta.json's blocks_per_step): a grad_accum
                 change that keeps it is applied, one that does not (or another number of ranks alone) is
                 refused with the grad_accum that keeps it ("resuming on 1 rank: set training.grad_accum=2 to
                 keep 2 blocks per step")

The recipe compared is the one the checkpoint was written with: <run>/recipe.yaml of the run that holds it,
also when `--resume <other run>/checkpoints/step_N` starts a new run dir from it.
"""

from __future__ import annotations

from pathlib import Path

from ftcli.config.errors import UserError

APPLIED_ON_RESUME = (
    "name", "description", "output.", "tracking.", "compute.",
    "training.log_every", "training.max_bad_steps", "training.cpu_processes", "training.context_parallel",
    "training.context_parallel_balance",
    "training.checkpoint.every_steps", "training.checkpoint.every_minutes", "training.checkpoint.keep_last",
    "training.checkpoint.save_final_hf", "training.checkpoint.enabled",
    "training.activation_checkpointing", "training.activation_checkpointing_keep", "training.compile",
    "training.loss.", "data.num_workers", "data.cache_dir",
    "eval.every_steps", "eval.samples", "eval.samples_max_new_tokens",
)
OPTIMIZER_AND_SCHEDULE = (
    "training.optimizer.", "training.schedule.", "training.epochs", "training.max_steps", "training.grad_accum",
    "training.grad_clip", "training.precision.", "training.seed", "training.per_device_batch",
)


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) or key.startswith(p + ".") for p in prefixes)


def classify_changes(changed: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Dotted keys that differ -> (applied, optimizer/schedule (refused), shapes/data (refused))."""
    applied = [k for k in changed if _matches(k, APPLIED_ON_RESUME)]
    optim = [k for k in changed if k not in applied and _matches(k, OPTIMIZER_AND_SCHEDULE)]
    shape = [k for k in changed if k not in applied and k not in optim]
    return applied, optim, shape


def check_resume_recipe(run_dir: Path, recipe, *, warn=print, same_global_batch: bool = False) -> None:
    """UserError listing the refused keys (module doc); `warn` gets one line naming the applied ones.
    `same_global_batch`: the checkpoint's blocks per step are this launch's (`check_global_batch`), so a
    grad_accum change that keeps them is applied."""
    from ftcli.artifacts.rundir import RECIPE_FILE, recipe_differences

    changed = recipe_differences(run_dir, recipe)
    changed = [k for k in changed if not any(o.startswith(k + ".") for o in changed)]  # `{}` -> `{a: 1}`: a
    applied, optim, shape = classify_changes(changed)
    if same_global_batch and "training.grad_accum" in optim:
        optim.remove("training.grad_accum")
        applied.append("training.grad_accum")
    parts = []
    if shape:
        parts.append(f"{', '.join(shape)} (the model, its parameter shapes or the data order the checkpoint continues)")
    if optim:
        parts.append(f"{', '.join(optim)} (its optimizer state and schedule were saved with the old values; "
                     "ftcli does not change them on resume)")
    if parts:
        raise UserError(f"--resume: the recipe differs from the run's {Path(run_dir) / RECIPE_FILE} at "
                        f"{'; and at '.join(parts)}; undo these edits to resume, or train them as a new run "
                        "(another output.dir)")
    if applied:
        warn(f"warning: resuming with changed {', '.join(applied)} (applied from here on)")


def check_global_batch(checkpoint: Path, meta: dict, grad_accum: int, world_size: int) -> None:
    """UserError when this launch (`world_size` ranks x `grad_accum`) would train another number of blocks per
    optimizer step than the checkpoint's run (meta.json's blocks_per_step), naming the grad_accum that keeps
    it on these ranks. A checkpoint without blocks_per_step (an older ftcli's) passes."""
    saved = meta.get("blocks_per_step")
    if not isinstance(saved, int) or saved == world_size * grad_accum:
        return
    def ranks(n: int) -> str:
        return f"{n} rank{'s' if n != 1 else ''}"

    if saved % world_size == 0:
        fix = f"set training.grad_accum={saved // world_size} to keep {saved} blocks per step"
    else:
        fix = (f"no training.grad_accum keeps {saved} blocks per step on {ranks(world_size)}; resume on a number of "
               f"ranks that divides {saved}")
    saved_ranks = meta.get("world_size") if isinstance(meta.get("world_size"), int) and meta["world_size"] > 0 else 1
    raise UserError(f"--resume: {checkpoint} was trained with {saved} blocks per optimizer step ({ranks(saved_ranks)} x "
                    f"training.grad_accum {saved // saved_ranks}), this launch takes {world_size * grad_accum} "
                    f"({ranks(world_size)} x {grad_accum}); resuming on {ranks(world_size)}: {fix}")
