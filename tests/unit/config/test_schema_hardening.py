"""The recipe schema holds against careless and hostile input: every float finite, no booleans as
numbers, no duplicate keys, no aliases, bounded nesting and block length, model configs that build.

Each test is one scenario of issue 17 ("Validation and errors"); the messages are asserted exactly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ftcli import cli
from ftcli.config.errors import UserError
from ftcli.config.recipe import RecipeError, builtin_recipe_text, load_recipe

TINY = "tiny-qwen-cpu"
runner = CliRunner()


def _error(name_or_path, overrides=()) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(name_or_path, list(overrides))
    return str(err.value)


def _file(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _tiny_with(tmp_path: Path, section: str, key: str, raw_value: str) -> Path:
    """The tiny recipe's text with `section:` gaining the line `  key: raw_value` (raw YAML)."""
    text = builtin_recipe_text(TINY).replace(f"\n{section}:\n", f"\n{section}:\n  {key}: {raw_value}\n", 1)
    return _file(tmp_path, text)


def _check_model_config(recipe):
    """ftcli.model.checks.check_model_config on a recipe's model and packing sections."""
    from ftcli.model.checks import check_model_config

    return check_model_config(recipe.model, recipe.data.packing)


# ---------------------------------------------------------------------------------- finite floats
@pytest.mark.parametrize("override,key,shown", [
    ("training.optimizer.lr=.inf", "training.optimizer.lr", "inf"),
    ("training.epochs=.inf", "training.epochs", "inf"),
    ("training.schedule.warmup=.nan", "training.schedule.warmup", "nan"),
    ("training.grad_clip=-.inf", "training.grad_clip", "-inf"),
    ("training.optimizer.lr=1e999", "training.optimizer.lr", "inf"),  # the `--set` float rule overflows
    ("training.optimizer.betas=[0.9, .nan]", "training.optimizer.betas.1", "nan"),
    ("model.config_overrides.rope_theta=.inf", "model.config_overrides.rope_theta", "inf"),
])
def test_every_float_is_finite(override, key, shown):
    assert _error(TINY, [override]) == f"invalid recipe '{TINY}': {key}: must be a finite number (got {shown})"


def test_non_finite_float_in_a_file_names_file_and_key(tmp_path):
    path = _tiny_with(tmp_path, "training", "epochs", ".inf")
    text = path.read_text().replace("  epochs: 1\n", "")
    path.write_text(text)
    assert _error(path) == f"invalid recipe {path}: training.epochs: must be a finite number (got inf)"


def test_inf_as_a_string_is_not_a_float_either():
    # pydantic reads the string "inf" as a float; the schema's allow_inf_nan=False refuses it
    msg = _error(TINY, ["training.optimizer.lr=inf"])
    assert msg == f"invalid recipe '{TINY}': training.optimizer.lr: Input should be a finite number (got 'inf')"


# ------------------------------------------------------------------------------ bools as numbers
@pytest.mark.parametrize("override,key", [
    ("training.optimizer.lr=true", "training.optimizer.lr"),
    ("training.grad_accum=true", "training.grad_accum"),
    ("training.epochs=false", "training.epochs"),
    ("training.max_steps=true", "training.max_steps"),  # int | None
    ("data.packing.block_len=true", "data.packing.block_len"),
    ("compute.num_accelerators=true", "compute.num_accelerators"),
    ("training.grad_clip=true", "training.grad_clip"),  # float | None
])
def test_booleans_are_not_numbers(override, key):
    assert _error(TINY, [override]) == (
        f"invalid recipe '{TINY}': {key}: expected a number, not true/false (got True)"
        if override.endswith("true") else
        f"invalid recipe '{TINY}': {key}: expected a number, not true/false (got False)"
    )


def test_booleans_are_not_numbers_inside_a_tuple():
    msg = _error(TINY, ["training.optimizer.betas=[true, 0.9]"])
    assert msg == f"invalid recipe '{TINY}': training.optimizer.betas: expected a number, not true/false"


def test_boolean_fields_and_numbers_still_validate():
    r = load_recipe(TINY, ["training.compile=true", "data.streaming=false", "training.epochs=2",
                           "training.optimizer.lr=1", "training.grad_clip=null"])
    assert (r.training.compile, r.data.streaming, r.training.epochs, r.training.optimizer.lr) == (True, False, 2.0, 1.0)
    assert r.training.grad_clip is None
    assert type(r.training.optimizer.lr) is float and type(r.training.grad_accum) is int


# ---------------------------------------------------------------------------------- duplicate keys
def test_duplicate_section_is_rejected_with_key_and_line(tmp_path):
    text = builtin_recipe_text(TINY) + "training:\n  epochs: 2\n"
    path = _file(tmp_path, text)
    first = text.splitlines().index("training:") + 1
    last = len(text.splitlines()) - 1
    assert _error(path) == (
        f"invalid recipe {path}: not valid YAML line {last}: duplicate key 'training' (first set at line {first})"
    )


def test_duplicate_nested_key_is_rejected(tmp_path):
    path = _file(tmp_path, "name: x\nmodel:\n  model_type: a\n  dtype: float32\n  model_type: b\n")
    assert _error(path) == f"invalid recipe {path}: not valid YAML line 5: duplicate key 'model_type' (first set at line 3)"


def test_duplicate_key_in_a_flow_mapping_on_one_line(tmp_path):
    path = _file(tmp_path, "name: x\ntraining: {optimizer: {lr: 0.1, lr: 0.2}}\n")
    assert _error(path) == f"invalid recipe {path}: not valid YAML line 2: duplicate key 'lr' (first set at line 2)"


def test_duplicate_key_through_set_override_is_not_a_duplicate():
    # --set replaces a value on purpose: only the YAML text is checked for duplicates
    assert load_recipe(TINY, ["training.epochs=2", "training.epochs=3"]).training.epochs == 3.0


# ------------------------------------------------------------------------------ aliases and depth
def _alias_bomb() -> str:
    """A 'billion laughs' of ~1.5 KB: 24 levels of 10 aliases, 10**24 leaves once expanded."""
    lines = ["  a0: &a0 [" + ",".join(['"lol"'] * 10) + "]"]
    for i in range(1, 24):
        lines.append(f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]")
    overrides = "\n".join("  " + line for line in lines)
    return builtin_recipe_text(TINY).replace("model:\n", f"model:\n  config_overrides:\n{overrides}\n", 1)


@pytest.mark.parametrize("command", [["recipes", "show"], ["render-workload", "--recipe"],
                                     ["render-workload", "--launcher", "slurm", "--recipe"]])
def test_alias_bomb_fails_fast_in_one_line(command, tmp_path):
    text = _alias_bomb()
    assert 1200 < len(text.encode()) - len(builtin_recipe_text(TINY).encode()) < 1700
    path = _file(tmp_path, text)
    line = text.splitlines().index(next(x for x in text.splitlines() if "*a0" in x)) + 1
    start = time.perf_counter()
    res = runner.invoke(cli.app, [*command, str(path)])
    assert time.perf_counter() - start < 5
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit)
    assert res.stderr == (f"error: invalid recipe {path}: not valid YAML line {line}: YAML aliases (*a0) are not "
                          "supported; write the value out\n")


def test_anchor_without_alias_is_fine(tmp_path):
    text = builtin_recipe_text(TINY).replace("  dtype: float32\n", "  dtype: &d float32\n", 1)
    assert load_recipe(_file(tmp_path, text)) == load_recipe(TINY)


def test_merge_key_needs_an_alias_and_is_refused(tmp_path):
    path = _file(tmp_path, "name: x\nbase: &b {epochs: 1}\ntraining:\n  <<: *b\n")
    assert _error(path) == (
        f"invalid recipe {path}: not valid YAML line 4: YAML aliases (*b) are not supported; write the value out"
    )


@pytest.mark.parametrize("opening,closing", [("[", "]"), ("{a: ", "}")])
def test_5000_deep_nesting_is_one_line(opening, closing, tmp_path):
    path = _file(tmp_path, "name: x\nmodel:\n  config_overrides:\n    deep: " + opening * 5000 + closing * 5000 + "\n")
    assert _error(path) == f"invalid recipe {path}: not valid YAML line 4: nested deeper than 64 levels"


def test_deep_nesting_in_a_set_value_stays_a_string():
    # a `--set` value that is not acceptable YAML is taken as the literal string (then typed by the schema)
    msg = _error(TINY, ["training.epochs=" + "[" * 5000 + "]" * 5000])
    assert msg.startswith(f"invalid recipe '{TINY}': training.epochs: Input should be a valid number")


def test_nesting_up_to_the_limit_is_accepted(tmp_path):
    value = "[" * 60 + "]" * 60  # 60 lists inside recipe > model > config_overrides
    text = builtin_recipe_text(TINY).replace("model:\n", f"model:\n  config_overrides: {{deep: {value}}}\n", 1)
    assert load_recipe(_file(tmp_path, text)).model.config_overrides["deep"] is not None


# --------------------------------------------------------------------------------------- block_len
def test_block_len_has_a_hard_cap():
    assert _error("qwen-b300", ["data.packing.block_len=1000000000000"]) == (
        "invalid recipe 'qwen-b300': data.packing.block_len=1000000000000 is over ftcli's limit of 1048576 tokens "
        "per block (2**20)"
    )
    assert load_recipe("qwen-b300", ["data.packing.block_len=1048576"]).data.packing.block_len == 2**20


def test_block_len_bounded_by_shipped_config_max_position_embeddings():
    assert _error(TINY, ["data.packing.block_len=4097"]) == (
        f"invalid recipe '{TINY}': data.packing.block_len=4097 is over the model's max_position_embeddings=4096 "
        "(pkg://assets/tiny-qwen3_5.json); lower block_len or raise model.config_overrides.max_position_embeddings"
    )
    assert load_recipe(TINY, ["data.packing.block_len=4096"]).data.packing.block_len == 4096
    raised = load_recipe(TINY, ["data.packing.block_len=8192", "model.config_overrides.max_position_embeddings=8192"])
    assert raised.data.packing.block_len == 8192
    # packing off: block_len is not used, the model's limit does not apply
    assert load_recipe(TINY, ["data.packing.block_len=8192", "data.packing.enabled=false"]).data.packing.block_len == 8192


def test_block_len_bounded_by_local_model_dir_config(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "max_position_embeddings": 2048}))
    overrides = [f"model.id={model_dir}", "data.packing.block_len=4096"]
    assert _error("gpt-oss-h100", overrides) == (
        "invalid recipe 'gpt-oss-h100': data.packing.block_len=4096 is over the model's max_position_embeddings=2048 "
        f"({model_dir}); lower block_len or raise model.config_overrides.max_position_embeddings"
    )
    # a VLM config keeps it under text_config
    (model_dir / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 1024}}))
    assert "max_position_embeddings=1024" in _error("gpt-oss-h100", overrides)


def test_block_len_of_hub_model_is_not_checked_offline():
    assert load_recipe("qwen-b300", ["data.packing.block_len=524288"]).data.packing.block_len == 524288


# ------------------------------------------------------------------------------- model config check
def test_config_override_that_builds_no_model_is_one_line():
    with pytest.raises(UserError) as err:
        _check_model_config(load_recipe(TINY, ["model.config_overrides.hidden_act=nope"]))  # sizes: test_recipe
    assert str(err.value) == (
        "model config pkg://assets/tiny-qwen3_5.json with model.config_overrides {'hidden_act': 'nope'} does not "
        "build a model: 'nope'"
    )


def test_config_override_of_the_wrong_type_is_one_line():
    with pytest.raises(UserError) as err:
        _check_model_config(load_recipe("tiny-gpt-oss-cpu", ["model.config_overrides.vocab_size=abc"]))
    msg = str(err.value)
    assert msg.startswith("model config pkg://assets/tiny-gpt-oss.json with model.config_overrides "
                          "{'vocab_size': 'abc'} ")
    assert "\n" not in msg


@pytest.mark.parametrize("name,config_class,hidden", [
    ("tiny-qwen-cpu", "Qwen3_5TextConfig", 64), ("tiny-gpt-oss-cpu", "GptOssConfig", 64),
])
def test_valid_model_configs_pass_the_check(name, config_class, hidden):
    config = _check_model_config(load_recipe(name, [f"model.config_overrides.hidden_size={hidden}"]))
    assert type(config).__name__ == config_class and config.hidden_size == hidden


def test_hub_models_not_in_the_cache_are_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert _check_model_config(load_recipe("qwen-b300")) is None


# ------------------------------------------------------------------------------------------ names
@pytest.mark.parametrize("key", ["tracking.experiment", "tracking.run_name"])
def test_tracking_names_have_no_control_characters(key, tmp_path):
    data = yaml.safe_load(builtin_recipe_text(TINY))
    section, field = key.split(".")
    data[section][field] = "a\nb"
    path = _file(tmp_path, yaml.safe_dump(data))
    assert _error(path) == (
        f"invalid recipe {path}: {key}: contains the control character '\\n'; use printable characters only "
        "(got 'a\\nb')"
    )


def test_dumped_recipe_has_no_aliases_and_loads_back(tmp_path):
    from ftcli.config.recipe import dump_recipe

    recipe = load_recipe(TINY)
    shared = [1, 2, 3]
    recipe.model.config_overrides = {"a": shared, "b": shared}  # one object twice: YAML would alias it
    text = dump_recipe(recipe)
    assert "&" not in text and "*" not in text
    assert load_recipe(_file(tmp_path, text)).model.config_overrides == {"a": [1, 2, 3], "b": [1, 2, 3]}


@pytest.mark.parametrize("key,hint", [
    ("hiden_size", "; did you mean 'hidden_size'?"),
    ("rope_theta", "; did you mean 'rope_parameters'?"),  # moved in transformers 5: would be ignored
])
def test_config_override_the_model_would_ignore_is_refused(key, hint):
    with pytest.raises(UserError) as err:
        _check_model_config(load_recipe(TINY, [f"model.config_overrides.{key}=64"]))
    assert str(err.value) == (
        f"model.config_overrides.{key}: Qwen3_5TextConfig has no such key, the model would ignore it{hint}"
    )


def _fake_hub_cache(root: Path, repo_id: str, config: dict) -> None:
    """The Hugging Face cache layout for one repo whose `main` holds only config.json."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))


def test_hub_model_in_the_local_cache_is_checked_offline(monkeypatch, tmp_path):
    config = json.loads((Path(__file__).parents[3] / "ftcli/assets/tiny-gpt-oss.json").read_text())
    _fake_hub_cache(tmp_path, "openai/gpt-oss-20b", config)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert _check_model_config(load_recipe("gpt-oss-h100")).hidden_size == config["hidden_size"]
    with pytest.raises(UserError) as err:
        _check_model_config(load_recipe("gpt-oss-h100", ["model.config_overrides.rope_parameters={rope_type: nope}"]))
    assert str(err.value) == (f"model config {tmp_path}/models--openai--gpt-oss-20b/snapshots/{'0' * 40} with "
                              "model.config_overrides {'rope_parameters': {'rope_type': 'nope'}} does not build a "
                              "model: 'nope'")
    with pytest.raises(UserError) as err:  # the cached config's limit applies to block_len as well
        _check_model_config(load_recipe("gpt-oss-h100", ["data.packing.block_len=8192"]))
    assert str(err.value) == ("data.packing.block_len=8192 is over the model's max_position_embeddings=4096; lower "
                              "block_len or raise model.config_overrides.max_position_embeddings")
