"""Check a recipe's model before any worker starts: build its transformers config (with
`model.config_overrides` applied) and then the model itself on the meta device, where no weight is
allocated, so `config_overrides: {hidden_size: -4}` is one line here rather than a traceback per rank.

Only configs that can be read on this machine are checked: `init: random` configs, local model
directories and hub configs already in the local Hugging Face cache (no network, no downloads).
`trust_remote_code` models are not built here: that would run the repository's code in the launcher.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from ftcli.config.errors import UserError
from ftcli.config.recipe import ModelConfig, PackingConfig, resolve_path


def _local_source(cfg: ModelConfig) -> ModelConfig | None:
    """The model section pointing at a config on this machine, or None when there is none."""
    if cfg.trust_remote_code:
        return None
    if cfg.init == "random" or Path(resolve_path(cfg.id) or "").is_dir():
        return cfg
    from huggingface_hub import try_to_load_from_cache

    try:  # a hub id: only from the local cache
        path = try_to_load_from_cache(cfg.id, "config.json", revision=cfg.revision)
    except ValueError:  # not a valid repo id
        return None
    return cfg.model_copy(update={"id": str(Path(path).parent), "revision": None}) if isinstance(path, str) else None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())  # transformers' messages span lines
    return (text or type(err).__name__)[:300]


def _check_override_keys(config: Any, overrides: dict[str, Any]) -> None:
    """An override the config does not have would be set and then ignored by the model (a typo, or a
    key that moved, like `rope_theta` into `rope_parameters` in transformers 5)."""
    from ftcli.model.build import text_config

    known = set(config.to_dict()) | set(text_config(config).to_dict())
    for key in overrides:
        if not (hasattr(config, key) or hasattr(text_config(config), key)):
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UserError(f"model.config_overrides.{key}: {type(config).__name__} has no such key, the model would "
                            f"ignore it{hint}")


def check_model_config(model: ModelConfig, packing: PackingConfig) -> Any:
    """The transformers config the workers will build, or None when it cannot be read offline here.

    Raises `UserError` (one line) when the config or the model cannot be built from it, or when
    `data.packing.block_len` is over the built config's `max_position_embeddings`. A pretrained
    model without overrides is not built: its published config is what its weights were saved with."""
    import torch

    from ftcli.model.build import auto_class, load_config, text_config

    cfg = _local_source(model)
    if cfg is None:
        return None
    overrides = f" with model.config_overrides {cfg.config_overrides}" if cfg.config_overrides else ""
    try:
        _check_override_keys(load_config(cfg.model_copy(update={"config_overrides": {}})), cfg.config_overrides)
        config = load_config(cfg)
    except UserError:
        raise
    except Exception as e:  # transformers raises ValueError, TypeError, KeyError... for bad configs
        raise UserError(f"model config {cfg.config or cfg.id}{overrides} is not valid: {_one_line(e)}") from None
    limit = getattr(text_config(config), "max_position_embeddings", None)
    block_len = packing.block_len
    if packing.enabled and isinstance(limit, int) and block_len > limit:
        raise UserError(
            f"data.packing.block_len={block_len} is over the model's max_position_embeddings={limit}; "
            "lower block_len or raise model.config_overrides.max_position_embeddings"
        )
    if cfg.init == "pretrained" and not cfg.config_overrides:
        return config  # a published config as it is: its weights will load (or fail with their own line)
    try:
        with torch.device("meta"):
            auto_class(cfg.model_class).from_config(config)
    except Exception as e:  # e.g. "Trying to create tensor with negative dimension -4"
        raise UserError(f"model config {cfg.config or cfg.id}{overrides} does not build a model: "
                        f"{_one_line(e)}") from None
    return config

