"""ftcli.artifacts.tracking: the MLflow run a training run logs to."""

from __future__ import annotations

import json
import time

import pytest


def test_tracking_attaches_to_mlflow_run_id_and_fails_fast_on_unreachable_server(tmp_path, monkeypatch):
    import mlflow

    from ftcli.config.errors import UserError
    from ftcli.config.recipe import load_recipe
    from ftcli.artifacts.tracking import NoTracking, start_tracking

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


def test_recorded_store_comes_after_the_flag_and_a_missing_sqlite_file_is_one_line(tmp_path, monkeypatch):
    from ftcli.config.errors import UserError
    from ftcli.artifacts.tracking import resolve_tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    gone = f"sqlite:///{tmp_path / 'gone.db'}"
    assert resolve_tracking_uri("http://flag:5000", recorded=gone) == "http://flag:5000"  # the flag wins, unchecked
    with pytest.raises(UserError, match=r"^the training run's MLflow store sqlite:///.*gone.db \(run.json\) is missing; "
                                        r"pass --tracking-uri$"):
        resolve_tracking_uri(None, recorded=gone)
    (tmp_path / "gone.db").write_bytes(b"")
    assert resolve_tracking_uri(None, recorded=gone) == gone
    assert resolve_tracking_uri(None, recorded=None) == "http://env:5000"


def test_http_settings_restore_each_variable_afterwards(monkeypatch):
    import os

    from ftcli.artifacts.tracking import http_settings

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    with pytest.raises(RuntimeError):
        with http_settings(max_retries="0", timeout_s=5):
            assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
            assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"
            raise RuntimeError
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "7" and "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_create_run_logs_scrubbed_recipe_params_and_step_0_metrics(tmp_path):
    from mlflow import MlflowClient

    from ftcli.artifacts.tracking import create_run, recipe_params

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    params = recipe_params({"name": "x", "compute": {"secrets": {"HF_TOKEN": "scope/key"}}, "training": {"lr": 1e-5}})
    assert params == {"name": "x", "compute.secrets.HF_TOKEN": "***", "training.lr": "1e-05"}
    run = create_run(client, "exp", run_name="r", tags={"k": "v"}, params=params, metrics={"steps": 3})
    again = create_run(client, "exp", run_name="r2", tags={}, params={}, metrics={})
    got = client.get_run(run.info.run_id)
    assert got.data.params == params and got.data.metrics == {"steps": 3.0} and got.data.tags["k"] == "v"
    assert again.info.experiment_id == run.info.experiment_id  # the experiment is made once


UNFINISHED = """
import sys
from ftcli.config.recipe import load_recipe
from ftcli.artifacts.tracking import start_tracking
recipe = load_recipe("tiny-qwen-cpu", [f"tracking.tracking_uri={sys.argv[1]}", "tracking.log_system_metrics=false"])
stopped = start_tracking(recipe)
stopped.finish("KILLED")  # what both trainers' handlers do on SIGTERM / SIGINT
failed = start_tracking(recipe)
print(stopped.info["run_id"], failed.info["run_id"], flush=True)
raise SystemExit(2)  # an error before the training loop's own handler: nobody calls finish
"""


def test_a_run_that_exits_without_finishing_is_failed_in_mlflow_not_finished(tmp_path):
    import os
    import subprocess
    import sys

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", UNFINISHED, uri], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    stopped, failed = res.stdout.split()
    client = MlflowClient(uri)
    assert (client.get_run(stopped).info.status, client.get_run(failed).info.status) == ("KILLED", "FAILED")


def test_a_delta_source_is_logged_as_a_dataset_input_and_reaches_the_model_version(tmp_path):
    """A run over a Delta table (version 1 of 2) logs it as an MLflow dataset input: a Delta source with the
    table's path and the version read, the digest run.json records, rows read and kept as input tags; the recipe
    digest as a run tag. `registry.lineage_tags` turns the run record into the model version's tags, which a
    registered version on the same local store reads back (which data, which recipe, which base)."""
    import sys
    from types import SimpleNamespace

    import pyarrow as pa
    from deltalake import write_deltalake
    from mlflow import MlflowClient

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _data_common import recipe as data_recipe, tokenizer

    from ftcli.artifacts import registry
    from ftcli.artifacts.rundir import RunRecord, new_run_record, recipe_digest
    from ftcli.artifacts.tracking import start_tracking
    from ftcli.data import data_summary, prepare_blocks
    from ftcli.train.session import announce_data, data_sources

    table = tmp_path / "chats"
    rows = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}], "n": i}
            for i in range(12)]
    write_deltalake(str(table), pa.Table.from_pylist(rows[:8]))
    write_deltalake(str(table), pa.Table.from_pylist(rows[8:]), mode="append")
    write_deltalake(str(table), pa.Table.from_pylist(rows[:2]), mode="append")  # version 2: not read
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = data_recipe(tmp_path, data__source="delta", data__path=table, data__revision=1,
                         data__filter='[["n", "<", 10]]', tracking__tracking_uri=uri, tracking__log_system_metrics="false")
    summary = data_summary(recipe, prepare_blocks(recipe, tokenizer("qwen")))
    tracker = start_tracking(recipe, run_dir=tmp_path / "run")
    announce_data(recipe, summary, SimpleNamespace(packed={}), say=lambda line: None, tracker=tracker)
    tracker.finish()

    (source,) = data_sources(recipe, summary, SimpleNamespace(packed={}))
    assert (source.kind, source.path, source.revision, source.rows_read, source.rows_kept) == \
        ("delta", str(table), "1", 10, 10)
    client = MlflowClient(uri)
    run = client.get_run(tracker.info["run_id"])
    (logged,) = run.inputs.dataset_inputs
    assert (logged.dataset.name, logged.dataset.digest, logged.dataset.source_type) == (str(table), source.digest,
                                                                                       "delta_table")
    assert json.loads(logged.dataset.source) == {"path": str(table), "delta_table_version": 1}
    tags = {t.key: t.value for t in logged.tags}
    assert tags == {"mlflow.data.context": "training", "ftcli.split": "train", "ftcli.rows_read": "10",
                    "ftcli.rows_kept": "10", "ftcli.kind": "delta", "ftcli.revision": "1", "ftcli.filter": "n < 10"}
    assert run.data.tags["ftcli.recipe_digest"] == recipe_digest(recipe)

    record = RunRecord.model_validate_json(new_run_record(
        recipe, method="full", mlflow=tracker.info, recipe_digest=recipe_digest(recipe),
        data_sources=[source]).model_dump_json())  # as run.json holds it
    client.create_registered_model("tiny")
    (tmp_path / "model").mkdir()
    version = client.create_model_version("tiny", source=str(tmp_path / "model"), run_id=run.info.run_id,
                                          tags=registry.lineage_tags(record))
    got = client.get_model_version("tiny", version.version).tags
    assert got["ftcli.data.training.0"] == (f"delta {table}@1 where n < 10 (train) rows 10 read, 10 kept, digest "
                                            f"{source.digest}")
    assert got["ftcli.data.training.count"] == "1" and got["ftcli.recipe_digest"] == recipe_digest(recipe)
    assert got["ftcli.recipe"] == "tiny-qwen-cpu" and got["ftcli.method"] == "full"
    assert got["ftcli.base"] == f"random init from {recipe.model.config}"
