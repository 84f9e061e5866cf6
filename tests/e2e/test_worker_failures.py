"""A failed training job ends with the first failing rank's error once and one summary line: the peers'
consequential errors (gloo "Connection closed by peer") are recorded in torchrun's error files, not
printed; a stop signal that reached only some ranks is reported as the stop it was; a stop every rank decided
together (TrainingStopped) is its one line alone."""

from __future__ import annotations

import os
import signal

from _run_common import REPO, env, ftcli, train_args  # noqa: F401 - env is a fixture
from ftcli.train.failures import (DECIDED_STOP_EXIT, PEER_LOST_EXIT, Failure, decided_stop, peer_lost,
                                  recorded_message, stop_signal, summary)

STOP_CODES = {143: 15, 130: 2, -15: 15, -2: 2}
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:22224. This is typically caused by a remote worker crashing.")


def test_peer_lost_errors_are_told_from_own_errors():
    assert peer_lost(RuntimeError(GLOO))
    assert not peer_lost(RuntimeError("CUDA out of memory"))
    assert not peer_lost(ValueError("bad recipe"))


def test_summary_names_the_rank_that_failed_for_its_own_reason():
    failures = [Failure(1, PEER_LOST_EXIT, f"RuntimeError: {GLOO}"), Failure(0, 2)]
    assert summary(failures, STOP_CODES) == ("training stopped: rank 0 failed (its error is printed above); "
                                             "rank(s) 1 stopped with it")
    # rank 0 recorded its error, then torchrun's SIGTERM caught it in its teardown: still the cause
    failures = [Failure(1, PEER_LOST_EXIT, f"RuntimeError: {GLOO}"), Failure(0, -15, "UserError: no data")]
    assert stop_signal(failures, STOP_CODES) is None
    assert summary(failures, STOP_CODES) == ("training stopped: rank 0 failed (its error is printed above); "
                                             "rank(s) 1 stopped with it")
    assert summary([Failure(0, -15), Failure(1, -9)], STOP_CODES, " (hint)") == (
        "training stopped: rank 1 was killed by SIGKILL (it printed nothing: out of memory, or killed from "
        "outside?); rank(s) 0 stopped with it (hint)")
    assert summary([Failure(0, PEER_LOST_EXIT, f"RuntimeError: {GLOO}"), Failure(1, PEER_LOST_EXIT)],
                   STOP_CODES) == f"training stopped: rank(s) 0, 1 lost the connection to the other ranks: RuntimeError: {GLOO}"


def test_recorded_message_is_what_record_exception_wrote():
    assert recorded_message({"message": {"message": "UserError: x", "extraInfo": {}}}) == "UserError: x"
    assert recorded_message({"message": "<NONE>"}) == ""


def test_a_stop_every_rank_decided_is_its_own_line_alone():
    """Every rank raised the same TrainingStopped (a save a full disk stopped): its line, without the exception's
    name torchrun's error file puts first, whichever rank's exit torchrun saw first; not when a rank failed for a
    reason of its own."""
    line = "the checkpoint of step 4 could not be saved: No space left on device [errno 28]; ..."
    both = [Failure(1, DECIDED_STOP_EXIT, f"CheckpointNotSaved: {line}"), Failure(0, DECIDED_STOP_EXIT, f"CheckpointNotSaved: {line}")]
    assert decided_stop(both) == line
    assert decided_stop([Failure(1, DECIDED_STOP_EXIT, f"TrainingStopped: {line}"), Failure(0, -15)]) == line
    assert stop_signal([Failure(1, DECIDED_STOP_EXIT, f"TrainingStopped: {line}"), Failure(0, 143)], STOP_CODES) is None
    assert decided_stop([Failure(0, DECIDED_STOP_EXIT, f"TrainingStopped: {line}"), Failure(1, 2, "ValueError: x")]) is None
    assert decided_stop([Failure(0, 2), Failure(1, PEER_LOST_EXIT, f"RuntimeError: {GLOO}")]) is None


def test_sigterm_to_one_rank_is_a_stop_even_when_the_others_lost_it():
    assert stop_signal([Failure(1, -15), Failure(0, 143)], STOP_CODES) == signal.SIGTERM
    assert stop_signal([Failure(1, -15), Failure(0, PEER_LOST_EXIT)], STOP_CODES) == signal.SIGTERM
    assert stop_signal([Failure(1, -15), Failure(0, 2)], STOP_CODES) is None
    assert stop_signal([Failure(0, 143), Failure(1, 130)], STOP_CODES) is None


def test_a_link_planted_in_the_run_dir_is_refused_before_any_worker_starts(tmp_path, env):  # noqa: F811
    """A link planted where rank 0 would write tracking.json: the launcher's run-dir check (#47) refuses it in one
    line before torchrun starts, so no worker fails and no peer waits (this was rank 0's error inside the worker,
    printed once while rank 1 waited at the data barrier; `summary` above still says how such a failure reads)."""
    from ftcli.artifacts.rundir import prepare_run_dir
    from ftcli.config.recipe import load_recipe

    run_dir = prepare_run_dir(load_recipe("tiny-qwen-cpu", [f"output.dir={tmp_path / 'run'}"]))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    (run_dir / "tracking.json").symlink_to(victim)
    res = ftcli(train_args(run_dir, "tracking.log_system_metrics=false", "training.max_steps=2"), tmp_path, env)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert errors == [
        f"error: {run_dir / 'tracking.json'} is a symbolic link (to {victim}); ftcli does not write, rename or "
        "delete through links in a run dir: remove it"], res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "gloo" not in res.stderr and "[rank" not in res.stderr
    assert victim.read_text() == "keep\n"


def test_rank0_error_inside_the_workers_is_printed_once_and_no_peer_traceback(tmp_path, env):  # noqa: F811
    """Rank 0 alone fails inside the workers after step 1 (tests/support/rank0_fault: its first open of metrics.jsonl
    raises a UserError; the launcher cannot meet it) while rank 1 waits for it in step 2's all-reduce: rank 0's line
    once, rank 1's gloo error recorded in its error file, not printed, one summary line naming rank 0, no --resume
    hint (no checkpoint was committed) and no run dir left behind."""
    run_dir = tmp_path / "run"
    faulty = {**env, "FTCLI_TEST_RANK0_FAULT": "metrics.jsonl",
              "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "support" / "rank0_fault"), str(REPO)])}
    res = ftcli(train_args(run_dir, "tracking.enabled=false", "training.max_steps=2", "training.log_every=1",
                           "data.max_examples=64", "eval.holdout=0"),
                tmp_path, faulty)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert errors == [
        f"error: {run_dir / 'metrics.jsonl'}: cannot be opened (the rank-0 fault tests/support/rank0_fault plants)",
        "error: training stopped: rank 0 failed (its error is printed above); rank(s) 1 stopped with it"], \
        res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "step 1/2 | loss" in out and "step 2/2" not in out  # it failed inside the training loop
    assert "Traceback" not in res.stderr and "gloo" not in res.stderr and "[rank" not in res.stderr
    assert not run_dir.exists()  # a failed start removes the dirs it made
