"""The Slurm launcher (ftcli.launchers.slurm): the sbatch script for a recipe and its check. Its shell logic run
with stand-ins for srun / torchrun / pip is tests/e2e/test_slurm_script.py, the real Slurm run
tests/e2e/test_slurm_e2e.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ftcli.config.errors import UserError
from ftcli.config.recipe import RecipeError, load_recipe
from ftcli.launchers import slurm

BASH = shutil.which("bash")
SLURM = ["compute.launcher=slurm"]
GPU_RECIPES = ["gemma3-12b-h100", "gpt-oss-120b-h100", "gpt-oss-h100", "llama3-70b-lora-h100", "llama3-8b-h100",
               "qwen-b300", "qwen3-30b-a3b-lora-h100"]


def _recipe(name: str, *sets: str):
    return load_recipe(name, [*SLURM, *sets])


def _directives(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


# --------------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("name", GPU_RECIPES)
def test_shipped_gpu_recipes_render_scripts_that_pass_check_and_bash_n(name, nodes, tmp_path):
    per_node = load_recipe(name).compute.gpus_per_node
    recipe = _recipe(name, f"compute.num_accelerators={per_node * nodes}")
    text = slurm.render(recipe, fit_check=False)
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert slurm.check_script(text) == []
    if BASH:
        assert subprocess.run([BASH, "-n", str(path)]).returncode == 0
    assert _directives(text)[:4] == [f"--job-name={name}", f"--nodes={nodes}", "--ntasks-per-node=1",
                                     f"--gpus-per-node={per_node}"]
    from ftcli import cli

    res = CliRunner().invoke(cli.app, ["render-workload", "--check", str(path)])
    assert res.exit_code == 0 and " ".join(res.output.split()) == f"{path}: valid sbatch script"


def test_no_site_is_guessed_and_the_recipe_keys_become_directives():
    bare = slurm.render(_recipe("llama3-8b-h100"), fit_check=False)
    assert _directives(bare) == ["--job-name=llama3-8b-h100", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=8",
                                 "--requeue", "--open-mode=append"]
    full = slurm.render(_recipe("llama3-8b-h100", "compute.num_accelerators=32", "compute.slurm.partition=gpu-h100",
                                "compute.slurm.account=proj.42", "compute.slurm.qos=high", "compute.slurm.time_limit=1-12:00:00",
                                "compute.slurm.stop_before_limit_s=900"), fit_check=False)
    assert _directives(full) == ["--job-name=llama3-8b-h100", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8",
                                 "--partition=gpu-h100", "--account=proj.42", "--qos=high", "--time=1-12:00:00",
                                 "--signal=TERM@900", "--requeue", "--open-mode=append"]
    cpu = slurm.render(_recipe("tiny-qwen-cpu", "compute.slurm.devices=cpu", "compute.slurm.requeue=false"))
    assert _directives(cpu) == ["--job-name=tiny-qwen-cpu", "--nodes=1", "--ntasks-per-node=1", "--no-requeue",
                                "--open-mode=append"]
    assert "--nproc_per_node=2 " in cpu  # training.cpu_processes


@pytest.mark.parametrize("key,value", [
    ("partition", "gpu h100"), ("partition", "gpu;reboot"), ("account", "$(id)"), ("qos", "a\nb"),
    ("partition", "-p"), ("time_limit", "4h"), ("time_limit", "04:00:00;x"), ("rendezvous_port", "80"),
])
def test_bad_slurm_values_are_refused_in_one_line(key, value):
    with pytest.raises(RecipeError) as e:
        _recipe("llama3-8b-h100", f"compute.slurm.{key}={json.dumps(value)}")
    assert f"compute.slurm.{key}" in str(e.value) and "\n" not in str(e.value).split(": ", 1)[1].strip()


def test_secrets_are_refused_and_ai_runtime_keys_are_said_to_be_ignored(monkeypatch, tmp_path):
    with pytest.raises(UserError, match=r"compute.secrets \(HF_TOKEN\) are Databricks secret references"):
        slurm.render(_recipe("gpt-oss-h100", "compute.secrets.HF_TOKEN=scope/key"), fit_check=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[3])  # the checkout: no warning about the submit dir
    warnings = slurm.render_warnings(_recipe("gpt-oss-h100", "output.dir=runs/x"), fit_check=False)
    assert warnings[-1] == ("ignored by the Slurm launcher (AI Runtime keys): compute.experiment_name, "
                            "compute.timeout_minutes; the job's time limit is compute.slurm.time_limit")
    assert warnings[0].startswith("output.dir=runs/x is relative: the job resolves it in the directory sbatch is")


MOUNTS = """overlay / overlay rw 0 0
/dev/sda1 /scratch ext4 rw 0 0
fs:/export /shared nfs4 rw 0 0
lustre@tcp:/fs /lustre lustre rw 0 0
tmpfs /shared/tmp tmpfs rw 0 0
"""


@pytest.mark.parametrize("path,fstype,warned", [
    ("/shared/runs/x", "nfs4", False), ("/lustre/u/runs", "lustre", False), ("/scratch/runs", "ext4", True),
    ("/shared/tmp/run", "tmpfs", True), ("/home/u/runs", "overlay", True), ("/sharedx/run", "overlay", True),
])
def test_run_dir_on_a_local_file_system_is_warned_about(path, fstype, warned):
    assert slurm.file_system_of(Path(path), MOUNTS) == fstype
    warnings = slurm.shared_path_warnings(_recipe("llama3-8b-h100", f"output.dir={path}"), MOUNTS)
    assert bool(warnings) == warned
    if warned:
        assert warnings == [f"output.dir={path} is on a local file system here ({fstype}): the nodes of the job and "
                            "the node a requeued job lands on must all see the run dir; set output.dir to a shared path"]


def test_render_refuses_a_recipe_that_does_not_fit_like_the_ai_runtime_launcher():
    recipe = _recipe("qwen-b300", "compute.accelerator_type=GPU_8xH100", "data.packing.block_len=65536")
    with pytest.raises(UserError, match="does not fit GPU_8xH100.*--no-fit-check renders it anyway"):
        slurm.render(recipe)
    assert slurm.check_script(slurm.render(recipe, fit_check=False)) == []


# ---------------------------------------------------------------------------------------------- check
def _script() -> str:
    return slurm.render(_recipe("llama3-8b-h100", "compute.num_accelerators=16", "compute.slurm.partition=gpu"),
                        fit_check=False)


@pytest.mark.parametrize("edit,expected", [
    (lambda t: t.replace("#SBATCH --partition=gpu", "#SBATCH --partition=gpu h100"),
     "line 15: --partition: bad value 'gpu h100'"),
    (lambda t: t.replace("#SBATCH --partition=gpu", "#SBATCH --wrap=reboot"), "line 15: --wrap is not a directive ftcli writes"),
    (lambda t: t.replace("#SBATCH --nodes=2", "#SBATCH --nodes=3"),
     "--nodes=3 but the embedded recipe needs 2 (16 x GPU_8xH100)"),
    (lambda t: t.replace("#SBATCH --gpus-per-node=8", "#SBATCH --gpus-per-node=4"),
     "--gpus-per-node=4 but the embedded recipe needs 8"),
    (lambda t: t.replace("#SBATCH --job-name=llama3-8b-h100\n", ""), "missing directive --job-name"),
    (lambda t: t.replace("  lr: 1.0e-05", "  lr: fast"),
     "embedded recipe: training.optimizer.lr: Input should be a valid number, unable to parse string as a number"),
    (lambda t: t.replace("--rdzv_backend=c10d", "--rdzv_backend=static"),
     "no per-node task running torchrun with a c10d rendezvous (a FTCLI_TASK heredoc)"),
    (lambda t: t.replace("#!/bin/bash", "#!/bin/sh"), "not an sbatch script ftcli writes: the first line must be #!/bin/bash"),
])
def test_check_names_each_broken_rule(edit, expected):
    text = _script()
    edited = edit(text)
    assert edited != text
    problems = slurm.check_script(edited)
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_check_runs_bash_n():
    problems = slurm.check_script(_script().replace('exit "$status"', 'if then "$status"'))
    assert len(problems) == 1 and problems[0].startswith("shell syntax: line "), problems


# ------------------------------------------------------------------------------------- both launchers
@pytest.mark.parametrize("launcher", ["databricks", "slurm"])
@pytest.mark.parametrize("name", ["PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONFIG_FILE",
                                  "pip_index_url", "BASH_ENV", "LD_PRELOAD", "PYTHONPATH", "PYTHONSTARTUP", "A-B", "1X"])
def test_pip_and_loader_variables_are_refused_for_every_launcher(launcher, name):
    with pytest.raises(RecipeError) as e:
        load_recipe("gpt-oss-h100", [f"compute.launcher={launcher}", f"compute.env_variables.{name}=x"])
    message = str(e.value)
    assert "compute.env_variables" in message and "\n" not in message.split(": ", 1)[1].strip()
    if name.upper().startswith("PIP_"):
        assert f"{name} is a pip option" in message
    elif name in ("A-B", "1X"):
        assert "is not a valid environment variable name" in message
    else:
        assert f"{name} makes the job's shell, loader or Python run other code before ftcli" in message


def test_a_workload_file_with_a_pip_variable_is_refused(tmp_path):
    from ftcli.launchers import databricks

    data = yaml.safe_load(databricks.render_workload(load_recipe("gpt-oss-h100")))
    data["env_variables"]["PIP_INDEX_URL"] = "http://evil.example/simple"
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data))
    (problem,) = databricks.check_workload_file(path)
    assert problem.startswith("env_variables.PIP_INDEX_URL: PIP_INDEX_URL is a pip option")


@pytest.mark.parametrize("launcher", ["databricks", "slurm"])
def test_strings_a_yaml_reader_would_retype_are_quoted(launcher):
    """YAML 1.2 reads 1e3, 12345e67 and 0o17 as numbers and YAML 1.1 reads y / n as booleans; PyYAML writes
    them plain unless told. Every such string in the rendered file is quoted and reads back as the string."""
    values = {"A": "1e3", "B": "12345e67", "C": "0o17", "D": "y", "E": "0x1F", "F": ".inf", "G": "+12", "H": "1_000",
              "I": "2026-12-05", "J": "on", "K": "~", "L": "plain"}
    recipe = load_recipe("gpt-oss-h100", [f"compute.launcher={launcher}", "model.revision='12345e67'",
                                          *(f"compute.env_variables.{k}={json.dumps(v)}" for k, v in values.items())])
    from ftcli.launchers import launcher_named

    text = launcher_named(launcher).render(recipe, fit_check=False)
    if launcher == "slurm":
        text = text.split(slurm.RECIPE_START + "\n")[1].split("\n" + slurm.RECIPE_END)[0]
        assert "    A: '1e3'" in text and "  revision: '12345e67'" in text
    else:
        assert "  A: '1e3'\n" in text and "  C: '0o17'\n" in text and "    revision: '12345e67'\n" in text
    data = yaml.safe_load(text)
    env = data["compute"]["env_variables"] if launcher == "slurm" else data["env_variables"]
    assert {k: env[k] for k in values} == values
    for value in ("1e3", "12345e67", "0o17", "y", "0x1F", ".inf"):
        assert f": {value}\n" not in text  # never plain


# ------------------------------------------------------------------------------------------- the CLI
def test_render_workload_takes_the_launcher_from_the_recipe_or_the_flag(tmp_path):
    from ftcli import cli

    runner = CliRunner()
    out = tmp_path / "job.sbatch"
    res = runner.invoke(cli.app, ["render-workload", "--recipe", "tiny-qwen-cpu", "--launcher", "slurm", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text().startswith("#!/bin/bash\n") and f"submit with: sbatch {out}" in " ".join(res.stderr.split())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(out.read_text().split(slurm.RECIPE_START + "\n")[1].split(slurm.RECIPE_END)[0])
    res = runner.invoke(cli.app, ["render-workload", "--recipe", str(recipe)])  # compute.launcher: slurm
    assert res.exit_code == 0 and res.stdout.startswith("#!/bin/bash\n")
    res = runner.invoke(cli.app, ["render-workload", "--recipe", str(recipe), "--launcher", "databricks"])
    assert res.exit_code == 0 and res.stdout.startswith("# Databricks AI Runtime workload")
    res = runner.invoke(cli.app, ["render-workload", "--recipe", "tiny-qwen-cpu", "--launcher", "pbs"])
    assert res.exit_code == 2 and "compute.launcher" in res.stderr and "'databricks' or 'slurm'" in res.stderr


@pytest.mark.parametrize("launcher", ["databricks", "slurm"])
def test_output_force_replaces_a_link_and_leaves_its_target(launcher, tmp_path):
    from ftcli import cli

    victim = tmp_path / "victim.txt"
    victim.write_text("VICTIM\n")
    link = tmp_path / "out"
    link.symlink_to(victim)
    args = ["render-workload", "--recipe", "tiny-qwen-cpu", "--launcher", launcher, "-o", str(link)]
    res = CliRunner().invoke(cli.app, args)
    assert res.exit_code == 2 and "is a symbolic link" in res.stderr and "--force" in res.stderr
    res = CliRunner().invoke(cli.app, [*args, "--force"])
    assert res.exit_code == 0, res.output
    assert victim.read_text() == "VICTIM\n" and not link.is_symlink()
    assert CliRunner().invoke(cli.app, ["render-workload", "--check", str(link)]).exit_code == 0
