"""`ftcli doctor`: versions, the packed-kernel backends this machine will use, and known-bad combinations.

With a recipe it answers one question, "can this recipe train correctly here?", and returns exit code 1
with a one-line reason when it cannot. The checks are plain data (`doctor_checks`), so they can be tested
against any machine description; `run_doctor` only renders them.

Importing this module is free: torch, transformers and ftcli.kernels are imported inside `run_doctor`.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

OK, WARN, FAIL, NA = "ok", "warn", "FAIL", "n/a"

# distribution names, in the order shown
PACKAGES = ("torch", "transformers", "trl", "peft", "flash-linear-attention", "fla-core", "tilelang", "triton",
            "causal-conv1d", "flash-attn", "liger-kernel", "mlflow")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | FAIL | n/a
    detail: str  # what was found, and the fix when it is not ok
    blocks_recipe: bool = False  # a FAIL that makes the given recipe train wrongly (or not at all) here


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def doctor_checks(recipe, m) -> list[Check]:
    """Known-bad combinations on machine `m` (a `ftcli.kernels.Machine`), for `recipe` if one is given."""
    from ftcli import kernels

    model_type = recipe.model.model_type if recipe else None
    qwen = model_type is None or kernels.MODEL_FAMILIES.get(model_type) == "qwen3_5"
    checks = []

    # fla on a machine without CUDA
    if "fla" in m.importable and m.device_type == "cpu":
        checks.append(Check("fla on a CPU-only machine", FAIL, "flash-linear-attention is installed but there is no "
                            "GPU: transformers binds it and every Qwen3.5 forward fails; pip uninstall "
                            "flash-linear-attention fla-core", blocks_recipe=qwen and recipe is not None))
    else:
        checks.append(Check("fla on a CPU-only machine", NA if m.device_type == "cpu" else OK,
                            "fla not installed" if m.device_type == "cpu" else f"GPU present ({m.device})"))

    # Hopper + Triton [3.4, 3.7.1): fla's gated-delta backward is wrong unless tilelang takes over
    triton = m.versions.get("triton")
    if not m.hopper_bad_triton:
        checks.append(Check("Hopper + Triton 3.4-3.7.0 (fla gradients)", NA,
                            f"capability {m.capability or '-'}, Triton {triton or '-'}"))
    elif m.tilelang_usable:
        checks.append(Check("Hopper + Triton 3.4-3.7.0 (fla gradients)", OK,
                            f"Triton {triton} on capability {m.capability}: fla uses its tilelang "
                            f"{m.versions.get('tilelang')} kernels"))
    else:
        checks.append(Check("Hopper + Triton 3.4-3.7.0 (fla gradients)", FAIL,
                            f"Triton {triton} on capability {m.capability} gives wrong gated-delta gradients and "
                            "tilelang is not usable: install tilelang (and a CUDA toolkit's nvcc) or Triton >= 3.7.1",
                            blocks_recipe=qwen and recipe is not None))

    # packing: every op must keep the segments apart
    if recipe is None:
        for family in kernels.FAMILY_OPS:
            problems = kernels.check_packing_safe(family, m)
            checks.append(Check(f"packing keeps segments apart ({family})", FAIL if problems else OK,
                                problems[0] if problems else "every op has a segment-aware backend"))
    elif not recipe.data.packing.enabled:
        checks.append(Check("packing keeps segments apart", NA, "data.packing.enabled is false"))
    else:
        problems = kernels.check_packing_safe(model_type, m)
        checks.append(Check("packing keeps segments apart", FAIL if problems else OK,
                            problems[0] if problems else "every op has a segment-aware backend", blocks_recipe=True))

    # a VLM class whose loss is a per-micro-batch mean (accepts_loss_kwargs=False), trained through TRL
    vlm_lora = (recipe is not None and recipe.model.model_class == "image_text_to_text"
                and recipe.training.method == "lora")
    if recipe is not None and not vlm_lora:
        checks.append(Check("VLM loss across grad accumulation", NA, "not a LoRA run of a VLM class"))
    else:
        cls = _vlm_class(model_type or "qwen3_5")
        if cls is None or getattr(cls, "accepts_loss_kwargs", True):
            checks.append(Check("VLM loss across grad accumulation", OK, f"{getattr(cls, '__name__', model_type)} "
                                "normalizes its loss by the step's tokens"))
        elif _lora_normalizes_by_tokens():
            checks.append(Check("VLM loss across grad accumulation", OK, f"{cls.__name__}.accepts_loss_kwargs=False "
                                "(a mean per micro-batch); ftcli's LoRA path divides by the step's trained tokens "
                                "instead (train_lora.normalize_loss_by_tokens)"))
        else:
            checks.append(Check("VLM loss across grad accumulation", FAIL, f"{cls.__name__}.accepts_loss_kwargs=False: "
                                "gradient accumulation averages per-micro-batch means (short blocks weigh as much "
                                "as long ones); set training.grad_accum: 1",
                                blocks_recipe=recipe is not None and recipe.training.grad_accum > 1))

    # LoRA all-linear on a VLM class also wraps the vision tower
    if recipe is None:
        checks.append(Check("LoRA all-linear reaching a vision tower", NA, "needs a recipe"))
    elif not vlm_lora:
        checks.append(Check("LoRA all-linear reaching a vision tower", NA, "not a LoRA run of a VLM class"))
    elif recipe.lora.target_modules != "all-linear":
        checks.append(Check("LoRA all-linear reaching a vision tower", OK, "explicit lora.target_modules"))
    elif recipe.lora.exclude_vision:
        checks.append(Check("LoRA all-linear reaching a vision tower", OK, "excluded by lora.exclude_vision"))
    else:
        checks.append(Check("LoRA all-linear reaching a vision tower", WARN, "all-linear also wraps the vision tower, "
                            "which text-only data never trains; set lora.exclude_vision: true"))
    return checks


def _vlm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def _lora_normalizes_by_tokens() -> bool:
    try:
        from ftcli.train_lora import normalize_loss_by_tokens  # noqa: F401
    except ImportError:
        return False
    return True


def run_doctor(recipe=None) -> int:
    """Print the report; with a recipe, return 1 when it cannot train correctly here (else 0)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from ftcli import kernels

    console = Console()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = kernels.machine(device)

    versions = Table(title="Versions", title_justify="left")
    versions.add_column("package")
    versions.add_column("version")
    for dist in PACKAGES:
        shown = version(dist) or "-"
        if dist == "torch":
            shown += f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"
        versions.add_row(dist, shown)
    gpu = f"{torch.cuda.get_device_name(m.device)} (capability {m.capability[0]}.{m.capability[1]})" if m.capability \
        else "none"
    versions.add_row("GPU", gpu)
    console.print(versions)

    backends = Table(title=f"Packed kernels on {m.device}", title_justify="left")
    for column in ("model_type", "op", "backend", "why"):
        backends.add_column(column)
    model_types = [recipe.model.model_type] if recipe else list(kernels.FAMILY_OPS)
    for model_type in model_types:
        chosen = kernels.decide_backends(model_type, m)
        if not chosen:
            backends.add_row(model_type, "-", kernels.UNAVAILABLE, "no segment-aware kernels for this model_type")
        for b in chosen:
            backends.add_row(model_type, b.op, b.name, b.reason)
    console.print(backends)

    checks = doctor_checks(recipe, m)
    table = Table(title="Known-bad combinations", title_justify="left")
    for column in ("check", "status", "detail"):
        table.add_column(column)
    style = {OK: "green", WARN: "yellow", FAIL: "bold red", NA: "dim"}
    for c in checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail)
    console.print(table)

    if recipe is None:
        return 0
    blocking = [c for c in checks if c.status == FAIL and c.blocks_recipe]
    if blocking:
        console.print(f"[bold red]recipe {recipe.name} cannot run correctly here:[/] {blocking[0].detail}",
                      highlight=False, soft_wrap=True)
        return 1
    console.print(f"[green]recipe {recipe.name} can run correctly here[/]", highlight=False)
    return 0
