"""What the data path reads: a `DataSpec` (the data section, and with `eval.holdout` which side of the split it
keeps). `data_spec(recipe)` is a recipe's training data; `ftcli.data.evalsplit.eval_specs` gives the eval data's,
one per source. Every entry point of `ftcli.data.pipeline` takes either (a recipe stands for its training data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Holdout:
    share: float  # < 1: a share of the rows; >= 1: a row count per source
    seed: int
    keep: str  # "train": the rows that are not held out; "eval": the held-out rows


@dataclass(frozen=True)
class DataSpec:
    name: str  # the recipe's (summaries name it)
    data: Any  # ftcli.config.recipe.DataConfig: sources, encoding, packing, cache
    holdout: Holdout | None = None  # None: every row read is used
    pairs: bool = False  # preference rows (chosen/rejected), packed as whole pairs (ftcli.data.preference)


def holdout_rule(ev) -> Holdout | None:
    """The holdout of the training data under `ev` (the eval section, or None): the rows `eval.holdout` does not
    hold out (None: every row)."""
    if ev is None or ev.holdout is None:
        return None
    return Holdout(float(ev.holdout), int(ev.holdout_seed), "train")


def data_spec(recipe_or_spec) -> DataSpec:
    """A recipe's training data, or a DataSpec as it is."""
    if isinstance(recipe_or_spec, DataSpec):
        return recipe_or_spec
    pairs = getattr(recipe_or_spec.training, "preference", None) is not None  # the preference objectives' knobs
    holdout = holdout_rule(getattr(recipe_or_spec, "eval", None))
    return DataSpec(recipe_or_spec.name, recipe_or_spec.data, holdout, pairs)
