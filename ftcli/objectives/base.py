"""What a training objective and a training method are: one `Objective` record per objective module, one `Method`
record per method, gathered in `ftcli.objectives.OBJECTIVES` and `ftcli.objectives.METHODS`.

A run is two choices, asked separately:

    training.objective   what is optimized: next-token SFT today (the preference objectives are the next ones)
    training.method      how the parameters train and what the run writes: every weight (full, the FSDP2
                         loop) or an adapter over a frozen base (lora, TRL + PEFT)

Every consumer asks the records; none branches on the names (tests/unit/test_architecture.py checks that no module
outside this room compares `method` or `objective` to a string):

    consumer                               asks the Objective
    ftcli.train.session                    units(spec, tokenizer, first)     the packed units it trains on
    ftcli.train.full, ftcli.train.lora     count(block), loss_sum(model, inputs)   the micro-batch's loss terms
    ftcli.train.evaluate                   count, loss_sum (the same terms over the held-out units)
    ftcli.estimate.memory                  sequences_per_unit, reference_model   memory terms
    ftcli.commands.workload                requirements(recipe)               pip pins the job installs
    ftcli.commands.plan / doctor           label, methods                     their lines

                                           asks the Method
    ftcli.artifacts.resolve / merge        writes_adapter                     final/ is an adapter or a model
    ftcli.train.launch                     checkpoint_kind, needs_packing, writes_adapter
    ftcli.estimate (fit, memory, steptime) trains_base, checkpointing, keeps_layers, picks_sharding
    ftcli.features                         runs_features                      the full-SFT features apply

Records are plain data and functions: importing this package imports no torch (doctor, plan and the workload read
it); the torch parts (`units`, `loss_sum`) import what they need when called, as ftcli.features does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def _nothing(*_: Any) -> list:
    return []


@dataclass(frozen=True)
class Objective:
    """One training objective: what it reads, what it packs, what it minimizes, what it reports."""

    name: str  # its training.objective value, the module's name in ftcli.objectives
    label: str  # how lines and docs call it ("SFT")
    row_forms: tuple[str, ...]  # the data.format values it reads (ftcli.data.formats), `auto` detecting among them
    unit: str  # what one packed unit holds: "sequence" (a segment of a block); "pair" for preference objectives
    sequences_per_unit: int  # sequences a unit puts in a block (memory: tokens per unit, estimate.memory)
    reference_model: bool  # needs a frozen reference model's log-probs (memory, workload, the trainers)
    # the loss as (sum over the micro-batch, count): the step divides the summed sums of every micro-batch on
    # every rank by the summed counts (the written-out algebra is `loss_algebra`)
    loss_algebra: str
    metrics: tuple[str, ...]  # the step line's and MLflow's metric names beyond loss / grad norm / lr
    eval_metric: str  # the held-out metric that picks the best model ("loss": lower is better)
    # (training data: ftcli.data.DataSpec, tokenizer, first) -> ftcli.data.PackedDataset of its units; `first` is
    # ftcli.train.distributed.rank0_first (rank 0 fills the cache, then the others open it)
    units: Callable[[Any, Any, Callable], Any]
    # the loss of one micro-batch (a block of units) as two terms, so the step can normalize globally:
    count: Callable[[Any], int]  # block -> its share of the step's denominator, known before any forward
    loss_sum: Callable[[Any, dict], Any]  # (model with ftcli.train.loss.attach_loss, block's model inputs) -> sum
    methods: tuple[str, ...] = ("full", "lora")  # the training.method values it trains with
    requirements: Callable[[Any], list] = _nothing  # recipe -> ftcli.features.Requirement pins for the workload


@dataclass(frozen=True)
class Method:
    """How a run's parameters train and what it writes. The facts each consumer asks, so none compares names."""

    name: str  # its training.method value ("full" | "lora")
    label: str  # how lines call it
    writes_adapter: bool  # <run>/final is a PEFT adapter over a base (merge-lora, register, generate); else a model
    trains_base: bool  # every weight trains (master weights, grads, AdamW state for all); else a frozen base
    checkpoint_kind: str  # "dcp" (ftcli.train.checkpoint's DCP step dirs) or "trl" (TRL's checkpoint-N)
    needs_packing: bool  # trains on packed blocks only (data.packing.enabled must be true)
    checkpointing: tuple[str, ...]  # the activation_checkpointing levels it has, least memory last
    keeps_layers: bool  # training.activation_checkpointing_keep applies (full checkpointing keeps the last layers)
    picks_sharding: bool  # training.sharding picks ddp (a whole base per GPU) or fsdp; else always FSDP2-sharded
    runs_features: bool  # the full-SFT training features (ftcli.features: precision, fused kernels, fused loss) apply
    master_weights: bool  # training.precision.master_dtype sets the trained weights' dtype (else float32 adapters)
    splits_blocks: bool  # training.context_parallel applies: a block's slices over a group of ranks (plan, schema)
