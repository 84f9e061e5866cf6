"""The training features, one module each, and the loops every consumer runs over them (ftcli.features.base
says what a record holds and who asks it):

    float8     training.precision.fp8     float8 GEMMs in the decoder linears (torchao)
    compile    training.compile           torch.compile per layer or per region
    loss       training.loss.impl         the fused linear cross-entropy
    fused_ops  training.fused_ops         fused norm / SwiGLU kernels

The registry's order is the order of every list they add to (doctor's row, the plan's speed key, the LoRA
warnings, the start-up lines, the conversions). Importing this package does not import torch.
"""

from __future__ import annotations

from pathlib import Path

from ftcli.features import compile, float8, fused_ops, loss
from ftcli.features.base import Feature, Found, Requirement

FEATURES: dict[str, Feature] = {f.name: f for f in (float8.FEATURE, compile.FEATURE, loss.FEATURE, fused_ops.FEATURE)}

__all__ = ["FEATURES", "Feature", "Found", "Requirement", "active", "checked", "describe", "load_recipe",
           "packages", "preflight", "prepare_lora", "problems", "recipe_problems", "requirements", "speed_keys"]


def active(training) -> list[Feature]:
    """The features the training section `training` turns on."""
    return [f for f in FEATURES.values() if f.applies(training)]


def problems(model, data, training) -> list[str]:
    """What the features refuse in a recipe's model, data and training sections beyond the schema, one line each
    (empty: nothing)."""
    return [problem for f in FEATURES.values() for problem in f.validate(model, data, training)]


def recipe_problems(recipe) -> list[str]:
    """`problems` as the schema's rule hook (`config.recipe.load_recipe(rules=...)` hands a rule the Recipe)."""
    return problems(recipe.model, recipe.data, recipe.training)


def load_recipe(name_or_path: str | Path, overrides: list[str] | None = None):
    """`ftcli.config.recipe.load_recipe` with the features' rules: what every command loads."""
    from ftcli.config.recipe import load_recipe as load_schema

    return load_schema(name_or_path, overrides, rules=recipe_problems)


def requirements(training) -> list[tuple[str, str]]:
    """(pip requirement, why) of the features the training section uses, one per package (sorted by it)."""
    uses: dict[str, list[Requirement]] = {}
    for f in FEATURES.values():
        for req in f.requirements(training):
            uses.setdefault(req.pin, []).append(req)
    return [(pin, " ".join(filter(None, (reqs[0].kind, " and ".join(r.use for r in reqs)))))
            for pin, reqs in sorted(uses.items())]


def packages() -> list[str]:
    """The distributions the features run with (sorted)."""
    return sorted({p for f in FEATURES.values() for p in f.packages})


def checked() -> list[Feature]:
    """The features doctor checks on a machine."""
    return [f for f in FEATURES.values() if f.check is not None]


def speed_keys(training) -> tuple[str, ...]:
    """The step-time rows' `speed` field for a training section: the speed key of each feature that applies."""
    return tuple(key for f in FEATURES.values() if f.applies(training) and (key := f.speed_key(training)))


def describe(model, training) -> list[str]:
    """What each training feature `training` turns on did to the built `model`: its start-up line, one each."""
    return [line for f in active(training) if (line := f.describe(model, training)) is not None]


def preflight(training, device) -> None:
    """What every worker would fail on in the same way (a missing package, a CPU for a GPU kernel): a
    UserError now."""
    for f in active(training):
        if f.preflight is not None:
            f.preflight(training, device)


def prepare_lora(model, training) -> None:
    """What the features `training` turns on do to a LoRA run's PEFT-wrapped model, before TRL trains it (in
    place)."""
    for f in active(training):
        if f.prepare_lora is not None:
            f.prepare_lora(model, training)
