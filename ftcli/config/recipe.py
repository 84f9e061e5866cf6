"""Recipes: typed, validated YAML that says everything about one fine-tune.

A recipe is data. `load_recipe("qwen-b300")` finds a built-in recipe by name (shipped inside the
package, so it works after a plain `pip install`), `load_recipe("my.yaml")` reads a file, and
`--set training.optimizer.lr=2e-5` style overrides are applied before validation. Unknown keys fail
with their dotted path and the closest valid key; type errors name the path. No pydantic dumps reach
the user: every problem becomes a `RecipeError` with one short line per problem.

What YAML allows but a recipe refuses (`parse_yaml`, also used for workloads): duplicate keys, aliases
(`*name`; anchors alone are harmless), nesting deeper than 64 levels, files that are not UTF-8 text or
are over 8 MiB. What the schema refuses everywhere: inf/nan (also inside `model.config_overrides`),
`true`/`false` where a number goes, `data.packing.block_len` over 2**20 or over the model's
`max_position_embeddings` when its config.json is a file here, sizes and counts in
`model.config_overrides` below 1 (`num_hidden_layers: 0`). `ftcli.model.checks` goes further and
builds the model config (and the model, on the meta device) before any worker starts.

Paths inside a recipe may use `pkg://assets/...` for files shipped with ftcli (tiny configs, the tiny
tokenizer and dataset). They stay `pkg://` in the validated recipe (so a recipe rendered into a
workload still points at the installed package there); code that opens one calls `resolve_path`.
Plain relative paths (model files, the chat template, local data and eval data) are made absolute
against the recipe file's folder at load time.

This module imports no torch: `ftcli --help` and `ftcli render-workload` stay instant.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import types
import typing
import unicodedata
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    ValidationError,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from ftcli.config.accelerators import Accelerator, parse_accelerator
from ftcli.config.errors import UserError
from ftcli.config.pipspec import check_env_name, check_pip_spec

PKG_PREFIX = "pkg://"
# Shared with ftcli.launchers (experiment and workload names follow the same rules).
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,100}")
NAME_RULE = "use 1-100 letters, digits, '-' or '_'"
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
MAX_BLOCK_LEN = 2**20  # tokens per packed block; past this one block's activations fit no GPU


class RecipeError(UserError):
    """A user mistake in a recipe or an override; the message is ready to print."""


def _members(annotation: Any) -> list:
    """The alternatives a field accepts: `int | None` -> [int, NoneType]; `Annotated[X, ...]` -> [X]."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _bool_for_number(annotation: Any, value: Any) -> bool:
    """True where YAML `true`/`false` stands in a number's place (pydantic would read it as 1/0)."""
    members = _members(annotation)
    if isinstance(value, bool):
        kinds = {type(v) for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)}
        kinds |= {m for m in members if typing.get_origin(m) is not Literal}
        return bool(kinds & {int, float}) and not kinds & {bool, Any}
    if isinstance(value, list):  # tuple[float, float], list[int]: look at the items
        for m in members:
            origin, args = typing.get_origin(m), typing.get_args(m)
            if origin is tuple and any(_bool_for_number(t, v) for t, v in zip(args, value)):
                return True
            if origin is list and args and any(_bool_for_number(args[0], v) for v in value):
                return True
    return False


class _Section(BaseModel):
    """Rules for every section: unknown keys fail, every float is finite, `true`/`false` is no number."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # keys a dump leaves out while they hold these values: settings added later, so that dumps (recipe.yaml,
    # rendered workloads) of recipes that do not use them stay byte-identical
    quiet_defaults: ClassVar[dict[str, Any]] = {}

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        return self._without_quiet_defaults(handler(self))

    @classmethod
    def _without_quiet_defaults(cls, out: dict[str, Any]) -> dict[str, Any]:
        for key, default in cls.quiet_defaults.items():
            if key in out and out[key] == default:
                del out[key]
        return out

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if _bool_for_number(cls.model_fields[info.field_name].annotation, value):
            raise ValueError("expected a number, not true/false")
        return value


# ----------------------------------------------------------------------------------------- model
# `model.config_overrides` keys that are sizes or counts in transformers' configs (at any depth, e.g.
# text_config.num_hidden_layers): a whole number (not true/false) of at least 1; zero only for the keys
# where it means "none of these" (no MTP layers, no shared expert, a dense model).
_SIZE_KEY_RE = re.compile(r"^(num|n)_|_(size|dim|layers|heads|experts|per_tok)$|^max_position_embeddings$")
_ZERO_MEANS_NONE = frozenset({
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "max_window_layers", "n_shared_experts",
    "num_shared_experts", "shared_expert_intermediate_size", "num_experts", "n_routed_experts",
})


def _impossible_sizes(overrides: dict[str, Any], prefix: str = "") -> list[str]:
    """What is wrong with the sizes and counts in `model.config_overrides` (nested configs included)."""
    problems = []
    for key, value in overrides.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            problems += _impossible_sizes(value, f"{name}.")
        elif not isinstance(key, str) or not _SIZE_KEY_RE.search(key):
            continue
        elif isinstance(value, bool):
            problems.append(f"{name} must be a whole number, not true/false")
        elif isinstance(value, int) and value < (0 if key in _ZERO_MEANS_NONE else 1):
            least = "not be negative" if key in _ZERO_MEANS_NONE else "be at least 1"
            problems.append(f"{name} must {least} (got {value})")
    return problems


class ModelConfig(_Section):
    id: str | None = Field(None, description="Hub repo id or local directory of pretrained weights.")
    revision: str | None = Field(None, description="Hub commit to pin (ignored for local paths).")
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="random: build from `config` with random weights (tiny recipes, benchmarks)."
    )
    config: str | None = Field(None, description="config.json for random init (path or pkg://).")
    config_overrides: dict[str, Any] = Field(default_factory=dict, description="Applied on top of the config.")
    model_type: str = Field(..., description="transformers model_type (the families ftcli packs: ftcli.families)")
    model_class: Literal["causal_lm", "image_text_to_text"] = "causal_lm"
    tokenizer: str | None = Field(None, description="Tokenizer id/path; defaults to `id`.")
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    attn_implementation: str = Field(
        "auto", description="auto: ftcli's packed-kernel module picks per machine; or a transformers name."
    )
    quantization: Literal["none", "mxfp4_dequantize", "mxfp4"] = Field(
        "none", description="mxfp4_dequantize: MXFP4 experts loaded as model.dtype; mxfp4 (LoRA, gpt-oss): kept in "
        "MXFP4 and dequantized a chunk of experts at a time in the grouped expert GEMMs (ftcli.model.mxfp4_lora).")
    trust_remote_code: bool = False

    @field_validator("config_overrides")
    @classmethod
    def _possible_sizes(cls, value: dict[str, Any]) -> dict[str, Any]:
        problems = _impossible_sizes(value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _source(self) -> ModelConfig:
        if self.init == "random" and not self.config:
            raise ValueError("model.init=random needs model.config (a config.json path)")
        if self.init == "pretrained" and not self.id:
            raise ValueError("model.init=pretrained needs model.id (hub id or local path)")
        if not (self.tokenizer or self.id):
            raise ValueError("set model.tokenizer (or model.id) so ftcli can tokenize the data")
        return self


# ------------------------------------------------------------------------------------------ data
class PackingConfig(_Section):
    enabled: bool = True
    block_len: int = Field(32768, ge=8, description="Tokens per packed block.")
    strategy: Literal["split", "bfd"] = Field(
        "split", description="split: cut at the block edge (the published Databricks examples); bfd: best-fit decreasing, no splits."
    )
    bfd_buffer: int = Field(1024, ge=1, description="Examples buffered per best-fit-decreasing round.")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="bfd: example longer than a block.")


class SyntheticData(_Section):
    """Random token conversations with a realistic length spread (benchmarks)."""

    num_examples: int = Field(20000, ge=1)
    mean_tokens: int = Field(1200, ge=2)
    max_tokens: int = Field(16384, ge=2)
    prompt_fraction: float = Field(0.3, ge=0.0, le=1.0)
    seed: int = 0


SourceKind = Literal["hub", "local", "synthetic", "delta"]  # delta: ftcli.data.delta


def _revision_text(value: Any) -> Any:
    """YAML reads `revision: 12` as an int and an unquoted timestamp as a datetime: both kept as text."""
    import datetime

    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value.isoformat() if isinstance(value, (datetime.datetime, datetime.date)) else value


Revision = Annotated[str | None, BeforeValidator(_revision_text)]  # a hub commit; a delta version or timestamp
SpecialTokensInText = Literal["keep", "escape", "error"]
# ftcli.data.formats; `preference`: chosen/rejected rows in any form ftcli.data.preference reads (auto detects it too)
DataFormat = Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "preference"]


class SourceConfig(_Section):
    """One dataset of a mix (`data.sources`). Fields left unset take the value of the same key in `data`."""

    name: str | None = Field(None, description="Label in pack-preview and run.json; default: the path.")
    source: SourceKind = "hub"
    path: str | None = Field(
        None, description="Hub dataset id, or a local file/dir (JSONL, Parquet, CSV, Arrow; a UC volume is a path); "
        "delta: a table path or a Unity Catalog name catalog.schema.table."
    )
    revision: Revision = Field(None, description="hub: a commit; delta: a table version (12) or an ISO-8601 "
                               "timestamp (2026-12-01T00:00:00Z).")
    split: str = "train"
    streaming: bool = False
    columns: list[str] | None = Field(None, description="delta: read only these columns (default: all).")
    format: DataFormat | None = None
    messages_field: str | None = None
    tools_field: str | None = None
    max_examples: int | None = Field(None, ge=1, description="Rows read from this source (before weighting).")
    synthetic: SyntheticData = Field(default_factory=SyntheticData)
    weight: float = Field(
        1.0, gt=0, description="Times each row is used: 2 = every row twice (epochs-style), 0.5 = a seeded half, "
        "1.5 = every row once plus a seeded half again (data.mix_seed)."
    )

    @model_validator(mode="after")
    def _path(self) -> SourceConfig:
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"a data.sources entry with source={self.source} needs a path")
        _check_delta_keys(self)
        return self

    @property
    def label(self) -> str:
        return self.name or (self.path if self.source != "synthetic" else "synthetic")


def parse_delta_revision(revision: str | int | None):
    """A delta source's `revision` (ftcli.data.delta): a table version (an integer >= 0, as int) or an ISO-8601
    timestamp with its time zone (as datetime); None: the newest version. Else ValueError."""
    from datetime import datetime

    if revision is None:
        return None
    text = str(revision).strip()
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"revision {revision!r} of a delta source: a table version (12) or an ISO-8601 timestamp "
                         "(2026-12-01T00:00:00Z)") from None
    if when.tzinfo is None:
        raise ValueError(f"revision {revision!r} of a delta source: give the timestamp's time zone (...Z or +00:00)")
    return when


def _check_delta_keys(src) -> None:
    """A delta source's revision is a version or a timestamp; `columns` belongs to delta sources only."""
    if src.source == "delta":
        parse_delta_revision(src.revision)
    elif src.columns is not None:
        raise ValueError(f"columns is for source=delta (a Delta table's columns), not source={src.source}")


class DataConfig(_Section):
    quiet_defaults: ClassVar[dict[str, Any]] = {"tools_field": "tools", "special_tokens_in_text": "keep",
                                                "sources": None, "mix_seed": 0, "allow_empty_sources": False,
                                                "max_row_chars": None, "columns": None}
    source: SourceKind = "hub"
    path: str | None = Field(None, description="Hub dataset id, or a local file/dir (JSONL, Parquet, CSV, Arrow); "
                             "delta: a table path or a Unity Catalog name catalog.schema.table.")
    revision: Revision = Field(None, description="hub: a commit; delta: a table version or an ISO-8601 timestamp.")
    split: str = "train"
    streaming: bool = False
    columns: list[str] | None = Field(None, description="delta: read only these columns (default: all).")
    format: DataFormat = Field(
        "auto", description="Row format: auto (detected from the first rows), messages, sharegpt, alpaca, "
        "prompt_completion, text (ftcli.data.formats)."
    )
    messages_field: str = "messages"
    tools_field: str | None = Field(
        "tools", description="Row field with function schemas, passed to the template as tools=."
    )
    sources: list[SourceConfig] | None = Field(
        None, description="The datasets read, each with its own fields and weight (a mix); source/path/revision/split/"
        "streaming/synthetic above are the shorthand for one entry (give one form, not both)."
    )
    mix_seed: int = Field(0, description="Seed of the fractional part of data.sources weights.")
    chat_template: str | None = Field(None, description="Jinja file overriding the tokenizer's template.")
    train_on: Literal["assistant", "all", "last"] = Field("assistant", description="Which turns get loss.")
    strict: bool = Field(False, description="Stop at the first bad row instead of skipping and counting it.")
    allow_empty_sources: bool = Field(
        False, description="Train although a source keeps no row (or under 1% of its rows); default: refused before launch."
    )
    # keep (default): a special-token string a user typed (`<|im_end|>`) is tokenized as the characters it
    # is, never as the control token: the text reaches the model unchanged and cannot end a turn or fake
    # a role. escape: a zero-width space after its first character (the text changes, visibly to a
    # decoder). error: the row is skipped and counted (strict: stops). Counted in every mode. (With a
    # tokenizer ftcli cannot cut at its added tokens, e.g. a SentencePiece one, keep tokenizes as escape.)
    special_tokens_in_text: SpecialTokensInText = Field(
        "keep", description="keep: tokenize as plain text; escape: break with a zero-width space; error: skip the row."
    )
    max_examples: int | None = Field(None, ge=1, description="Rows read (per source with data.sources).")
    max_length: int | None = Field(None, ge=2, description="Truncate each example to this many tokens (counted as truncated).")
    max_row_chars: int | None = Field(
        None, ge=1, description="Skip (and count) rows with more characters, before tokenizing; default 64 x the "
        "block length (data.max_length when packing is off and it is set).")
    packing: PackingConfig = Field(default_factory=PackingConfig)
    synthetic: SyntheticData = Field(default_factory=SyntheticData)
    num_workers: int = Field(0, ge=0)
    cache_dir: str | None = Field(None, description="Tokenize/pack cache; default ~/.cache/ftcli or $FTCLI_CACHE.")

    # The one-source shorthand: these keys describe the single entry of `sources` (`shorthand_source`).
    SHORTHAND: ClassVar[tuple[str, ...]] = ("source", "path", "revision", "split", "streaming", "columns", "synthetic")

    @model_validator(mode="wrap")
    @classmethod
    def _normal_form(cls, data: Any, handler) -> DataConfig:
        """`sources` is the one form every reader sees: the shorthand becomes its single entry; a shorthand key
        that differs from its default next to `sources` is refused (the two forms would disagree)."""
        out = handler(data)  # every key checked where it is written
        if out.sources is None:
            if out.source != "synthetic" and not out.path:
                raise ValueError(f"data.source={out.source} needs data.path")
            return out.model_copy(update={"sources": [out.shorthand_source()]})
        if out.one_source:  # the shorthand already in its normal form (an assignment validates the section again)
            return out
        given = [k for k in cls.SHORTHAND if getattr(out, k) != cls.model_fields[k].get_default(call_default_factory=True)
                 and not (k == "source" and out.path is None and out.source != "synthetic")]  # a kind alone names no data
        if given:
            # what drops the shorthand (a kind alone, without a path, is none)
            defaults = {k: cls.model_fields[k].default for k in given
                        if k != "synthetic" and (k != "source" or out.source == "synthetic")}
            unset = " ".join(f"--set data.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in defaults.items())
            raise ValueError(f"data.sources and {', '.join('data.' + k for k in given)} are both set; those keys are "
                             "the shorthand for a single data.sources entry: keep one form"
                             + (f" ({unset} drops the shorthand)" if unset else ""))
        if not out.sources:
            raise ValueError("data.sources is empty; list at least one source (or use data.path)")
        labels = [s.label for s in out.sources]
        if len(set(labels)) != len(labels):
            raise ValueError("data.sources: two sources have the same name/path; give them distinct names")
        return out

    def shorthand_source(self) -> SourceConfig:
        """The `sources` entry the one-source keys describe."""
        return SourceConfig(source=self.source, path=self.path, revision=self.revision, split=self.split,
                            streaming=self.streaming, columns=self.columns, synthetic=self.synthetic)

    @property
    def one_source(self) -> bool:
        """Whether `sources` is what the one-source shorthand describes (dumps then write the shorthand, as given)."""
        described = self.source == "synthetic" or bool(self.path)
        return described and self.sources == [self.shorthand_source()]

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        if self.one_source:
            out["sources"] = None
        return self._without_quiet_defaults(out)

    def source_list(self) -> list[SourceConfig]:
        """The sources to read (`data.sources`, the shorthand's single entry included), with unset per-source fields
        filled from `data`."""
        return [
            s.model_copy(update={
                "format": s.format or self.format,
                "messages_field": s.messages_field or self.messages_field,
                "tools_field": s.tools_field if s.tools_field is not None else self.tools_field,
            })
            for s in self.sources or [self.shorthand_source()]
        ]


# ------------------------------------------------------------------------------------------ eval
class EarlyStopConfig(_Section):
    patience: int = Field(3, ge=1, description="Evals in a row without an improvement before the run stops.")
    min_delta: float = Field(0.0, ge=0, description="An eval improves when it beats the best by more than this.")


class EvalConfig(_Section):
    """A held-out loss: a share of the training rows (`holdout`) or separate data (`path` / `sources`),
    encoded, masked and packed by the training data path. Every source gets its own loss (ftcli.train.evaluate)."""

    enabled: bool = Field(True, description="false turns eval off (the section is kept for later runs); "
                          "`--set eval.enabled=false` on the command line.")
    holdout: float | None = Field(
        None, ge=0, description="Training rows held out for eval: a share (<1, e.g. 0.02) or a row count per "
        "source (>=1), picked by a hash of the row and holdout_seed; training never sees them. 0: none.")
    holdout_seed: int = 0
    source: SourceKind = "local"
    path: str | None = Field(None, description="Separate eval data (same forms as data.path).")
    revision: str | None = None
    split: str = "validation"
    sources: list[SourceConfig] | None = Field(None, description="Separate eval data as a list (data.sources form).")
    max_examples: int | None = Field(None, ge=1, description="Eval rows read (per source).")
    block_len: int | None = Field(None, ge=8, description="Eval block length; default data.packing.block_len.")
    strategy: Literal["bfd", "split", "none"] = Field(
        "bfd", description="bfd (default): no example is cut, so the loss does not depend on the block length; "
        "split: as training's split; none: one example per block.")
    every_steps: int | None = Field(None, ge=1)
    every_minutes: float | None = Field(None, gt=0)
    at_start: bool = Field(False, description="Also evaluate before the first step (step 0).")
    export: Literal["last", "best"] = Field("last", description="What becomes <run>/final: the last or the best model.")
    early_stop: EarlyStopConfig | None = None
    samples: list[str | list[dict[str, Any]]] = Field(
        default_factory=list, description="Prompts (a user message, or a conversation) generated greedily during "
        "training into <run>/samples.jsonl.")
    samples_every: int = Field(1, ge=1, description="Generate the samples every N evals (and at the end).")
    samples_every_steps: int | None = Field(None, ge=1, description="Generate the samples every N steps instead.")
    samples_max_new_tokens: int = Field(32, ge=1)

    @field_validator("holdout")
    @classmethod
    def _no_holdout(cls, v: float | None) -> float | None:
        return None if v == 0 else v  # hold out nothing: no eval data from the training rows

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        given = [k for k in ("holdout", "path", "sources") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"eval: set one of holdout, path, sources (got {', '.join(given)})")
        if self.holdout is not None and self.holdout >= 1 and self.holdout != int(self.holdout):
            raise ValueError("eval.holdout: a share below 1 (0.02) or a whole row count (200)")
        if not self.has_data and (self.early_stop is not None or self.export == "best"):
            raise ValueError("eval.early_stop / eval.export=best need eval data (eval.holdout, eval.path or eval.sources)")
        return self

    @property
    def has_data(self) -> bool:
        return self.holdout is not None or self.path is not None or self.sources is not None

    def sample_conversations(self) -> list[list[dict[str, Any]]]:
        return [[{"role": "user", "content": s}] if isinstance(s, str) else s for s in self.samples]


# -------------------------------------------------------------------------------------- training
class OptimizerConfig(_Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    eps: float = Field(1e-8, gt=0)
    fused: bool = True


class ScheduleConfig(_Section):
    name: Literal["constant", "cosine", "cosine_with_min_lr", "linear"] = "constant"
    warmup: float = Field(0.0, ge=0, description="<1: fraction of total steps; >=1: number of steps.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class PrecisionConfig(_Section):
    quiet_defaults: ClassVar[dict[str, Any]] = {"fp8": False, "fp8_recipe": "tensorwise"}
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    reduce_dtype: Literal["bfloat16", "float32"] = "float32"
    master_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="bfloat16: what the published Databricks qwen-b300 example did (most small updates round away)."
    )
    fp8: bool = Field(
        False, description="Full SFT: the decoder layers' large linears run their GEMMs in float8 (torchao float8 "
        "training, dynamic tensorwise scales; needs torchao and a GPU of compute capability >= 8.9). The LM "
        "head, small projections and the master weights stay as they are (ftcli/features/float8.py)."
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="torchao's float8 scaling with fp8: tensorwise (one scale per tensor, fastest) or "
        "rowwise (one scale per row: on an outlier model its gradient norms stay closer to bf16's, ~7% slower per step; BENCHMARKS.md 'fp8 on pretrained-like weights')."
    )


class CheckpointConfig(_Section):
    quiet_defaults: ClassVar[dict[str, Any]] = {"keep_best": False}
    enabled: bool = True
    every_steps: int | None = Field(None, ge=1)
    every_minutes: float | None = Field(None, gt=0)
    keep_last: int = Field(2, ge=1)
    save_final_hf: bool = Field(True, description="Write a Hugging Face checkpoint at the end.")
    keep_best: bool = Field(
        False, description="Keep the checkpoint of the best eval loss beside the last keep_last (needs eval data)."
    )


class LossConfig(_Section):
    impl: Literal["chunked", "chunked_fwd_grad", "full", "liger"] = Field(
        "chunked", description="chunked: never materializes full fp32 logits; chunked_fwd_grad: the same chunks with "
        "their gradients made in forward (no recompute: one LM-head GEMM less); full: full-vocabulary logits (the "
        "published examples' loss)."
    )
    chunk_tokens: int = Field(4096, ge=1)


PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")  # ftcli/objectives/preference.py


# context-parallel slices are whole gated-delta chunks: ftcli.data.collate.FLA_CHUNK (that module imports torch)
CP_SLICE_MULTIPLE = 64


class PreferenceSection(_Section):
    """The knobs of the preference objectives (ftcli/objectives/preference.py, ftcli/train/preference.py)."""

    beta: float = Field(0.1, gt=0, description="dpo/ipo: the KL strength (ipo: its regularization tau); simpo: "
                        "the reward scale.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo and simpo: the share of pairs assumed "
                                   "flipped (conservative DPO).")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: the target reward margin.")
    orpo_lambda: float = Field(0.1, gt=0, description="orpo: the weight of the odds-ratio term beside the SFT term.")
    reference: Literal["model", "precomputed"] = Field(
        "model", description="dpo/ipo: where the reference's log-probs come from. model: a frozen copy of the "
        "starting model beside the policy (method full) or the base with the adapter off (lora), one more forward "
        "per block; precomputed: one pass of the starting model (lora: the base, training.sharding=ddp) over the "
        "packed blocks before step 1, stored beside the pack cache (keyed by the blocks and the reference model), "
        "then no second model and no reference forward.")


class _Training(_Section):
    """What both trainers read. `training` is `FullTraining | LoraTraining`, picked by `method`. A key of the other
    method's section is refused with one line naming the method it belongs to (`format_validation_error`), except
    at its default: dumps write every key of both (so recipe.yaml and rendered workloads stay as they were, and a
    dump loads again), and loading drops them there."""

    quiet_defaults: ClassVar[dict[str, Any]] = {"objective": "sft", "preference": None}
    other_method: ClassVar[str] = ""  # the method whose keys `other_keys` are
    other_keys: ClassVar[tuple[str, ...]] = ()

    # declared here first so that every dump starts with them (each method's class narrows `method` to its name)
    method: str = "full"
    objective: Literal["sft", "dpo", "ipo", "simpo", "orpo"] = Field(
        "sft", description="What is optimized (ftcli/objectives/): sft, next-token cross-entropy on the trained "
        "tokens; dpo, ipo (against a reference model), simpo, orpo (reference-free) on preference pairs "
        "(training.preference). Separate from training.method (full | lora: how the parameters train and what "
        "the run writes).")
    preference: PreferenceSection | None = Field(
        None, description="The preference objectives' knobs (set for dpo, ipo, simpo, orpo; absent for sft).")
    epochs: float = Field(1.0, gt=0, le=100_000)
    max_steps: int | None = Field(None, ge=1)
    grad_accum: int = Field(1, ge=1, description="Micro-batches (blocks) per optimizer step per rank.")
    per_device_batch: int = Field(1, ge=1)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    grad_clip: float | None = Field(1.0, gt=0, description="Max grad norm; null disables clipping.")
    activation_checkpointing: Literal["none", "full", "selective"] = "full"
    loss: LossConfig = Field(default_factory=LossConfig)
    seed: int = 0
    log_every: int = Field(1, ge=1)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    max_bad_steps: int = Field(3, ge=1, description="Consecutive non-finite steps before the run stops.")
    cpu_processes: int = Field(2, ge=1, description="torchrun processes on a machine without GPUs.")

    @classmethod
    def _other(cls) -> type[_Training]:
        return TRAINING_BY_METHOD[cls.other_method]

    @model_validator(mode="after")
    def _preference_knobs(self) -> _Training:
        pairs = self.objective in PREFERENCE_OBJECTIVES
        if pairs and self.preference is None:
            self.preference = PreferenceSection()
        if not pairs and self.preference is not None:
            raise ValueError(f"training.preference applies to the preference objectives "
                             f"({', '.join(PREFERENCE_OBJECTIVES)}); training.objective is {self.objective}")
        if pairs and self.loss.impl != "chunked":
            raise ValueError(f"training.loss.impl={self.loss.impl} is SFT's token loss; the preference objectives' "
                             "log-probs are chunked (training.loss.chunk_tokens): leave training.loss.impl out")
        return self

    @model_validator(mode="before")
    @classmethod
    def _other_keys_at_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if k not in cls.other_keys or not cls._other().holds_default(k, v)}

    @classmethod
    def holds_default(cls, key: str, value: Any) -> bool:
        """Whether `value` given for this section's `key` is what leaving the key out gives."""
        default = cls.model_fields[key].get_default(call_default_factory=True)
        try:
            given = cls.model_validate({"method": cls.model_fields["method"].default, key: value})
        except ValidationError:
            return False
        return getattr(given, key) == default

    @model_serializer(mode="wrap")
    def _dump(self, handler, info):
        out = self._without_quiet_defaults(handler(self))
        other = self._other()
        for key in self.other_keys:
            default = other.model_fields[key].get_default(call_default_factory=True)
            out[key] = default.model_dump(mode=info.mode) if isinstance(default, BaseModel) else default
        out = other._without_quiet_defaults(out)
        return {k: out[k] for k in training_keys() if k in out}


class FullTraining(_Training):
    """Full-parameter SFT (ftcli.train.full: the FSDP2 loop)."""

    quiet_defaults: ClassVar[dict[str, Any]] = {**_Training.quiet_defaults, "fused_ops": [], "context_parallel": 1}
    other_method: ClassVar[str] = "lora"
    other_keys: ClassVar[tuple[str, ...]] = ("sharding",)
    method: Literal["full"] = "full"
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    activation_checkpointing_keep: int = Field(
        0, ge=0, description="With full checkpointing: keep the activations of this many decoder layers (the "
        "last ones) instead of recomputing them; spare memory for speed (benchmarks/memory_model.py says how "
        "many fit per card)."
    )
    compile: bool | Literal["regions"] = Field(
        False, description="true: torch.compile each decoder layer whole; regions: compile only the parts of each "
        "layer around its packed kernels (norms, the dense MLP, float8 linears), which a graph break in the "
        "gated-delta or attention kernel cannot push back to eager (ftcli/features/compile.py)."
    )
    fused_ops: list[Literal["rms_norm", "swiglu", "gated_norm"]] = Field(
        default_factory=list, description="Full SFT on CUDA: fused Triton kernels for Qwen3.5's decoder norms "
        "(rms_norm, liger-kernel), MLP activation (swiglu, liger-kernel) and gated-delta output norm "
        "(gated_norm, fla); same parameters and checkpoints (ftcli/features/fused_ops.py)."
    )
    context_parallel: int = Field(
        1, ge=1, description="Ranks that share each packed block, each training on a contiguous slice of "
        "block_len / N tokens (attention keys gathered, the gated-delta state and the conv halo passed across the "
        "slices: ftcli/model/kernels/cp.py); blocks per step = ranks / N x grad_accum. `ftcli plan` says which N "
        "fits a block length."
    )

    @field_validator("method", mode="before")
    @classmethod
    def _known_method(cls, value: Any) -> Any:
        if value not in ("full", "lora"):
            raise ValueError("Input should be 'full' or 'lora'")
        return value

    @model_validator(mode="after")
    def _keep_needs_full(self) -> FullTraining:
        if self.activation_checkpointing_keep and self.activation_checkpointing != "full":
            raise ValueError("activation_checkpointing_keep applies to activation_checkpointing=full only")
        return self


class LoraTraining(_Training):
    """LoRA through TRL + PEFT (ftcli.train.lora.trainer): the base frozen in model.dtype, adapters in float32."""

    other_method: ClassVar[str] = "full"
    other_keys: ClassVar[tuple[str, ...]] = ("precision", "activation_checkpointing_keep", "fused_ops",
                                             "context_parallel")
    method: Literal["lora"] = "lora"
    compile: bool | Literal["regions"] = Field(
        False, description="true: torch.compile each decoder layer whole (LoRA linears, attention, router and "
        "experts in one graph); regions: only the LoRA linears, norms and MoE MLP of each layer "
        "(ftcli/features/compile.py)."
    )
    sharding: Literal["auto", "ddp", "fsdp"] = Field(
        "auto", description="LoRA: ddp keeps the whole frozen base on every GPU, fsdp shards it (FSDP2); auto: "
        "ddp where `ftcli plan` says it fits the recipe's accelerator, else fsdp. Full SFT always shards."
    )

    @field_validator("loss")
    @classmethod
    def _trl_loss(cls, value: LossConfig) -> LossConfig:
        if value.impl != "chunked":
            raise ValueError(f"impl={value.impl} belongs to training.method=full; LoRA's loss is the chunked one "
                             "(ftcli's, as the eval's): leave training.loss.impl out")
        return value


TRAINING_BY_METHOD: dict[str, type[_Training]] = {"full": FullTraining, "lora": LoraTraining}


def training_keys() -> tuple[str, ...]:
    """The keys of `training` in the order dumps write them (recipe.yaml, rendered workloads, `recipes show`): taken
    from the schema, so a new key is dumped without being listed anywhere: the keys both methods share in their
    declaration order (`_Training`'s), then each method's own keys (full's, then lora's)."""
    return tuple(dict.fromkeys(k for cls in TRAINING_BY_METHOD.values() for k in cls.model_fields))


def _training_method(value: Any) -> str:
    method = value.get("method", "full") if isinstance(value, dict) else getattr(value, "method", "full")
    return "lora" if method == "lora" else "full"  # an unknown method: FullTraining says which are known


TrainingConfig = Annotated[
    Annotated[FullTraining, Tag("full")] | Annotated[LoraTraining, Tag("lora")], Discriminator(_training_method)
]


# ------------------------------------------------------------------------------------------ lora
class LoraConfig(_Section):
    quiet_defaults: ClassVar[dict[str, Any]] = {"experts": "grouped"}
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.05, ge=0, lt=1)
    bias: Literal["none", "all", "lora_only"] = "none"
    target_modules: str | list[str] = "all-linear"
    target_parameters: list[str] = Field(default_factory=list, description="3-D params, e.g. MoE experts.")
    experts: Literal["grouped", "peft"] = Field(
        "grouped", description="LoRA on MoE expert parameters (gpt-oss, Qwen3-MoE): grouped (unmerged x·W + s·(x·A)·B over tokens "
        "grouped by expert, no base gradient: ftcli.model.moe_lora) or peft (PEFT's ParamWrapper, W + s·A·B "
        "folded every forward).")
    exclude_vision: bool = Field(True, description="Keep LoRA off the vision tower of VLM classes.")


# -------------------------------------------------------------------------------------- tracking
def _plain_text(v: str | None) -> str | None:
    problem = None if v is None else plain_text_problem(v)
    if problem:
        raise ValueError(problem)
    return v


class TrackingConfig(_Section):
    enabled: bool = True
    tracking_uri: str | None = Field(None, description="Default: sqlite:///mlflow.db (or $MLFLOW_TRACKING_URI).")
    experiment: Annotated[str | None, AfterValidator(_plain_text)] = None
    run_name: Annotated[str | None, AfterValidator(_plain_text)] = None
    log_system_metrics: bool = True


class OutputConfig(_Section):
    dir: str = Field("runs/{name}", description="Run directory; {name} is the recipe name.")


# --------------------------------------------------------------------------------------- compute
class PermissionConfig(_Section):
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


class SlurmConfig(_Section):
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


class ComputeConfig(_Section):
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


def max_position_embeddings(cfg: ModelConfig) -> tuple[int, str] | None:
    """(the model's max_position_embeddings, where it comes from) when its config.json is a readable
    file here (random init, or a local model dir); None otherwise (hub ids are checked by the workers)."""
    override = cfg.config_overrides.get("max_position_embeddings")
    if isinstance(override, int) and not isinstance(override, bool):
        return override, "model.config_overrides"
    source = cfg.config if cfg.init == "random" else cfg.id
    try:
        path = Path(resolve_path(source) or "")
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file() or path.stat().st_size > MAX_YAML_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RuntimeError):  # unreadable here: the workers report it
        return None
    for section in (data, data.get("text_config") if isinstance(data, dict) else None):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value, str(source)
    return None


# ---------------------------------------------------------------------------------------- recipe
class Recipe(_Section):
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
        if self.training.objective != "sft":  # a pair's two sequences would land on different ranks
            raise ValueError(f"training.context_parallel={n} trains training.objective: sft only (not "
                             f"{self.training.objective}: a preference pair is not split across ranks yet)")
        block_len = self.data.packing.block_len
        if block_len % (n * CP_SLICE_MULTIPLE):
            raise ValueError(f"training.context_parallel={n}: data.packing.block_len={block_len} must be a multiple "
                             f"of {n * CP_SLICE_MULTIPLE} (N slices of a multiple of {CP_SLICE_MULTIPLE} tokens)")
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


# ------------------------------------------------------------------------------------------- YAML
# One reader for every YAML file ftcli is handed (recipes, `--set` values, workloads to check).
MAX_YAML_BYTES = 8 * 2**20
MAX_YAML_DEPTH = 64


class YamlError(UserError):
    """What is wrong with a YAML text, in one line that names the line."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader minus what a recipe never needs and YAML makes dangerous: duplicate keys (the later
    one silently replaced a whole section), aliases (a 1.5 KB alias bomb expands to billions of nodes,
    which validation and `recipes show` then walk) and nesting deeper than MAX_YAML_DEPTH (PyYAML
    composes recursively: 5,000 levels end in a RecursionError)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not supported; write the value out", event.start_mark
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", event.start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first set at line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    """Parse one YAML document with `_StrictLoader`; every failure is a one-line `YamlError`."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}" if mark else ""
        raise YamlError(f"not valid YAML{where}: {e.problem or e.context}") from None
    except yaml.reader.ReaderError as e:  # `character` is a code point (or a byte for bytes input)
        raise YamlError(
            f"not valid YAML: control character #x{e.character:04x} at offset {e.position} (a binary file?)"
        ) from None
    except yaml.YAMLError as e:
        raise YamlError(f"not valid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of `path`; a missing, unreadable, binary or oversized file is one line naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > MAX_YAML_BYTES:
        raise UserError(f"{what} {path} is larger than {MAX_YAML_BYTES // 2**20} MiB; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); is it a binary file?"
        ) from None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a NUL byte or an over-long name: not a file
        return False


def plain_text_problem(value: str) -> str | None:
    """What is wrong with a name that ends up in MLflow, a registry or a terminal (None: nothing):
    it must not be blank or hold control characters (newlines, escapes, bidi overrides)."""
    if not value.strip():
        return "must not be empty"
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    return None if bad is None else f"contains the control character {bad!r}; use printable characters only"


# ------------------------------------------------------------------------------ loading & errors
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


def resolve_path(value: str | None, base: Path | None = None) -> str | None:
    """`pkg://assets/x` -> the installed file; relative paths -> against `base` (the recipe's folder)."""
    if value is None:
        return None
    if value.startswith(PKG_PREFIX):
        return str(resources.files("ftcli").joinpath(value[len(PKG_PREFIX) :]))
    try:
        path = Path(value).expanduser()
        if base is not None and not path.is_absolute() and (base / path).exists():
            return str((base / path).resolve())
    except (OSError, ValueError, RuntimeError):  # NUL bytes, over-long names, `~nosuchuser`: left as given
        pass
    return value


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


# ------------------------------------------------------------------------------------ did you mean
# One helper for every schema here: recipes (`Recipe`) and AI Runtime workloads (`ftcli.launchers.databricks`).
def _sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The schema sections a field holds: `X`, `X | None`, `list[X]` -> [X]."""
    args = getattr(annotation, "__args__", None)
    if args:
        return [t for a in args for t in _sections_in(a)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def _tagged_sections(annotation: Any) -> dict[str, type[BaseModel]]:
    """tag -> section of a discriminated union (`training`: full -> FullTraining, lora -> LoraTraining)."""
    out: dict[str, type[BaseModel]] = {}
    for member in typing.get_args(annotation):
        if typing.get_origin(member) is Annotated:
            inner, *meta = typing.get_args(member)
            out.update({m.tag: inner for m in meta if isinstance(m, Tag)})
        out.update(_tagged_sections(member))
    return out


def _walk(root: type[BaseModel], loc: tuple) -> tuple[tuple, type[BaseModel] | None]:
    """(`loc` without the tags pydantic puts in it after a discriminated union, the section it ends at: None
    where it is not one)."""
    model: type[BaseModel] | None = root
    clean: list = []
    tags: dict[str, type[BaseModel]] = {}
    for part in loc:
        if part in tags:
            model, tags = tags[part], {}
            continue
        clean.append(part)
        if isinstance(part, int) or model is None:  # an item of a list of sections
            continue
        field = model.model_fields.get(part)
        sections = _sections_in(field.annotation) if field else []
        tags = _tagged_sections(field.annotation) if field else {}
        model = sections[0] if sections else None
    return tuple(clean), model


def schema_section(root: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """Walk the schema from `root` along a pydantic error location to the section it names (None: not one)."""
    return _walk(root, path)[1]


def _nested_key(model: type[BaseModel], key: str, prefix: str = "") -> str | None:
    """`training.lr` -> `optimizer.lr`: the key exists one section further down."""
    for name, field in model.model_fields.items():
        for section in _sections_in(field.annotation):
            if key in section.model_fields:
                return f"{prefix}{name}.{key}"
            found = _nested_key(section, key, f"{prefix}{name}.")
            if found:
                return found
    return None


def did_you_mean(root: type[BaseModel], loc: tuple) -> str:
    """"; did you mean 'a.b'?" for the unknown key at `loc` under the schema `root`: the closest key of its
    section, else the same key one section further down; "" when there is neither."""
    where, owner = _walk(root, loc[:-1])
    if owner is None:
        return ""
    keys = [*owner.model_fields, *getattr(owner, "other_keys", ())]  # training: the other method's keys too
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.5)
    found = _nested_key(owner, str(loc[-1])) or (close[0] if close else None)  # an exact key deeper beats a near one
    return f"; did you mean '{'.'.join([*map(str, where), found])}'?" if found else ""


def _other_method_key(root: type[BaseModel], loc: tuple) -> str | None:
    """For a key of the other training method's section (`training.precision` in a LoRA recipe): one line naming
    the method it belongs to; None for any other unknown key."""
    where, owner = _walk(root, loc[:-1])
    if owner is None or loc[-1] not in getattr(owner, "other_keys", ()):
        return None
    path = ".".join(map(str, [*where, loc[-1]]))
    this = owner.model_fields["method"].default
    default = owner._other().model_fields[loc[-1]].get_default(call_default_factory=True)
    # the --set value that leaves it at its default
    reset = "{}" if isinstance(default, BaseModel) else default if isinstance(default, str) else json.dumps(default)
    return (f"{path} belongs to training.method={owner.other_method} (this recipe's is {this}): leave it out "
            f"(switching a recipe's method with --set: also --set {path}={reset})")


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        tagged = tuple(p for p in e["loc"] if not str(p).startswith("function-"))
        loc = _walk(Recipe, tagged)[0]
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


class YamlDumper(yaml.SafeDumper):
    """Writes a value out wherever it appears: no `&anchor`/`*alias`, which `parse_yaml` refuses."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_recipe(recipe: Recipe) -> str:
    return yaml.dump(recipe.to_dict(), Dumper=YamlDumper, sort_keys=False)
