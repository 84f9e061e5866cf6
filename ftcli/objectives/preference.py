"""`training.objective: dpo | ipo | simpo | orpo`: preference tuning on pairs of completions of one prompt.

One unit is one pair: its chosen and rejected sequences, two adjacent segments of one packed block, never split
(ftcli.data.preference reads the rows, ftcli.data.packing.pack_pairs packs them). The losses, their knobs
(`training.preference`) and the written-out algebra are in ftcli.train.preference; the step normalizes by the
global number of pairs, as SFT normalizes by the global number of trained tokens.

    dpo     -logsigmoid(beta * log-ratio margin) against a reference model (label smoothing: conservative DPO)
    ipo     (per-token log-ratio margin - 1 / (2 beta))^2 against a reference model
    simpo   -logsigmoid(beta * mean log-prob margin - gamma), no reference
    orpo    chosen NLL + lambda * -logsigmoid(log odds ratio), no reference

The reference: method full builds a frozen copy of the starting model sharded like the policy (the same
`build_model`: twice the parameter memory in param dtype, no gradients or optimizer state); method lora turns the
adapter off in the same model (no copy).
"""

from __future__ import annotations

from ftcli.objectives import sft
from ftcli.objectives.base import Objective

LOSS_ALGEBRA = """\
One optimizer step covers W ranks x M micro-batches (blocks) holding P pairs in all. The objective is the mean
pair loss over every pair of the step, wherever it sits:

    L = (1 / P) * sum_{r, m} S_{r,m}          S_{r,m} = summed pair loss of block m on rank r   (loss_sum)
                                              P = sum_{r,m} p_{r,m}, p_{r,m} = its pairs        (count)

P is known before any backward (one all_reduce(SUM) of the counts); each rank backpropagates S_{r,m} * W / P and
the gradient reduction averages over the W ranks, so grad = grad(L) for any split of the same pairs over ranks
and accumulation (the per-pair formulas: ftcli.train.preference)."""

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # TRL's names


def count(block) -> int:
    """The pairs of a block (`Block.pairs`), known before any forward."""
    return len(block.pairs)


def loss_sum(model, inputs: dict):
    """Summed pair loss of one block (`model.loss_sum`, ftcli.train.preference.attach_preference_loss)."""
    return model.loss_sum(**inputs)


def _objective(name: str, label: str, reference: bool) -> Objective:
    return Objective(
        name=name, label=label, row_forms=("preference",), unit="pair", sequences_per_unit=2,
        reference_model=reference, loss_algebra=LOSS_ALGEBRA, metrics=METRICS, eval_metric="loss",
        units=sft.units, count=count, loss_sum=loss_sum,
    )


DPO = _objective("dpo", "DPO", reference=True)
IPO = _objective("ipo", "IPO", reference=True)
SIMPO = _objective("simpo", "SimPO", reference=False)
ORPO = _objective("orpo", "ORPO", reference=False)
OBJECTIVES = (DPO, IPO, SIMPO, ORPO)
