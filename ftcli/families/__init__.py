"""The model families: `FAMILIES` (name -> Family) and `family_of(model_type)`. See ftcli/families/base.py."""

from __future__ import annotations

from ftcli.config.errors import UserError
from ftcli.families import gemma3, gpt_oss, llama, qwen3, qwen3_5, qwen3_moe
from ftcli.families.base import Family, Pin, registry_by_model_type

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen3_5.FAMILY, gpt_oss.FAMILY, llama.FAMILY, qwen3.FAMILY,
                                                   qwen3_moe.FAMILY, gemma3.FAMILY)}
BY_MODEL_TYPE: dict[str, Family] = registry_by_model_type(FAMILIES)


def find_family(model_type: str | None) -> Family | None:
    """The family of `model_type`, or None when ftcli has none."""
    return BY_MODEL_TYPE.get(model_type or "")


def family_of(model_type: str | None) -> Family:
    """The family of `model_type`; a one-line UserError naming the known model types when there is none."""
    family = find_family(model_type)
    if family is None:
        raise UserError(f"ftcli has no model family for model_type {model_type!r} "
                        f"(known: {', '.join(sorted(BY_MODEL_TYPE))})")
    return family


def model_types() -> list[str]:
    return sorted(BY_MODEL_TYPE)


def fused_op_model_types() -> tuple[str, ...]:
    """The model types whose modules training.fused_ops can swap (their families name fused-op targets)."""
    return tuple(t for f in FAMILIES.values() if f.fused_op_targets for t in f.model_types)


__all__ = ["BY_MODEL_TYPE", "FAMILIES", "Family", "Pin", "family_of", "find_family", "fused_op_model_types", "model_types"]
