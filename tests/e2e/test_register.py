"""`ftcli register` against a real local MLflow (a sqlite store and a `mlflow server` started here),
on tiny random models: what is registered loads back by alias, generates, and has exactly the
weights that training wrote. Unity Catalog rules are checked without Databricks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
import torch
from safetensors.torch import load_file

from ftcli import __version__
from ftcli.config.errors import UserError
from ftcli.config.recipe import load_recipe, resolve_path
from ftcli.artifacts.mlflow_model import check_remote_code
from ftcli.config.redact import scrub_recipe
from ftcli.artifacts.tracking import check_reachable, flatten
from ftcli.artifacts import mlflow_model
from ftcli.artifacts import registry
from ftcli.commands import register as reg


HUB_BASE = "openai/gpt-oss-20b"
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"
SECRET_VALUE = "s3cr3t-value-never-logged"
CHAT = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}
RECIPE_DIGEST = "0123456789abcdef"
DATA_SOURCES = [  # run.json's lineage, as ftcli.train.session.data_sources writes it
    {"label": "main.sft.chats", "context": "training", "kind": "delta", "path": "main.sft.chats", "revision": "12",
     "split": "train", "digest": "aaaabbbbccccdddd", "rows_read": 40, "rows_kept": 39},
    {"label": "pkg://assets/tiny_chat.jsonl", "context": "eval", "kind": "local", "path": "pkg://assets/tiny_chat.jsonl",
     "revision": None, "split": "validation", "digest": "eeeeffff00001111", "rows_read": 8, "rows_kept": 8},
]

PARENT_RUN = {  # run.json's parent_run: the SFT run a DPO run started from (ftcli.artifacts.resolve.parent_run_of)
    "run_dir": "/runs/tiny-sft", "model_dir": "final", "recipe": "tiny-qwen-cpu", "recipe_digest": "fedcba9876543210",
    "method": "full", "objective": "sft", "mlflow_run_id": "0a1b2c3d4e5f", "mlflow_experiment_id": "7"}

# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _isolated_mlflow_uris(monkeypatch):
    """Tests point MLflow at their own stores; nothing carries over to the next test."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    yield
    if "mlflow" in sys.modules and sys.modules["mlflow"] is not None:
        sys.modules["mlflow"].set_tracking_uri(None)
        sys.modules["mlflow"].set_registry_uri(None)


def _save_tokenizer(path: Path, asset: str) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(resolve_path(f"pkg://assets/{asset}")).save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_full_final(tmp_path_factory) -> Path:
    """What the full-SFT trainer leaves in <run>/final: an HF checkpoint + tokenizer + template."""
    from ftcli.model.build import load_model

    out = tmp_path_factory.mktemp("full") / "final"
    torch.manual_seed(0)
    load_model(load_recipe("tiny-qwen-cpu").model).save_pretrained(out)
    _save_tokenizer(out, "tokenizer-qwen")
    return out


@pytest.fixture(scope="session")
def tiny_lora_files(tmp_path_factory) -> Path:
    """What the LoRA trainer leaves: <run>/base (the random-init base) and <run>/final (adapter)."""
    from peft import LoraConfig, get_peft_model

    from ftcli.model.build import load_model

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = load_model(load_recipe("tiny-gpt-oss-cpu").model)
    base.save_pretrained(root / "base")
    _save_tokenizer(root / "base", "tokenizer-gpt-oss")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(root / "final")  # non-zero B: merging changes weights
    _save_tokenizer(root / "final", "tokenizer-gpt-oss")
    return root


def _recipe_with_secrets(name: str) -> dict:
    recipe = load_recipe(name).to_dict()
    recipe["compute"]["env_variables"] = {"HF_HOME": SECRET_VALUE}
    recipe["compute"]["secrets"] = {"HF_TOKEN": f"scope/{SECRET_VALUE}"}
    return recipe


def _training_run(tracking_uri: str, recipe: dict) -> dict:
    """A finished training run with params and a loss curve, as the trainers log it."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(recipe["name"])
    exp_id = exp.experiment_id if exp else client.create_experiment(recipe["name"])
    run = client.create_run(exp_id, run_name="train")
    params = flatten(scrub_recipe(recipe))
    metrics = [Metric("loss", 5.0 - step, 0, step) for step in range(3)]
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
    client.set_terminated(run.info.run_id)
    return {"tracking_uri": tracking_uri, "experiment_id": exp_id, "run_id": run.info.run_id}


def _write_run_json(run_dir: Path, method: str, recipe: dict, mlflow_info: dict | None, base_model: dict) -> None:
    run = {
        "ftcli_version": "0.1.0", "method": method, "recipe": recipe, "model_dir": "final",
        "base_model": base_model, "mlflow": mlflow_info, "steps": 3, "tokens": {"trained": 300, "seen": 900},
        "final_loss": 2.5, "throughput": {"tokens_per_s": 1000.0, "s_per_step": 0.3}, "status": "completed",
        "recipe_digest": RECIPE_DIGEST, "data_sources": DATA_SOURCES, "parent_run": PARENT_RUN,
    }
    (run_dir / "run.json").write_text(json.dumps(run))


def make_full_run(tmp_path: Path, final: Path, tracking_uri: str | None) -> Path:
    run_dir = tmp_path / "full-run"
    shutil.copytree(final, run_dir / "final")
    recipe = _recipe_with_secrets("tiny-qwen-cpu")
    info = _training_run(tracking_uri, recipe) if tracking_uri else None
    base = {"id": None, "revision": None, "init": "random", "model_type": "qwen3_5_text", "model_class": "causal_lm"}
    _write_run_json(run_dir, "full", recipe, info, base)
    return run_dir


def make_lora_run(tmp_path: Path, files: Path, tracking_uri: str | None, hub_base: bool = False) -> Path:
    run_dir = tmp_path / "lora-run"
    shutil.copytree(files / "final", run_dir / "final")
    recipe = _recipe_with_secrets("tiny-gpt-oss-cpu")
    info = _training_run(tracking_uri, recipe) if tracking_uri else None
    if hub_base:
        base = {"id": HUB_BASE, "revision": HUB_REVISION, "init": "pretrained", "model_type": "gpt_oss",
                "model_class": "causal_lm"}
    else:
        shutil.copytree(files / "base", run_dir / "base")
        base = {"id": None, "revision": None, "init": "random", "model_type": "gpt_oss", "model_class": "causal_lm",
                "path": "base"}
    _write_run_json(run_dir, "lora", recipe, info, base)
    return run_dir


@pytest.fixture
def sqlite_uri(tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)  # the store's default artifact root (./mlruns) lands in tmp_path
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on loopback, killed (whole process group) at teardown."""
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--default-artifact-root", str(tmp_path / "server-artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no job runner, no huey consumers
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not come up: {(tmp_path / 'server.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield uri
    finally:
        os.killpg(proc.pid, 9)  # a throwaway store: no graceful stop needed (SIGTERM took ~13 s to end the server)
        proc.wait(timeout=20)
        log.close()


def _safetensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_chat_completion(response) -> None:
    response = response[0] if isinstance(response, list) else response
    assert response["object"] == "chat.completion"
    message = response["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert 1 <= response["usage"]["completion_tokens"] <= CHAT["max_tokens"]


# --------------------------------------------------------------------- end to end, real MLflow
def test_full_run_on_server_loads_back_by_alias_with_identical_weights(tmp_path, tiny_full_final, mlflow_server):
    import mlflow
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from ftcli.cli import app

    run_dir = make_full_run(tmp_path, tiny_full_final, mlflow_server)
    training = json.loads((run_dir / "run.json").read_text())["mlflow"]
    client = MlflowClient(mlflow_server)
    before = client.get_run(training["run_id"]).info

    # a password in the tracking URI (--tracking-uri; the server ignores it): never printed, MLflow's own
    # `View run ... at: <url>` line included (#47)
    with_password = mlflow_server.replace("http://", f"http://u:{SECRET_VALUE}@")
    result = CliRunner().invoke(app, ["register", str(run_dir), "--name", "tiny-qwen", "--alias", "champion", "--json",
                                      "--tracking-uri", with_password])
    assert result.exit_code == 0, result.output
    assert SECRET_VALUE not in result.output + result.stderr
    assert f"View run train at: http://***@{mlflow_server[len('http://'):]}/#/experiments/" in result.stderr
    # logged through the training run, which keeps its own status and end time; no fluent state is left
    after = client.get_run(training["run_id"]).info
    assert (after.status, after.end_time) == (before.status, before.end_time) == ("FINISHED", before.end_time)
    assert mlflow.active_run() is None and "MLFLOW_TRACKING_URI" not in os.environ
    out = json.loads(result.stdout)  # stdout holds the JSON and nothing else
    assert (out["name"], out["version"], out["alias"], out["mode"]) == ("tiny-qwen", "1", "champion", "full")
    assert out["alias_uri"] == "models:/tiny-qwen@champion" and out["model_uri"] == "models:/tiny-qwen/1"
    assert out["run_id"] == training["run_id"] and out["attached_to_training_run"]

    version = client.get_model_version_by_alias("tiny-qwen", "champion")
    assert version.version == "1" and version.run_id == training["run_id"]
    logged = client.search_logged_models(experiment_ids=[training["experiment_id"]])  # the run's, not "0"
    assert [m.source_run_id for m in logged] == [training["run_id"]]
    assert version.tags["ftcli.mode"] == "full" and version.tags["ftcli.version"] == __version__
    run = client.get_run(training["run_id"])  # params, metrics and the model on one run
    assert run.data.params["training.method"] == "full" and run.data.metrics["loss"] == 3.0
    assert run.data.tags["ftcli.registered_model"] == "tiny-qwen/1"

    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_registry_uri(mlflow_server)
    components = mlflow.transformers.load_model("models:/tiny-qwen@champion", return_type="components")
    loaded = components["model"].state_dict()
    trained = _safetensors(run_dir / "final")
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)

    check_reachable(mlflow_server.replace("http://", f"http://u:{SECRET_VALUE}@"), fix="")  # user-info is not the host

    chat = mlflow.pyfunc.load_model("models:/tiny-qwen@champion")
    assert chat.metadata.get_input_schema() is not None and chat.metadata.get_output_schema() is not None
    _assert_chat_completion(chat.predict(CHAT))


def test_lora_run_registers_merged_weights_by_default(tmp_path, tiny_lora_files, sqlite_uri, monkeypatch):
    """Merged by ftcli.artifacts.merge.merge_lora into <run>/merged. No training run in MLflow (tracking was
    off): a new run gets the scrubbed recipe and run.json's summary metrics."""
    import mlflow
    from mlflow import MlflowClient
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SOME_TOKEN", SECRET_VALUE)
    run_dir = make_lora_run(tmp_path, tiny_lora_files, tracking_uri=None)
    result = reg.run_register(run_dir, name="tiny-oss", alias="champion", tracking_uri=sqlite_uri)
    assert (result.mode, result.version, result.attached_to_training_run) == ("merged", "1", False)

    mlflow.set_tracking_uri(sqlite_uri)
    mlflow.set_registry_uri(sqlite_uri)
    model = mlflow.transformers.load_model("models:/tiny-oss@champion", return_type="components")["model"]
    merged_files = _safetensors(run_dir / "merged")
    loaded = model.state_dict()
    assert merged_files.keys() == loaded.keys()
    assert all(torch.equal(merged_files[k], loaded[k]) for k in merged_files)

    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(run_dir / "base", dtype=torch.float32), str(run_dir / "final")
    )
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, peft(ids).logits, rtol=1e-4, atol=1e-4)
    _assert_chat_completion(mlflow.pyfunc.load_model("models:/tiny-oss@champion").predict(CHAT))

    client = MlflowClient(sqlite_uri, registry_uri=sqlite_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and client.get_experiment(run.info.experiment_id).name == "tiny-gpt-oss-cpu"
    assert [m.source_run_id for m in client.search_logged_models(experiment_ids=[run.info.experiment_id])] == [run.info.run_id]
    logged = json.dumps({**run.data.params, **run.data.tags})
    assert SECRET_VALUE not in logged
    assert run.data.params["compute.env_variables.HF_HOME"] == "***"
    assert run.data.params["compute.secrets.HF_TOKEN"] == "***"
    assert run.data.metrics["final_loss"] == 2.5


def test_qwen3_moe_expert_lora_registers_merged_with_the_adapters_logits(tmp_path, sqlite_uri):
    """A Qwen3-MoE adapter with LoRA on the 3-D experts (tiny-qwen3-moe-cpu's lora section, through ftcli's own
    LoraConfig) over a saved base (per-expert linears, as the hub stores them): register merges it (merge-lora's
    fold), registers the merged model under the alias, and the merged weights give the adapter's logits, experts
    included."""
    from mlflow import MlflowClient
    from peft import PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcli.train.lora.config import lora_config

    recipe = load_recipe("tiny-qwen3-moe-cpu")
    cfg = json.loads(Path(resolve_path("pkg://assets/tiny-qwen3-moe.json")).read_text())
    run_dir = tmp_path / "moe-run"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    base.save_pretrained(run_dir / "base")
    _save_tokenizer(run_dir / "base", "tokenizer-qwen3")
    lora = lora_config(recipe.lora, recipe.model, base)
    lora.init_lora_weights = False  # non-zero B everywhere: the merge must move the experts too
    get_peft_model(base, lora).save_pretrained(run_dir / "final")
    _save_tokenizer(run_dir / "final", "tokenizer-qwen3")
    _write_run_json(run_dir, "lora", recipe.to_dict(), None,
                    {"id": None, "revision": None, "init": "random", "model_type": "qwen3_moe",
                     "model_class": "causal_lm", "path": "base"})

    result = reg.run_register(run_dir, name="tiny-moe", alias="champion", tracking_uri=sqlite_uri)
    assert (result.mode, result.version) == ("merged", "1")
    client = MlflowClient(sqlite_uri, registry_uri=sqlite_uri)
    assert client.get_model_version_by_alias("tiny-moe", "champion").run_id == result.run_id
    # (loading back by alias is test_lora_run_registers_merged_weights_by_default's; here: what was merged)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "merged", dtype=torch.float32)
    merged, base_files = _safetensors(run_dir / "merged"), _safetensors(run_dir / "base")
    assert merged.keys() == base_files.keys() and "model.layers.0.mlp.experts.3.up_proj.weight" in merged
    expert = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert (merged[expert] - base_files[expert]).abs().max() > 1e-3  # the expert LoRA was folded in
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run_dir / "base", dtype=torch.float32),
                                     str(run_dir / "final")).eval()
    ids = torch.arange(3, 43)[None]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, peft(ids).logits, rtol=1e-4, atol=1e-4)


def test_adapter_only_local_base_loads_back_with_identical_logits(tmp_path, tiny_lora_files, sqlite_uri):
    import mlflow
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = make_lora_run(tmp_path, tiny_lora_files, tracking_uri=sqlite_uri)
    result = reg.run_register(run_dir, name="tiny-oss-adapter", adapter_only=True, alias="dev")
    assert result.mode == "adapter" and result.attached_to_training_run  # tracking URI taken from run.json

    mlflow.set_tracking_uri(sqlite_uri)
    mlflow.set_registry_uri(sqlite_uri)
    local = Path(mlflow.artifacts.download_artifacts("models:/tiny-oss-adapter@dev"))
    assert not (local / "model").exists()  # the base is referenced, not copied
    logged, trained = _safetensors(local / "peft"), _safetensors(run_dir / "final")
    assert logged.keys() == trained.keys() and all(torch.equal(logged[k], trained[k]) for k in trained)

    loaded = mlflow.transformers.load_model("models:/tiny-oss-adapter@dev", return_type="components")["model"]
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(run_dir / "base", dtype=torch.float32), str(run_dir / "final")
    )
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, peft(ids).logits)


def test_adapter_over_hub_base_references_the_pinned_revision(tmp_path, tiny_lora_files, sqlite_uri, monkeypatch):
    """The base is never loaded or saved: MLflow records repo id + the revision run.json pinned."""
    import mlflow
    import transformers
    from mlflow.models import Model

    tiny_config = transformers.AutoConfig.from_pretrained(tiny_lora_files / "base")
    real = transformers.AutoConfig.from_pretrained

    def from_pretrained(ref, *args, **kwargs):
        if ref == HUB_BASE:
            assert kwargs.get("revision") == HUB_REVISION
            return tiny_config
        return real(ref, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setenv("MLFLOW_RUN_ID", "the-job-run")  # AI Runtime sets it; MLflow's end_run clears it
    run_dir = make_lora_run(tmp_path, tiny_lora_files, tracking_uri=sqlite_uri, hub_base=True)
    result = reg.run_register(run_dir, name="oss-hub-adapter")
    assert result.mode == "adapter" and result.base_model == f"{HUB_BASE}@{HUB_REVISION}"
    assert result.attached_to_training_run and os.environ["MLFLOW_RUN_ID"] == "the-job-run"

    mlflow.set_tracking_uri(sqlite_uri)
    local = Path(mlflow.artifacts.download_artifacts(f"models:/oss-hub-adapter/{result.version}"))
    flavor = Model.load(local).flavors["transformers"]
    assert flavor["source_model_name"] == HUB_BASE and flavor["source_model_revision"] == HUB_REVISION
    assert "model_binary" not in flavor and not (local / "model").exists()
    assert (flavor["tokenizer_name"], flavor["tokenizer_revision"]) == (HUB_BASE, HUB_REVISION)
    logged, trained = _safetensors(local / "peft"), _safetensors(run_dir / "final")
    assert logged.keys() == trained.keys() and all(torch.equal(logged[k], trained[k]) for k in trained)


def test_alias_is_moved_only_with_force(tmp_path, tiny_full_final, sqlite_uri):
    from mlflow import MlflowClient

    run_dir = make_full_run(tmp_path, tiny_full_final, sqlite_uri)
    first = reg.run_register(run_dir, name="q", alias="champion")
    assert first.version == "1"
    with pytest.raises(UserError, match=r"alias 'champion' of q already points at version 1; pass --force") as err:
        reg.run_register(run_dir, name="q", alias="champion")
    assert "\n" not in str(err.value)
    client = MlflowClient(sqlite_uri, registry_uri=sqlite_uri)
    assert [str(v.version) for v in client.search_model_versions("name='q'")] == ["1"]  # refused before upload

    moved = reg.run_register(run_dir, name="q", alias="champion", force=True)
    assert (moved.version, moved.previous_alias_version) == ("2", "1")
    version = client.get_model_version_by_alias("q", "champion")
    assert str(version.version) == "2"
    # lineage on the version: which data, which recipe, which base (run.json's data_sources and recipe digest)
    lineage = {k: v for k, v in version.tags.items() if k.startswith(("ftcli.data", "ftcli.recipe", "ftcli.base"))}
    assert lineage == {
        "ftcli.data.training.0": "delta main.sft.chats@12 (train) rows 40 read, 39 kept, digest aaaabbbbccccdddd",
        "ftcli.data.eval.0": "local pkg://assets/tiny_chat.jsonl (validation) rows 8 read, 8 kept, digest eeeeffff00001111",
        "ftcli.data.training.count": "1", "ftcli.data.eval.count": "1",
        "ftcli.recipe": "tiny-qwen-cpu", "ftcli.recipe_digest": RECIPE_DIGEST, "ftcli.base": "random init (qwen3_5_text)",
    }
    # the run it started from (a DPO run's SFT run): run dir, model, recipe and digest, MLflow run
    assert {k: v for k, v in version.tags.items() if k.startswith("ftcli.parent.")} == {
        "ftcli.parent.run_dir": "/runs/tiny-sft", "ftcli.parent.model_dir": "final",
        "ftcli.parent.recipe": "tiny-qwen-cpu", "ftcli.parent.recipe_digest": "fedcba9876543210",
        "ftcli.parent.objective": "sft", "ftcli.parent.run_id": "0a1b2c3d4e5f", "ftcli.parent.experiment_id": "7"}


# ------------------------------------------------------------------------------ errors, no MLflow
def test_a_store_that_fills_up_while_logging_is_one_line_and_no_mlflow_log(tmp_path, tiny_full_final, sqlite_uri,
                                                                          monkeypatch, capfd):
    """The model's copy into the store fails as on a full disk: MLflow logs the exception with its traceback at each
    layer (1,173 lines on a real full tmpfs) and raises an MlflowException whose first line is SQLAlchemy's wrapper
    text. Register prints none of MLflow's records and one line saying the store is full, removes the model's
    partial files and the model, and ends its run FAILED (each only where the store still takes it)."""
    import logging

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    full = ("(raised as a result of Query-invoked autoflush; consider using a session.no_autoflush block if this "
            "flush is occurring prematurely)\n(sqlite3.OperationalError) database or disk is full\n"
            "[SQL: UPDATE runs SET status=? WHERE runs.run_uuid = ?]\n(Background on this error at: https://sqlalche.me)")

    partial = []

    def log_chat_model(model_dir, *, run, **kwargs):  # MLflow began the model and copied part of its files
        client = MlflowClient(tracking_uri=sqlite_uri)
        model = client.create_logged_model(run.info.experiment_id, name="model", source_run_id=run.info.run_id)
        files = Path(model.artifact_location.removeprefix("file://"))
        (files / "model").mkdir(parents=True)
        (files / "model" / "model.safetensors").write_bytes(b"\0" * 1024)
        partial.append((model.model_id, files))
        try:
            raise OSError(28, "No space left on device", str(files / "model" / "model.safetensors"))
        except OSError:
            for name in ("mlflow.store.db.utils", "mlflow.tracking.fluent", "alembic.runtime", "sqlalchemy.engine"):
                logging.getLogger(name).exception("SQLAlchemy database error. The following exception is caught.")
        raise MlflowException(full)

    monkeypatch.setattr(mlflow_model, "log_chat_model", log_chat_model)
    with pytest.raises(UserError) as err:
        reg.run_register(run_dir, name="q", tracking_uri=sqlite_uri)
    assert str(err.value) == ("MLflow: (sqlite3.OperationalError) database or disk is full (free space for the store "
                              f"{sqlite_uri} and its artifacts, then register again)")
    out = capfd.readouterr()
    assert "Traceback" not in out.err and "SQLAlchemy database error" not in out.err and " INFO " not in out.err
    assert logging.getLogger("mlflow").level != logging.CRITICAL + 1  # the loggers' levels are given back
    (run,) = MlflowClient(tracking_uri=sqlite_uri).search_runs(
        [e.experiment_id for e in MlflowClient(tracking_uri=sqlite_uri).search_experiments()])
    assert run.info.status == "FAILED"
    (model_id, files), = partial
    assert not files.exists() and not files.parent.exists()  # the space the partial copy took is given back
    assert MlflowClient(tracking_uri=sqlite_uri).search_logged_models([run.info.experiment_id]) == []


def test_unreachable_server_fails_fast_in_one_line_with_the_uri(tmp_path, tiny_full_final):
    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    uri = f"http://127.0.0.1:{_free_port()}"
    start = time.time()
    with pytest.raises(UserError) as err:
        reg.run_register(run_dir, name="q", tracking_uri=uri)
    assert time.time() - start < 15
    assert str(err.value) == f"cannot reach the MLflow tracking server at {uri} (connection refused); start it or pass --tracking-uri"


def test_unreachable_registry_fails_fast_with_the_masked_uri(tmp_path, tiny_full_final, sqlite_uri):
    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    port = _free_port()
    start = time.time()
    with pytest.raises(UserError) as err:
        reg.run_register(run_dir, name="q", tracking_uri=sqlite_uri, registry_uri=f"http://u:{SECRET_VALUE}@127.0.0.1:{port}")
    assert time.time() - start < 15
    assert str(err.value) == (f"cannot reach the model registry at http://***@127.0.0.1:{port} (connection refused); "
                              "check --registry-uri and your credentials")


def test_missing_run_json_and_model_files_are_one_line_errors(tmp_path, tiny_full_final):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"holds no model: expected run.json \(a run dir\), config.json \(a model dir\)"):
        reg.resolve_source(empty)
    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    shutil.rmtree(run_dir / "final")
    with pytest.raises(UserError, match=r"no model in this run \(.*final does not exist; a full run exports final/ only with"):
        reg.resolve_source(run_dir)
    (run_dir / "final").mkdir()
    (run_dir / "final" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"missing model weights .*tokenizer"):
        reg.resolve_source(run_dir)
    with pytest.raises(UserError, match="does not exist"):
        reg.resolve_source(tmp_path / "nope")
    run = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**run, "model_dir": None}))
    with pytest.raises(UserError, match=r"no model in this run \(run.json names no model_dir; .*save_final_hf"):
        reg.resolve_source(run_dir)


def test_register_uploads_only_model_files_and_lists_the_rest(tmp_path, tiny_full_final, sqlite_uri, capsys):
    """A key, a notes dir and a link planted in final/ stay here: the logged model dir holds exactly
    the checkpoint's files."""
    import mlflow

    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    model_files = sorted(p.name for p in (run_dir / "final").iterdir())
    (run_dir / "final" / "id_rsa").write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----{SECRET_VALUE}")
    (run_dir / "final" / "notes").mkdir()
    (run_dir / "final" / "notes" / "todo.txt").write_text(SECRET_VALUE)
    (tmp_path / "outside.txt").write_text(SECRET_VALUE)
    (run_dir / "final" / "link.txt").symlink_to(tmp_path / "outside.txt")
    result = reg.run_register(run_dir, name="q", tracking_uri=sqlite_uri)
    assert f"not uploaded from {run_dir / 'final'} (not model files): id_rsa, link.txt, notes/\n" in capsys.readouterr().err
    mlflow.set_tracking_uri(sqlite_uri)
    mlflow.set_registry_uri(sqlite_uri)
    local = Path(mlflow.artifacts.download_artifacts(result.model_uri))
    assert sorted(p.name for p in (local / "model").iterdir()) == model_files
    assert model_files == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                           "tokenizer.json", "tokenizer_config.json"]
    logged = [p for p in local.rglob("*") if p.is_file()]
    assert not [p for p in logged if p.name in ("id_rsa", "todo.txt", "link.txt")]
    assert not [p for p in logged if SECRET_VALUE.encode() in p.read_bytes()]


def test_select_model_files_keeps_the_allow_list_and_names_the_rest(tmp_path):
    (tmp_path / "additional_chat_templates").mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "merge.json",
                 "tokenizer.json", "chat_template.jinja", "additional_chat_templates/tool.jinja", "id_rsa",
                 "modeling_custom.py", "additional_chat_templates/x.sh", ".env"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    files = mlflow_model.select_model_files(tmp_path, tmp_path)
    assert files.keep == ["additional_chat_templates/tool.jinja", "chat_template.jinja", "config.json", "merge.json",
                          "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    assert files.skipped == [".env", "additional_chat_templates/x.sh", "checkpoints/", "id_rsa", "modeling_custom.py"]
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_custom.MyLM"}}))
    assert "modeling_custom.py" in mlflow_model.select_model_files(tmp_path, tmp_path).keep  # custom code: needed


def test_a_hard_linked_model_file_is_not_uploaded(tmp_path):
    """A file of final/ with another hard link (to a file anywhere on the filesystem) is one line before any
    upload: what leaves the machine is what the run dir owns (#47)."""
    (tmp_path / "config.json").write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET_VALUE)
    os.link(secret, tmp_path / "tokenizer.json")
    with pytest.raises(UserError) as err:
        mlflow_model.select_model_files(tmp_path, tmp_path)
    assert str(err.value) == (f"{tmp_path / 'tokenizer.json'} has 1 other hard link(s); ftcli does not write, delete "
                              "or upload a file shared with another path in what register uploads: replace it with a "
                              "copy (cp, not ln)")


def test_model_dir_or_model_file_resolving_outside_the_run_dir_is_refused(tmp_path, tiny_full_final):
    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run_dir / "final", elsewhere)
    (elsewhere / "id_rsa").write_text(SECRET_VALUE)
    run = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**run, "model_dir": "../elsewhere"}))
    with pytest.raises(UserError, match=r"outside the run dir .*model_dir='../elsewhere'"):
        reg.resolve_source(run_dir)
    (run_dir / "run.json").write_text(json.dumps({**run, "model_dir": str(elsewhere)}))
    with pytest.raises(UserError, match=r"outside the run dir"):
        reg.resolve_source(run_dir)
    (run_dir / "run.json").write_text(json.dumps(run))
    shutil.rmtree(run_dir / "final")
    (run_dir / "final").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError, match=r"final resolves to .*elsewhere, outside the run dir"):
        reg.resolve_source(run_dir)
    (run_dir / "final").unlink()
    shutil.copytree(elsewhere, run_dir / "final")
    (run_dir / "final" / "model.safetensors").unlink()
    (run_dir / "final" / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    with pytest.raises(UserError, match=r"model.safetensors links outside .* \(to .*elsewhere/model.safetensors\)") as err:
        reg.resolve_source(run_dir)
    assert "\n" not in str(err.value)


def test_checkpoint_needing_remote_code_is_refused_unless_recipe_trusts_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MyCustomLM"], "auto_map": {"x": "y"}}))
    with pytest.raises(UserError, match="trust_remote_code: true"):
        check_remote_code(tmp_path, trust_remote_code=False)
    check_remote_code(tmp_path, trust_remote_code=True)


# ------------------------------------------------------------------------------- Unity Catalog
@pytest.mark.parametrize(
    "name, expected",
    [("main.default.my_model", "main.default.my_model"), ("Main.ML.Tiny-Qwen", "main.ml.tiny-qwen")],
)
def test_uc_names_are_three_valid_parts_lowercased(name, expected):
    assert registry.validate_uc_name(name) == expected


@pytest.mark.parametrize(
    "name, problem",
    [("my_model", "three parts"), ("main.my_model", "three parts"), ("a.b.c.d", "three parts"),
     ("main..m", "schema part is empty"), ("main.default.my model", "contains ' '"),
     ("main.default.m\x07", "contains"), ("main.default." + "m" * 256, "longer than 255")],
)
def test_uc_bad_names_are_refused(name, problem):
    with pytest.raises(UserError, match=problem) as err:
        registry.validate_model_name(name, "databricks-uc")
    assert "\n" not in str(err.value)


def test_uc_signature_needs_inputs_and_outputs():
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    inputs = Schema([ColSpec("string", "prompt")])
    with pytest.raises(UserError, match="inputs and outputs"):
        registry.require_uc_signature(None)
    with pytest.raises(UserError, match="outputs"):
        registry.require_uc_signature(ModelSignature(inputs=inputs))
    registry.require_uc_signature(ModelSignature(inputs=inputs, outputs=Schema([ColSpec("string", "text")])))


def test_uc_bad_name_fails_before_any_mlflow_call(tmp_path, tiny_full_final, monkeypatch):
    from typer.testing import CliRunner

    from ftcli.cli import app

    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    for module in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # any `import mlflow` now raises
    result = CliRunner().invoke(
        app, ["register", str(run_dir), "--name", "my_model", "--registry-uri", "databricks-uc"]
    )
    assert result.exit_code == 2 and result.stdout == ""
    assert "catalog.schema.model" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_uc_adapter_rules(tmp_path):
    adapter = lambda base: reg.Source(model_dir=tmp_path, kind="adapter", base=base)  # noqa: E731
    hub, local = reg.BaseRef(id=HUB_BASE, revision=HUB_REVISION), reg.BaseRef(path=tmp_path)
    choose = reg.choose_mode
    with pytest.raises(UserError, match="download the base weights.*--merged"):
        choose(adapter(hub), adapter_only=False, merged=False, uc=True)
    assert choose(adapter(hub), adapter_only=True, merged=False, uc=True) == "adapter"  # asked for it
    with pytest.raises(UserError, match="cannot reference the local base.*--merged"):
        choose(adapter(local), adapter_only=True, merged=False, uc=True)
    assert choose(adapter(local), adapter_only=False, merged=False, uc=False) == "merged"
    assert choose(adapter(hub), adapter_only=False, merged=False, uc=False) == "adapter"
    assert choose(adapter(hub), adapter_only=False, merged=True, uc=True) == "merged"
    with pytest.raises(UserError, match="needs a LoRA adapter"):
        choose(reg.Source(model_dir=tmp_path, kind="checkpoint"), adapter_only=True, merged=False, uc=False)


# ------------------------------------------------------------------ probe generation, input example
def _registry_versions(uri: str) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(uri, registry_uri=uri)
    return [f"{v.name}/{v.version}" for v in client.search_model_versions()]


def _set_recipe(run_dir: Path, **sections) -> None:
    run = json.loads((run_dir / "run.json").read_text())
    run["recipe"] = {**run["recipe"], **sections}
    (run_dir / "run.json").write_text(json.dumps(run))


def _logged_input_example(model_uri: str, tracking_uri: str):
    import mlflow
    from mlflow.models import Model

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    local = mlflow.artifacts.download_artifacts(model_uri)
    return Model.load(local).load_input_example(local)


def test_probe_reply_equals_sample_greedy(tmp_path, tiny_full_final, sqlite_uri):
    """The probe is sample_greedy on the logged weights, asked the recipe's first eval sample (the
    default prompt without one: test_probe_conversation_reads_eval_samples_defensively)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftcli.inference import sample_greedy

    samples = ["What is 9 plus 2?", "unused"]
    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    _set_recipe(run_dir, eval={"samples": samples})
    result = reg.run_register(run_dir, name="probed", tracking_uri=sqlite_uri)

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    [expected] = sample_greedy(model, tokenizer, [[{"role": "user", "content": samples[0]}]], reg.PROBE_MAX_NEW_TOKENS)
    assert expected and result.probe_reply == expected


def test_probe_conversation_reads_eval_samples_defensively():
    default = [{"role": "user", "content": reg.PROBE_PROMPT}]
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert reg.probe_conversation(None) == default
    assert reg.probe_conversation({"eval": None}) == default
    assert reg.probe_conversation({"eval": {"samples": []}}) == default
    assert reg.probe_conversation({"eval": {"samples": ["hi", "no"]}}) == [{"role": "user", "content": "hi"}]
    assert reg.probe_conversation({"eval": {"samples": [turns]}}) == turns


def _silent_model(src: Path, dst: Path) -> Path:
    """The tiny checkpoint with an all-zero lm_head (every logit 0, so greedy picks id 0) and id 0
    as the generation config's eos: every reply ends before its first token."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    model.save_pretrained(dst)
    GenerationConfig(eos_token_id=0).save_pretrained(dst)
    return dst


@pytest.mark.parametrize("broken", ["silent", "garbage_weights"])
def test_model_that_cannot_produce_a_token_is_refused_in_one_line_before_registering(
        tmp_path, tiny_full_final, sqlite_uri, broken):
    from typer.testing import CliRunner

    from ftcli.cli import app

    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    shutil.rmtree(run_dir / "final")
    if broken == "silent":
        _silent_model(tiny_full_final, run_dir / "final")
        expected = (f"error: probe generation on {run_dir / 'final'}: the model produced no token before its end "
                    f"of turn (prompt {reg.PROBE_PROMPT!r}); it would serve empty replies")
    else:
        shutil.copytree(tiny_full_final, run_dir / "final")
        for f in (run_dir / "final").glob("*.safetensors"):
            f.write_bytes(b"\x00" * 64)
        expected = (f"error: probe generation on {run_dir / 'final'} failed: model.id '{run_dir / 'final'}': cannot load "
                    "weights: model.safetensors is not what its header says (")

    result = CliRunner().invoke(app, ["register", str(run_dir), "--name", "silent", "--tracking-uri", sqlite_uri])
    assert result.exit_code == 2 and result.stdout == ""
    # one error line, no traceback (the rest of stderr is MLflow's store log and transformers' load bar)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(expected), result.stderr
    assert "Traceback" not in result.stderr
    assert _registry_versions(sqlite_uri) == []  # nothing registered, no model logged
    from mlflow import MlflowClient

    assert MlflowClient(sqlite_uri).search_runs([e.experiment_id for e in MlflowClient(sqlite_uri).search_experiments()]) == []


def test_input_example_is_the_first_data_row_with_a_user_turn(tmp_path, tiny_full_final, sqlite_uri):
    """Rows without a user turn (or unparsable) are passed over; the request keeps the turns before
    the first assistant reply."""
    rows = [
        "not json",
        json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}),
        json.dumps({"messages": [
            {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "11"},
        ]}),
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(rows) + "\n")
    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    recipe = json.loads((run_dir / "run.json").read_text())["recipe"]
    _set_recipe(run_dir, data={**recipe["data"], "path": str(data)})

    result = reg.run_register(run_dir, name="example", tracking_uri=sqlite_uri)
    assert _logged_input_example(result.model_uri, sqlite_uri) == {"messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."},
    ]}


def test_input_example_of_the_shipped_data_on_an_adapter(tmp_path, tiny_lora_files, sqlite_uri):
    """The tiny recipe's own data (pkg://assets/tiny_chat.jsonl), logged with an adapter over a
    local base (probed as base + adapter)."""
    first = json.loads(Path(resolve_path("pkg://assets/tiny_chat.jsonl")).read_text().splitlines()[0])["messages"]
    assert [m["role"] for m in first[:2]] == ["user", "assistant"]
    run_dir = make_lora_run(tmp_path, tiny_lora_files, tracking_uri=None)
    result = reg.run_register(run_dir, name="oss-example", adapter_only=True, tracking_uri=sqlite_uri)
    assert result.probe_reply
    assert _logged_input_example(result.model_uri, sqlite_uri) == {"messages": first[:1]}


def test_unreadable_data_falls_back_to_a_fixed_example_with_a_warning(tmp_path, tiny_full_final, sqlite_uri, capsys):
    run_dir = make_full_run(tmp_path, tiny_full_final, tracking_uri=None)
    recipe = json.loads((run_dir / "run.json").read_text())["recipe"]
    _set_recipe(run_dir, data={**recipe["data"], "path": str(tmp_path / "moved.jsonl")})
    result = reg.run_register(run_dir, name="fallback", tracking_uri=sqlite_uri)
    assert _logged_input_example(result.model_uri, sqlite_uri) == mlflow_model.FALLBACK_EXAMPLE
    err = " ".join(capsys.readouterr().err.split())
    assert (f"warning: input example: a fixed chat request, not one from the training data (cannot read "
            f"{tmp_path / 'moved.jsonl'} (data.path {str(tmp_path / 'moved.jsonl')!r} does not exist))") in err


def test_data_that_cannot_give_a_chat_request_says_why():
    import datasets

    assert mlflow_model.chat_request_from_data(None) == (None, "no training recipe to read the data from")
    assert mlflow_model.chat_request_from_data({"data": {"source": "synthetic"}}) == (None, "synthetic data has no chat turns")
    plain = {"data": {"source": "local", "path": "pkg://assets/tiny_chat.jsonl", "format": "prompt_completion"}}
    assert mlflow_model.chat_request_from_data(plain) == (
        None, f"no row with a user turn in the first {mlflow_model.EXAMPLE_SCAN_ROWS} rows of pkg://assets/tiny_chat.jsonl")
    if datasets.config.HF_HUB_OFFLINE:  # set before datasets was imported (this module's HF_HUB_OFFLINE)
        example, why = mlflow_model.chat_request_from_data({"data": {"source": "hub", "path": "nobody/no-such-dataset"}})
        assert example is None and why.startswith("cannot read nobody/no-such-dataset (no connection to the Hub "
                                                  "(HF_HUB_OFFLINE is set) and hub dataset 'nobody/no-such-dataset'")


def test_input_example_skips_rows_over_max_row_chars(tmp_path):
    huge = {"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "y"}]}
    small = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(huge) + "\n" + json.dumps(small) + "\n")
    data = {"source": "local", "path": str(path), "packing": {"block_len": 64}}  # default bound: 64 x 64
    assert mlflow_model.chat_request_from_data({"data": data}) == ({"messages": [small["messages"][0]]}, None)
    assert mlflow_model.chat_request_from_data({"data": {**data, "max_row_chars": 10_000}}) == (
        {"messages": [huge["messages"][0]]}, None)


def test_probe_skipped_with_a_warning_when_the_model_does_not_fit_here(tmp_path, monkeypatch, capsys):
    from ftcli import inference

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(inference, "load", out_of_memory)
    source = reg.Source(model_dir=tmp_path, kind="checkpoint")
    assert reg.probe_generation(tmp_path, None, source, [{"role": "user", "content": "hi"}]) is None
    assert " ".join(capsys.readouterr().err.split()) == (
        f"warning: no probe generation: {tmp_path} does not fit in memory here (OutOfMemoryError)")


def test_register_reaches_no_private_mlflow_state():
    """register, registry, mlflow_model and tracking use MLflow's public API only: no `mlflow...._name`
    attribute and no private import (they once saved and restored MLflow's private globals)."""
    import ast

    import ftcli

    found = []
    for module in ("commands/register", "artifacts/registry", "artifacts/mlflow_model", "artifacts/tracking"):
        path = Path(ftcli.__file__).parent / f"{module}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlflow"):
                found += [f"{module}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") or "._" in node.module]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id == "mlflow":
                    found.append(f"{module}: mlflow...{node.attr}")
    assert found == []


def test_mlflow_model_card_and_license_warnings_are_dropped_only_while_logging():
    """A local model has no Hub card or license to fetch: MLflow's two warnings about it are dropped on its own
    logger while register logs the model, and nothing else is."""
    import logging

    from ftcli.artifacts.mlflow_model import _quiet_card_lookup

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger, keep = logging.getLogger("mlflow.transformers"), Keep()
    logger.addHandler(keep)
    try:
        with _quiet_card_lookup():
            logger.warning("The model card could not be retrieved from the hub due to 404")
            logger.warning("Unable to find license information for this model. Please verify ...")
            logger.warning("something else")
        logger.warning("Unable to find license information after the block")
    finally:
        logger.removeHandler(keep)
    assert seen == ["something else", "Unable to find license information after the block"]


def test_an_alias_set_by_another_register_meanwhile_is_a_clash_not_a_silent_overwrite(tmp_path, sqlite_uri):
    """Two registers with --alias prod and no --force (#47): the one that finds the alias taken when it claims
    it (another set it while this one logged its model) says so in one line and leaves it; one whose claim is
    overwritten at the same moment (read back: another version) says that; --force moves it."""
    from mlflow import MlflowClient

    client = MlflowClient(sqlite_uri, registry_uri=sqlite_uri)
    client.create_registered_model("m")
    v1, v2, v3 = (str(client.create_model_version("m", source=str(tmp_path / f"v{i}")).version) for i in (1, 2, 3))
    client.set_registered_model_alias("m", "prod", v1)  # the other register's claim, after this one started
    with pytest.raises(UserError) as err:
        registry.claim_alias(client, "m", "prod", v2, expected=None, force=False)
    assert str(err.value) == ("alias 'prod' of m was set to version 1 by another register while this one ran; "
                              "version 2 is registered without the alias: pass --force to move it to 2")
    assert registry.alias_version(client, "m", "prod") == v1

    class Racing:  # another register sets the alias right after this one did
        def __getattr__(self, attr):
            return getattr(client, attr)

        def set_registered_model_alias(self, name, alias, version):
            client.set_registered_model_alias(name, alias, version)
            client.set_registered_model_alias(name, alias, v3)

    with pytest.raises(UserError) as err:
        registry.claim_alias(Racing(), "m", "prod", v2, expected=v1, force=False)
    assert str(err.value) == ("alias 'prod' of m points at version 3: another register set it at the same time; "
                              "version 2 is registered without the alias")
    registry.claim_alias(client, "m", "prod", v2, expected=v1, force=True)
    assert registry.alias_version(client, "m", "prod") == v2

