"""`training.loss.impl`: how full SFT's summed token cross-entropy is computed (ftcli.train.loss.token_loss_sum).

    chunked  (default) only the trained positions, `chunk_tokens` rows at a time, each chunk checkpointed
    chunked_fwd_grad  the same chunks, their gradients made in forward (no recompute; ftcli.train.loss.ChunkedLinearCE)
    full     logits for every position at once, upcast to fp32 (the published examples' loss)
    liger    liger-kernel's fused linear cross-entropy (GPU): the LM head and the CE in one kernel, in chunks
             it picks itself

The fused implementations are records of `FUSED_LINEAR_CE`: the loss module, what the plan's memory model
holds for it, and below which block length the chunked loss is faster. The LoRA path computes its loss
through TRL and ignores `impl`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ftcli.config.errors import UserError
from ftcli.objectives import method_of
from ftcli.features.base import Feature, Requirement
from ftcli.features.fused_ops import LIGER_KIND, LIGER_PIN

SETTING = "training.loss.impl"


@dataclass(frozen=True)
class FusedLinearCE:
    """A loss implementation that fuses the LM head with the cross-entropy."""

    impl: str  # its training.loss.impl value
    pin: str  # what the workload installs
    load: Callable[[], Callable]  # -> loss(weight [V, H], hidden [N, H], targets [N]) summed, or a one-line UserError
    transient_bytes: Callable[[int, int, int], float]  # (tokens, vocab, hidden) -> its peak logits buffer
    # tokens per micro-batch at or below which the chunked loss is faster (measured: ftcli.commands.plan suggests it)
    chunked_faster_up_to: int = 0


def liger_loss():
    """liger-kernel's fused linear cross-entropy (sum over the trained tokens, fp32 accumulation)."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        raise UserError(
            f"{SETTING}=liger needs liger-kernel (GPU only: pip install 'ftcli[gpu]'); or set {SETTING}=chunked"
        ) from None
    import inspect

    import torch

    from ftcli.data.packing import IGNORE_INDEX

    kwargs = {"ignore_index": IGNORE_INDEX, "reduction": "sum"}
    if "accum_dtype" in inspect.signature(LigerFusedLinearCrossEntropyLoss).parameters:
        kwargs["accum_dtype"] = torch.float32  # the LM head gradient adds up over chunks in fp32
    return LigerFusedLinearCrossEntropyLoss(**kwargs)


def _liger_chunk_bytes(tokens: int, vocab: int, hidden: int) -> float:
    """liger picks its chunk from T and vocab / hidden (a power of two near T / (vocab / hidden))."""
    chunk = 2 ** math.ceil(math.log2(max(1, math.ceil(tokens / math.ceil(vocab / hidden)))))
    return 4.0 * min(chunk, tokens) * vocab


# Full SFT, one H200, 27B width, 2026-12-01 (BENCHMARKS.md, "Levers measured alone"): at 8k-token blocks the
# chunked loss's fixed cost per step is 0.160 s against liger's 0.286 (per layer the same); at 32k liger was 8%
# faster. So a suggested block of 8k or less comes with the chunked loss (16k not measured: left as it is).
FUSED_LINEAR_CE = {
    "liger": FusedLinearCE("liger", LIGER_PIN, liger_loss, _liger_chunk_bytes, chunked_faster_up_to=8192),
}


def _fused(training) -> FusedLinearCE | None:
    return FUSED_LINEAR_CE.get(training.loss.impl)


FEATURE = Feature(
    name="loss", label="fused loss", setting=SETTING,
    applies=lambda t: method_of(t).runs_features and _fused(t) is not None,
    # the pin follows the setting, whichever the method
    requirements=lambda t: [Requirement(_fused(t).pin, f"fused linear cross-entropy (loss.impl={_fused(t).impl})",
                                        LIGER_KIND)] if _fused(t) is not None else [],
    preflight=lambda training, device: _fused(training).load(),
    off_without_gpu=f"{SETTING}=chunked",
)
