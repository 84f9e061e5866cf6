"""Install the chosen backends process-wide, and take them out again.

Attention goes through `transformers.AttentionInterface` / `AttentionMaskInterface` (no model class is
touched). transformers offers no hook for the gated-delta rule and the conv when the `kernels` package
is absent (its `use_kernel_func_from_hub_with_fallback` binds fla / causal-conv1d at import time, and its
torch fallbacks raise on `cu_seqlens`/`seq_idx`), so the two module globals `torch_chunk_gated_delta_rule`
and `causal_conv1d_fn` of the Qwen3.5 modeling module, which the layer looks up at call time, are
replaced. `disable_packed_kernels` puts the originals back.
"""

from __future__ import annotations

import importlib
import logging

import torch

from ftcli.config.errors import UserError
from ftcli.families import family_of
from ftcli.model.kernels.choose import (
    FAMILY_OPS,
    MODEL_FAMILIES,
    QWEN35_MODULE,
    UNAVAILABLE,
    Backend,
    check_packing_safe,
    decide_backends,
)
from ftcli.model.kernels.cp import across_slices
from ftcli.model.kernels.ops import KERNELS, MASKS, TRANSFORMERS_ORIGINALS, block_masks_hook, transformers_original

log = logging.getLogger("ftcli.model.kernels")

# attention backend -> the attn_implementation name models are given
ATTN_IMPLEMENTATIONS = {
    "flash_attn_varlen": "flash_attention_2",
    "torch_varlen": "ftcli_varlen",
    "sdpa_segments": "ftcli_sdpa_segments",
    "flex_sinks": "ftcli_flex_sinks",
    "eager_segments": "ftcli_eager_segments",
}

_LOGGED: set[tuple] = set()


def enable_packed_kernels(
    model_type: str, device: str | torch.device, *, reference: bool = False, context_parallel: bool = False
) -> tuple[str, list[Backend]]:
    """Choose and install the packed kernels for `model_type` on `device`; log the choice once.
    `context_parallel`: each kernel also takes a call over one rank's slice of a block (ftcli.model.kernels.cp).

    Returns the attn_implementation to give `from_pretrained` / `from_config` /
    `model.set_attn_implementation`, and the backends. Raises UserError when packed training of this
    model cannot be correct here (unknown model_type, fla with wrong gradients).
    """
    problems = check_packing_safe(model_type, device)
    if problems:
        raise UserError(problems[0])
    backends = decide_backends(model_type, device, reference=reference)
    if context_parallel:
        backends = [cp_backend(b) for b in backends]
    attn_implementation = install_backends(model_type, backends, context_parallel=context_parallel)
    key = (model_type, str(device), tuple(backends))
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(
            "packed kernels for %s on %s: %s",
            model_type,
            device,
            "; ".join(f"{b.op}={b.name} ({b.reason})" for b in backends),
        )
    return attn_implementation, backends


def cp_backend(backend: Backend) -> Backend:
    """The backend that serves `backend`'s op under context parallelism: flash-attn's varlen attention is
    transformers' own function (not one ftcli can wrap), so the CP attention calls torch's varlen_attn instead."""
    if backend.op == "attention" and backend.name == "flash_attn_varlen":
        return Backend("attention", "torch_varlen", "context parallelism: torch varlen_attn over the gathered keys")
    return backend


def install_backends(model_type: str, backends: list[Backend], *, context_parallel: bool = False) -> str:
    """Install the given backends (process-wide) and return the attn_implementation name to use. With
    `context_parallel` every kernel is wrapped by `cp.across_slices` (a call with a slice crosses its boundaries)."""
    wrap = across_slices if context_parallel else (lambda op, kernel: kernel)
    from transformers import AttentionInterface, AttentionMaskInterface

    by_op = {b.op: b for b in backends}
    missing = set(FAMILY_OPS[MODEL_FAMILIES[model_type]]) - set(by_op)
    assert not missing, f"no backend for {missing}"
    for b in backends:
        if b.name == UNAVAILABLE:
            raise UserError(f"{b.op}: {b.reason}")

    attention = by_op["attention"].name
    attn_implementation = ATTN_IMPLEMENTATIONS[attention]
    if attention in KERNELS["attention"]:
        AttentionInterface.register(attn_implementation, wrap("attention", KERNELS["attention"][attention]))
        AttentionMaskInterface.register(attn_implementation, MASKS[attention])

    family = family_of(model_type)
    if family.module_globals:
        module = importlib.import_module(family.kernel_module)
        for op, name in family.module_globals.items():
            transformers_original(name)  # saved before the first replacement
            setattr(module, name, wrap(op, KERNELS[op][by_op[op].name]))
    return attn_implementation


def block_masks_ahead(model: torch.nn.Module):
    """For a model whose attention is flex attention with sinks: build the packed block's masks (full and sliding
    window) once per forward, before the decoder layers, and hand them to every layer (`ops.block_masks_hook`), so
    that a compiled layer has no graph break in its attention. Returns the hook's handle, or None (another
    attention: nothing to build)."""
    config = getattr(model.config, "text_config", None) or model.config
    # the name `install_backends` registered; transformers reads the same attribute at every attention call
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATIONS["flex_sinks"]:
        return None
    windows = {None, getattr(config, "sliding_window", None)}
    return model.register_forward_pre_hook(block_masks_hook(windows), with_kwargs=True)


def disable_packed_kernels() -> None:
    """Put transformers' own gated-delta rule and conv back (registered attention names stay)."""
    if TRANSFORMERS_ORIGINALS:
        module = importlib.import_module(QWEN35_MODULE)
        for name, fn in TRANSFORMERS_ORIGINALS.items():
            setattr(module, name, fn)
