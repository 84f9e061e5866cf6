"""Tracking never holds a run: against a fake local server (127.0.0.1, stops by itself) that answers
/health and then stalls, or answers 503 everywhere, train's tracking setup returns within seconds with
one line; a stalled logging call turns tracking off; SIGTERM during a stalled call ends it at once and
is still recorded by the trainer's stop flag."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from ftcli.config.errors import UserError

STALL_S = 20  # the longest the fake server holds a request; the test would fail long before


class _Handler(BaseHTTPRequestHandler):
    def _answer(self):
        mode, release = self.server.mode, self.server.release
        if mode == "503":
            self.send_response(503)
        elif self.path.rstrip("/").endswith("/health"):
            self.send_response(200)
        else:
            release.wait(STALL_S)  # accepts, reads, never answers (until the test ends)
            self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _serve(mode: str):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.mode, srv.release = mode, threading.Event()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()


@pytest.fixture(params=["stall", "503"])
def server(request):
    with _serve(request.param) as srv:
        yield srv


@pytest.fixture
def stalling():
    with _serve("stall") as srv:
        yield srv


@pytest.fixture
def quick(monkeypatch):
    import mlflow  # noqa: F401 - its import (seconds on a busy machine) is not what the budgets bound

    from ftcli.artifacts import tracking

    monkeypatch.setattr(tracking, "START_BUDGET_S", 3)
    monkeypatch.setattr(tracking, "CALL_BUDGET_S", 1)
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_RUN_ID",
                 "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(name, "")  # so that teardown restores each, also what start_tracking sets
        monkeypatch.delenv(name)
    return tracking


def _recipe(uri, tmp_path):
    from ftcli.config.recipe import load_recipe

    return load_recipe("tiny-qwen-cpu", [f"tracking.tracking_uri={uri}", "tracking.log_system_metrics=false",
                                         f"output.dir={tmp_path / 'run'}"])


def test_stalling_or_503_server_fails_the_start_within_seconds_in_one_line(server, quick, tmp_path):
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    started = time.monotonic()
    with pytest.raises(UserError) as err:
        quick.start_tracking(_recipe(uri, tmp_path), run_dir=tmp_path / "run")
    assert time.monotonic() - started < quick.START_BUDGET_S + 3
    if server.mode == "503":
        assert str(err.value) == (f"cannot reach the MLflow tracking server at {uri} (it answers HTTP 503); start it, "
                                  "fix tracking.tracking_uri / $MLFLOW_TRACKING_URI, or set tracking.enabled=false")
    else:
        assert str(err.value) == (f"cannot start an MLflow run at {uri}: no answer within 3 s; set "
                                  "tracking.enabled=false to train without tracking")
    assert not (tmp_path / "run" / "tracking.json").exists()


def test_sigterm_during_a_stalled_start_ends_it_at_once_and_the_stop_flag_has_it(stalling, quick, tmp_path):
    from ftcli.train.preempt import StopFlag

    quick.START_BUDGET_S = 30
    uri = f"http://127.0.0.1:{stalling.server_address[1]}"
    flag = StopFlag().install()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        started = time.monotonic()
        timer.start()
        tracker = quick.start_tracking(_recipe(uri, tmp_path), run_dir=tmp_path / "run")
        elapsed = time.monotonic() - started
    finally:
        timer.cancel()
        flag.restore()
    assert elapsed < 5 and tracker.info is None and flag.signum == signal.SIGTERM


def test_stalled_logging_call_turns_tracking_off_within_its_budget(stalling, quick, capsys):
    import urllib.request

    url = f"http://127.0.0.1:{stalling.server_address[1]}/api/2.0/mlflow/runs/log-batch"
    calls = []

    def stalled_log(metrics, step):
        calls.append(step)
        urllib.request.urlopen(url, timeout=STALL_S)

    run = SimpleNamespace(info=SimpleNamespace(experiment_id="1", run_id="r"))
    ended = []
    fake_mlflow = SimpleNamespace(log_metrics=stalled_log, end_run=lambda status: ended.append(status))
    tracker = quick.MlflowTracking(fake_mlflow, run, "http://127.0.0.1")
    started = time.monotonic()
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.log_metrics({"loss": 0.9}, step=2)  # tracking is off: not called
    assert time.monotonic() - started < quick.CALL_BUDGET_S + 2 and calls == [1]
    assert capsys.readouterr().err.strip() == (
        "warning: MLflow logging to http://127.0.0.1 failed (no answer within 1 s); tracking is off for the rest "
        "of this run (metrics.jsonl keeps the metrics)")
    tracker.finish()  # tracking is off: the run is not ended through the stalled server either
    assert ended == []


def test_bounded_keeps_an_outer_alarm_running():
    """pytest-timeout (and anyone else) may have SIGALRM armed: after a bounded call it is armed again."""
    from ftcli.artifacts.tracking import bounded

    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        with bounded(5):
            time.sleep(0.05)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert signal.getsignal(signal.SIGALRM) is not None and 99 < remaining < 100 and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_dead_proxy_is_named_not_reported_as_the_live_server_refusing(stalling, monkeypatch):
    """$HTTP_PROXY on a dead local port in front of a live local server (it answers /health): the line names the
    proxy (credentials masked) and the variable that set it, not the server; $NO_PROXY naming the host goes direct."""
    import socket

    from ftcli.artifacts.tracking import check_reachable, proxy_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed again: nothing listens there
    server = f"http://127.0.0.1:{stalling.server_address[1]}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
                 "NO_PROXY", "REQUEST_METHOD"):
        monkeypatch.delenv(name, raising=False)
    check_reachable(server, fix="start it")  # direct: the live server answers
    monkeypatch.setenv("HTTP_PROXY", f"http://user:secret@127.0.0.1:{dead}")
    assert proxy_for(server + "/health") == ("HTTP_PROXY", f"http://***@127.0.0.1:{dead}")
    with pytest.raises(UserError) as err:
        check_reachable(server, fix="start it or pass --tracking-uri")
    assert str(err.value) == (
        f"cannot reach the proxy http://***@127.0.0.1:{dead} ($HTTP_PROXY) that the MLflow tracking server at {server} "
        "is reached through (connection refused); fix the proxy setting, or add the server's host to $NO_PROXY")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert proxy_for(server + "/health") is None
    check_reachable(server, fix="start it")  # $NO_PROXY: direct again


def test_an_mlflow_error_is_told_by_its_reason_not_sqlalchemys_wrapper_text():
    from mlflow.exceptions import MlflowException

    from ftcli.artifacts.tracking import mlflow_problem

    wrapped = MlflowException("(raised as a result of Query-invoked autoflush; consider using a session.no_autoflush "
                              "block)\n(sqlite3.OperationalError) database or disk is full\n[SQL: UPDATE runs]\n"
                              "(Background on this error at: https://sqlalche.me/e/21/e3q8)")
    assert mlflow_problem(wrapped) == "(sqlite3.OperationalError) database or disk is full"
    assert mlflow_problem(MlflowException("RESOURCE_DOES_NOT_EXIST: at https://u:pw@host/x\nmore")) == \
        "RESOURCE_DOES_NOT_EXIST: at https://***@host/x"
