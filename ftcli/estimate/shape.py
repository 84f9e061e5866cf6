"""The model's shape for the estimates: from its config.json (shipped, local, or the Hugging Face cache; no
torch, no model build), and the LoRA adapter's parameter count on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftcli.config.errors import UserError
from ftcli.config.recipe import Recipe, resolve_path
from ftcli.estimate import memory
from ftcli.objectives import method_of


def model_shape(recipe: Recipe) -> memory.ModelShape:
    """The model's shape from its config: random init reads model.config; a pretrained id reads the shipped
    shape (ftcli/assets/models), a local directory's config.json, or the Hugging Face cache."""
    m = recipe.model
    cfg: dict[str, Any] | None = None
    if m.init == "random":
        cfg = json.loads(Path(resolve_path(m.config)).read_text())
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
    try:
        return memory.shape_from_config(cfg)
    except (KeyError, ValueError) as e:
        raise UserError(f"plan cannot size model {m.id or m.config}: {e}") from None


def _hub_cached_config(model_id: str | None, revision: str | None) -> dict[str, Any] | None:
    if not model_id:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    path = try_to_load_from_cache(model_id, "config.json", revision=revision)
    return json.loads(Path(path).read_text()) if isinstance(path, str) else None


def adapter_params(recipe: Recipe, shape: memory.ModelShape) -> int:
    """LoRA weights: r x (in + out) per wrapped linear of each layer, and per expert of a wrapped 3-D parameter."""
    if method_of(recipe.training).trains_base:  # no adapter
        return 0
    lora, r = recipe.lora, recipe.lora.r
    wanted = None if lora.target_modules == "all-linear" else set(lora.target_modules)
    total = 0
    for kind in shape.layer_kinds:
        total += sum(r * (i + o) for k, name, i, o in shape.linear_shapes
                     if k in ("*", kind) and (wanted is None or name in wanted))
    per_layer_experts = sum(r * e * (i + o) for name, e, i, o in shape.expert_shapes if name in lora.target_parameters)
    return total + per_layer_experts * shape.layers
