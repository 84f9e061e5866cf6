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
