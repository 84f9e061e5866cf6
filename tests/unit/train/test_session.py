"""ftcli.train.session.RunSession's stop handling, in one process: which status the tracked run ends with, and
what a stop asks of the trainer's checkpoint callable (the trainers' stops run end to end in
tests/e2e/test_preemption.py and tests/e2e/test_lora_train.py)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from ftcli.train.preempt import Stopped
from ftcli.train.session import RunSession


class Tracker:
    def __init__(self):
        self.statuses = []

    def finish(self, status="FINISHED"):
        self.statuses.append(status)


def _session(tmp_path, checkpoints: bool) -> RunSession:
    recipe = SimpleNamespace(training=SimpleNamespace(checkpoint=SimpleNamespace(enabled=checkpoints)), eval=None)
    return RunSession(recipe, tmp_path, 0, 1, "cpu", Tracker(), say=lambda line: None)


def test_a_stop_saves_through_the_trainer_when_checkpoints_are_on_and_ends_the_run_killed(tmp_path):
    for checkpoints, saved in ((True, tmp_path / "step_00000005"), (False, None)):
        session, asked, cleaned = _session(tmp_path, checkpoints), [], []

        def checkpoint(save: bool):
            asked.append(save)
            return saved

        with pytest.raises(Stopped) as err, session.running(cleanup=lambda: cleaned.append(True)):
            session.stop(5, signal.SIGTERM, checkpoint)
        assert asked == [checkpoints] and cleaned == [True]
        assert (err.value.step, err.value.signum, err.value.checkpoint) == (5, signal.SIGTERM, saved and str(saved))
        assert err.value.exit_code == 143 and session.tracker.statuses == ["KILLED"]


def test_an_error_ends_the_run_failed_and_no_error_leaves_it_to_the_trainer(tmp_path):
    session = _session(tmp_path, True)
    with pytest.raises(ValueError), session.running():
        raise ValueError("a bug")
    assert session.tracker.statuses == ["FAILED"]
    with session.running(cleanup=lambda: pytest.fail("no cleanup without an error")):
        pass
    assert session.tracker.statuses == ["FAILED"]


def test_complete_says_the_best_eval_records_the_run_ends_it_finished_and_says_done(tmp_path, monkeypatch):
    """`complete`, the end both trainers call: the best eval's line on every rank (printed by rank 0's `say`), then
    on rank 0 only run.json, FINISHED and the done line, worded by what the run trains (model / adapter)."""
    import ftcli.train.session as session_module

    recorded = []
    monkeypatch.setattr(session_module, "record_run", lambda recipe, run_dir, **fields: recorded.append(fields))
    evals = SimpleNamespace(best_step=4, best_loss=1.23456)
    for method, rank, final_loss, best_dir, model_dir, lines in (
        ("full", 0, 2.5, "final", "final", [f"best eval: step 4, eval loss 1.2346, model in {tmp_path / 'final'}",
                                            f"done: 6 steps, final loss 2.5000, model in {tmp_path / 'final'}"]),
        ("full", 0, None, None, None, ["done: 6 steps, final loss n/a"]),
        ("lora", 0, 0.75, "best", "final", [f"best eval: step 4, eval loss 1.2346, model in {tmp_path / 'best'}",
                                            f"done: 6 steps, final loss 0.7500, adapter in {tmp_path / 'final'}"]),
        ("lora", 1, 0.75, "best", "final", [f"best eval: step 4, eval loss 1.2346, model in {tmp_path / 'best'}"]),
    ):
        said, recorded[:] = [], []
        recipe = SimpleNamespace(training=SimpleNamespace(method=method, objective="sft"), eval=None)
        session = RunSession(recipe, tmp_path, rank, 2, "cpu", Tracker(), say=said.append)
        session.complete(steps=6, final_loss=final_loss, evals=evals, best_model_dir=best_dir, model_dir=model_dir,
                         tokens={"trained": 10, "seen": 12})
        assert said == lines
        assert session.tracker.statuses == (["FINISHED"] if rank == 0 else [])
        assert [(r["steps"], r["final_loss"], r["best_model_dir"], r["model_dir"], r["tokens"]) for r in recorded] == (
            [(6, final_loss, best_dir, model_dir, {"trained": 10, "seen": 12})] if rank == 0 else [])


def test_an_error_while_a_full_run_sets_up_ends_its_tracked_run_failed(tmp_path, monkeypatch):
    """FullRun.__init__ raises after tracking started (here the real check: the data gave no packed block): the
    tracked run ends FAILED, as an error in the steps does, not left RUNNING."""
    import torch
    from _data_common import recipe

    from ftcli.config.errors import TrainingStopped
    from ftcli.train.full import FullRun

    tracker = Tracker()
    monkeypatch.setattr(RunSession, "start", classmethod(
        lambda cls, recipe, run_dir, *, say, **kw: cls(recipe, run_dir, 0, 1, torch.device("cpu"), tracker, say)))

    def no_blocks(self):
        self.tokenizer, self.units, self.summary, self.evaluator = None, [], None, []

    monkeypatch.setattr(RunSession, "open_data", no_blocks)
    world = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), is_main=True, cp_size=1, dp_rank=0,
                            dp_size=1)
    with pytest.raises(TrainingStopped, match="the data gave no packed block"):
        FullRun(recipe(tmp_path), tmp_path / "run", None, world)
    assert tracker.statuses == ["FAILED"]
