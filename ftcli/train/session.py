"""One run's session: what every trainer's run has, whichever trainer steps it (ftcli.train.full's FSDP2 loop,
ftcli.train.lora's TRL adapter), so that a run reads the same and a new trainer (a preference objective's) copies
none of it:

    session = RunSession.start(recipe, run_dir, rank=.., world_size=.., device=.., resume=.., say=..)
                              tracking: MLflow (rank 0) starts or attaches to the run, logs the recipe
    session.open_data()       tokenizer, the objective's units (ftcli.objectives: rank 0 packs them into the cache,
                              then every rank opens it), the data summary, the evaluator of every eval split, and
                              the lines a run starts with about them (`announce_data`, summary metrics at step 0)
    ...                       the trainer's own steps, evals and checkpoints
    session.stop_signal()     at each step boundary: the SIGTERM / SIGINT any rank got (ftcli.train.preempt;
                              collective); when one came,
    session.stop(step, signum, checkpoint)
                              the trainer's checkpoint of this step when checkpoints are on (`checkpoint(save)`),
                              then `Stopped` on every rank (the launcher's exit code and resume line)
    session.export_models(best_step, last_step, export_last=.., export_best=..)
                              final/ and best/ (ftcli.train.export: which model goes where, written in place by
                              the trainer's callables or copied from the best/ it kept, no dir renamed); returns
                              run.json's best_model_dir
    session.complete(...)     the run's end, the same for every trainer: the best eval's line, run.json
                              (ftcli.artifacts.rundir.RunRecord: steps, tokens, loss, throughput, data, every eval,
                              the best one and where its model is) logged with recipe.yaml (rank 0), the tracked run
                              FINISHED, the `done:` line
    session.end(error)        the tracked run's status: FINISHED, KILLED (a stop signal) or FAILED; `with
                              session.running(cleanup):` around everything after `start` ends it on any exception

A trainer plugs in callables (save a checkpoint, export the model it holds, export the best eval's) and the session
decides when they run: no trainer class hierarchy.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from ftcli.artifacts.resolve import parent_run_of
from ftcli.artifacts.rundir import (RECIPE_FILE, DataSourceRecord, new_run_record, recipe_digest,
                                   write_run_record)


@dataclass
class RunSession:
    """See the module docstring. Every rank holds one; `say` prints on rank 0 only."""

    recipe: Any
    run_dir: Path
    rank: int
    world_size: int
    device: Any  # torch.device of this rank
    tracker: Any  # ftcli.artifacts.tracking's tracker (NoTracking off rank 0 or with tracking off)
    say: Callable[[str], Any]
    tokenizer: Any = None
    units: Any = None  # ftcli.data.PackedDataset of the objective's units
    summary: Any = None  # ftcli.data.DataSummary
    evaluator: Any = None  # ftcli.train.evaluate.Evaluator (empty without eval data)

    @classmethod
    def start(cls, recipe, run_dir: Path, *, rank: int, world_size: int, device, resume: bool,
              say: Callable[[str], Any]) -> RunSession:
        """MLflow (rank 0): ftcli.artifacts.tracking starts or attaches to the run (MLFLOW_RUN_ID, or this run dir's
        tracking.json on resume) and logs the recipe."""
        from ftcli.artifacts.tracking import start_tracking
        from ftcli.train.preempt import stop_flag

        stop_flag()  # SIGTERM / SIGINT from here on (if the worker has not already): stop at a step boundary
        tracker = start_tracking(recipe, run_dir=run_dir, rank=rank, resume=resume)
        return cls(recipe, Path(run_dir), rank, world_size, device, tracker, say)

    def open_data(self) -> None:
        """Tokenizer, the objective's units, summary and eval data; rank 0 fills each cache first, then the others
        open it (ftcli.train.distributed.rank0_first). Collective."""
        from ftcli import data
        from ftcli.objectives import objective_of
        from ftcli.train.distributed import rank0_first
        from ftcli.train.evaluate import Evaluator, prepare_eval

        recipe = self.recipe
        self.tokenizer = rank0_first(lambda: data.load_tokenizer(recipe.model, recipe.data))
        objective = objective_of(recipe.training)
        self.units = objective.units(data.data_spec(recipe), self.tokenizer, rank0_first)
        self.summary = data.data_summary(recipe, self.units)
        eval_units = prepare_eval(data.data_spec(recipe), recipe.eval, self.tokenizer, rank0_first)
        self.evaluator = Evaluator(eval_units, self.rank, self.world_size, self.device, objective)
        announce_data(self.recipe, self.summary, self.evaluator, say=self.say, tracker=self.tracker)

    @contextmanager
    def running(self, cleanup: Callable[[], Any] = lambda: None) -> Iterator[RunSession]:
        """Around the trainer's steps and finish: an exception out of them (`Stopped` by a signal included) runs
        `cleanup` (the progress bar gives the terminal back), ends the tracked run with its status (`end`: KILLED or
        FAILED) and propagates."""
        try:
            yield self
        except BaseException as e:
            cleanup()
            self.end(e)
            raise

    def stop_signal(self, device=None) -> int:
        """Collective, at a step boundary: the stop signal any rank got (ftcli.train.preempt.StopFlag.agreed; the
        largest number when several), 0 for none. `device`: where the all-reduce runs (default: the session's)."""
        from ftcli.train.preempt import stop_flag

        return stop_flag().agreed(self.device if device is None else device)

    @property
    def checkpoint_on_stop(self) -> bool:
        """Whether a stop saves a checkpoint of its step first (training.checkpoint.enabled)."""
        return bool(self.recipe.training.checkpoint.enabled)

    def stop(self, step: int, signum: int, checkpoint: Callable[[bool], str | Path | None]) -> NoReturn:
        """Collective, after `stop_signal` gave `signum`: `checkpoint(save)` is the trainer's newest checkpoint after
        it saved one of this step when `save` (`checkpoint_on_stop`; a step that has one is not saved again), then
        every rank raises `Stopped`, which the worker turns into the launcher's exit code and resume line."""
        from ftcli.train.preempt import Stopped

        saved = checkpoint(self.checkpoint_on_stop)
        raise Stopped(step, signum, str(saved) if saved is not None else None)

    def export_models(self, best_step: int | None, last_step: int, *, export_last: Callable[[Path], None],
                      export_best: Callable[[Path], None] | None = None) -> str | None:
        """Collective: <run>/final and <run>/best as ftcli.train.export.export_models decides (eval.export), from the
        trainer's `export_last` and `export_best` (None: the trainer kept its best model in best/ during training);
        returns run.json's best_model_dir."""
        from ftcli.train.export import export_models

        export = self.recipe.eval.export if self.recipe.eval is not None else None
        return export_models(self.run_dir, best_step, last_step, export, export_last=export_last,
                             export_best=export_best, what=self.model_word, is_main=self.rank == 0,
                             device=self.device)

    @property
    def model_word(self) -> str:
        """What the run writes, in its lines: "adapter" (a method that writes one) or "model"."""
        from ftcli.objectives import method_of

        return "adapter" if method_of(self.recipe.training).writes_adapter else "model"

    def complete(self, *, steps: int, final_loss: float | None, evals, best_model_dir: str | None,
                 model_dir: str | None, **fields: Any) -> None:
        """After the exports, the run's end on every rank: the best eval's line (when a best model was exported), then
        on rank 0 run.json (`record_run`; `fields`: what it takes beyond these and the session's own), the tracked run
        FINISHED and the last line, `done: N steps, final loss L, <model> in <run>/final`."""
        if best_model_dir is not None:
            self.say(f"best eval: step {evals.best_step}, eval loss {evals.best_loss:.4f}, model in "
                     f"{self.run_dir / best_model_dir}")
        if self.rank != 0:
            return
        record_run(self.recipe, self.run_dir, tracker=self.tracker, summary=self.summary, evaluator=self.evaluator,
                   steps=steps, final_loss=final_loss, evals=evals, best_model_dir=best_model_dir,
                   model_dir=model_dir, **fields)
        self.end()
        where = f", {self.model_word} in {self.run_dir / model_dir}" if model_dir is not None else ""
        self.say(f"done: {steps} steps, final loss {f'{final_loss:.4f}' if final_loss is not None else 'n/a'}{where}")

    def end(self, error: BaseException | None = None) -> None:
        """The tracked run's status: finished, or KILLED by a stop signal (ftcli.train.preempt.Stopped), or FAILED."""
        from ftcli.train.preempt import Stopped

        if error is None:
            self.tracker.finish()
        else:
            self.tracker.finish("KILLED" if isinstance(error, Stopped) else "FAILED")


def data_sources(recipe, summary, evaluator) -> list[DataSourceRecord]:
    """Every source the run read: the training data's, then each eval split's (eval.path / sources, or the rows
    eval.holdout kept apart), with where the rows come from and how many were read and kept."""
    from ftcli.data import data_spec
    from ftcli.train.evaluate import eval_summaries

    evals = eval_summaries(data_spec(recipe), recipe.eval, evaluator.packed)
    parts = [("training", summary), *(("eval", s) for s in evals.values())]
    records = []
    for context, part in parts:
        for label, src in part.sources.items():
            origin = src.origin or {"kind": "unknown"}
            records.append(DataSourceRecord(label=label, context=context, rows_read=src.rows_read,
                                            rows_kept=src.kept, **origin))
    return records


def announce_data(recipe, summary, evaluator, *, say: Callable[[str], Any], tracker) -> None:
    """The lines a run starts with about its data (every rank calls it; `say` prints on rank 0 only), the summary's
    metrics at step 0, and every data source as an MLflow dataset input with the recipe digest (`data_sources`:
    what run.json records too)."""
    for line in summary.lines():
        say(f"data {line}")
    for label, p in evaluator.packed.items():
        say(f"eval data {label}: {p.stats.examples_kept} rows, {p.stats.tokens} tokens, "
            f"{int(p.block_trained.sum())} trained, {len(p)} blocks")
    tracker.log_metrics(summary.metrics(), step=0)
    if tracker.info is not None:  # rank 0 with tracking on
        tracker.log_lineage(data_sources(recipe, summary, evaluator), recipe_digest(recipe),
                            parent_run_of(recipe.model))


def record_run(recipe, run_dir: Path, *, tracker, steps: int, tokens: dict[str, int],
               final_loss: float | None, throughput, summary, evaluator, evals, best_model_dir: str | None,
               stopped_early: str | None, model_dir: str | None, base_path: str | None = None,
               best_checkpoint: str | None = None) -> Path:
    """run.json of a completed run (rank 0), logged to MLflow with the resolved recipe; returns its path.
    `evals`: the run's EvalTracker (None without eval data)."""
    from ftcli.data import data_spec
    from ftcli.train.evaluate import eval_summaries

    evals_data = eval_summaries(data_spec(recipe), recipe.eval, evaluator.packed)
    record = new_run_record(
        recipe, method=recipe.training.method, mlflow=tracker.info, base_path=base_path, model_dir=model_dir, steps=steps,
        tokens=tokens, final_loss=final_loss, throughput=throughput, status="completed", data=summary.to_dict(),
        evals=evals.history if evals else [],
        eval_data={k: s.to_dict() for k, s in evals_data.items()} or None,
        best_step=evals.best_step if evals else None, best_eval_loss=evals.best_loss if evals else None,
        best_checkpoint=best_checkpoint, best_model_dir=best_model_dir, stopped_early=stopped_early,
        recipe_digest=recipe_digest(recipe), data_sources=data_sources(recipe, summary, evaluator),
        parent_run=parent_run_of(recipe.model),
    )
    path = write_run_record(run_dir, record)
    tracker.log_artifact(path)
    tracker.log_artifact(run_dir / RECIPE_FILE)
    return path
