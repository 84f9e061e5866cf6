"""The thin CLI: recipe commands, --version, and user mistakes as one line and exit code 2."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from ftcli import __version__, cli
from ftcli.config.recipe import builtin_recipe_text, load_recipe

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(cli.app, list(args))


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_version():
    res = invoke("--version")
    assert res.exit_code == 0 and res.output.strip() == f"ftcli {__version__}"


def test_recipes_list_shows_the_four_builtins(monkeypatch):
    monkeypatch.setattr(cli.console, "width", 200)
    res = invoke("recipes", "list")
    assert res.exit_code == 0, res.output
    for name in ("qwen-b300", "gpt-oss-h100", "tiny-qwen-cpu", "tiny-gpt-oss-cpu"):
        assert f"{name} " in res.output
    assert "8xB300" in res.output and "openai/gpt-oss-20b" in res.output


@pytest.mark.parametrize("name", ["qwen-b300", "gpt-oss-h100", "tiny-qwen-cpu", "tiny-gpt-oss-cpu"])
def test_recipes_show_loads_back_to_equal_recipe(name, tmp_path):
    res = invoke("recipes", "show", name, "--set", "training.grad_accum=3")
    assert res.exit_code == 0, res.output
    path = tmp_path / "shown.yaml"
    path.write_text(res.output)
    assert load_recipe(str(path)) == load_recipe(name, ["training.grad_accum=3"])
    assert yaml.safe_load(res.output)["training"]["grad_accum"] == 3


def test_recipes_cp_refuses_to_overwrite_without_force(tmp_path):
    dest = tmp_path / "mine.yaml"
    copy = builtin_recipe_text("tiny-qwen-cpu").replace("\nname: tiny-qwen-cpu\n", "\nname: mine\n")
    assert invoke("recipes", "cp", "tiny-qwen-cpu", str(dest)).exit_code == 0
    assert dest.read_text() == copy
    dest.write_text("# edited\n")
    res = invoke("recipes", "cp", "tiny-qwen-cpu", str(dest))
    assert res.exit_code == 2 and "--force" in res.output
    assert dest.read_text() == "# edited\n"
    assert invoke("recipes", "cp", "tiny-qwen-cpu", str(dest), "--force").exit_code == 0
    assert dest.read_text() == copy


def test_recipes_cp_renames_the_copy_so_it_trains_into_its_own_run_dir(tmp_path):
    """The copy is named after its file (a copy keeping `name: tiny-qwen-cpu` trained into runs/tiny-qwen-cpu,
    the original's run dir, and was refused); the rest of the text is the original's, byte for byte."""
    from ftcli.train.launch import run_dir_of

    dest = tmp_path / "my-recipe.yaml"
    res = invoke("recipes", "cp", "tiny-qwen-cpu", str(dest))
    assert res.exit_code == 0
    assert _flat(res.output) == (f"wrote {dest} (name: my-recipe, was tiny-qwen-cpu: it trains into runs/my-recipe); "
                                 f"edit it, then: ftcli train --recipe {dest}")
    assert load_recipe(str(dest)) == load_recipe("tiny-qwen-cpu", ["name=my-recipe"])
    assert run_dir_of(load_recipe(str(dest)).output_dir).name == "my-recipe"
    odd = tmp_path / "my recipe.yaml"  # no valid recipe name: the name is kept
    assert invoke("recipes", "cp", "tiny-qwen-cpu", str(odd)).exit_code == 0
    assert odd.read_text() == builtin_recipe_text("tiny-qwen-cpu")


def test_recipes_cp_into_a_folder(tmp_path):
    assert invoke("recipes", "cp", "qwen-b300", str(tmp_path)).exit_code == 0
    assert load_recipe(str(tmp_path / "qwen-b300.yaml")) == load_recipe("qwen-b300")


def test_recipes_cp_accepts_a_recipe_file(tmp_path):
    mine = tmp_path / "my-recipe.yaml"
    mine.write_text(builtin_recipe_text("tiny-qwen-cpu").replace("  grad_accum: 1\n", "  grad_accum: 7\n"))
    res = invoke("recipes", "cp", str(mine), str(tmp_path / "other.yaml"))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "other.yaml").read_text() == mine.read_text().replace("name: tiny-qwen-cpu", "name: other")
    assert load_recipe(str(tmp_path / "other.yaml")).training.grad_accum == 7
    (tmp_path / "copies").mkdir()
    assert invoke("recipes", "cp", str(mine), str(tmp_path / "copies")).exit_code == 0
    assert (tmp_path / "copies" / "my-recipe.yaml").read_text() == mine.read_text().replace("name: tiny-qwen-cpu",
                                                                                          "name: my-recipe")
    broken = tmp_path / "broken.yaml"
    broken.write_text("training: {lr: 1}\n")
    res = invoke("recipes", "cp", str(broken), str(tmp_path / "x.yaml"))
    assert res.exit_code == 2 and "unknown key" in res.output and not (tmp_path / "x.yaml").exists()
    res = invoke("recipes", "cp", str(tmp_path / "nope.yaml"), str(tmp_path / "x.yaml"))
    assert res.exit_code == 2 and "no recipe file or built-in recipe named" in _flat(res.output)


def test_recipes_cp_unknown_recipe(tmp_path):
    res = invoke("recipes", "cp", "qwen-b30", str(tmp_path / "x.yaml"))
    assert res.exit_code == 2 and "did you mean 'qwen-b300'" in res.output
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("args,expected", [
    (["recipes", "show", "qwen-b300", "--set", "training.lr=1"],
     "error: invalid recipe 'qwen-b300': unknown key 'training.lr'; did you mean 'training.optimizer.lr'?"),
    (["recipes", "show", "qwen-b300", "--set", "training.epochs"],
     "error: --set 'training.epochs': expected dotted.key=value, e.g. training.optimizer.lr=2e-5"),
    (["recipes", "show", "qwen-b30"],
     "error: no recipe file or built-in recipe named 'qwen-b30'; did you mean 'qwen-b300'?"),
    (["render-workload", "--recipe", "gpt-oss-h100", "--set", "compute.num_accelerators=12"],
     "error: invalid recipe 'gpt-oss-h100': compute: num_accelerators=12 is not a multiple of the 8 GPUs per node of GPU_8xH100"),
    (["render-workload", "--set", "training.epochs=2"], "error: --set needs --recipe"),
    (["render-workload"], "error: render-workload needs --recipe (or --check FILE)"),
])
def test_user_mistake_is_one_line_and_exit_2(args, expected):
    res = invoke(*args)
    assert res.exit_code == 2
    assert _flat(res.output) == expected
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_bad_recipe_file_through_cli(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmodel: [\n")
    res = invoke("recipes", "show", str(path))
    assert res.exit_code == 2
    assert _flat(res.output).startswith(f"error: invalid recipe {path}: not valid YAML line")
    assert "Traceback" not in res.output


def test_help_shows_flags_as_flags():
    """Typer prints each option's type; a flag takes no value (`--force true` is refused), so its help row
    must read `--force`, not `--force <bool>`."""
    commands = [[], ["recipes"], ["recipes", "cp"], ["train"], ["render-workload"], ["pack-preview"], ["merge-lora"],
                ["register"], ["generate"], ["chat"], ["doctor"], ["plan"]]
    for command in commands:
        res = runner.invoke(cli.app, [*command, "--help"], env={"COLUMNS": "120"})
        assert res.exit_code == 0, (command, res.output)
        assert "<bool>" not in res.output and "--help" in res.output, command
        assert "<str>" in res.output or command in ([], ["recipes"], ["doctor"]), command  # other types still shown
    train = runner.invoke(cli.app, ["train", "--help"], env={"COLUMNS": "120"}).output
    assert any(line.split()[1:3] == ["--force", "Start"] for line in train.splitlines() if "--force" in line)


def test_every_command_help_ends_with_examples_and_names_its_arguments_one_way():
    for command, examples in cli.EXAMPLES.items():
        res = runner.invoke(cli.app, [*command.split(), "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, command
        text = _flat(res.output)
        assert "Examples:" in text and all(e in text for e in examples), command
        usage = next(line for line in res.output.splitlines() if "Usage:" in line)
        args = [w.strip("{}[].") for w in usage.split() if w.startswith("{")]
        assert all(a.isupper() for a in args), (command, usage)  # {RUN_OR_MODEL}, never {model_dir}
    train = _flat(runner.invoke(cli.app, ["train", "--help"], env={"COLUMNS": "200"}).output)
    assert "--set data.path=FILE_OR_FOLDER --set data.format=auto" in train and "eval.enabled=false" in train
    commands = {c.name for c in __import__("typer").main.get_command(cli.app).commands.values()}
    assert commands - {"recipes"} <= set(cli.EXAMPLES), commands - set(cli.EXAMPLES)


def test_a_bare_group_shows_its_help_and_exits_0():
    for args in ([], ["recipes"]):
        res = runner.invoke(cli.app, args, env={"COLUMNS": "120"})
        assert res.exit_code == 0 and "Usage: ftcli" in res.output and "Commands" in res.output, args


def test_a_flag_given_a_value_says_that_flags_take_none():
    res = runner.invoke(cli.app, ["train", "--recipe", "tiny-qwen-cpu", "--force", "true"], env={"COLUMNS": "200"})
    assert res.exit_code == 2
    assert ("Got unexpected extra argument(s) (true); a flag such as --force takes no value: write the flag alone "
            "to turn it on, leave it out for off") in _flat(res.output.replace("│", ""))


def test_recipes_cp_force_onto_a_link_replaces_the_link_not_its_target(tmp_path):
    """#47 item 15: --force onto a link writes a new file in its place (as generate -o --force does); the file
    the link pointed at keeps its content."""
    victim = tmp_path / "victim.txt"
    victim.write_text("VICTIM\n")
    dest = tmp_path / "mine.yaml"
    dest.symlink_to(victim)
    assert invoke("recipes", "cp", "tiny-qwen-cpu", str(dest)).exit_code == 2  # exists: --force needed
    assert invoke("recipes", "cp", "tiny-qwen-cpu", str(dest), "--force").exit_code == 0
    assert not dest.is_symlink() and "name: mine" in dest.read_text()
    assert victim.read_text() == "VICTIM\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml", "victim.txt"]
