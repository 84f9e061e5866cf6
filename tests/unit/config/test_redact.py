"""Redaction (ftcli.config.redact) and the import rule it exists for: tracking, register and merge import
downwards only, so no module of the register/tracking/merge group imports one that imports it back."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ftcli.config.recipe import load_recipe
from ftcli.config.redact import has_masked_credentials, holds_credentials, mask_uri, scrub_recipe, split_credentials
from ftcli.artifacts.tracking import flatten

SECRET = "s3cr3t-value-never-logged"


@pytest.mark.parametrize("text, masked", [
    ("https://user:tok@mlflow.example.com:5000/x?y=1", "https://***@mlflow.example.com:5000/x?y=1"),
    ("http://tok@127.0.0.1", "http://***@127.0.0.1"),
    ("http://user:p@ss@host/api", "http://***@host/api"),  # up to the host's last '@'
    ("API request to http://u:tok@h:1/api/2.0 failed (see http://h:2/x@y)",
     "API request to http://***@h:1/api/2.0 failed (see http://h:2/x@y)"),
    ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ("databricks-uc", "databricks-uc"),
])
def test_mask_uri_hides_user_info_and_nothing_else(text, masked):
    assert mask_uri(text) == masked


@pytest.mark.parametrize("text, masked", [
    ("https://mlflow.example.com/?token=abc", "https://mlflow.example.com/?token=***"),
    ("https://h/x?y=1&access_token=abc#f", "https://h/x?y=1&access_token=***#f"),
    ("https://h/x?api_key=a&key=b&secret=c&password=d", "https://h/x?api_key=***&key=***&secret=***&password=***"),
    ("https://acct.blob.core.windows.net/c/f?sv=2024-01-01&se=2030&sig=AbC%3D",
     "https://acct.blob.core.windows.net/c/f?sv=2024-01-01&se=2030&sig=***"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA&X-Amz-Signature=ff&X-Amz-Security-Token=t",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***"),
    ("https://u:p@h/x?auth=z", "https://***@h/x?auth=***"),
    ("failed (see https://h/x?code=abc): retry", "failed (see https://h/x?code=***): retry"),
    ("https://h/x?tokenizer=qwen&page=2&keyboard=us", "https://h/x?tokenizer=qwen&page=2&keyboard=us"),
    ("https://h/x?token=", "https://h/x?token="),  # nothing to hide
])
def test_mask_uri_hides_token_like_query_parameters(text, masked):
    assert mask_uri(text) == masked
    assert holds_credentials(text) == (masked != text)
    assert has_masked_credentials(masked) == (masked != text)


def test_split_credentials_drops_user_info_and_token_parameters():
    assert split_credentials("https://u:p@h/x?token=t&y=1") == ("https://h/x?y=1", "u", "p")
    assert split_credentials("https://h/x?sig=s") == ("https://h/x", None, None)
    assert split_credentials("https://h/x?y=1") == ("https://h/x?y=1", None, None)


def test_scrub_recipe_hides_secret_and_env_values():
    recipe = load_recipe("tiny-qwen-cpu").to_dict()
    recipe["compute"]["env_variables"] = {"HF_HOME": SECRET}
    recipe["compute"]["secrets"] = {"HF_TOKEN": f"scope/{SECRET}"}
    recipe["tracking"]["tracking_uri"] = f"https://user:{SECRET}@mlflow.example.com"
    params = flatten(scrub_recipe(recipe))
    assert SECRET not in json.dumps(params)
    assert params["compute.secrets.HF_TOKEN"] == "***" and params["compute.env_variables.HF_HOME"] == "***"
    assert params["tracking.tracking_uri"] == "https://***@mlflow.example.com"
    assert recipe["compute"]["env_variables"]["HF_HOME"] == SECRET  # the input is not modified


def _ftcli_imports(module: str) -> set[str]:
    """Every ftcli module `module` imports, at the top or inside a function."""
    path = Path(__file__).resolve().parents[3] / "ftcli" / (module.removeprefix("ftcli.").replace(".", "/") + ".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ftcli"):
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "ftcli" else [node.module]
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ftcli"))
    return found


def test_register_tracking_merge_imports_have_no_circle():
    group = {"ftcli.config.redact", "ftcli.artifacts.tracking", "ftcli.artifacts.rundir", "ftcli.artifacts.merge", "ftcli.artifacts.mlflow_model", "ftcli.commands.register",
             "ftcli.artifacts.registry"}
    edges = {m: _ftcli_imports(m) & group for m in group}
    assert edges["ftcli.config.redact"] == set() and "ftcli.commands.register" not in edges["ftcli.artifacts.tracking"]

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in edges[start])

    assert [m for m in sorted(group) if reaches(m, m, set())] == []


def test_what_a_library_prints_or_logs_goes_out_masked(capfd):
    """register runs MLflow inside masked_output: its print to stdout (`View run ... at: <url>`), a write to
    stderr and a logging line (a handler that looks sys.stderr up, as MLflow's and logging's last resort do)
    come out with the URL's password masked."""
    import logging
    import sys

    from ftcli.config.redact import masked_output

    class StderrAtCallTime:  # what MLflow's MlflowLoggingStream does
        def write(self, text):
            sys.stderr.write(text)

        def flush(self):
            sys.stderr.flush()

    logger = logging.getLogger("mlflow.test_masked")
    handler = logging.StreamHandler(StderrAtCallTime())
    logger.addHandler(handler)
    logger.propagate = False
    url = "http://user:hunter2@host:5000/#/experiments/1"
    try:
        with masked_output(stdout=sys.stderr):
            print(f"View run train at: {url}")
            sys.stderr.write(f"retrying {url}?token=abc\n")
            logger.warning("cannot reach %s", url)
    finally:
        logger.removeHandler(handler)
    out, err = capfd.readouterr()
    assert out == "" and "hunter2" not in err and "abc" not in err
    assert err.splitlines() == ["View run train at: http://***@host:5000/#/experiments/1",
                                "retrying http://***@host:5000/#/experiments/1?token=***",
                                "cannot reach http://***@host:5000/#/experiments/1"]
