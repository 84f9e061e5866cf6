"""No secret value in any artifact: env variables whose names look secret are refused (they belong in
compute.secrets as scope/key), and a password in the tracking URI is masked in recipe.yaml, run.json,
tracking.json, what MLflow gets (params, artifacts) and what ftcli prints, while the workers still
authenticate with it."""

from __future__ import annotations

import base64
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from _run_common import subprocess_env, train_args

SECRET = "S3cr3t-never-written"


@pytest.mark.parametrize("name", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "DATABRICKS_TOKEN", "WANDB_API_KEY",
                                  "OPENAI_APIKEY", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "PGPASSWORD",
                                  "GOOGLE_APPLICATION_CREDENTIALS", "my_db_password", "GITHUB_PAT",
                                  # issue 32: *_AUTH, *PROXY*, *_CREDENTIALS, *_SECRET*, *_PASS*, *_KEY
                                  "REGISTRY_AUTH", "BASICAUTH", "HTTPS_PROXY", "http_proxy", "ALL_PROXY",
                                  "PROXY_URL", "DOCKER_CREDENTIALS", "CLIENT_SECRET_VALUE", "MY_SECRETS",
                                  "SMTP_PASS", "SMTP_PASSPHRASE", "SSH_KEY", "ENCRYPTION_KEY"])
def test_env_variable_that_looks_secret_is_refused_with_the_way_to_secrets(name):
    from ftcli.config.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError) as err:
        load_recipe("tiny-qwen-cpu", [f"compute.env_variables.{name}={SECRET}"])
    assert str(err.value) == (
        f"invalid recipe 'tiny-qwen-cpu': compute.env_variables: {name} looks like a secret; env_variables values are "
        f"written in clear, so set it in compute.secrets as {name}: <scope>/<key> (a Databricks secret)")
    assert SECRET not in str(err.value)


def test_ordinary_env_variables_are_accepted():
    from ftcli.config.recipe import load_recipe

    names = ["TOKENIZERS_PARALLELISM", "HF_HOME", "NCCL_DEBUG", "PYTORCH_CUDA_ALLOC_CONF", "KEYBOARD_LAYOUT", "PATH",
             "NO_PROXY", "no_proxy", "AUTHOR", "BYPASS_CACHE"]
    recipe = load_recipe("tiny-qwen-cpu", [f"compute.env_variables.{n}=x" for n in names])
    assert sorted(recipe.compute.env_variables) == sorted(names)


@pytest.mark.parametrize("value", [f"http://user:{SECRET}@proxy.example.com:3128",
                                   f"https://mlflow.example.com/?token={SECRET}",
                                   f"https://acct.blob.core.windows.net/c/x?sv=2024&sig={SECRET}"])
def test_env_variable_whose_value_holds_credentials_is_refused(value):
    from ftcli.config.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"compute.env_variables: UPSTREAM looks like a secret") as err:
        load_recipe("tiny-qwen-cpu", [f"compute.env_variables.UPSTREAM={value}"])
    assert SECRET not in str(err.value)


def test_masked_uri_stands_for_the_one_in_the_environment(monkeypatch):
    from ftcli.config.recipe import load_recipe
    from ftcli.artifacts.tracking import export_credentials, resolve_tracking_uri

    real = f"https://ftcli:{SECRET}@mlflow.example.com:5000/prefix"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri("https://***@mlflow.example.com:5000/prefix") == "https://mlflow.example.com:5000/prefix"
    export_credentials(load_recipe("tiny-qwen-cpu", [f"tracking.tracking_uri={real}"]).tracking)
    assert resolve_tracking_uri("https://***@mlflow.example.com:5000/prefix") == real
    assert resolve_tracking_uri("https://***@other.example.com") == "https://other.example.com"
    assert resolve_tracking_uri(None) == real and resolve_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"


# ------------------------------------------------------------------------------------ a whole run
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proxy(http.server.ThreadingHTTPServer):
    """Forwards every request to the MLflow server and records (method, path, Authorization)."""

    def __init__(self, upstream: str):
        self.upstream, self.seen = upstream, []
        super().__init__(("127.0.0.1", 0), _Forward)


class _Forward(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "authorization")}
        req = urllib.request.Request(self.server.upstream + self.path, data=body or None, headers=headers,
                                     method=self.command)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, reply, reply_headers = resp.status, resp.read(), resp.headers
        except urllib.error.HTTPError as e:
            status, reply, reply_headers = e.code, e.read(), e.headers
        self.send_response(status)
        for k, v in reply_headers.items():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward


def _server_env() -> dict[str, str]:
    """No job runner: MLflow's server would start one and a pool of huey consumers (6 more processes) that
    these tests never use, on the 2 cores the tests share."""
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (sqlite + served artifacts) behind a proxy that records the auth header."""
    store = tmp_path_factory.mktemp("mlflow-store")
    port = _free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
           "--artifacts-destination", str(store / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    server = subprocess.Popen(cmd, cwd=store, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, env=_server_env())
    proxy = _Proxy(f"http://127.0.0.1:{port}")
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        yield store, proxy
    finally:
        proxy.shutdown()
        os.killpg(server.pid, signal.SIGKILL)  # a throwaway store: no graceful stop (SIGTERM took seconds)
        server.wait(timeout=30)


def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and secret.encode() in p.read_bytes()]


def test_no_secret_in_any_file_of_the_run_or_the_mlflow_store(mlflow_server, tmp_path):
    """`ftcli train` with a password in tracking.tracking_uri: the workers log through it (every
    request to the server carries it), and no file ftcli writes in the run dir, nothing in MLflow's
    store (database, artifacts) and nothing printed holds it."""
    from mlflow import MlflowClient

    store, proxy = mlflow_server
    host = f"127.0.0.1:{proxy.server_address[1]}"
    uri = f"http://ftcli:{SECRET}@{host}"
    run_dir = tmp_path / "run"
    args = train_args(run_dir, f"tracking.tracking_uri={uri}", "tracking.log_system_metrics=false",
                      "training.max_steps=2", "training.log_every=1", "training.cpu_processes=1",
                      "compute.env_variables.NCCL_SOCKET_IFNAME=eth0", "compute.secrets.HF_TOKEN=my-scope/hf-key")
    res = subprocess.run([sys.executable, "-m", "ftcli", *args], cwd=tmp_path, env=subprocess_env(tmp_path / "cache"),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    assert sorted(p.name for p in run_dir.iterdir()) == [".ftcli-run", ".ftcli.lock", "checkpoints", "final",
                                                          "metrics.jsonl", "recipe.yaml", "run.json", "tracking.json"]
    assert _files_holding(run_dir, SECRET) == [] and _files_holding(store, SECRET) == []
    assert SECRET not in res.stdout + res.stderr
    masked = f"http://***@{host}"
    assert f"tracking_uri: {masked}" in (run_dir / "recipe.yaml").read_text()
    from ftcli.artifacts.rundir import read_run_record

    record = read_run_record(run_dir)
    assert record.mlflow.tracking_uri == masked and record.recipe["tracking"]["tracking_uri"] == masked

    auth = "Basic " + base64.b64encode(f"ftcli:{SECRET}".encode()).decode()
    calls = [(m, p, a) for m, p, a in proxy.seen if p != "/health"]  # ftcli's reachability probe needs none
    assert len(calls) >= 5 and {a for _, _, a in calls} == {auth}, calls[:5]
    assert any(m == "PUT" and "mlflow-artifacts" in p for m, p, _ in proxy.seen)  # artifacts went through it too
    client = MlflowClient(f"http://{host}")
    run = client.get_run(record.mlflow.run_id)
    assert run.data.params["tracking.tracking_uri"] == masked
    assert run.data.params["compute.env_variables.NCCL_SOCKET_IFNAME"] == "***"
    assert {"run.json", "recipe.yaml"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_render_workload_refuses_a_tracking_uri_with_credentials(tmp_path):
    """A workload file is shared and versioned: it must not hold a password in clear (the rendered
    parameters would carry the recipe's tracking URI as it is)."""
    from typer.testing import CliRunner

    from ftcli import cli

    out = tmp_path / "w.yaml"
    res = CliRunner().invoke(cli.app, ["render-workload", "--recipe", "tiny-qwen-cpu", "--no-fit-check", "-o", str(out),
                                       "--set", "tracking.tracking_uri=https://alice:hunter2@mlflow.example.com"])
    assert res.exit_code == 2
    assert "hunter2" not in res.output and not out.exists()
    assert res.output.strip().splitlines() == [
        "error: tracking.tracking_uri https://***@mlflow.example.com carries credentials, which the workload file "
        "would hold in clear; use the URI without them and put the password in compute.secrets "
        "(MLFLOW_TRACKING_PASSWORD: scope/key, and MLFLOW_TRACKING_USERNAME in compute.env_variables)"]


def test_render_workload_refuses_a_tracking_uri_with_a_token_parameter(tmp_path):
    from typer.testing import CliRunner

    from ftcli import cli

    out = tmp_path / "w.yaml"
    res = CliRunner().invoke(cli.app, ["render-workload", "--recipe", "tiny-qwen-cpu", "--no-fit-check", "-o", str(out),
                                       "--set", f"tracking.tracking_uri=https://mlflow.example.com/?x=1&token={SECRET}"])
    assert res.exit_code == 2
    assert SECRET not in res.output and not out.exists()
    assert res.output.strip().splitlines() == [
        "error: tracking.tracking_uri https://mlflow.example.com/?x=1&token=*** carries credentials, which the workload "
        "file would hold in clear; use the URI without them and put the token in compute.secrets "
        "(MLFLOW_TRACKING_TOKEN: scope/key)"]


def test_masked_token_uri_stands_for_the_one_in_the_environment(monkeypatch):
    from ftcli.config.recipe import load_recipe
    from ftcli.config.redact import mask_recipe_uris
    from ftcli.artifacts.tracking import export_credentials, resolve_tracking_uri

    real = f"https://mlflow.example.com/prefix?token={SECRET}&team=a"
    masked = "https://mlflow.example.com/prefix?token=***&team=a"
    recipe = load_recipe("tiny-qwen-cpu", [f"tracking.tracking_uri={real}"])
    assert mask_recipe_uris(recipe.to_dict())["tracking"]["tracking_uri"] == masked  # recipe.yaml, run.json
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(masked) == "https://mlflow.example.com/prefix?team=a"
    export_credentials(recipe.tracking)
    assert resolve_tracking_uri(masked) == real
