"""The run lifecycle both trainers share (ftcli.train.full, ftcli.train.lora), so a run reads the same whichever
trainer ran it:

    start   `announce_data`   the data summary and each eval split, one line each, and the summary's metrics
                              logged at step 0
    ...     (the trainer's own loop: FSDP2 steps, or TRL's)
    end     `record_run`      run.json (ftcli.artifacts.rundir.RunRecord: steps, tokens, loss, throughput, data,
                              every eval, the best one and where its model is), logged to MLflow with recipe.yaml

The best-eval model's place (`final/` or `best/`) is decided once, by ftcli.train.evaluate.best_model_location;
each trainer moves its own weights there (DCP checkpoint -> HF export, or the TRL checkpoint's adapter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ftcli.artifacts.rundir import RECIPE_FILE, new_run_record, write_run_record


def announce_data(summary, evaluator, *, say: Callable[[str], Any], tracker) -> None:
    """The lines a run starts with about its data (every rank calls it; `say` prints on rank 0 only)."""
    for line in summary.lines():
        say(f"data {line}")
    for label, p in evaluator.packed.items():
        say(f"eval data {label}: {p.stats.examples_kept} rows, {p.stats.tokens} tokens, "
            f"{int(p.block_trained.sum())} trained, {len(p)} blocks")
    tracker.log_metrics(summary.metrics(), step=0)


def record_run(recipe, run_dir: Path, *, tracker, steps: int, tokens: dict[str, int],
               final_loss: float | None, throughput, summary, evaluator, evals, best_model_dir: str | None,
               stopped_early: str | None, model_dir: str | None, base_path: str | None = None,
               best_checkpoint: str | None = None) -> Path:
    """run.json of a completed run (rank 0), logged to MLflow with the resolved recipe; returns its path.
    `evals`: the run's EvalTracker (None without eval data)."""
    from ftcli.train.evaluate import eval_summaries

    record = new_run_record(
        recipe, method=recipe.training.method, mlflow=tracker.info, base_path=base_path, model_dir=model_dir, steps=steps,
        tokens=tokens, final_loss=final_loss, throughput=throughput, status="completed", data=summary.to_dict(),
        evals=evals.history if evals else [],
        eval_data={k: s.to_dict() for k, s in eval_summaries(recipe, evaluator.packed).items()} or None,
        best_step=evals.best_step if evals else None, best_eval_loss=evals.best_loss if evals else None,
        best_checkpoint=best_checkpoint, best_model_dir=best_model_dir, stopped_early=stopped_early,
    )
    path = write_run_record(run_dir, record)
    tracker.log_artifact(path)
    tracker.log_artifact(run_dir / RECIPE_FILE)
    return path
