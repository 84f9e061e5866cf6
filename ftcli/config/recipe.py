"""Recipes: typed, validated YAML that says everything about one fine-tune.

A recipe is data. `load_recipe("qwen-b300")` finds a built-in recipe by name (shipped inside the
package, so it works after a plain `pip install`), `load_recipe("my.yaml")` reads a file, and
`--set training.optimizer.lr=2e-5` style overrides are applied before validation. Unknown keys fail
with their dotted path and the closest valid key; type errors name the path. No pydantic dumps reach
the user: every problem becomes a `RecipeError` with one short line per problem. What the schema refuses
everywhere: inf/nan (also inside `model.config_overrides`), `true`/`false` where a number goes,
`data.packing.block_len` over 2**20 or over the model's `max_position_embeddings` when its config.json is a file
here, sizes and counts in `model.config_overrides` below 1 (`num_hidden_layers: 0`).

Where things are:
- each section's keys and its own rules: `ftcli/config/sections/<section>.py` (model, data, eval, training, lora,
  tracking, output, compute), every one a `Section` (`sections/base.py`: unknown keys fail, inf/nan and
  `true`/`false` where a number goes are refused);
- the rules between sections (packing and attention, block length and the model's positions, context
  parallelism, kept MXFP4, preference data, keep_best and eval): `Recipe`, below, and nowhere else;
- loading (built-in names, files, `--set`, paths made absolute), error lines and the dump: below;
- the YAML reader and writer: `ftcli/config/strict_yaml.py`; `pkg://` paths: `ftcli/config/paths.py`;
  did-you-mean: `ftcli/config/did_you_mean.py`.

This module imports no torch: `ftcli --help` and `ftcli render-workload` stay instant.
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from ftcli.config.did_you_mean import did_you_mean, schema_walk
from ftcli.config.errors import UserError
from ftcli.config.paths import PKG_PREFIX, resolve_path
from ftcli.config.sections.base import Section
from ftcli.config.sections.compute import ComputeConfig
from ftcli.config.sections.data import DataConfig, SourceConfig
from ftcli.config.sections.eval import EvalConfig
from ftcli.config.sections.lora import LoraConfig
from ftcli.config.sections.model import ModelConfig, max_position_embeddings
from ftcli.config.sections.output import OutputConfig
from ftcli.config.sections.tracking import TrackingConfig
from ftcli.config.sections.training import (
    CP_SLICE_MULTIPLE,
    PREFERENCE_OBJECTIVES,
    FullTraining,
    TrainingConfig,
)
from ftcli.config.strict_yaml import MAX_YAML_DEPTH, YamlDumper, YamlError, parse_yaml, read_text_file

# The rest of the recipe's vocabulary that other rooms import from here (`from ftcli.config.recipe import ...`),
# defined in the modules named.
from ftcli.config.sections.base import plain_text_problem  # noqa: F401
from ftcli.config.sections.compute import (  # noqa: F401
    DATABRICKS_ONLY,
    SLURM_NAME_RE,
    SLURM_TIME_RE,
    check_accelerator_type,
    check_secret_ref,
    placement_problems,
)
from ftcli.config.sections.data import PackingConfig, parse_delta_revision  # noqa: F401
from ftcli.config.sections.training import (  # noqa: F401
    TRAINING_BY_METHOD,
    LoraTraining,
    ScheduleConfig,
    training_keys,
)

# Shared with ftcli.launchers (experiment and workload names follow the same rules).
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,100}")
NAME_RULE = "use 1-100 letters, digits, '-' or '_'"
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
MAX_BLOCK_LEN = 2**20  # tokens per packed block; past this one block's activations fit no GPU


class RecipeError(UserError):
    """A user mistake in a recipe or an override; the message is ready to print."""


class Recipe(Section):
    """The whole recipe: its sections, and the rules between sections (the `model_validator`s below; a rule within
    one section lives in that section's module)."""

    quiet_defaults: ClassVar[dict[str, Any]] = {"eval": None}  # no `eval: null` in recipes without eval
    name: str
    description: str = ""
    model: ModelConfig
    data: DataConfig
    training: TrainingConfig = Field(default_factory=FullTraining)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    eval: EvalConfig | None = None
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)

    @field_validator("eval", mode="before")
    @classmethod
    def _eval_off(cls, v: Any) -> Any:
        """`eval.enabled: false` is no eval at all, as `eval: null` is."""
        return None if isinstance(v, dict) and v.get("enabled") is False else v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(NAME_RULE)
        return v

    @model_validator(mode="after")
    def _packing(self) -> Recipe:
        """Packed blocks need attention that keeps their documents apart: ftcli's packed kernels ("auto")."""
        if self.data.packing.enabled and self.model.attn_implementation != "auto":
            raise ValueError(
                f"model.attn_implementation={self.model.attn_implementation} cannot keep packed documents apart; "
                "use model.attn_implementation=auto (or, for LoRA, data.packing.enabled=false)"
            )
        return self

    @model_validator(mode="after")
    def _block_len(self) -> Recipe:
        """A hard cap, and the model's own limit where its config can be read here (a file, no hub)."""
        block_len = self.data.packing.block_len
        if block_len > MAX_BLOCK_LEN:
            raise ValueError(f"data.packing.block_len={block_len} is over ftcli's limit of {MAX_BLOCK_LEN} "
                             "tokens per block (2**20)")
        limit = max_position_embeddings(self.model)
        if self.data.packing.enabled and limit is not None and block_len > limit[0]:
            raise ValueError(
                f"data.packing.block_len={block_len} is over the model's max_position_embeddings={limit[0]} "
                f"({limit[1]}); lower block_len or raise model.config_overrides.max_position_embeddings"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel(self) -> Recipe:
        """A block splits into equal slices, each longer than a gated-delta chunk (fla's chunked kernels and the
        conv halo work per slice)."""
        n = getattr(self.training, "context_parallel", 1)
        if n == 1:
            return self
        if not self.data.packing.enabled:
            raise ValueError(f"training.context_parallel={n} splits packed blocks; set data.packing.enabled: true")
        block_len = self.data.packing.block_len
        if block_len % (n * CP_SLICE_MULTIPLE):
            raise ValueError(f"training.context_parallel={n}: data.packing.block_len={block_len} must be a multiple "
                             f"of {n * CP_SLICE_MULTIPLE} (N slices of a multiple of {CP_SLICE_MULTIPLE} tokens)")
        if self.training.context_parallel_balance and block_len % (2 * n * CP_SLICE_MULTIPLE):
            raise ValueError(f"training.context_parallel_balance with context_parallel={n}: data.packing.block_len="
                             f"{block_len} must be a multiple of {2 * n * CP_SLICE_MULTIPLE} (2N chunks of a multiple "
                             f"of {CP_SLICE_MULTIPLE} tokens); or set context_parallel_balance: false")
        if self.training.compile is True:  # a whole compiled layer would trace the slice's metadata (not checked)
            raise ValueError(f"training.context_parallel={n} runs with training.compile: regions or false, not true "
                             "(whole compiled layers are not checked with context parallelism)")
        return self

    @model_validator(mode="after")
    def _kept_mxfp4(self) -> Recipe:
        if self.model.quantization == "mxfp4" and (self.training.method != "lora" or self.model.init != "pretrained"):
            raise ValueError("model.quantization=mxfp4 keeps a pretrained MXFP4 base frozen for LoRA; it needs "
                             "training.method=lora and model.init=pretrained (else use mxfp4_dequantize)")
        if self.model.quantization == "mxfp4" and self.training.sharding == "fsdp":
            raise ValueError("model.quantization=mxfp4 runs with training.sharding=ddp or auto (a kept-MXFP4 base per "
                             "GPU); FSDP2 over it is not built yet")
        if self.model.quantization == "mxfp4" and self.lora.experts != "grouped":
            raise ValueError("model.quantization=mxfp4 computes the experts through the grouped expert LoRA; "
                             "lora.experts=peft needs a bf16 base (model.quantization=mxfp4_dequantize)")
        return self

    @model_validator(mode="after")
    def _preference_data(self) -> Recipe:
        pairs = self.training.preference is not None
        formats = {s.format for s in self.data.source_list()}
        if pairs and formats - {"auto", "preference"}:
            raise ValueError(f"training.objective={self.training.objective} reads preference rows: data.format must "
                             f"be preference or auto (got {', '.join(sorted(formats - {'auto', 'preference'}))})")
        if not pairs and "preference" in formats:
            raise ValueError("data.format=preference needs a preference objective (training.objective: "
                             f"{' | '.join(PREFERENCE_OBJECTIVES)})")
        if pairs and self.data.packing.enabled and self.data.packing.strategy == "split":
            raise ValueError("a preference pair is never split across blocks: use data.packing.strategy=bfd")
        return self

    @model_validator(mode="after")
    def _keep_best(self) -> Recipe:
        if self.training.checkpoint.keep_best and not (self.eval and self.eval.has_data):
            raise ValueError("training.checkpoint.keep_best needs eval data (eval.holdout, eval.path or eval.sources)")
        if self.eval and self.eval.export == "best" and not self.training.checkpoint.keep_best:
            raise ValueError("eval.export=best needs training.checkpoint.keep_best=true")
        return self

    @property
    def output_dir(self) -> Path:
        return Path(self.output.dir.replace("{name}", self.name))

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ------------------------------------------------------------------------------------------ loading
def builtin_recipe_names() -> list[str]:
    root = resources.files("ftcli") / "recipes"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def builtin_recipe_text(name: str) -> str:
    path = resources.files("ftcli") / "recipes" / f"{name}.yaml"
    if not NAME_RE.fullmatch(name) or not path.is_file():
        raise RecipeError(_unknown_recipe_message(name))
    return path.read_text()


def recipe_text(name_or_path: str) -> str:
    """The YAML to start a recipe from (`recipes cp`): a recipe file's own text, once it loads as a recipe, or a
    built-in recipe's."""
    path = Path(name_or_path).expanduser()
    if _is_file(path):
        load_recipe(path)  # a broken recipe is refused here, not copied
        return read_text_file(path, "recipe")
    return builtin_recipe_text(str(name_or_path))  # "no recipe file or built-in recipe named ..."


def renamed(text: str, name: str) -> tuple[str, str | None]:
    """A recipe's YAML text with its top-level `name:` set to `name` (the run dir is `runs/<name>`: a copy
    that kept the original's name would train into the original's run dir), and the old name; the text
    unchanged and None when `name` is no valid recipe name or the text has no top-level `name:` line."""
    line = re.compile(r"^name:[ \t]*(?P<old>[^#\n]*?)[ \t]*(?P<comment>#.*)?$", re.M)
    found = line.search(text)
    if not NAME_RE.fullmatch(name) or found is None:
        return text, None
    comment = f"  {found['comment']}" if found["comment"] else ""
    return text[:found.start()] + f"name: {name}{comment}" + text[found.end():], found["old"].strip("'\"")


def _unknown_recipe_message(name: str) -> str:
    names = builtin_recipe_names()
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; built-in recipes: {', '.join(names)}"
    return f"no recipe file or built-in recipe named '{name}'{hint}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], parsed value); values are YAML (1e-5, true, [1,2], null)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected dotted.key=value, e.g. training.optimizer.lr=2e-5")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except YamlError:
        value = raw
    if isinstance(value, str) and _FLOAT_RE.fullmatch(raw.strip()):
        value = float(raw)  # YAML 1.1 reads `1e-5` (no dot) as a string
    keys = key.strip().split(".")
    if len(keys) > MAX_YAML_DEPTH:
        raise RecipeError(f"--set {key.strip()[:40]}...: {len(keys)} levels of keys; a recipe nests at most "
                          f"{MAX_YAML_DEPTH}")
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"--set {item!r}: '{'.'.join(keys[: i + 1])}' is a value, not a section")
            node = child
        node[keys[-1]] = value
    return data


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a NUL byte or an over-long name: not a file
        return False


# ------------------------------------------------------------------------------------------- errors
def _other_method_key(root: type[BaseModel], loc: tuple) -> str | None:
    """For a key of the other training method's section (`training.precision` in a LoRA recipe): one line naming
    the method it belongs to; None for any other unknown key."""
    where, owner = schema_walk(root, loc[:-1])
    if owner is None or loc[-1] not in getattr(owner, "other_keys", ()):
        return None
    return owner.other_method_problem(".".join(map(str, [*where, loc[-1]])), loc[-1])


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        tagged = tuple(p for p in e["loc"] if not str(p).startswith("function-"))
        loc = schema_walk(Recipe, tagged)[0]
        path = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(_other_method_key(Recipe, tagged) or f"unknown key '{path}'{did_you_mean(Recipe, tagged)}")
        elif e["type"] == "missing":
            lines.append(f"missing required key '{path}'")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            given = e.get("input")
            shown = "" if isinstance(given, (dict, list)) else f" (got {given!r})"
            lines.append(f"{path}: {msg}{shown}" if loc else msg)  # top-level rules name their own keys
    return _problems_message(lines, source)


def _problems_message(lines: list[str], source: str) -> str:
    """One line for one problem; a head line and one indented `  - ` line per problem for several."""
    head = f"invalid recipe {source}: "
    if len(lines) == 1:
        return head + lines[0]
    return head + f"{len(lines)} problems\n" + "\n".join(f"  - {line}" for line in lines)


def _non_finite(data: Any, path: str = "") -> list[tuple[str, float]]:
    """(dotted path, value) of every inf/nan anywhere in parsed YAML, `config_overrides` included."""
    if isinstance(data, float) and not math.isfinite(data):
        return [(path or "(top level)", data)]
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    return [found for key, value in items for found in _non_finite(value, f"{path}.{key}" if path else str(key))]


def _resolve_paths(data: dict[str, Any], base: Path | None) -> None:
    """Make paths relative to the recipe file absolute; `pkg://` stays symbolic until opened. Data paths
    (data, eval and their `sources`) only where the source is local (else a hub id)."""
    if base is None:
        return
    model, dataset = data.get("model") or {}, data.get("data") or {}
    for section, key in ((model, "config"), (model, "tokenizer"), (model, "id"), (dataset, "chat_template")):
        if isinstance(section, dict) and isinstance(section.get(key), str) and not section[key].startswith(PKG_PREFIX):
            section[key] = resolve_path(section[key], base)
    entries = []  # (a section holding `source` / `path`, the schema's default source there)
    for section, schema in ((dataset, DataConfig), (data.get("eval"), EvalConfig)):
        if isinstance(section, dict):
            entries.append((section, schema.model_fields["source"].default))
            sources = section.get("sources")
            default = SourceConfig.model_fields["source"].default
            entries += [(s, default) for s in sources if isinstance(s, dict)] if isinstance(sources, list) else []
    for entry, default in entries:
        path = entry.get("path")
        if isinstance(path, str) and entry.get("source", default) == "local" and not path.startswith(PKG_PREFIX):
            entry["path"] = resolve_path(path, base)


def load_recipe(name_or_path: str | Path, overrides: list[str] | None = None,
                rules: typing.Callable[[Recipe], list[str]] | None = None) -> Recipe:
    """Load a built-in recipe by name or a YAML file by path, apply `--set` overrides, validate. `rules`: the
    rooms above that know more (the training features: `ftcli.features.load_recipe`), one line per problem."""
    path = Path(name_or_path).expanduser()
    base: Path | None = None
    if _is_file(path):
        text, source, base = read_text_file(path, "recipe"), str(path), path.resolve().parent
    elif str(name_or_path).endswith((".yaml", ".yml")) or "/" in str(name_or_path):
        raise RecipeError(f"recipe file not found: {name_or_path}")
    else:
        text, source = builtin_recipe_text(str(name_or_path)), f"'{name_or_path}'"
    try:
        data = parse_yaml(text)
    except YamlError as e:
        raise RecipeError(f"invalid recipe {source}: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"invalid recipe {source}: expected a mapping of sections at the top level")
    if not any(isinstance(k, str) and k in Recipe.model_fields for k in data):  # never echo a foreign file's lines
        raise RecipeError(f"{source} is not a recipe (no name, model or data section at its top level)")
    data = apply_overrides(data, overrides or [])
    not_finite = [f"{key}: must be a finite number (got {value})" for key, value in _non_finite(data)]
    if not_finite:
        raise RecipeError(_problems_message(not_finite, source))
    _resolve_paths(data, base)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, source)) from None
    problems = rules(recipe) if rules is not None else []
    if problems:
        raise RecipeError(_problems_message(problems, source))
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    return yaml.dump(recipe.to_dict(), Dumper=YamlDumper, sort_keys=False)
