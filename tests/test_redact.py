"""Redaction (ftcli.config.redact) and the import rule it exists for: tracking, register and merge import
downwards only, so no module of the register/tracking/merge group imports one that imports it back."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ftcli.config.recipe import load_recipe
from ftcli.config.redact import mask_uri, scrub_recipe
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
    path = Path(__file__).resolve().parents[1] / "ftcli" / (module.removeprefix("ftcli.").replace(".", "/") + ".py")
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
