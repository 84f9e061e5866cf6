"""The run's model exports, decided once for every trainer (the run session calls `export_models`): which model
goes into <run>/final and whether the best eval's goes beside it into <run>/best.

    best eval      eval.export   final/ holds       best/ holds      run.json best_model_dir
    none           -             the last model     -                null
    the last step  either        the last model     -                final
    earlier        best          the best model     -                final     (the last model is not written)
    earlier        last          the last model     the best model   best

A trainer plugs in `export_last(out_dir)`, which writes the model it holds now, and for the best model either
`export_best(out_dir)` (the full loop: the best checkpoint's weights loaded, then the Hugging Face export), or
nothing when it kept the best model in best/ itself during training (LoRA's adapter, small enough to write at
every new best): then final/ gets a copy of best/ (`ftcli.artifacts.publish.copy_export`), and best/ goes once
final/ is published. Every export is written in place with the publish protocol (ftcli_export.json "incomplete"
first, the file list with sizes last: `ftcli.artifacts.publish`), so no export dir is ever renamed (on a Unity
Catalog Volume a rename copies every byte server-side) and a kill mid-export leaves a final/ that
`ftcli.artifacts.resolve.locate` refuses. A kept best/ is checked before anything of final/ goes; when it is not
whole, final/ gets the last model and every rank stops with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ftcli.artifacts.publish import copy_export, export_problem
from ftcli.artifacts.rundir import BEST, FINAL
from ftcli.config.safe_files import remove_tree
from ftcli.config.errors import TrainingStopped
from ftcli.train.evaluate import best_model_location


def export_models(run_dir: Path, best_step: int | None, last_step: int, export: str | None, *,
                  export_last: Callable[[Path], None], export_best: Callable[[Path], None] | None = None,
                  what: str = "model", is_main: bool = True, device="cpu") -> str | None:
    """Collective (every rank calls it: a trainer's export may gather the model). The exports of the table above;
    returns where the best model is relative to `run_dir` (run.json's best_model_dir), None without one.
    `best_step`: the best eval's step when the trainer kept its model (training.checkpoint.keep_best), else None;
    `export`: eval.export ("best" | "last"); `export_best` None: the best model is kept in best/ (see above);
    `what`: the model's name in the one line ("model", "adapter"); `device`: where rank 0's answer is broadcast."""
    run_dir = Path(run_dir)
    final, best = run_dir / FINAL, run_dir / BEST
    kept = export_best is None
    if kept:
        export_best = lambda out_dir: copy_kept_best(best, out_dir, what, is_main)  # noqa: E731
    if best_step is None:
        export_last(final)
        return None
    where = best_model_location(best_step, last_step, export)
    if where == FINAL and best_step != last_step:
        if kept and (problem := kept_best_problem(best, is_main, device)) is not None:
            export_last(final)
            raise TrainingStopped(f"export: best needs the best eval's {what} in {best}, which {problem}; the last "
                                  f"{what} stays in {final}")
        export_best(final)
    else:
        export_last(final)
        if where == BEST:
            export_best(best)
    if kept and where == FINAL and is_main:
        remove_tree(best)  # final/ holds the best model now, published: its copy in best/ goes
    return where


def kept_best_problem(best: Path, is_main: bool, device) -> str | None:
    """Collective: why the best model kept in `best` cannot become the final one, as rank 0 sees it (missing:
    removed by hand before a resume; not whole: its record says so), the same answer on every rank; None when it can."""
    from ftcli.train.distributed import rank0_decides

    problem = None
    if is_main:
        if not best.is_dir() or not any(p.is_file() for p in best.iterdir()):
            problem = "is missing"
        elif (why := export_problem(best)) is not None:
            problem = f"is not whole ({why})"
    if rank0_decides(problem is None, device):
        return None
    return problem or "rank 0 found not whole"


def copy_kept_best(best: Path, out_dir: Path, what: str, is_main: bool) -> None:
    """`export_best` of a trainer that kept its best model in `best` (main process; the file work is rank 0's): there
    already when `out_dir` is `best`, else copied and published in place (`copy_export`: checked first, no file
    renamed). A write error (a full disk) removes the partial copy and is one line."""
    from ftcli.train.checkpoint import WRITE_ERRORS, export_not_written

    if not is_main or Path(out_dir) == Path(best):
        return
    try:
        copy_export(best, out_dir)
    except WRITE_ERRORS as e:
        needed = sum(p.stat().st_size for p in Path(best).rglob("*") if p.is_file())
        raise export_not_written(f"the best {what}", out_dir, e, needed) from None


def best_from_checkpoint(checkpoint: Path | None, model, export: Callable[[Path], None]) -> Callable[[Path], None]:
    """`export_best` of a trainer that keeps its best model as a DCP checkpoint (the full loop, keep_best protects
    it from rotation): collective, the checkpoint's model weights loaded into `model` (the optimizer and trainer
    state left alone), then `export(out_dir)` of it."""
    def export_best(out_dir: Path) -> None:
        from ftcli.train.checkpoint import load_model_weights

        load_model_weights(checkpoint, model)
        export(out_dir)

    return export_best
