"""On CPU, one line from ftcli instead of transformers' per-kernel advice to install GPU packages.

transformers logs "`causal_conv1d_fn` is falling back to its reference PyTorch implementation because
`causal_conv1d` is not installed ... install `causal_conv1d`" once per kernel (four lines for Qwen3.5) at
the first forward. On a CPU machine that advice is wrong: those packages are GPU-only and must never be
installed there (README). `quiet_kernel_fallbacks` drops exactly those records through a filter on
transformers' own logger (its public logging API; nothing else is silenced) and says once what is true.
"""

from __future__ import annotations

import importlib.util
import logging

FALLBACK_LOGGER = "transformers.integrations.hub_kernels"
FALLBACK_MESSAGE = "is falling back to its reference PyTorch implementation"
# the packed ops whose fast kernels are GPU packages, and their import names
GPU_KERNEL_OPS = {"gated_delta_rule": ("flash-linear-attention", "fla"), "causal_conv1d": ("causal-conv1d", "causal_conv1d")}


class _DropFallbackAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return FALLBACK_MESSAGE not in record.getMessage()


def _gpu_kernel_packages(model_type: str | None) -> list[str]:
    """The GPU-only kernel packages this model type's layers would use, that are not importable here."""
    from ftcli.model.kernels.choose import FAMILY_OPS, MODEL_FAMILIES

    ops = FAMILY_OPS.get(MODEL_FAMILIES.get(model_type or ""), ())
    return [dist for op, (dist, module) in GPU_KERNEL_OPS.items()
            if op in ops and importlib.util.find_spec(module) is None]


def quiet_kernel_fallbacks(model_type: str | None, device_type: str) -> str | None:
    """On CPU: drop transformers' "install X for the optimized kernel" records and return the one line to
    print instead (None: not on CPU, or the model uses no GPU-only kernel)."""
    if device_type != "cpu":
        return None
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger(FALLBACK_LOGGER)
    if not any(isinstance(f, _DropFallbackAdvice) for f in logger.filters):
        logger.addFilter(_DropFallbackAdvice())
    missing = _gpu_kernel_packages(model_type)
    if not missing:
        return None
    return (f"CPU: the fast kernels ({', '.join(missing)}) are GPU-only; this model runs their PyTorch reference "
            "path (same results, slower). Nothing to install here.")


def quiet_library_output(model_type: str | None, device_type: str, say=None) -> None:
    """What a process that loads, trains or saves a model shows of its libraries: no transformers progress
    bars ("Loading weights", "Writing model shards": ftcli says what it loads and saves), no FutureWarning
    about `is_gradient_checkpointing` (PEFT reads the attribute that transformers deprecates; nothing for the
    user to change), and on CPU ftcli's one kernel line instead of transformers' advice, said through `say`
    (None: not said, e.g. on ranks other than 0)."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' public switch for its tqdm bars
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
    notice = quiet_kernel_fallbacks(model_type, device_type)
    if notice and say is not None:
        say(notice)
