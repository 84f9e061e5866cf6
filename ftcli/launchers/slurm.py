"""The Slurm launcher: render an sbatch script from a recipe, check one that already exists.

    #SBATCH directives   --nodes, --ntasks-per-node=1, --gpus-per-node from compute.accelerator_type and
                         compute.num_accelerators; --partition, --account, --qos, --time only where the recipe
                         sets compute.slurm.* (nothing guesses a site); --requeue, --open-mode=append and, with a
                         time limit, --signal=TERM@<compute.slurm.stop_before_limit_s>
    environment          the recipe's compute.env_variables, each `export NAME=<shlex-quoted value>`
    setup                the AI Runtime workload's install step (ftcli, the family's and features' pins,
                         compute.dependencies), once, on the first node; $CODE_SOURCE_PATH is the submit directory
    the recipe           resolved, in a quoted heredoc (no expansion), exported to every task
    one srun task/node   writes the recipe to a private temp dir and runs
                         torchrun --nnodes=$SLURM_NNODES --nproc_per_node=G --rdzv_backend=c10d
                                  --rdzv_endpoint=<first node>:<port> -m ftcli train --recipe ... [--resume]

Stop and requeue: Slurm's SIGTERM (preemption, `scancel --signal=TERM`, or --signal before the time limit) reaches
torchrun and the workers, which stop at the next step boundary with a checkpoint (ftcli.train.preempt). Each task
then exits 143; the batch script requeues the job (`scontrol requeue`, with compute.slurm.requeue), and a requeued
job (SLURM_RESTART_COUNT > 0) trains with `--resume` when the run dir holds a checkpoint. Slurm must deliver the
signal to every process of the step (proctrack/cgroup or proctrack/linuxproc, the usual settings), and the stop
checkpoint must be written before Slurm's SIGKILL: KillWait after scancel, the partition's GraceTime on
preemption, compute.slurm.stop_before_limit_s before the time limit; torchrun itself waits up to
ftcli.train.preempt.STOP_GRACE_S for its workers where it has --shutdown_timeout (torch 2.13).

The run dir must be on a path every node sees (and the node a requeued job lands on): `render_warnings` says so
when output.dir is relative or on a local file system here.

This module imports no torch, transformers, datasets or mlflow.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from ftcli.config.errors import UserError
from ftcli.config.recipe import (
    DATABRICKS_ONLY,
    SLURM_NAME_RE,
    SLURM_TIME_RE,
    Recipe,
    format_validation_error,
    parse_yaml,
)
from ftcli.launchers.base import (
    Launcher,
    checkout_warnings,
    comment,
    dump_yaml,
    fit_warnings,
    pip_install_line,
    preflight,
    setup_comment,
)
from ftcli.train.preempt import STOP_GRACE_S

SUBMIT = "sbatch"
# Quoted heredocs (no expansion) read into a variable without a command substitution, whose parsing of a
# heredoc body differs between bash versions
RECIPE_END = "FTCLI_RECIPE_END"
RECIPE_START = f"IFS= read -r -d '' FTCLI_RECIPE <<'{RECIPE_END}' || true"
TASK_END = "FTCLI_TASK_END"
TASK_START = f"IFS= read -r -d '' FTCLI_TASK <<'{TASK_END}' || true"
SOURCE_DIR = '"$SLURM_SUBMIT_DIR"'  # $CODE_SOURCE_PATH on Slurm: the directory sbatch was called from

# The directives ftcli writes, and the values each may hold (`check_script` refuses any other)
_INT = re.compile(r"[1-9][0-9]{0,5}")
DIRECTIVES: dict[str, re.Pattern | None] = {
    "job-name": re.compile(r"[A-Za-z0-9_-]{1,100}"),
    "nodes": _INT,
    "ntasks-per-node": re.compile("1"),
    "gpus-per-node": _INT,
    "partition": SLURM_NAME_RE,
    "account": SLURM_NAME_RE,
    "qos": SLURM_NAME_RE,
    "time": SLURM_TIME_RE,
    "signal": re.compile(r"TERM@[1-9][0-9]{1,5}"),
    "requeue": None,
    "no-requeue": None,
    "open-mode": re.compile("append"),
}
REQUIRED = ("job-name", "nodes", "ntasks-per-node")
# file systems every node of a cluster mounts the same; anything else (ext4, xfs, tmpfs, overlay) is one node's
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs", "wekafs",
             "panfs", "cifs", "smb3", "fuse.juicefs", "fuse.sshfs", "9p", "virtiofs", "fuse.gcsfuse", "fuse.s3fs")


# ---------------------------------------------------------------------------------------------- render
def processes_per_node(recipe: Recipe) -> tuple[int, str]:
    if recipe.compute.slurm_keys.devices == "cpu":
        return recipe.training.cpu_processes, "CPU processes"
    return recipe.compute.gpus_per_node, "GPUs"


def _directives(recipe: Recipe) -> list[str]:
    c, s = recipe.compute, recipe.compute.slurm_keys
    lines = [f"--job-name={recipe.name}", f"--nodes={c.num_nodes}", "--ntasks-per-node=1"]
    if s.devices == "gpu":
        lines.append(f"--gpus-per-node={c.gpus_per_node}")
    for key, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos), ("time", s.time_limit)):
        if value is not None:
            lines.append(f"--{key}={value}")
    if s.time_limit is not None:
        lines.append(f"--signal=TERM@{s.stop_before_limit_s}")
    lines += ["--requeue" if s.requeue else "--no-requeue", "--open-mode=append"]
    return ["#SBATCH " + line for line in lines]


def _header(recipe: Recipe) -> list[str]:
    c = recipe.compute
    nproc, unit = processes_per_node(recipe)
    nodes = "node" if c.num_nodes == 1 else "nodes"
    lines = [
        "#!/bin/bash",
        f"# Slurm batch script for the ftcli recipe '{recipe.name}' (ftcli render-workload).",
        "# Submit: sbatch THIS_FILE  (check: ftcli render-workload --check THIS_FILE)",
        f"# {c.num_nodes} {nodes} x {nproc} {unit} ({c.accelerator_type if unit == 'GPUs' else 'compute.slurm.devices: cpu'}): "
        "one srun task per node runs torchrun,",
        "# c10d rendezvous on the first node.",
    ]
    lines += comment("Stops: a SIGTERM from Slurm (preemption, scancel --signal=TERM, or the time limit's --signal) "
                     "makes ftcli checkpoint at the next step and exit 143; the job then requeues itself and the "
                     "requeued job resumes from that checkpoint (--resume)." if c.slurm_keys.requeue else
                     "Stops: a SIGTERM from Slurm makes ftcli checkpoint at the next step and exit 143; "
                     "compute.slurm.requeue is off, so resume by hand (ftcli train --recipe <run>/recipe.yaml --resume).")
    if c.slurm_keys.time_limit is None:
        lines += comment("No --time: compute.slurm.time_limit is unset, so the partition's limit applies (and no "
                         "stop signal comes before it).")
    return lines


def _task(recipe: Recipe) -> str:
    """What each node's srun task runs (bash). Static text: every recipe value reaches it through the environment."""
    nproc, _ = processes_per_node(recipe)
    return "\n".join([
        "set -euo pipefail",
        'work=$(mktemp -d "${TMPDIR:-/tmp}/ftcli-job.XXXXXXXX")',
        'printf \'%s\\n\' "$FTCLI_RECIPE" > "$work/recipe.yaml"',
        "stop=0",
        "trap 'stop=1' TERM  # torchrun and the workers get Slurm's SIGTERM too; they checkpoint and stop",
        "# torchrun's wait for the workers' stop checkpoint before SIGKILL (default 30 s); torch < 2.13 has no option",
        "grace=",
        "if torchrun --help 2>/dev/null | grep -q -- --shutdown_timeout; then "
        f"grace=--shutdown_timeout={STOP_GRACE_S}; fi",
        'torchrun --nnodes="$SLURM_NNODES" '
        f"--nproc_per_node={nproc} $grace "
        '--rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$FTCLI_RDZV_ENDPOINT" '
        '-m ftcli train --recipe "$work/recipe.yaml" ${FTCLI_RESUME:+--resume} &',
        "pid=$!",
        "# poll, then wait: a trapped signal would end a `wait` early, and a second `wait` may have lost the status",
        'while kill -0 "$pid" 2>/dev/null; do sleep 1 || true; done',
        'status=0',
        'wait "$pid" || status=$?',
        'rm -rf "$work"',
        'if [ "$stop" = 1 ] && [ "$status" -ne 0 ]; then exit 143; fi  # stopped, not finished just then',
        'exit "$status"',
    ])


def render_script(recipe: Recipe) -> str:
    """The sbatch script (no preflight; `render` adds it)."""
    c, s = recipe.compute, recipe.compute.slurm_keys
    lines = _header(recipe) + _directives(recipe) + ["set -euo pipefail", ""]
    if c.env_variables:
        lines.append("# The recipe's compute.env_variables")
        lines += [f"export {name}={shlex.quote(value)}" for name, value in c.env_variables.items()]
    lines += ["export PYTHONUNBUFFERED=1", ""]
    if s.install:
        lines += setup_comment(recipe, "Setup runs once per job, on the first node, into the Python the job runs "
                                       "(activate it before sbatch; it must be the same on every node):",
                               "torch stays the environment's build. $CODE_SOURCE_PATH is the submit directory.")
        lines += [pip_install_line(recipe, SOURCE_DIR), ""]
    else:
        lines += comment("No setup (compute.slurm.install: false): the job's Python already has ftcli and its pins.")
        lines.append("")
    parameters = recipe.to_dict()
    parameters["compute"]["secrets"] = {}
    recipe_text = dump_yaml(parameters)
    if RECIPE_END in recipe_text.splitlines():
        raise UserError(f"the recipe holds a line '{RECIPE_END}', which would end its heredoc in the script")
    run_dir = str(recipe.output_dir)
    lines += [
        "# The resolved recipe; each node writes it to a private file and trains from it.",
        RECIPE_START,
        recipe_text.rstrip("\n"),
        RECIPE_END,
        "export FTCLI_RECIPE",
        f"run_dir={shlex.quote(run_dir)}  # output.dir, as the job sees it",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE',
        f'export FTCLI_RDZV_ENDPOINT="$head_node:{s.rendezvous_port}"',
        "# a requeued job resumes from the run's newest checkpoint",
        'FTCLI_RESUME=""',
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -n "$(ls -A "$run_dir/checkpoints" 2>/dev/null)" ]; then',
        "  FTCLI_RESUME=1",
        "fi",
        "export FTCLI_RESUME",
        "",
        "# One task per node. The batch shell waits for it through a SIGTERM of its own (preemption signals it too).",
        TASK_START,
        _task(recipe),
        TASK_END,
        "stopped=0",
        "trap 'stopped=1' TERM",
        f'srun --nodes={c.num_nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$FTCLI_TASK" &',
        "srun_pid=$!",
        'while kill -0 "$srun_pid" 2>/dev/null; do sleep 1 || true; done',
        "status=0",
        'wait "$srun_pid" || status=$?',
        'if [ "$status" -ne 0 ] && { [ "$status" -eq 143 ] || [ "$stopped" = 1 ]; }; then',
    ]
    if s.requeue:
        lines += [
            '  echo "ftcli: stopped with a checkpoint; requeueing job $SLURM_JOB_ID (it resumes with --resume)" >&2',
            '  scontrol requeue "$SLURM_JOB_ID" || echo "ftcli: scontrol requeue failed; resubmit to resume" >&2',
        ]
    else:
        lines.append('  echo "ftcli: stopped with a checkpoint; resume with ftcli train --recipe '
                     '$run_dir/recipe.yaml --resume" >&2')
    lines += ["fi", 'exit "$status"']
    return "\n".join(lines) + "\n"


def render(recipe: Recipe, *, fit_check: bool = True) -> str:
    """The sbatch script, checked by `check_script` before it is returned. With `fit_check`, a recipe whose plan
    does not fit its accelerator is refused (ftcli.launchers.base.preflight)."""
    preflight(recipe, fit_check=fit_check)
    if recipe.compute.secrets:
        raise UserError(f"compute.secrets ({', '.join(recipe.compute.secrets)}) are Databricks secret references, "
                        "which a Slurm job cannot read; set them in the job's environment (exported before sbatch) "
                        "and remove compute.secrets")
    text = render_script(recipe)
    problems = check_script(text)
    assert problems == [], problems  # a rendered script is valid by construction
    return text


# -------------------------------------------------------------------------------------------- warnings
def file_system_of(path: Path, mounts: str) -> str | None:
    """The type of the file system `path` is on, from /proc/mounts' text (the longest mount point above it)."""
    best, fstype = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype


def shared_path_warnings(recipe: Recipe, mounts: str | None) -> list[str]:
    """output.dir must be a path every node sees, and the node a requeued job lands on."""
    out = recipe.output_dir
    if not out.is_absolute():
        return [f"output.dir={recipe.output.dir} is relative: the job resolves it in the directory sbatch is called "
                "from; every node (and a requeued job's node) must see it, so set an absolute path on a shared file "
                "system"]
    fstype = file_system_of(out.expanduser(), mounts) if mounts is not None else None
    if fstype is not None and fstype not in SHARED_FS and not fstype.startswith("nfs"):
        return [f"output.dir={recipe.output.dir} is on a local file system here ({fstype}): the nodes of the job and "
                "the node a requeued job lands on must all see the run dir; set output.dir to a shared path"]
    return []


def _mounts() -> str | None:
    try:
        return Path("/proc/mounts").read_text()
    except OSError:
        return None


def render_warnings(recipe: Recipe, *, fit_check: bool = True) -> list[str]:
    preflight(recipe, fit_check=False)
    out = fit_warnings(recipe, fit_check=fit_check)
    out += shared_path_warnings(recipe, _mounts())
    ignored = [key for key, unused in DATABRICKS_ONLY.items() if getattr(recipe.compute, key) != unused]
    if ignored:
        out.append(f"ignored by the Slurm launcher (AI Runtime keys): {', '.join('compute.' + k for k in ignored)}; "
                   "the job's time limit is compute.slurm.time_limit")
    if recipe.compute.slurm_keys.install:
        out += checkout_warnings(recipe, Path.cwd(), "sbatch ...")
    return out


# ----------------------------------------------------------------------------------------------- check
def _heredoc(lines: list[str], start: str, end: str) -> str | None:
    try:
        i = lines.index(start)
        j = lines.index(end, i + 1)
    except ValueError:
        return None
    return "\n".join(lines[i + 1:j]) + "\n"


def check_script(text: str) -> list[str]:
    """Every problem of an sbatch script as ftcli writes it: shell syntax (`bash -n`), the directives (only those
    ftcli writes, each with a value of its form, the required ones present), the embedded recipe (a valid recipe
    whose nodes and GPUs agree with the directives), and the training command (srun, torchrun's c10d rendezvous)."""
    lines = text.splitlines()
    if not lines or lines[0] != "#!/bin/bash":
        return ["not an sbatch script ftcli writes: the first line must be #!/bin/bash"]
    problems = []
    bash = shutil.which("bash")
    if bash is not None:
        res = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            problems.append("shell syntax: " + " ".join(res.stderr.replace(f"{bash}: ", "").split())[:300])
    directives: dict[str, str | None] = {}
    for n, line in enumerate(lines[1:], start=2):
        if not line.startswith("#SBATCH"):
            if line.startswith("#") or not line.strip():
                continue
            break  # sbatch reads directives only up to the first command
        m = re.fullmatch(r"#SBATCH --([a-z-]+)(?:=(.*))?", line)
        if not m:
            problems.append(f"line {n}: a directive ftcli does not write: {line[:80]!r}")
            continue
        key, value = m.group(1), m.group(2)
        if key not in DIRECTIVES:
            problems.append(f"line {n}: --{key} is not a directive ftcli writes")
        elif key in directives:
            problems.append(f"line {n}: --{key} given twice")
        elif (DIRECTIVES[key] is None) != (value is None) or (value is not None and not DIRECTIVES[key].fullmatch(value)):
            problems.append(f"line {n}: --{key}: bad value {value!r}")
        directives[key] = value
    problems += [f"missing directive --{key}" for key in REQUIRED if key not in directives]
    if "requeue" in directives and "no-requeue" in directives:
        problems.append("--requeue and --no-requeue exclude each other")
    recipe_text = _heredoc(lines, RECIPE_START, RECIPE_END)
    if recipe_text is None:
        problems.append(f"no embedded recipe (a FTCLI_RECIPE heredoc ending in {RECIPE_END})")
    else:
        problems += _recipe_problems(recipe_text, directives)
    task = _heredoc(lines, TASK_START, TASK_END) or ""
    if "torchrun " not in task or "--rdzv_backend=c10d" not in task or '--nnodes="$SLURM_NNODES"' not in task:
        problems.append("no per-node task running torchrun with a c10d rendezvous (a FTCLI_TASK heredoc)")
    if not any(line.startswith("srun ") and 'bash -c "$FTCLI_TASK"' in line for line in lines):
        problems.append('no srun line running the task (srun ... bash -c "$FTCLI_TASK")')
    return problems


def _recipe_problems(recipe_text: str, directives: dict[str, str | None]) -> list[str]:
    from pydantic import ValidationError

    try:
        recipe = Recipe.model_validate(parse_yaml(recipe_text))
    except UserError as e:
        return [f"embedded recipe: {e}"]
    except ValidationError as e:
        return ["embedded recipe: " + format_validation_error(e, "-").removeprefix("invalid recipe -: ")]
    problems = []
    if directives.get("nodes") != str(recipe.compute.num_nodes):
        problems.append(f"--nodes={directives.get('nodes')} but the embedded recipe needs {recipe.compute.num_nodes} "
                        f"({recipe.compute.num_accelerators} x {recipe.compute.accelerator_type})")
    gpus = str(recipe.compute.gpus_per_node) if recipe.compute.slurm_keys.devices == "gpu" else None
    if directives.get("gpus-per-node") != gpus:
        problems.append(f"--gpus-per-node={directives.get('gpus-per-node')} but the embedded recipe needs {gpus}")
    return problems


def _owns(text: str) -> bool:
    return text.startswith("#!")


LAUNCHER = Launcher(name="slurm", what="sbatch script", render=render, warnings=render_warnings, check=check_script,
                    owns=_owns, submit=SUBMIT + " {path}")
