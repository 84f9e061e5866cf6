"""The `compute` section: where a job runs. `compute.launcher` picks who reads it (ftcli.launchers); the card and
GPU count, env variables, dependencies and the ftcli pip spec are every launcher's, the AI Runtime keys sit at the
top level (as recipes have always written them) and Slurm's under `compute.slurm`. The rules on single values
(accelerator strings, secret references, Slurm names and time limits) are shared with the launchers' file checks."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from ftcli.config.accelerators import Accelerator, parse_accelerator
from ftcli.config.pipspec import check_env_name, check_pip_spec
from ftcli.config.sections.base import Section


class PermissionConfig(Section):
    user_name: str | None = None
    group_name: str | None = None
    service_principal_name: str | None = None
    level: str

    @model_validator(mode="after")
    def _one_principal(self) -> PermissionConfig:
        given = [x for x in (self.user_name, self.group_name, self.service_principal_name) if x]
        if len(given) != 1:
            raise ValueError("a permission names exactly one of user_name, group_name, service_principal_name")
        return self


# Where a job runs: rules shared by `ComputeConfig` and the launchers' file checks (`ftcli.launchers`).
def check_accelerator_type(v: str) -> str:
    parse_accelerator(v)  # a ValueError saying the form
    return v


def check_secret_ref(v: str) -> str:
    if v.count("/") != 1 or not all(v.split("/")):
        raise ValueError("must be 'scope/key' (exactly one '/')")
    return v


def placement_problems(
    accelerator_type: str | None, num_accelerators: int | None, pool_id: str | None, priority_class: str | None
) -> list[str]:
    """Every broken rule between the compute keys, one line each. None: a key that is missing or
    already reported as bad on its own (those rules are skipped)."""
    problems = []
    try:
        per_node = parse_accelerator(accelerator_type).gpus_per_node if accelerator_type is not None else None
    except ValueError:
        per_node = None
    if per_node and num_accelerators is not None and num_accelerators % per_node:
        problems.append(f"num_accelerators={num_accelerators} is not a multiple of the {per_node} GPUs per node "
                        f"of {accelerator_type}")
    if priority_class is not None and not pool_id:
        problems.append("priority_class needs pool_id (provisioned capacity)")
    return problems


# Slurm names (partition, account, qos): letters, digits and . _ + -, so a directive holds one word and no shell
SLURM_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]], or UNLIMITED
SLURM_TIME_RE = re.compile(r"[0-9]{1,7}(:[0-9]{1,2}){0,2}|[0-9]{1,4}-[0-9]{1,2}(:[0-9]{1,2}){0,2}|UNLIMITED")


def check_slurm_name(v: str) -> str:
    if not SLURM_NAME_RE.fullmatch(v):
        raise ValueError("use 1-64 letters, digits, '.', '_', '+' or '-' (no spaces or shell characters)")
    return v


def check_slurm_time(v: str) -> str:
    if not SLURM_TIME_RE.fullmatch(v):
        raise ValueError("a Slurm time limit: MINUTES, HH:MM:SS, D-HH, D-HH:MM:SS or UNLIMITED (e.g. 04:00:00)")
    return v


class SlurmConfig(Section):
    """`compute.slurm`: the keys only the Slurm launcher reads (ftcli.launchers.slurm). Nothing guesses a
    site: a key left unset writes no directive, so the cluster's defaults apply."""

    partition: Annotated[str, AfterValidator(check_slurm_name)] | None = Field(
        None, description="sbatch --partition (unset: the cluster's default partition).")
    account: Annotated[str, AfterValidator(check_slurm_name)] | None = Field(
        None, description="sbatch --account (unset: your default account).")
    qos: Annotated[str, AfterValidator(check_slurm_name)] | None = Field(None, description="sbatch --qos.")
    time_limit: Annotated[str, AfterValidator(check_slurm_time)] | None = Field(
        None, description="sbatch --time, e.g. 04:00:00 or 2-00:00:00 (unset: the partition's limit).")
    devices: Literal["gpu", "cpu"] = Field(
        "gpu", description="gpu: GPUs per node from compute.accelerator_type; cpu: training.cpu_processes per node, "
                           "no GPU request (CPU clusters, tests).")
    install: bool = Field(True, description="pip install ftcli (compute.ftcli_spec), the kernel pins and "
                                            "compute.dependencies into the job's Python before training.")
    stop_before_limit_s: int = Field(
        600, ge=60, description="SIGTERM this many seconds before the time limit: ftcli checkpoints, the job requeues.")
    requeue: bool = Field(True, description="Requeue after a preemption or a stop before the time limit; the "
                                            "requeued job resumes from the checkpoint (--resume).")
    rendezvous_port: int = Field(29500, ge=1024, le=65535, description="c10d rendezvous port on the first node.")


# Keys only the Databricks launcher reads, at the values that mean "not used" (the other launchers say they ignore them)
DATABRICKS_ONLY = {"experiment_name": None, "pool_id": None, "priority_class": None, "secrets": {},
                   "mlflow_experiment_directory": None, "permissions": [], "timeout_minutes": None, "max_retries": 0}


class ComputeConfig(Section):
    """Where a job runs. `launcher` picks who reads this section (ftcli.launchers): the card and GPUs
    (`accelerator_type`, `num_accelerators`), `env_variables`, `dependencies` and `ftcli_spec` are every launcher's;
    the AI Runtime keys stay at the top level (as recipes have always written them), Slurm's are under `slurm:`.
    One recipe renders for either launcher (`render-workload --launcher`); each says which keys it ignores."""

    quiet_defaults: ClassVar[dict[str, Any]] = {"launcher": "databricks", "slurm": None}

    launcher: Literal["databricks", "slurm"] = Field(
        "databricks", description="databricks: an AI Runtime workload YAML; slurm: an sbatch script.")
    accelerator_type: Annotated[str, AfterValidator(check_accelerator_type)] = Field(
        "GPU_8xH100", description="GPU_<gpus per node>x<model>, e.g. GPU_8xB300.")
    num_accelerators: int = Field(8, ge=1, description="Total GPUs (a multiple of GPUs per node).")
    experiment_name: str | None = Field(None, description="AI Runtime experiment; default: the recipe name.")
    environment_version: str = "databricks_ai_v6"
    dependencies: list[Annotated[str, AfterValidator(check_pip_spec)]] = Field(
        default_factory=list, description="Extra pip requirements for the job (requirements or local paths).")
    env_variables: dict[Annotated[str, AfterValidator(check_env_name)], str] = Field(default_factory=dict)
    secrets: dict[str, Annotated[str, AfterValidator(check_secret_ref)]] = Field(
        default_factory=dict, description="NAME -> 'scope/key'.")
    timeout_minutes: int | None = Field(None, ge=1)
    max_retries: int = Field(0, ge=0)
    pool_id: str | None = None
    priority_class: Literal["BEST_EFFORT", "NORMAL", "CRITICAL"] | None = None
    mlflow_experiment_directory: str | None = None
    permissions: list[PermissionConfig] = Field(default_factory=list)
    ftcli_spec: Annotated[str, AfterValidator(check_pip_spec)] = Field(
        "$CODE_SOURCE_PATH", description="pip spec that installs ftcli in the job (a requirement or a local path; "
                                         "$CODE_SOURCE_PATH: the checkout the job is submitted from).")
    slurm: SlurmConfig | None = Field(None, description="The Slurm launcher's keys (compute.launcher: slurm).")

    @field_validator("env_variables")
    @classmethod
    def _no_secret_values(cls, env: dict[str, str]) -> dict[str, str]:
        from ftcli.config.redact import holds_credentials, looks_secret

        secret = sorted(k for k, v in env.items() if looks_secret(k) or holds_credentials(v))
        if secret:  # a value here would land in recipe.yaml, run.json and the workload in clear
            raise ValueError(f"{', '.join(secret)} looks like a secret; env_variables values are written in clear, "
                             f"so set it in compute.secrets as {secret[0]}: <scope>/<key> (a Databricks secret)")
        return env

    @model_validator(mode="after")
    def _topology(self) -> ComputeConfig:
        problems = placement_problems(self.accelerator_type, self.num_accelerators, self.pool_id, self.priority_class)
        both = sorted(set(self.secrets) & set(self.env_variables))
        if both:
            problems.append(f"{', '.join(both)} set both as a secret and as an env variable")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def accelerator(self) -> Accelerator:
        return parse_accelerator(self.accelerator_type)

    @property
    def gpus_per_node(self) -> int:
        return self.accelerator.gpus_per_node

    @property
    def num_nodes(self) -> int:
        return self.num_accelerators // self.gpus_per_node

    @property
    def slurm_keys(self) -> SlurmConfig:
        """compute.slurm, or its defaults when the section is absent."""
        return self.slurm or SlurmConfig()
