"""ftcli.train.metrics: the step line's numbers (both trainers), from a window of steps, on a fake clock."""

from __future__ import annotations

import json

import pytest
import torch


def test_step_metrics_window_tokens_per_s_and_untimed_first_step():
    from ftcli.train.metrics import StepMetrics

    now = [0.0]
    meter = StepMetrics(flops_per_token=6e6, device=torch.device("cpu"), world_size=2, clock=lambda: now[0])
    for seconds in (5.0, 1.0, 1.0):  # the first step pays for warm-up
        now[0] += seconds
        meter.step_done(tokens_seen=1000, seconds=seconds)
    now[0] += 1.0  # time outside step_done (e.g. a checkpoint) still counts in the window
    m = meter.line(step=3, loss=2.5, grad_norm=0.75, lr=1e-4, tokens_trained=1800, tokens_seen=3000)
    assert m["tokens_per_s"] == pytest.approx(3000 / 8) and m["tokens_per_s_per_device"] == pytest.approx(3000 / 16)
    assert m["s_per_step"] == pytest.approx(8 / 3) and m["mfu"] is None  # no known peak on CPU
    assert (m["step"], m["loss"], m["grad_norm"], m["lr"], m["tokens_trained"], m["tokens_seen"]) == (
        3, 2.5, 0.75, 1e-4, 1800, 3000)
    assert m["mem_unit"] == "GiB rss" and m["peak_mem"] > 0 and m["peak_mem_reserved"] is None

    now[0] += 2.0  # the next window starts at line()
    meter.step_done(tokens_seen=500, seconds=2.0)
    m = meter.line(step=4, loss=2.0, grad_norm=0.5, lr=1e-4, tokens_trained=2000, tokens_seen=3500)
    assert m["tokens_per_s"] == pytest.approx(250) and m["s_per_step"] == pytest.approx(2)
    assert meter.throughput() == {"tokens_per_s": pytest.approx(2500 / 4), "s_per_step": pytest.approx(4 / 3)}


def test_mfu_is_model_flops_over_the_peak(monkeypatch):
    from ftcli.train import metrics

    monkeypatch.setattr(metrics, "peak_flops", lambda device: 1e12)
    now = [0.0]
    meter = metrics.StepMetrics(flops_per_token=6e6, device=torch.device("cpu"), world_size=4, clock=lambda: now[0])
    now[0] += 2.0
    meter.step_done(tokens_seen=80_000, seconds=2.0)
    m = meter.line(step=1, loss=1.0, grad_norm=1.0, lr=1.0, tokens_trained=1, tokens_seen=80_000)
    assert m["mfu"] == pytest.approx(6e6 * (80_000 / 2 / 4) / 1e12)  # 6e6 x 10k tok/s per device / 1 TFLOP/s


def test_log_step_prints_appends_and_tracks(tmp_path):
    from ftcli.train.metrics import log_step

    m = {"step": 2, "loss": 1.5, "grad_norm": 0.25, "lr": 3e-3, "tokens_per_s": 1234.4, "tokens_per_s_per_device": 617.2,
         "mfu": None, "peak_mem": 1.5, "peak_mem_reserved": None, "mem_unit": "GiB rss", "s_per_step": 0.5,
         "tokens_trained": 10, "tokens_seen": 20}
    lines, logged = [], []

    class Tracker:
        def log_metrics(self, values, step):
            logged.append((values, step))

    for _ in range(2):
        log_step(m, 8, say=lines.append, metrics_path=tmp_path / "metrics.jsonl", tracker=Tracker())
    assert lines[0] == ("step 2/8 | loss 1.5000 | gnorm 0.250 | lr 3.00e-03 | 1,234 tok/s (617/dev) | MFU n/a | "
                        "mem 1.50 GiB rss | 0.500 s/step")
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [m, m]
    assert logged[0][1] == 2 and "step" not in logged[0][0] and "mem_unit" not in logged[0][0]
    assert logged[0][0]["loss"] == 1.5 and "mfu" not in logged[0][0]  # None is not a number
