"""Accelerator strings, parsed in one place: `GPU_<gpus per node>x<card>` (AI Runtime's names, e.g. GPU_8xH100).

    parse_accelerator("GPU_8xH100") -> Accelerator(name="GPU_8xH100", gpus_per_node=8, card="H100")

Every module that needs the card or the GPUs per node of a recipe's `compute.accelerator_type` (the memory plan,
doctor, the launchers' pins) asks `Recipe.compute.accelerator` (this parser) rather than splitting the string.
What each card is (memory, FLOP/s, GPUs per node of a full node) is `ftcli.hardware.CARDS`; which types AI Runtime
offers is `AI_RUNTIME_TYPES` below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The accelerator types Databricks AI Runtime offers: databricks-sdk-air 0.1.1's `databricks.air.compute.AcceleratorType`
# (the `air` CLI's names). A recipe may name another (GPU_1xH200 for a machine of one's own); the AI Runtime
# launcher warns that the platform would refuse it.
AI_RUNTIME_TYPES = ("GPU_1xA10", "GPU_1xH100", "GPU_8xH100", "GPU_8xB300")

ACCELERATOR_RE = re.compile(r"GPU_([1-9][0-9]*)x([A-Za-z0-9]+)")  # groups: GPUs per node, card
ACCELERATOR_RULE = "expected GPU_<gpus per node>x<model> (case-sensitive), e.g. GPU_8xH100"


@dataclass(frozen=True)
class Accelerator:
    name: str  # GPU_8xH100
    gpus_per_node: int  # 8
    card: str  # H100 (a key of ftcli.hardware.CARDS when ftcli has figures for it)


def parse_accelerator(text: str) -> Accelerator:
    """The accelerator `text` names; ValueError (ACCELERATOR_RULE) when it is not GPU_<n>x<card>."""
    m = ACCELERATOR_RE.fullmatch(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(ACCELERATOR_RULE)
    return Accelerator(text, int(m.group(1)), m.group(2))


def accelerator_name(gpus_per_node: int, card: str) -> str:
    return f"GPU_{gpus_per_node}x{card}"
