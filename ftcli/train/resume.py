"""What a `--resume` may change: the launcher compares the recipe with the run's saved <run>/recipe.yaml
(the recipe its checkpoints were written with) before anything is written, and refuses in one line.

    applied      where and how often the run saves, logs and evaluates, how it is tracked, where it runs
                 (APPLIED_ON_RESUME: tracking.*, compute.*, training.checkpoint cadence, training.log_every,
                 training.cpu_processes (the checkpoint reshards), recomputation and compile settings, ...):
                 resumed with the new values, said in one warning line
    refused      everything else. Two kinds, named in the error:
                 - the model, the data, the method, LoRA: they change parameter shapes or which blocks a step
                   reads, so the checkpoint cannot continue the run (a load would fail, or train on other data)
                 - the optimizer and the schedule (training.optimizer.*, training.schedule.*, epochs,
                   max_steps, grad_accum, grad_clip, precision, seed): the checkpoint holds the optimizer state
                   and the schedule position of the old values, and DCP restores the old learning rate over
                   the new one; ftcli refuses them rather than apply half of the change. Start a new run
                   (another output.dir, model.id=<run>/final) to train on with other values.
"""

from __future__ import annotations

from pathlib import Path

from ftcli.config.errors import UserError

APPLIED_ON_RESUME = (
    "description", "output.", "tracking.", "compute.",
    "training.log_every", "training.max_bad_steps", "training.cpu_processes",
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


def check_resume_recipe(run_dir: Path, recipe, *, warn=print) -> None:
    """UserError listing the refused keys (module doc); `warn` gets one line naming the applied ones."""
    from ftcli.artifacts.rundir import RECIPE_FILE, recipe_differences

    changed = recipe_differences(run_dir, recipe)
    changed = [k for k in changed if not any(o.startswith(k + ".") for o in changed)]  # `{}` -> `{a: 1}`: a
    applied, optim, shape = classify_changes(changed)
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
