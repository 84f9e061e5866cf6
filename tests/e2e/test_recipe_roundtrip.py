"""Every key of the recipe schema survives the files a run is trained from: `<run>/recipe.yaml` (what every
torchrun worker loads) and a rendered AI Runtime workload's `parameters` (what the job's workers load). A key
that a dump dropped would be silently off in every worker (issue 40, item 5: a `training.*` key missing from a
hand-kept key list). The walk is over the schema itself, so a key added later is covered without editing this file.
In tests/e2e/ (not the fast tier): 200-odd recipes, each written, dumped and loaded back, are most of a minute.
"""

from __future__ import annotations

import copy
import functools
import types
import typing
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel

from ftcli.config.recipe import Recipe, TRAINING_BY_METHOD, dump_recipe, load_recipe, training_keys

# The recipe each section's keys are varied on: training's keys on a recipe of the method that has them.
BASE = {"full": "tiny-qwen-cpu", "lora": "tiny-gpt-oss-cpu"}
# Values the walk cannot make up from a key's type alone (a rule between keys, or a format of its own).
HAND_VALUES: dict[str, list[Any]] = {
    "compute.slurm.time_limit": ["04:00:00"],
    "data.columns": [["messages"]],  # with data.source=delta
    "data.sources.0.columns": [["messages"]],
    "eval.sources.0.columns": [["messages"]],
    **{f"{k}.filter": [[[["lang", "=", "en"], ["score", ">=", 3]]]] for k in ("data", "data.sources.0", "eval.sources.0")},
    "model.id": ["org/other-model"],
    "model.revision": ["0123456789abcdef0123456789abcdef01234567"],
    "model.tokenizer": ["pkg://assets/tokenizers/qwen"],
    "model.quantization": ["mxfp4_dequantize"],
    "model.attn_implementation": ["sdpa"],  # with data.packing.enabled=false
    "data.packing.enabled": [False],  # with model.attn_implementation=sdpa (LoRA)
    "compute.accelerator_type": ["GPU_4xH100"],
    "compute.num_accelerators": [16],
    "compute.priority_class": ["NORMAL"],  # with compute.pool_id
    "compute.pool_id": ["pool-1"],
    "compute.secrets": [{"HF_TOKEN": "scope/key"}],
    "compute.dependencies": [["numpy==2.0.0"]],
    "training.checkpoint.keep_best": [True],  # with eval data
    "eval.export": ["best"],  # with training.checkpoint.keep_best
    "eval.early_stop": [{"patience": 3, "min_delta": 0.01}],
}
# Keys set together (a rule between them); each is checked on the recipe that sets all of them.
WITH = {
    "model.attn_implementation": {"data.packing.enabled": False},
    "data.packing.enabled": {"model.attn_implementation": "sdpa"},
    "compute.priority_class": {"compute.pool_id": "pool-1"},
    "data.columns": {"data.source": "delta", "data.path": "main.sft.chats"},  # columns: a Delta table's
    "data.sources.0.columns": {"data.sources.0.source": "delta", "data.sources.0.path": "main.sft.chats"},
    "eval.sources.0.columns": {"eval.sources.0.source": "delta", "eval.sources.0.path": "main.sft.chats"},
    "data.filter": {"data.source": "delta", "data.path": "main.sft.chats"},  # filter: a Delta table's rows
    "data.sources.0.filter": {"data.sources.0.source": "delta", "data.sources.0.path": "main.sft.chats"},
    "eval.sources.0.filter": {"eval.sources.0.source": "delta", "eval.sources.0.path": "main.sft.chats"},
    "eval.export": {"training.checkpoint.keep_best": True},
    "training.activation_checkpointing_keep": {"training.activation_checkpointing": "full"},
    "compute.permissions.0.group_name": {"compute.permissions.0.user_name": None},
    "compute.permissions.0.service_principal_name": {"compute.permissions.0.user_name": None},
    "data.format": {"training.objective": "dpo", "data.format": "preference", "data.packing.strategy": "bfd"},
    **{f"training.preference.{k}": {"training.objective": "dpo", "data.format": "preference",
                                    "data.packing.strategy": "bfd"}
       for k in ("beta", "label_smoothing", "simpo_gamma", "orpo_lambda", "reference")},
    "training.objective": {"data.format": "preference", "data.packing.strategy": "bfd"},
}
# Keys with one allowed value so far (a second objective or optimizer adds the next): checked to load back
ONE_VALUE = {("full", "training.optimizer.name"),
             ("lora", "training.optimizer.name"), ("lora", "training.loss.impl")}
EVAL = {"holdout": 0.1}
DROPS_SECTION = {"eval.enabled": "eval"}  # false turns the section off: it loads as None
# Lists of sections, walked through their first entry: the entries each list starts from (two data sources, so
# the list is not the one-source shorthand's normal form; the shorthand keys go back to their defaults)
_SOURCES = [{"source": "local", "path": "pkg://assets/tiny_chat.jsonl", "format": "messages"},
            {"source": "local", "path": "second.jsonl", "name": "second"}]
LIST_ITEMS = {
    "data.sources": {"data.sources": _SOURCES, "data.source": "hub", "data.path": None, "data.split": "train"},
    "eval.sources": {"eval.sources": _SOURCES, "eval.holdout": None},
    "compute.permissions": {"compute.permissions": [{"user_name": "someone@example.com", "level": "CAN_VIEW"}]},
}  # eval's keys are varied on a recipe with eval data
# What a run dir and a workload keep of a key on purpose, not the value given (ftcli.config.redact, workload.py)
MASKED_IN_RUN_DIR = {"compute.env_variables",  # values -> '***'
                     "output.dir"}  # the run dir, made absolute
MASKED_IN_WORKLOAD = {"compute.secrets"}  # the references move to the workload's own `secrets:`


def _sections(annotation: Any) -> list[type[BaseModel]]:
    args = typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [s for a in args for s in _sections(a)]


def _candidates(annotation: Any, default: Any) -> list[Any]:
    """Values of `annotation` other than `default`, most likely to pass the key's own rules first."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _candidates(args[0], default)
    if origin is Literal:
        return [a for a in args if a != default]
    if origin in (typing.Union, types.UnionType):
        return [c for a in args if a is not type(None) for c in _candidates(a, default)]
    if annotation is bool:
        return [not default]
    if annotation is int:
        return [(default or 0) + 1, (default or 0) + 3, (default or 0) + 64]
    if annotation is float:
        return [0.5 if default in (None, 0, 0.0) else default / 2, (default or 0) + 0.25]
    if annotation is str:
        return ["other-value", "X"]
    if origin is tuple:
        return [tuple(0.8 for _ in args)]
    if origin is list:
        item = args[0] if args else str
        return [[v] for v in _candidates(item, None)[:1]] or [["x"]]
    if origin is dict:
        return [{"NCCL_DEBUG": "INFO"}]
    return []


def _leaves(model: type[BaseModel], prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, annotation, default) of every leaf key under `model` (a section inside: its keys)."""
    out = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = [s for s in _sections(info.annotation) if s.__name__ not in ("FullTraining", "LoraTraining")]
        if key in LIST_ITEMS:  # a list of sections: its first entry's keys
            out += _leaves(inner[0], key + ".0.")
        elif len(inner) == 1 and key not in HAND_VALUES:
            out += _leaves(inner[0], key + ".")
        else:
            out.append((key, info.annotation, info.get_default(call_default_factory=True)))
    return out


def _all_keys() -> list[tuple[str, str, Any, Any]]:
    """(method, key, annotation, default) of every leaf of the schema; training's keys once per method."""
    keys = []
    for name, info in Recipe.model_fields.items():
        if name == "training":
            for method, section in TRAINING_BY_METHOD.items():
                keys += [(method, k, a, d) for k, a, d in _leaves(section, "training.") if k != "training.method"]
            continue
        for section in _sections(info.annotation)[:1]:
            keys += [("full", k, a, d) for k, a, d in _leaves(section, f"{name}.")]
        if not _sections(info.annotation):
            keys.append(("full", name, info.annotation, info.get_default(call_default_factory=True)))
    return keys


def _get(data: Any, key: str) -> Any:
    for part in key.split("."):
        data = data[int(part)] if part.isdigit() else data[part]
    return data


def _set(data: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        if part.isdigit():
            data = data[int(part)]
            continue
        if data.get(part) is None:
            data[part] = {}
        data = data[part]
    data[int(last) if last.isdigit() else last] = value


# The test's own YAML reads and writes through libyaml where PyYAML has it (what ftcli writes and reads stays ftcli's)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_LOADER)


@functools.cache
def _base(method: str) -> dict:
    return load_recipe(BASE[method]).to_dict()


def _varied(method: str, key: str, annotation: Any, default: Any) -> tuple[Recipe, Any] | None:
    base = copy.deepcopy(_base(method))
    if key.startswith("eval.") or key in ("training.checkpoint.keep_best", "eval.export"):
        base["eval"] = {**(base.get("eval") or {}), **EVAL}
    listed = next((k for k in LIST_ITEMS if key.startswith(k + ".")), None)
    for other, value in {**LIST_ITEMS.get(listed, {}), **WITH.get(key, {})}.items():
        _set(base, other, copy.deepcopy(value))
    if key == "training.checkpoint.keep_best":
        base["eval"]["export"] = "last"
    if key == "eval.path":
        base["eval"]["holdout"] = None
    given = _get(base, key) if _has(base, key) else default
    if given != _plain(default):  # the base recipe already holds a value other than the default: that one
        return Recipe.model_validate(base), given
    for value in HAND_VALUES.get(key) or _candidates(annotation, default):
        data = copy.deepcopy(base)
        _set(data, key, copy.deepcopy(value))
        try:
            recipe = Recipe.model_validate(data)
        except Exception:
            continue
        return recipe, value if key in DROPS_SECTION else _attr(recipe, key)
    if (method, key) in ONE_VALUE:
        return Recipe.model_validate(base), _plain(default)
    return None


def _attr(recipe: Recipe, key: str) -> Any:
    """The value of `key` as the loaded recipe holds it (a key a dump leaves out at its default included)."""
    value: Any = recipe
    for part in key.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)
    return _plain(value)


def _has(data: Any, key: str) -> bool:
    try:
        _get(data, key)
    except (KeyError, IndexError, TypeError):
        return False
    return True


def _plain(value: Any) -> Any:
    """`value` as a dump writes it (a section as a mapping, a tuple as a list)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return list(value) if isinstance(value, tuple) else value


KEYS = _all_keys()


@pytest.mark.parametrize("method,key,annotation,default", KEYS, ids=[f"{m}:{k}" for m, k, _, _ in KEYS])
def test_every_schema_key_round_trips_through_run_recipe_and_workload(method, key, annotation, default, tmp_path):
    """Set the key to a value other than its default, then read it back from <run>/recipe.yaml (written as the
    launcher writes it, ftcli.artifacts.rundir.prepare_run_dir) and from a rendered workload's parameters."""
    from ftcli.artifacts.rundir import prepare_run_dir
    from ftcli.launchers.databricks import build_workload

    varied = _varied(method, key, annotation, default)
    assert varied is not None, f"{key}: no value other than the default validates; add one to HAND_VALUES"
    recipe, value = varied
    assert value != _plain(default) or (method, key) in ONE_VALUE

    in_tmp = recipe.model_copy(update={"output": recipe.output.model_copy(update={"dir": str(tmp_path / "run")})})
    run_dir = prepare_run_dir(in_tmp)
    reloaded = load_recipe(str(run_dir / "recipe.yaml"))
    parameters = _yaml(yaml.dump(build_workload(recipe), Dumper=_DUMPER))["parameters"]
    shown = Recipe.model_validate(_yaml(dump_recipe(recipe)))  # `ftcli recipes show`
    if key in DROPS_SECTION:
        assert _attr(recipe, DROPS_SECTION[key]) is None
        assert [_attr(r, DROPS_SECTION[key]) for r in (reloaded, Recipe.model_validate(parameters), shown)] == [None] * 3
        return
    if key not in MASKED_IN_RUN_DIR:
        assert _attr(reloaded, key) == value
    if key not in MASKED_IN_WORKLOAD:
        assert _attr(Recipe.model_validate(parameters), key) == value
    assert _attr(shown, key) == value


def test_the_walk_covers_every_training_key_of_both_methods():
    """The walk reaches each method's own keys (and the dump order lists every key of the schema)."""
    walked = {(m, k.split(".")[1]) for m, k, _, _ in KEYS if k.startswith("training.")}
    for method, section in TRAINING_BY_METHOD.items():
        assert {k for m, k in walked if m == method} == set(section.model_fields) - {"method"}
    assert set(training_keys()) == {k for s in TRAINING_BY_METHOD.values() for k in s.model_fields}
    assert len(KEYS) > 100


def test_a_new_training_key_is_dumped_without_being_listed(monkeypatch):
    """The bug of issue 40: a key added to the schema reached recipe.yaml only if a hand-kept list named it."""
    from pydantic import Field, create_model

    from ftcli.config import recipe as schema

    extended = create_model("FullTraining", __base__=schema.FullTraining, new_knob=(float | None, Field(None)))
    monkeypatch.setitem(schema.TRAINING_BY_METHOD, "full", extended)
    dumped = extended(new_knob=5.0).model_dump(mode="json")
    assert dumped["new_knob"] == 5.0
    assert extended.model_validate(dumped).new_knob == 5.0
