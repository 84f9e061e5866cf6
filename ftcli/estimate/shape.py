"""The model's shape for the estimates: from its config.json (shipped, local, or the Hugging Face cache; no
torch, no model build), and the LoRA adapter's parameter count on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftcli.config.errors import UserError
from ftcli.config.recipe import LoraConfig, ModelConfig, TrainingConfig, resolve_path
from ftcli.estimate import memory
from ftcli.objectives import method_of


class InvalidModelConfig(UserError):
    """The model's config cannot build a model (a shape number that is not a whole number >= 1, an unreadable
    model.config): every command that sizes the model refuses it ("fits here: no"), unlike a config that is
    merely not on this machine ("not checked")."""


def model_shape(m: ModelConfig) -> memory.ModelShape:
    """The shape of the model section `m` from its config: random init reads model.config; a pretrained id reads the
    shipped shape (ftcli/assets/models), a local directory's config.json, or the Hugging Face cache."""
    cfg: dict[str, Any] | None = None
    if m.init == "random":
        cfg = _read_config(resolve_path(m.config) if m.config else None, "model.config")
    elif m.id and memory.shipped_shape_path(m.id):
        cfg = json.loads(memory.shipped_shape_path(m.id).read_text())
    elif m.id and (Path(m.id).expanduser() / "config.json").is_file():
        cfg = json.loads((Path(m.id).expanduser() / "config.json").read_text())
    else:
        cfg = _hub_cached_config(m.id, m.revision)
    if cfg is None:
        raise UserError(f"plan needs {m.id}'s config.json: not shipped with ftcli, not a local directory and not in "
                        f"the Hugging Face cache (download it once: hf download {m.id} config.json)")
    cfg = {**cfg, **m.config_overrides}
    check_shape_numbers(cfg, f"model {m.id or m.config}")
    try:
        return memory.shape_from_config(cfg)
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        raise InvalidModelConfig(f"plan cannot size model {m.id or m.config}: {e}") from None


# the config numbers every family's shape is computed from: whole numbers, at least 1 (plan, doctor and train's fit
# check all size the model here, so a config that builds no model is refused by all three in the same words)
_POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "head_dim", "moe_intermediate_size", "num_experts", "num_local_experts")


def check_shape_numbers(cfg: dict[str, Any], what: str) -> None:
    """UserError naming the first shape number of `cfg` (and of its text_config) that is not a whole number >= 1."""
    for part, where in ((cfg, ""), (cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {},
                                    "text_config.")):
        for key in _POSITIVE:
            value = part.get(key)
            if value is None and key in ("num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                                         "num_local_experts", "intermediate_size"):
                continue
            if value is None and not where and isinstance(cfg.get("text_config"), dict):
                continue  # a VLM: its text_config holds the number
            if value is None and where:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidModelConfig(f"{what}: {where}{key} is {value!r}; it must be a whole number >= 1 "
                                "(model.config or model.config_overrides)")


def _read_config(path: str | None, what: str) -> dict[str, Any]:
    if not path:
        raise InvalidModelConfig(f"{what} is not set; model.init=random builds the model from a config.json: set {what}")
    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidModelConfig(f"{what} {path}: cannot read it ({e.strerror})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidModelConfig(f"{what} {path}: not a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise InvalidModelConfig(f"{what} {path}: not a JSON object")
    return cfg


def _hub_cached_config(model_id: str | None, revision: str | None) -> dict[str, Any] | None:
    if not model_id:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    path = try_to_load_from_cache(model_id, "config.json", revision=revision)
    return json.loads(Path(path).read_text()) if isinstance(path, str) else None


def adapter_params(training: TrainingConfig, lora: LoraConfig, shape: memory.ModelShape) -> int:
    """LoRA weights: r x (in + out) per wrapped linear of each layer, and per expert of a wrapped 3-D parameter."""
    if method_of(training).trains_base:  # no adapter
        return 0
    r = lora.r
    wanted = None if lora.target_modules == "all-linear" else set(lora.target_modules)
    total = 0
    for kind in shape.layer_kinds:
        total += sum(r * (i + o) for k, name, i, o in shape.linear_shapes
                     if k in ("*", kind) and (wanted is None or name in wanted))
    per_layer_experts = sum(r * e * (i + o) for name, e, i, o in shape.expert_shapes if name in lora.target_parameters)
    return total + per_layer_experts * shape.layers
