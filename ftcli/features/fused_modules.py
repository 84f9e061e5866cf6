"""The torch modules that run `training.fused_ops`' kernels in place of Qwen3.5's eager ones
(and of the dense families' norms and MLPs; ftcli.features.fused_ops swaps them in; this module imports
torch, that one does not)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


class _FusedNorm(nn.Module):
    """A norm's own weight (the same Parameter, so the same name and shard) and eps, and its fused kernel."""

    def __init__(self, norm: nn.Module, kernel: Callable, eps: float):
        super().__init__()
        self.weight = norm.weight
        self.eps = eps
        self._kernel = kernel

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, fused"


class FusedRMSNorm(_FusedNorm):
    """Any family's RMSNorm through liger's RMSNorm with the family's offset and casting mode (ftcli.families:
    `rms_norm_offset`): offset 1.0 is the zero-centred norm, y = (x / rms(x) * (1 + w)) in float32, cast to x's
    dtype (Qwen3.5, Gemma 3); offset 0.0 is w * (x / rms(x) in float32, cast to x's dtype first), the other
    families'."""

    def __init__(self, norm: nn.Module, kernel: Callable, offset: float = 1.0, casting: str = "gemma"):
        super().__init__(norm, kernel, getattr(norm, "eps", None) or norm.variance_epsilon)
        self.offset, self.casting = offset, casting

    def forward(self, x):
        return self._kernel(x, self.weight, self.eps, self.offset, self.casting, False)


class FusedSwiGLUMLP(nn.Module):
    """Qwen3_5MLP with silu(gate) * up in one kernel; the three linears are the original modules."""

    def __init__(self, mlp: nn.Module, kernel: Callable):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._kernel = kernel

    def forward(self, x):
        return self.down_proj(self._kernel(self.gate_proj(x), self.up_proj(x)))


class FusedGatedRMSNorm(_FusedNorm):
    """Qwen3_5RMSNormGated through fla's rms_norm_gated: y = w * norm(x) * silu(gate)."""

    def __init__(self, norm: nn.Module, kernel: Callable):
        super().__init__(norm, kernel, norm.variance_epsilon)

    def forward(self, x, gate):
        return self._kernel(x, gate, self.weight, None, "silu", eps=self.eps)


FUSED_MODULES = {"rms_norm": FusedRMSNorm, "swiglu": FusedSwiGLUMLP, "gated_norm": FusedGatedRMSNorm}
