"""ftcli.tracking: the MLflow run a training run logs to."""

from __future__ import annotations

import json
import time

import pytest


def test_tracking_attaches_to_mlflow_run_id_and_fails_fast_on_unreachable_server(tmp_path, monkeypatch):
    import mlflow

    from ftcli.errors import UserError
    from ftcli.recipe import load_recipe
    from ftcli.tracking import NoTracking, start_tracking

    assert isinstance(start_tracking(load_recipe("tiny-qwen-cpu", ["tracking.enabled=false"])), NoTracking)
    assert isinstance(start_tracking(load_recipe("tiny-qwen-cpu"), rank=1), NoTracking)

    unreachable = load_recipe("tiny-qwen-cpu", ["tracking.tracking_uri=http://user:pw@127.0.0.1:9"])
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"cannot reach the MLflow tracking server at http://\*\*\*@127.0.0.1:9"):
        start_tracking(unreachable)
    assert time.perf_counter() - t0 < 15

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the job's run (AI Runtime sets MLFLOW_RUN_ID)
    mlflow.set_tracking_uri(uri)
    job_run = mlflow.MlflowClient(uri).create_run(mlflow.set_experiment("job").experiment_id)
    monkeypatch.setenv("MLFLOW_RUN_ID", job_run.info.run_id)
    recipe = load_recipe("tiny-qwen-cpu", [f"tracking.tracking_uri={uri}", "tracking.log_system_metrics=false",
                                           "compute.env_variables={NCCL_SOCKET_IFNAME: hunter2}"])
    tracker = start_tracking(recipe, run_dir=tmp_path / "run")
    tracker.log_metrics({"loss": 1.5}, step=3)
    tracker.finish()
    assert tracker.info["run_id"] == job_run.info.run_id
    run = mlflow.MlflowClient(uri).get_run(job_run.info.run_id)
    assert run.data.metrics["loss"] == 1.5 and run.data.params["compute.env_variables.NCCL_SOCKET_IFNAME"] == "***"
    assert json.loads((tmp_path / "run" / "tracking.json").read_text())["run_id"] == job_run.info.run_id
