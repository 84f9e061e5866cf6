"""The `model` section: which weights (or which config, for a random init), tokenizer, dtype, attention and
quantization. Sizes and counts in `model.config_overrides` are checked here; `ftcli.model.checks` goes further and
builds the model config (and the model, on the meta device) before any worker starts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ftcli.config.paths import resolve_path
from ftcli.config.sections.base import Section
from ftcli.config.strict_yaml import MAX_YAML_BYTES


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


class ModelConfig(Section):
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
