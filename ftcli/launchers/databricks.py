"""The Databricks AI Runtime launcher: render a workload YAML from a recipe, check one that already exists.

One schema serves both directions. `WorkloadFile` (pydantic, unknown keys forbidden) plus
`_cross_field_problems` is what `databricks air run -f` accepts; `check_workload_file` reports every
violation of it in a file, and `render_workload` runs the same validation on what it produces, so a
rendered workload is valid by construction (or the render fails with the recipe key to fix).

A rendered workload is self-contained:

    parameters:   the resolved recipe (every default filled in). AI Runtime writes it to a file at
                  $HYPERPARAMETERS_PATH, and the job trains from that file, so
                  `databricks air run -f w.yaml --override parameters.training.optimizer.lr=2e-5`
                  changes a run without re-rendering. (ftcli's recipe loader parses YAML, and so JSON.)
    command:      setup (install ftcli from the code snapshot plus the few GPU wheels the recipe needs),
                  then `torchrun ... -m ftcli train --recipe "$HYPERPARAMETERS_PATH"`. The same command
                  runs on every node; torchrun takes NUM_NODES, NODE_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
                  and MASTER_PORT from AI Runtime, with single-node defaults.

Every recipe value that reaches the shell goes through `shlex.quote`; secrets appear only as
`scope/key` references under `secrets:`.

This module imports no torch, transformers, datasets or mlflow.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from ftcli.config.accelerators import AI_RUNTIME_TYPES
from ftcli.config.errors import UserError
from ftcli.config.pipspec import check_env_name, check_pip_spec
from ftcli.config.recipe import (
    NAME_RE,
    NAME_RULE,
    Recipe,
    check_accelerator_type,
    check_secret_ref,
    did_you_mean,
    parse_yaml,
    placement_problems,
    read_text_file,
)
from ftcli.launchers.base import (
    Launcher,
    checkout_warnings,
    comment,
    dump_yaml,
    fit_warnings,
    gpu_requirements,
    pip_install_line,
    preflight,
    setup_comment,
    shell_spec,
)

# ------------------------------------------------------------------------------------------- schema
_VAR_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_VERSION_RE = re.compile(r"(databricks_ai_v)?([1-9][0-9]*)")


def _name(v: str) -> str:
    if not NAME_RE.fullmatch(v):
        raise ValueError(NAME_RULE)
    return v


def _var_name(v: str) -> str:
    if not _VAR_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not a valid environment variable name (letters, digits, '_'; no leading digit)")
    return v


def _non_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v


def _token(v: str) -> str:
    if len(v) > 64:
        raise ValueError(f"at most 64 characters, this one has {len(v)}")
    return v


Name = Annotated[StrictStr, AfterValidator(_name)]
VarName = Annotated[StrictStr, AfterValidator(_var_name)]
EnvName = Annotated[StrictStr, AfterValidator(_var_name), AfterValidator(check_env_name)]
NonBlank = Annotated[StrictStr, AfterValidator(_non_blank)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkloadCompute(_Strict):
    accelerator_type: Annotated[StrictStr, AfterValidator(check_accelerator_type)]
    num_accelerators: StrictInt = Field(..., ge=1)
    pool_id: NonBlank | None = None
    priority_class: Literal["BEST_EFFORT", "NORMAL", "CRITICAL"] | None = None


class WorkloadEnvironment(_Strict):
    version: Any = None
    dependencies: list[Annotated[NonBlank, AfterValidator(check_pip_spec)]] | None = None
    unity_catalog_image: NonBlank | None = None

    @field_validator("version")
    @classmethod
    def _version(cls, v: Any) -> Any:
        if v is None:
            return v
        text = str(v) if isinstance(v, int) and not isinstance(v, bool) else v
        m = _ENV_VERSION_RE.fullmatch(text) if isinstance(text, str) else None
        if not m or (m.group(1) and int(m.group(2)) < 5):
            raise ValueError("expected an environment version such as 6 or databricks_ai_v6 (v5 or later)")
        return v


class WorkloadCodeSource(_Strict):
    root_path: NonBlank


class WorkloadPermission(_Strict):
    user_name: NonBlank | None = None
    group_name: NonBlank | None = None
    service_principal_name: NonBlank | None = None
    level: NonBlank


class WorkloadFile(_Strict):
    """A workload YAML for `databricks air run -f`. Cross-field rules live in `_cross_field_problems`."""

    experiment_name: Name
    compute: WorkloadCompute
    command: NonBlank
    environment: WorkloadEnvironment | None = None
    code_source: WorkloadCodeSource | None = None
    env_variables: dict[EnvName, StrictStr] | None = None
    secrets: dict[VarName, Annotated[StrictStr, AfterValidator(check_secret_ref)]] | None = None
    max_retries: StrictInt | None = Field(None, ge=0)
    timeout_minutes: StrictInt | None = Field(None, ge=1)
    idempotency_token: Annotated[NonBlank, AfterValidator(_token)] | None = None
    parameters: dict[str, Any] | None = None
    mlflow_run_name: Name | None = None
    mlflow_experiment_directory: StrictStr | None = None
    permissions: list[WorkloadPermission] | None = None
    usage_policy_name: NonBlank | None = None
    usage_policy_id: NonBlank | None = None

    @field_validator("mlflow_experiment_directory")
    @classmethod
    def _workspace_dir(cls, v: str) -> str:
        if not (v == "/Workspace" or v.startswith("/Workspace/")):
            raise ValueError("must start with /Workspace")
        return v


def _cross_field_problems(data: dict[str, Any]) -> list[str]:
    """Rules that span keys. They read the raw mapping, so they are reported even when a field is bad."""
    problems = []
    compute = data.get("compute") if isinstance(data.get("compute"), dict) else {}
    accel, total = compute.get("accelerator_type"), compute.get("num_accelerators")
    accel = accel if isinstance(accel, str) else None  # a bad one is a field error already
    total = total if isinstance(total, int) and not isinstance(total, bool) and total >= 1 else None
    placement = placement_problems(accel, total, compute.get("pool_id"), compute.get("priority_class"))
    problems += [f"compute: {p}" for p in placement]

    env = data.get("environment")
    unset = "environment.version: not set; set it explicitly (e.g. databricks_ai_v6), the CLI's default changes"
    if env is None:
        problems.append(unset)
    elif isinstance(env, dict):
        if env.get("unity_catalog_image") is not None:
            for key in ("version", "dependencies"):
                if key in env:
                    problems.append(f"environment.{key}: not allowed together with environment.unity_catalog_image")
        elif env.get("version") is None:
            problems.append(unset)

    env_vars, secrets = data.get("env_variables"), data.get("secrets")
    if isinstance(env_vars, dict) and isinstance(secrets, dict):
        for name in sorted(set(env_vars) & set(secrets), key=str):
            problems.append(f"secrets.{name}: also set in env_variables; keep it only as a secret")

    if data.get("usage_policy_name") is not None and data.get("usage_policy_id") is not None:
        problems.append("usage_policy_name and usage_policy_id exclude each other; keep one")

    permissions = data.get("permissions")
    if isinstance(permissions, list):
        for i, entry in enumerate(permissions):
            if isinstance(entry, dict):
                given = [k for k in ("user_name", "group_name", "service_principal_name") if entry.get(k)]
                if len(given) != 1:
                    problems.append(
                        f"permissions.{i}: name exactly one of user_name, group_name, service_principal_name"
                        f" (got {', '.join(given) or 'none'})"
                    )
    return problems


# Keys people reach for that AI Runtime does not have, and what to write instead.
_CODE_SOURCE_HINT = "; the current form is code_source: {root_path: .}"
_KEY_HINTS = {
    "run_name": "; did you mean 'mlflow_run_name'?",
    "name": "; did you mean 'experiment_name'?",
    "image": "; did you mean 'environment.unity_catalog_image'?",
    "requirements": "; did you mean 'environment.dependencies' (a list of pip requirements)?",
    "env": "; did you mean 'env_variables'?",
    "timeout": "; did you mean 'timeout_minutes'?",
    "retries": "; did you mean 'max_retries'?",
    "code_source.type": _CODE_SOURCE_HINT,
    "code_source.snapshot": _CODE_SOURCE_HINT,
}


def _did_you_mean(loc: tuple) -> str:
    path = ".".join(str(p) for p in loc)
    return _KEY_HINTS[path] if path in _KEY_HINTS else did_you_mean(WorkloadFile, loc)


def _format_error(e: dict) -> str:
    loc = tuple(p for p in e["loc"] if p != "[key]")
    path = ".".join(str(p) for p in loc) or "(top level)"
    if e["type"] == "extra_forbidden":
        return f"unknown key '{path}'{_did_you_mean(loc)}"
    if e["type"] == "missing":
        return f"missing required key '{path}'"
    if e["type"] == "string_type":
        return f"{path}: expected a string (got {e.get('input')!r}); quote the value in YAML"
    msg = e["msg"].removeprefix("Value error, ")
    given = e.get("input")
    hidden = isinstance(given, (dict, list)) or "[key]" in e["loc"] or len(repr(given)) > 70
    shown = "" if hidden else f" (got {given!r})"
    return f"{path}: {msg}{shown}"


def validate_workload(data: Any) -> list[str]:
    """Every way `data` (a parsed workload YAML) breaks AI Runtime's rules; [] when it is valid."""
    if not isinstance(data, dict):
        return [f"expected a mapping of workload keys at the top level, got {type(data).__name__}"]
    try:
        WorkloadFile.model_validate(data)
        problems = []
    except ValidationError as err:
        problems = [_format_error(e) for e in err.errors()]
    return problems + _cross_field_problems(data)


def check_workload_file(path: str | Path) -> list[str]:
    """Read a workload YAML and return one line per problem (empty list: valid)."""
    try:
        text = read_text_file(Path(path), "workload")
    except UserError as e:  # unreadable, binary
        return [str(e)]
    return check_workload_text(text)


# ------------------------------------------------------------------------------------------- render
HF_HOME_DEFAULT = "/tmp/.hf"  # /root/.cache is read-only on AI Runtime workers
BUILD_DIR = '"${TMPDIR:-/tmp}/ftcli-src"'  # where the read-only code snapshot is copied (shell word)
SUBMIT = "databricks air run -f"


def render_command(recipe: Recipe) -> str:
    from_snapshot = shell_spec(recipe.compute.ftcli_spec)[1]
    lines = ["set -euo pipefail"]
    if from_snapshot:
        lines += [
            f"ftcli_src={BUILD_DIR}",
            'rm -rf "$ftcli_src" && cp -R "$CODE_SOURCE_PATH" "$ftcli_src" && chmod -R u+w "$ftcli_src"',
        ]
    lines.append(pip_install_line(recipe))
    lines.append(
        "torchrun --nnodes=${NUM_NODES:-1} --node_rank=${NODE_RANK:-0} "
        f"--nproc_per_node=${{LOCAL_WORLD_SIZE:-{recipe.compute.gpus_per_node}}} "
        "--master_addr=${MASTER_ADDR:-127.0.0.1} --master_port=${MASTER_PORT:-29500} "
        '-m ftcli train --recipe "$HYPERPARAMETERS_PATH"'
    )
    return "\n".join(lines) + "\n"


def build_workload(recipe: Recipe) -> dict[str, Any]:
    """The workload as a mapping, in the order it is written."""
    c = recipe.compute
    env_variables = dict(c.env_variables)
    if "HF_HOME" not in env_variables and "HF_HOME" not in c.secrets:
        env_variables["HF_HOME"] = HF_HOME_DEFAULT
    parameters = recipe.to_dict()
    parameters["compute"]["secrets"] = {}  # secret references live only under `secrets:`

    data: dict[str, Any] = {
        "experiment_name": c.experiment_name or recipe.name,
        "compute": {"accelerator_type": c.accelerator_type, "num_accelerators": c.num_accelerators},
        "environment": {"version": c.environment_version},
        "code_source": {"root_path": "."},
        "env_variables": env_variables,
    }
    if c.pool_id is not None:
        data["compute"]["pool_id"] = c.pool_id
    if c.priority_class is not None:
        data["compute"]["priority_class"] = c.priority_class
    if c.secrets:
        data["secrets"] = dict(c.secrets)
    data["max_retries"] = c.max_retries
    if c.timeout_minutes is not None:
        data["timeout_minutes"] = c.timeout_minutes
    if c.mlflow_experiment_directory is not None:
        data["mlflow_experiment_directory"] = c.mlflow_experiment_directory
    if c.permissions:
        data["permissions"] = [p.model_dump(exclude_none=True) for p in c.permissions]
    data["command"] = render_command(recipe)
    data["parameters"] = parameters
    return data


def _header(recipe: Recipe) -> list[str]:
    c = recipe.compute
    nodes = "node" if c.num_nodes == 1 else "nodes"
    lines = [
        f"# Databricks AI Runtime workload for the ftcli recipe '{recipe.name}' (ftcli render-workload).",
        "# Submit: databricks air run -f THIS_FILE  (check: --dry-run, or ftcli render-workload --check THIS_FILE)",
        f"# {c.num_nodes} {nodes} x {c.gpus_per_node} GPUs ({c.accelerator_type}); "
        "the same command runs on every node.",
        "# `parameters:` is the resolved recipe; the job trains from the copy at $HYPERPARAMETERS_PATH, so",
        "#   databricks air run -f THIS_FILE --override parameters.training.optimizer.lr=2e-5",
        "# changes a run without re-rendering.",
    ]
    if c.timeout_minutes is None:
        lines += comment("No timeout_minutes: compute.timeout_minutes is unset, so AI Runtime's default applies.")
    if not recipe.output_dir.is_absolute():
        lines += comment(
            f"Note: output.dir '{recipe.output_dir}' is relative to the job's working directory, which is gone "
            "after the run; set output.dir to a /Volumes/... path to keep checkpoints."
        )
    return lines


def _setup_comment(recipe: Recipe) -> list[str]:
    return setup_comment(
        recipe, "Setup runs at the start of every run on every node, so it installs wheels only, no CUDA source builds:",
        "torch stays the image's build. The read-only code snapshot is copied to a writable dir first: setuptools "
        "writes build metadata in-tree.")


def render_warnings(recipe: Recipe, *, fit_check: bool = True) -> list[str]:
    """What renders fine but would likely go wrong on the cluster."""
    preflight(recipe, fit_check=False)  # credentials in clear are refused, not warned about
    out = fit_warnings(recipe, fit_check=fit_check)
    if recipe.compute.accelerator_type not in AI_RUNTIME_TYPES:
        out.append(f"compute.accelerator_type={recipe.compute.accelerator_type} is not one of AI Runtime's accelerator "
                   f"types ({', '.join(AI_RUNTIME_TYPES)}); databricks air run will refuse it")
    t = recipe.training
    writes = t.checkpoint.enabled or t.checkpoint.save_final_hf
    if recipe.compute.num_nodes > 1 and writes and not recipe.output.dir.startswith(("/Volumes/", "/dbfs/")):
        out.append(
            f"output.dir={recipe.output.dir} is on each node's own disk, but the {recipe.compute.num_nodes} nodes "
            "write one checkpoint together: set output.dir to a path every node sees (e.g. /Volumes/<catalog>/"
            "<schema>/<volume>/...)"
        )
    elif not recipe.output_dir.is_absolute():
        out.append(
            f"output.dir={recipe.output.dir} is relative: it lands in the job's working directory, which is gone "
            "when the job ends; set output.dir to a /Volumes/<catalog>/<schema>/<volume>/... path to keep the "
            "checkpoints and the model"
        )
    out += checkout_warnings(recipe, Path.cwd(), f"{SUBMIT} ...")
    return out


def render_workload(recipe: Recipe, *, fit_check: bool = True) -> str:
    """The workload YAML for `databricks air run -f`, validated against `WorkloadFile` before it is returned.
    With `fit_check`, a recipe whose plan (ftcli.estimate.plan) does not fit its accelerator is refused with the reason
    and the nearest setting that fits."""
    preflight(recipe, fit_check=fit_check)
    data = build_workload(recipe)
    problems = validate_workload(data)
    if problems:
        raise UserError(
            f"recipe '{recipe.name}' does not make a valid AI Runtime workload (fix its compute section): "
            + "; ".join(problems)
        )
    head = {k: v for k, v in data.items() if k not in ("command", "parameters")}
    text = "\n".join(_header(recipe)) + "\n" + dump_yaml(head)
    text += "\n".join(_setup_comment(recipe)) + "\n" + dump_yaml({"command": data["command"]})
    text += "# The resolved recipe, written by AI Runtime to $HYPERPARAMETERS_PATH.\n"
    text += dump_yaml({"parameters": data["parameters"]})
    assert yaml.safe_load(text) == data, "rendered YAML does not parse back to the workload"
    return text


def check_workload_text(text: str) -> list[str]:
    """A workload's text, one line per problem (empty list: valid)."""
    try:
        data = parse_yaml(text)
    except UserError as e:  # not YAML (duplicate keys, aliases, deep nesting included)
        return [str(e)]
    if data is None:
        return ["the file is empty; a workload needs experiment_name, compute and command"]
    return validate_workload(data)


def _owns(text: str) -> bool:
    return not text.startswith("#!")  # a workload is YAML; a script starts with its interpreter


LAUNCHER = Launcher(name="databricks", what="AI Runtime workload", render=render_workload, warnings=render_warnings,
                    check=check_workload_text, owns=_owns, submit=SUBMIT + " {path}")
