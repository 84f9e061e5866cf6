"""Recipes and run files against hostile or unlucky input: a foreign file given as a recipe is "not a
recipe" without its lines echoed, a 20,000-level `--set` key is one line, and no env variable's value
reaches recipe.yaml or run.json (names only)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

SHADOW = "root:$6$salt$hashedpassword:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"


@pytest.mark.parametrize("text", [SHADOW, "root: hunter2\ndaemon: x\n"])
def test_a_foreign_file_is_not_a_recipe_and_its_lines_are_not_echoed(tmp_path, text):
    from ftcli import cli

    path = tmp_path / "shadow"
    path.write_text(text)
    res = CliRunner().invoke(cli.app, ["recipes", "show", str(path)])
    assert res.exit_code == 2
    assert " ".join(res.output.split()) == (f"error: {path} is not a recipe (no name, model or data section at its "
                                            "top level)")


def test_a_recipe_with_an_unknown_key_still_names_it(tmp_path):
    from ftcli.config.recipe import RecipeError, load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("name: x\nmodle: {}\n")
    with pytest.raises(RecipeError, match="unknown key 'modle'; did you mean 'model'"):
        load_recipe(path)


def test_a_20000_level_set_key_is_one_line():
    from ftcli import cli

    key = ".".join(["a"] * 20_000)
    res = CliRunner().invoke(cli.app, ["recipes", "show", "tiny-qwen-cpu", "--set", f"{key}=1"])
    assert res.exit_code == 2
    assert res.output.strip() == "error: --set a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a....: 20000 levels of keys; " \
                                 "a recipe nests at most 64"


def test_env_values_stay_out_of_the_run_dir_and_a_resume_sees_no_change(tmp_path):
    from ftcli.artifacts.rundir import new_run_record, prepare_run_dir, recipe_differences
    from ftcli.config.recipe import load_recipe

    value = "value-that-might-be-a-secret-4711"
    recipe = load_recipe("tiny-qwen-cpu", [f"output.dir={tmp_path / 'run'}", f"compute.env_variables.MY_SETTING={value}"])
    run_dir = prepare_run_dir(recipe)
    text = (run_dir / "recipe.yaml").read_text()
    assert value not in text and "MY_SETTING: '***'" in text
    record = new_run_record(recipe, method="full", mlflow=None)
    assert record.recipe["compute"]["env_variables"] == {"MY_SETTING": "***"}
    assert value not in record.model_dump_json()
    assert recipe_differences(run_dir, recipe) == []
    assert recipe_differences(run_dir, load_recipe(str(run_dir / "recipe.yaml"))) == []
