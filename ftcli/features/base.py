"""What a training feature is: one `Feature` record per feature module, gathered in `ftcli.features.FEATURES`.

A feature is a setting of full SFT that changes how the model is built or how its loss is computed, not what
it learns: float8 GEMMs, regional compile, fused kernels, a fused loss. Every consumer asks the records and
loops over the features a recipe turns on; none names a feature. Each is handed the recipe's sections it reads,
not the recipe: `training` (the TrainingConfig; every feature is a training setting), and for `validate` the model
and data sections too:

    consumer                          asks
    ftcli.features.load_recipe        validate(model, data, training)  problems beyond the schema, one line each
    launchers.base                    requirements(training)    pip pins the rendered job installs
    commands.doctor                   check(training, machine)  torch-free: what this machine lacks
    commands.plan                     speed_key(training)       the measured step-time rows' `speed` item
    train.launch                      preflight(training, device) what every worker would fail on, once
    model.parallelize                 convert(model, training, device)   on the meta model, before sharding
                                      per_layer(layer, training)  each decoder layer, after checkpointing
    train.lora.trainer                prepare_lora(model, training)  the PEFT-wrapped model, before TRL trains it
    train.full                        describe(model, training) its start-up line
    train.launch (no GPU here)        off_without_gpu           the setting to turn off, never "install X"

`validate` and `requirements` see every recipe (each says when it has something to say); the others
are called only for the features that `applies(training)`. Records are plain data: no dotted paths, so every
check runs before launch. Importing a feature module does not import torch (doctor reads them).

LoRA has one of them, compile (`prepare_lora`); its typed training section (config.recipe.LoraTraining) refuses the
other features' keys in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Requirement:
    """A pip requirement of the rendered workload. Features that share a package share its line: the reason
    is `kind` followed by every feature's `use`, joined by " and "."""

    pin: str  # "torchao==0.18.0"
    use: str  # what this feature runs with it
    kind: str = ""  # what the package is ("pure Python + Triton"), said once per line


@dataclass(frozen=True)
class Found:
    """What a feature's doctor check saw: `problems` (each with its fix; any one blocks the recipe) and
    `found` (what it will use)."""

    problems: tuple[str, ...] = ()
    found: tuple[str, ...] = ()


def _nothing(*_: Any) -> list:
    return []


def _silent(*_: Any) -> None:
    return None


@dataclass(frozen=True)
class Feature:
    name: str  # the module's name in ftcli.features
    label: str  # how doctor's row and the docs call it ("fp8")
    setting: str  # the recipe key that turns it on ("training.precision.fp8")
    applies: Callable[[Any], bool]  # training section -> the feature runs in this training
    validate: Callable[[Any, Any, Any], list[str]] = _nothing  # (model, data, training sections) -> problems the
    #                                                           schema cannot see
    requirements: Callable[[Any], list[Requirement]] = _nothing  # training section -> pins for the workload
    packages: tuple[str, ...] = ()  # distributions doctor shows the versions of
    check: Callable[[Any, Any], Found] | None = None  # (training, ftcli.hardware.Machine) -> Found; torch-free
    speed_key: Callable[[Any], str | None] = _silent  # training config -> the step-time rows' speed item
    preflight: Callable[[Any, Any], None] | None = None  # (training, torch device): raise a UserError now
    convert: Callable[[Any, Any, Any], None] | None = None  # (meta model, training, torch device), in place
    per_layer: Callable[[Any, Any], None] | None = None  # (decoder layer, training), in place
    prepare_lora: Callable[[Any, Any], None] | None = None  # (PEFT-wrapped model, training), in place; LoRA only
    describe: Callable[[Any, Any], str | None] = _silent  # (built model, training) -> the start-up line
    off_without_gpu: str | None = None  # the `--set` that turns it off, for a feature that needs a GPU
