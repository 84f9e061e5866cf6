"""AI Runtime workloads: golden renders, the check rules and shell quoting (that rendering imports no torch:
tests/e2e/test_light_imports.py).

Regenerate the golden files after an intended change with:
    FTCLI_UPDATE_GOLDEN=1 pytest tests/unit/launchers/test_workload.py
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from _recipe_common import DELETE as _DELETE, set_key as _set

from ftcli.launchers import databricks as workload
from ftcli.config.errors import UserError
from ftcli.config.recipe import Recipe, builtin_recipe_names, load_recipe
from ftcli.config.pipspec import check_pip_spec

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
UPDATE = os.environ.get("FTCLI_UPDATE_GOLDEN") == "1"
BASH = shutil.which("bash")

CASES = {
    "qwen-b300-1node": ("qwen-b300", []),
    "qwen-b300-2nodes": ("qwen-b300", ["compute.num_accelerators=16"]),
    "gpt-oss-h100-1node": ("gpt-oss-h100", []),
    "gpt-oss-h100-2nodes": ("gpt-oss-h100", ["compute.num_accelerators=16"]),
}


def _render(name: str, overrides: list[str] | None = None) -> tuple[Recipe, str, dict]:
    recipe = load_recipe(name, overrides or [])
    text = workload.render_workload(recipe)
    return recipe, text, yaml.safe_load(text)


# ---------------------------------------------------------------------------------------- golden
@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_golden(case):
    name, overrides = CASES[case]
    _, text, _ = _render(name, overrides)
    path = GOLDEN / f"{case}.yaml"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}; create it with FTCLI_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{case} differs from {path}; if intended, regenerate with FTCLI_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_files_pass_check(case):
    assert workload.check_workload_file(GOLDEN / f"{case}.yaml") == []


@pytest.mark.parametrize("name", builtin_recipe_names())
@pytest.mark.parametrize("nodes", [1, 2])
def test_every_render_passes_check(name, nodes, tmp_path):
    recipe = load_recipe(name)
    total = recipe.compute.gpus_per_node * nodes
    _, text, _ = _render(name, [f"compute.num_accelerators={total}"])
    path = tmp_path / "w.yaml"
    path.write_text(text)
    assert workload.check_workload_file(path) == []


def test_render_keeps_published_examples_compute_and_env():
    _, _, qwen = _render("qwen-b300")
    assert qwen["experiment_name"] == "air-b300-qwen3-8-27b-sft"
    assert qwen["compute"] == {"accelerator_type": "GPU_8xB300", "num_accelerators": 8}
    assert qwen["environment"] == {"version": "databricks_ai_v6"}
    assert qwen["code_source"] == {"root_path": "."}
    assert (qwen["max_retries"], qwen["timeout_minutes"]) == (0, 240)
    assert qwen["env_variables"] == {
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "HF_HOME": "/tmp/.hf",
        "NCCL_DEBUG": "WARN",
        "TORCH_CUDA_ARCH_LIST": "10.0",
    }
    _, _, oss = _render("gpt-oss-h100", ["compute.num_accelerators=16"])
    assert oss["experiment_name"] == "gpt-oss-20b-lora"
    assert oss["compute"] == {"accelerator_type": "GPU_8xH100", "num_accelerators": 16}
    assert (oss["max_retries"], oss["timeout_minutes"]) == (0, 120)


# ------------------------------------------------------------------------------------ parameters
@pytest.mark.parametrize("name", ["qwen-b300", "gpt-oss-h100"])
def test_parameters_are_the_resolved_recipe(name):
    recipe, _, data = _render(name, ["training.optimizer.lr=3.0e-5"])
    assert data["parameters"] == recipe.to_dict()
    assert Recipe.model_validate(data["parameters"]) == recipe
    assert data["parameters"]["training"]["optimizer"]["lr"] == 3e-5


@pytest.mark.parametrize("fmt", ["yaml", "json", "noext"])
def test_parameters_file_loads_back_as_yaml_or_json(fmt, tmp_path):
    """AI Runtime writes `parameters:` to $HYPERPARAMETERS_PATH; YAML or JSON, the loader reads it."""
    recipe, _, data = _render("qwen-b300", ["compute.num_accelerators=16"])
    path = tmp_path / {"yaml": "params.yaml", "json": "params.json", "noext": "params"}[fmt]
    params = data["parameters"]
    path.write_text(json.dumps(params) if fmt != "yaml" else yaml.safe_dump(params))
    assert load_recipe(str(path)) == recipe


def test_submit_time_override_of_parameters_reaches_training(tmp_path):
    """`--override parameters.training.optimizer.lr=...` edits the map the job loads."""
    _, _, data = _render("gpt-oss-h100")
    params = copy.deepcopy(data["parameters"])
    params["training"]["optimizer"]["lr"] = 5e-5
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    assert load_recipe(str(path)).training.optimizer.lr == 5e-5


# -------------------------------------------------------------------------------- compute & env
def test_experiment_name_defaults_to_recipe_name():
    _, _, data = _render("tiny-qwen-cpu")
    assert data["experiment_name"] == "tiny-qwen-cpu"


def test_bad_experiment_name_fails_render_with_one_line():
    recipe = load_recipe("qwen-b300", ["compute.experiment_name=my experiment!"])
    with pytest.raises(UserError) as err:
        workload.render_workload(recipe)
    msg = str(err.value)
    assert "\n" not in msg and "experiment_name" in msg and "letters, digits" in msg


def test_hf_home_defaults_to_tmp_unless_set():
    _, _, data = _render("gpt-oss-h100", ["compute.env_variables={}"])
    assert data["env_variables"] == {"HF_HOME": "/tmp/.hf"}
    _, _, data = _render("gpt-oss-h100", ["compute.env_variables.HF_HOME=/local_disk0/hf"])
    assert data["env_variables"]["HF_HOME"] == "/local_disk0/hf"


def test_secrets_only_as_scope_key_references():
    recipe, text, data = _render("gpt-oss-h100", ["compute.secrets.HF_TOKEN=hf-scope/hf-token"])
    assert data["secrets"] == {"HF_TOKEN": "hf-scope/hf-token"}
    assert "HF_TOKEN" not in data["env_variables"]
    assert data["parameters"]["compute"]["secrets"] == {}
    assert text.count("hf-scope/hf-token") == 1
    assert recipe.compute.secrets == {"HF_TOKEN": "hf-scope/hf-token"}


def test_pool_and_priority_class_are_rendered():
    _, _, data = _render("qwen-b300", ["compute.pool_id=pool-1", "compute.priority_class=CRITICAL"])
    assert data["compute"] == {
        "accelerator_type": "GPU_8xB300", "num_accelerators": 8, "pool_id": "pool-1", "priority_class": "CRITICAL",
    }


def test_optional_compute_keys_are_rendered():
    _, _, data = _render("qwen-b300", [
        "compute.mlflow_experiment_directory=/Workspace/Users/me@example.com",
        "compute.permissions=[{group_name: ml-team, level: CAN_MANAGE}]",
    ])
    assert data["mlflow_experiment_directory"] == "/Workspace/Users/me@example.com"
    assert data["permissions"] == [{"group_name": "ml-team", "level": "CAN_MANAGE"}]


def test_bad_mlflow_experiment_directory_fails_render():
    recipe = load_recipe("qwen-b300", ["compute.mlflow_experiment_directory=/Users/me"])
    with pytest.raises(UserError, match="must start with /Workspace"):
        workload.render_workload(recipe)


def test_gpu_wheels_follow_model_and_hardware():
    def reqs(name, *overrides):
        return [r for r, _ in workload.gpu_requirements(load_recipe(name, list(overrides)))]

    # Blackwell: fla's Triton backward is fine; the recipe's fused loss brings liger-kernel
    # and its float8 GEMMs torchao
    assert reqs("qwen-b300") == ["flash-linear-attention==0.6.0", "liger-kernel==0.8.5", "torchao==0.18.0"]
    bf16 = ("training.precision.fp8=false",)
    assert reqs("qwen-b300", *bf16, "training.loss.impl=chunked") == ["flash-linear-attention==0.6.0"]
    assert reqs("qwen-b300", *bf16, "compute.accelerator_type=GPU_8xH100", "training.loss.impl=chunked") == [
        "flash-linear-attention==0.6.0", "tilelang==0.1.15"]
    # liger for the fused norms too, named once with both uses
    fused = workload.gpu_requirements(load_recipe("qwen-b300", [*bf16, "training.fused_ops=[rms_norm]"]))
    assert fused[1] == ("liger-kernel==0.8.5", "pure Python + Triton fused linear cross-entropy (loss.impl=liger) "
                                               "and fused RMSNorm / SwiGLU (training.fused_ops)")
    assert [r for r, _ in fused] == ["flash-linear-attention==0.6.0", "liger-kernel==0.8.5"]
    assert reqs("gpt-oss-h100") == []
    with pytest.raises(UserError, match="training.loss: impl=liger belongs to training.method=full"):
        reqs("gpt-oss-h100", "training.loss.impl=liger")  # LoRA's loss is TRL's: nothing to install for it


def test_no_source_builds_in_setup():
    for case, (name, overrides) in CASES.items():
        _, _, data = _render(name, overrides)
        for forbidden in ("causal-conv1d", "flash-attn", "--no-build-isolation", "FORCE_BUILD"):
            assert forbidden not in data["command"], (case, forbidden)


# ------------------------------------------------------------------------------------ the command
def _fake_bin(tmp_path: Path) -> Path:
    """`pip` and `torchrun` that record their argv, one NUL-terminated argument each."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("pip", "torchrun"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > "$FAKE_LOG/{tool}.args"\n')
        script.chmod(0o755)
    return bin_dir


def _run_command(command: str, tmp_path: Path, **env: str) -> tuple[list[str], list[str]]:
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir(exist_ok=True)
    (snapshot / "pyproject.toml").write_text("[project]\nname = 'ftcli'\n")
    log = tmp_path / "log"
    log.mkdir(exist_ok=True)
    run_env = {
        "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "FAKE_LOG": str(log),
        "CODE_SOURCE_PATH": str(snapshot),
        "HYPERPARAMETERS_PATH": str(tmp_path / "params.yaml"),
        **env,
    }
    subprocess.run([BASH, "-c", command], env=run_env, check=True, cwd=tmp_path)
    pip = (log / "pip.args").read_text().split("\0")[:-1]
    torchrun = (log / "torchrun.args").read_text().split("\0")[:-1]
    return pip, torchrun


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_torchrun_single_node_defaults(tmp_path):
    _, _, data = _render("qwen-b300")
    pip, torchrun = _run_command(data["command"], tmp_path)
    assert torchrun == [
        "--nnodes=1", "--node_rank=0", "--nproc_per_node=8", "--master_addr=127.0.0.1", "--master_port=29500",
        "-m", "ftcli", "train", "--recipe", str(tmp_path / "params.yaml"),
    ]
    assert pip == ["install", "--progress-bar", "off", str(tmp_path / "ftcli-src"), "flash-linear-attention==0.6.0",
                   "liger-kernel==0.8.5", "torchao==0.18.0"]
    assert (tmp_path / "ftcli-src" / "pyproject.toml").is_file()  # the writable copy of the snapshot


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_torchrun_takes_ai_runtime_multinode_variables(tmp_path):
    _, _, data = _render("gpt-oss-h100", ["compute.num_accelerators=16"])
    _, torchrun = _run_command(
        data["command"], tmp_path,
        NUM_NODES="2", NODE_RANK="1", LOCAL_WORLD_SIZE="8", MASTER_ADDR="10.0.0.5", MASTER_PORT="40000",
    )
    assert torchrun[:5] == [
        "--nnodes=2", "--node_rank=1", "--nproc_per_node=8", "--master_addr=10.0.0.5", "--master_port=40000",
    ]


INJECT = ";touch${{IFS}}{canary};#"  # one word: a local path to pip (compute.ftcli_spec), a command to a shell


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_recipe_values_cannot_inject_shell_commands(tmp_path):
    canary = tmp_path / "pwned"
    evil_dep = f'numpy; sys_platform != "$(touch {canary})" or os_name == "`touch {canary}`;"'  # a valid requirement
    evil_spec = "$CODE_SOURCE_PATH[gpu]" + INJECT.format(canary=canary)
    evil_env = f"$(touch {canary}) `touch {canary}` ' \" ; rm -rf /"
    marker_dep = 'a>=1 ; python_version > "3"'
    recipe = load_recipe("qwen-b300", [
        f"compute.dependencies={json.dumps([evil_dep, marker_dep])}",
        f"compute.ftcli_spec={json.dumps(evil_spec)}",
        f"compute.env_variables.EVIL={json.dumps(evil_env)}",
        f"description={json.dumps(evil_env)}",
    ])
    data = yaml.safe_load(workload.render_workload(recipe))
    command = data["command"]
    assert subprocess.run([BASH, "-n", "-c", command]).returncode == 0
    assert evil_env not in command  # env values and the recipe itself never reach the shell
    assert data["env_variables"]["EVIL"] == evil_env
    pip, _ = _run_command(command, tmp_path)
    assert not canary.exists()
    assert pip[3:] == [
        str(tmp_path / "ftcli-src") + "[gpu]" + INJECT.format(canary=canary),
        "flash-linear-attention==0.6.0",
        "liger-kernel==0.8.5",
        "torchao==0.18.0",
        evil_dep,
        marker_dep,
    ]


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_non_snapshot_ftcli_spec_is_one_quoted_argument(tmp_path):
    recipe = load_recipe("gpt-oss-h100", ['compute.ftcli_spec=ftcli==0.1.0; python_version >= "3.10"'])
    command = yaml.safe_load(workload.render_workload(recipe))["command"]
    assert "cp -R" not in command
    pip, _ = _run_command(command, tmp_path)
    assert pip == ["install", "--progress-bar", "off", 'ftcli==0.1.0; python_version >= "3.10"']


PIP_OPTIONS = ["--index-url=http://evil.example/simple", "-r/etc/shadow", "-egit+https://evil.example/x.git",
               "--extra-index-url", " -i http://evil.example/simple", "--trusted-host=evil.example"]
NOT_REQUIREMENTS = ["numpy; touch /tmp/x #", "a b", "rm -rf /", "https://evil.example/x.whl",
                    "git+https://evil.example/x.git", ""]


@pytest.mark.parametrize("launcher", ["databricks", "slurm"])
@pytest.mark.parametrize("key", ["compute.dependencies", "compute.ftcli_spec"])
@pytest.mark.parametrize("value", PIP_OPTIONS + NOT_REQUIREMENTS)
def test_pip_options_and_non_requirements_are_refused_at_recipe_validation(key, value, launcher):
    from ftcli.config.recipe import RecipeError

    override = json.dumps([value] if key == "compute.dependencies" else value)
    with pytest.raises(RecipeError) as err:
        load_recipe("qwen-b300", [f"{key}={override}", f"compute.launcher={launcher}"])
    message = str(err.value)
    where = f"{key}.0: " if key == "compute.dependencies" else f"{key}: "
    expected = "a pip option, not a requirement" if value in PIP_OPTIONS else "neither a requirement"
    assert f"{where}{expected}" in message and "\n" not in message


@pytest.mark.parametrize("value", [
    "torch==2.9.1", "flash-attn[build]>=2.6,<3", 'numpy; python_version >= "3.10"',
    "ftcli @ https://example.com/ftcli-0.1.0-py3-none-any.whl", "$CODE_SOURCE_PATH", "${CODE_SOURCE_PATH}[gpu]",
    "$CODE_SOURCE_PATH/sub", "/Workspace/Users/me/ftcli-0.1.0-py3-none-any.whl", "./dist/ftcli-0.1.0.tar.gz",
    "../ftcli", "~/src/ftcli", "dist/ftcli-0.1.0-py3-none-any.whl",
])
def test_requirements_and_local_paths_are_accepted(value):
    assert check_pip_spec(value) == value
    recipe = load_recipe("qwen-b300", [f"compute.dependencies={json.dumps([value])}",
                                       f"compute.ftcli_spec={json.dumps(value)}"])
    assert recipe.compute.dependencies == [value] and recipe.compute.ftcli_spec == value


def test_workload_file_dependencies_refuse_pip_options(tmp_path):
    data = _set(_valid(), "environment.dependencies", ["numpy", "--index-url=http://evil.example/simple"])
    problems = _check(tmp_path, data)
    assert len(problems) == 1 and "environment.dependencies.1: a pip option, not a requirement" in problems[0], problems


# ------------------------------------------------------------------------------------ check mode
@functools.cache
def _rendered_qwen() -> dict:
    return _render("qwen-b300")[2]


def _valid() -> dict:
    """A valid workload (qwen-b300's render, rendered once), for a test to break one key of."""
    return copy.deepcopy(_rendered_qwen())


def _check(tmp_path: Path, data) -> list[str]:
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return workload.check_workload_file(path)


RULES = [
    # (key, value, expected substring of the one problem)
    ("run_name", "x", "unknown key 'run_name'; did you mean 'mlflow_run_name'?"),
    ("image", "x", "unknown key 'image'; did you mean 'environment.unity_catalog_image'?"),
    ("experimnt_name", "x", "did you mean 'experiment_name'?"),
    ("dependencies", ["x"], "unknown key 'dependencies'; did you mean 'environment.dependencies'?"),
    ("compute.num_gpus", 8, "unknown key 'compute.num_gpus'"),
    ("experiment_name", _DELETE, "missing required key 'experiment_name'"),
    ("compute", _DELETE, "missing required key 'compute'"),
    ("command", _DELETE, "missing required key 'command'"),
    ("command", "  ", "command: must not be empty"),
    ("compute.accelerator_type", _DELETE, "missing required key 'compute.accelerator_type'"),
    ("experiment_name", "has space", "experiment_name: use 1-100 letters, digits, '-' or '_'"),
    ("experiment_name", "x" * 101, "experiment_name: use 1-100"),
    ("mlflow_run_name", "run.1", "mlflow_run_name: use 1-100 letters"),
    ("compute.accelerator_type", "gpu_8xh100", "compute.accelerator_type: expected GPU_<gpus per node>x<model>"),
    ("compute.num_accelerators", 12,
     "compute: num_accelerators=12 is not a multiple of the 8 GPUs per node of GPU_8xB300"),
    ("compute.num_accelerators", 0, "compute.num_accelerators: Input should be greater than or equal to 1"),
    ("compute.num_accelerators", "8", "compute.num_accelerators: Input should be a valid integer"),
    ("compute.priority_class", "NORMAL", "compute: priority_class needs pool_id (provisioned capacity)"),
    ("compute", {"accelerator_type": "GPU_8xB300", "num_accelerators": 8, "pool_id": "p", "priority_class": "HIGH"},
     "compute.priority_class: Input should be 'BEST_EFFORT', 'NORMAL' or 'CRITICAL'"),
    ("secrets", {"HF_TOKEN": "no-slash"}, "secrets.HF_TOKEN: must be 'scope/key'"),
    ("secrets", {"HF_TOKEN": "a/b/c"}, "secrets.HF_TOKEN: must be 'scope/key'"),
    ("secrets", {"HF_HOME": "s/k"}, "secrets.HF_HOME: also set in env_variables"),
    ("env_variables.BATCH", 32, "env_variables.BATCH: expected a string (got 32); quote the value"),
    ("env_variables", {"1BAD": "x"}, "is not a valid environment variable name"),
    ("environment.dependencies", "requirements.yaml", "environment.dependencies: Input should be a valid list"),
    ("environment.version", "latest", "environment.version: expected an environment version"),
    ("environment.version", "databricks_ai_v4", "environment.version: expected an environment version"),
    ("environment", _DELETE, "environment.version: not set; set it explicitly"),
    ("environment.version", _DELETE, "environment.version: not set; set it explicitly"),
    ("environment.unity_catalog_image", "main.default.img", "environment.version: not allowed together with environment.unity_catalog_image"),
    ("code_source", {"type": "snapshot", "snapshot": {"root_path": "."}}, "the current form is code_source: {root_path: .}"),
    ("mlflow_experiment_directory", "/Users/me", "mlflow_experiment_directory: must start with /Workspace"),
    ("permissions", [{"user_name": "a", "group_name": "b", "level": "CAN_MANAGE"}], "permissions.0: name exactly one of"),
    ("permissions", [{"user_name": "a"}], "missing required key 'permissions.0.level'"),
    ("permissions", [{"usr_name": "a", "level": "CAN_VIEW"}], "unknown key 'permissions.0.usr_name'; did you mean 'permissions.0.user_name'?"),
    ("idempotency_token", "t" * 65, "idempotency_token: at most 64 characters, this one has 65"),
    ("usage_policy_id", "1", None),  # set together with usage_policy_name below
    ("max_retries", -1, "max_retries: Input should be greater than or equal to 0"),
    ("timeout_minutes", 0, "timeout_minutes: Input should be greater than or equal to 1"),
    ("parameters", ["not", "a", "map"], "parameters: Input should be a valid dictionary"),
]


@pytest.mark.parametrize("key,value,expected", RULES, ids=[f"{k}={str(v)[:20]}" for k, v, _ in RULES])
def test_check_rule(key, value, expected, tmp_path):
    data = _set(_valid(), key, value)
    if key == "usage_policy_id":
        data["usage_policy_name"] = "team-policy"
        expected = "usage_policy_name and usage_policy_id exclude each other"
    problems = _check(tmp_path, data)
    assert any(expected in p for p in problems), problems
    # Only the key that was broken is reported (code_source's legacy form also lacks root_path).
    assert all(key.split(".")[0].split("_")[0] in p for p in problems), problems


@pytest.mark.parametrize("key,value", [
    ("idempotency_token", "t" * 64), ("mlflow_run_name", "run-1_a"), ("environment.version", 6),
    ("compute.pool_id", "p-1"), ("mlflow_experiment_directory", "/Workspace/Shared/x"),
    ("usage_policy_name", "team-policy"), ("secrets", {"HF_TOKEN": "scope/key"}),
    ("environment", {"unity_catalog_image": "main.default.img"}),
])
def test_check_accepts_valid_optional_keys(key, value, tmp_path):
    assert _check(tmp_path, _set(_valid(), key, value)) == []


def test_check_reports_every_violation_at_once(tmp_path):
    data = _valid()
    data["experiment_name"] = "bad name"
    data["compute"]["num_accelerators"] = 12
    data["compute"]["priority_class"] = "NORMAL"
    data["secrets"] = {"HF_HOME": "nope"}
    data["run_name"] = "x"
    data["max_retries"] = -1
    data["usage_policy_name"], data["usage_policy_id"] = "a", "b"
    del data["command"]
    problems = _check(tmp_path, data)
    assert len(problems) == 9, problems
    for expected in ("experiment_name:", "not a multiple", "priority_class needs pool_id", "secrets.HF_HOME: must be",
                     "also set in env_variables", "unknown key 'run_name'", "max_retries:", "exclude each other",
                     "missing required key 'command'"):
        assert any(expected in p for p in problems), (expected, problems)


@pytest.mark.parametrize("text,expected", [
    ("experiment_name: [unclosed\n", "not valid YAML line 2"),
    ("- a\n- b\n", "expected a mapping of workload keys at the top level, got list"),
    ("", "the file is empty"),
])
def test_check_bad_file_is_one_problem(text, expected, tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    problems = workload.check_workload_file(path)
    assert len(problems) == 1 and expected in problems[0], problems


def test_check_missing_file(tmp_path):
    problems = workload.check_workload_file(tmp_path / "nope.yaml")
    assert len(problems) == 1 and problems[0].startswith("cannot read"), problems


def test_cli_check_exit_codes(tmp_path):
    from typer.testing import CliRunner

    from ftcli.cli import app

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(workload.render_workload(load_recipe("gpt-oss-h100")))
    bad.write_text("experiment_name: [\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["render-workload", "--check", str(good)])
    assert ok.exit_code == 0 and "valid AI Runtime workload" in " ".join(ok.output.split())
    res = runner.invoke(app, ["render-workload", "--check", str(bad)])
    assert res.exit_code == 2 and "not valid YAML" in res.output and "Traceback" not in res.output


def test_cli_render_writes_file_and_refuses_overwrite(tmp_path):
    from typer.testing import CliRunner

    from ftcli.cli import app

    out = tmp_path / "w.yaml"
    runner = CliRunner()
    res = runner.invoke(app, ["render-workload", "-r", "qwen-b300", "-o", str(out)])
    assert res.exit_code == 0
    assert out.read_text() == (GOLDEN / "qwen-b300-1node.yaml").read_text()
    assert f"wrote {out}; submit with:\n  databricks air run -f {out}\n" in res.stderr  # the command on its own line
    again = runner.invoke(app, ["render-workload", "-r", "qwen-b300", "-o", str(out)])
    assert again.exit_code == 2 and "--force" in again.output


def test_multi_node_render_warns_when_checkpoints_go_to_a_node_local_dir():
    def warnings(name, *overrides):
        return workload.render_warnings(load_recipe(name, list(overrides)))

    assert warnings("qwen-b300") == [RELATIVE]  # one node
    assert warnings("qwen-b300", "compute.num_accelerators=16") == [
        "output.dir=runs/{name} is on each node's own disk, but the 2 nodes write one checkpoint together: set "
        "output.dir to a path every node sees (e.g. /Volumes/<catalog>/<schema>/<volume>/...)"]
    assert warnings("gpt-oss-h100", "compute.num_accelerators=16") == []  # a Unity Catalog volume
    assert warnings("qwen-b300", "compute.num_accelerators=16", "training.checkpoint.enabled=false",
                    "training.checkpoint.save_final_hf=false") == [RELATIVE]


RELATIVE = ("output.dir=runs/{name} is relative: it lands in the job's working directory, which is gone when the job "
            "ends; set output.dir to a /Volumes/<catalog>/<schema>/<volume>/... path to keep the checkpoints and the "
            "model")


def test_render_says_where_to_submit_from_and_that_a_relative_output_dir_is_lost(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ftcli.cli import app

    recipe = load_recipe("gpt-oss-h100")  # output.dir on a volume: nothing to say from the checkout
    assert workload.render_warnings(recipe, fit_check=False) == []
    monkeypatch.chdir(tmp_path)  # not an ftcli checkout
    (outside,) = workload.render_warnings(recipe, fit_check=False)
    assert outside == (f"{tmp_path} is not an ftcli checkout, but the job installs ftcli from the directory it is "
                       "submitted from (compute.ftcli_spec=$CODE_SOURCE_PATH): run `databricks air run -f ...` "
                       "from the ftcli checkout, or set compute.ftcli_spec to a pip spec (e.g. 'ftcli @ git+https://...')")
    pinned = load_recipe("gpt-oss-h100", ["compute.ftcli_spec=ftcli==0.1.0"])
    assert workload.render_warnings(pinned, fit_check=False) == []  # installs from PyPI, not from the snapshot
    res = CliRunner().invoke(app, ["render-workload", "-r", "qwen-b300", "-o", str(tmp_path / "w.yaml")])
    assert res.exit_code == 0
    said = " ".join(res.output.split())
    assert f"warning: {RELATIVE}" in said and f"warning: {outside}" in said


# -------------------------------------------------------------------------------------- fit check
def test_render_refuses_a_recipe_that_does_not_fit_its_accelerator():
    recipe = load_recipe("qwen-b300", ["compute.accelerator_type=GPU_8xH100"])  # 211.4 GiB per GPU, 68.5 usable
    with pytest.raises(UserError) as e:
        workload.render_workload(recipe)
    assert str(e.value) == ("qwen-b300 does not fit GPU_8xH100: 211.4 GiB per GPU > 68.5 usable of 80 GB; nearest that "
                            "fits: --set training.activation_checkpointing_keep=0 --set data.packing.block_len=16384 "
                            "(65.8 GiB); --no-fit-check renders it anyway")
    text = workload.render_workload(recipe, fit_check=False)
    assert yaml.safe_load(text)["compute"]["accelerator_type"] == "GPU_8xH100"
    fitted = load_recipe("qwen-b300", ["compute.accelerator_type=GPU_8xH100", "training.activation_checkpointing_keep=0",
                                       "data.packing.block_len=16384"])
    assert yaml.safe_load(workload.render_workload(fitted))["parameters"]["data"]["packing"]["block_len"] == 16384


def test_render_warns_when_the_fit_cannot_be_checked():
    recipe = load_recipe("qwen-b300", ["compute.accelerator_type=GPU_8xL40S"])
    workload.render_workload(recipe)  # renders
    assert workload.render_warnings(recipe)[0] == ("memory fit not checked: no figures for GPU_8xL40S (cards known: "
                                                   "H100, H200, B300, A10)")
    not_offered = ("compute.accelerator_type=GPU_8xL40S is not one of AI Runtime's accelerator types (GPU_1xA10, "
                   "GPU_1xH100, GPU_8xH100, GPU_8xB300); databricks air run will refuse it")
    assert workload.render_warnings(recipe, fit_check=False) == [not_offered, RELATIVE]
    assert workload.render_warnings(load_recipe("qwen-b300"), fit_check=False) == [RELATIVE]


def test_render_workload_cli_fit_check_and_override(tmp_path):
    from typer.testing import CliRunner

    from ftcli.cli import app

    runner = CliRunner()
    argv = ["render-workload", "-r", "qwen-b300", "--set", "compute.accelerator_type=GPU_8xH100"]
    refused = runner.invoke(app, argv)
    assert refused.exit_code == 2
    assert "error: qwen-b300 does not fit GPU_8xH100: 211.4 GiB per GPU" in refused.output
    forced = runner.invoke(app, [*argv, "--no-fit-check", "-o", str(tmp_path / "w.yaml")])
    assert forced.exit_code == 0 and (tmp_path / "w.yaml").is_file()


def test_a_recipe_reading_a_delta_table_renders_a_workload_that_passes_check(tmp_path):
    """`source: delta` by Unity Catalog name at a pinned version: the job installs deltalake beside ftcli, the
    resolved recipe in `parameters` keeps the table and version, and the file passes `render-workload --check`."""
    from typer.testing import CliRunner

    from ftcli.cli import app

    recipe, text, rendered = _render("qwen-b300", ["data.source=delta", "data.path=main.sft.chats", "data.revision=12",
                                                   "data.columns=[messages]",
                                                   "output.dir=/Volumes/main/sft/ckpts/qwen-b300"])
    assert rendered["parameters"]["data"]["source"] == "delta"
    assert (rendered["parameters"]["data"]["path"], rendered["parameters"]["data"]["revision"]) == ("main.sft.chats", "12")
    pip = next(line for line in rendered["command"].splitlines() if line.startswith("pip install"))
    from ftcli.launchers.base import DELTALAKE

    assert pip.split()[-1] == DELTALAKE == "deltalake==1.6.6"
    assert "deltalake==1.6.6: data.source=delta reads the Delta table with delta-rs." in " ".join(text.split())
    path = tmp_path / "w.yaml"
    path.write_text(text)
    assert workload.check_workload_file(path) == []
    ok = CliRunner().invoke(app, ["render-workload", "--check", str(path)])
    assert ok.exit_code == 0 and "valid AI Runtime workload" in " ".join(ok.output.split())
    from ftcli.launchers.base import data_requirements

    assert data_requirements(load_recipe("qwen-b300")) == []
