"""The training objectives, one module each, and the training methods (ftcli.objectives.base says what a record
holds and who asks it):

    sft      training.objective: sft     next-token cross-entropy on the trained tokens (the default)
    preference  dpo | ipo | simpo | orpo  preference pairs: chosen vs rejected completions of one prompt
    methods  training.method: full | lora

Adding an objective: `ftcli/objectives/<name>.py` with its `OBJECTIVE = Objective(...)`, one line in OBJECTIVES
below, and its value (and knobs) in the schema (`ftcli/config/sections/training.py`, `_Training.objective`).
Importing this package does not import torch.
"""

from __future__ import annotations

from ftcli.objectives import preference, sft
from ftcli.objectives.base import Method, Objective
from ftcli.objectives.methods import METHODS

OBJECTIVES: dict[str, Objective] = {o.name: o for o in (sft.OBJECTIVE, *preference.OBJECTIVES)}

__all__ = ["METHODS", "OBJECTIVES", "Method", "Objective", "method_of", "objective_of"]


def objective_of(training) -> Objective:
    """The objective record of a recipe's `training` section (or a run record's objective name)."""
    return OBJECTIVES[getattr(training, "objective", training)]


def method_of(training) -> Method:
    """The method record of a recipe's `training` section, a RunRecord, or a method name."""
    return METHODS[getattr(training, "method", training)]
