"""`ftcli doctor`: versions, the packed-kernel backends this machine will use, and known-bad combinations.

With a recipe it answers "can this recipe run here?" in two parts, said separately: "kernels correct here"
(every packed op has a correct backend, no known-bad version combination applies: `doctor_checks` and
ftcli.compat) and "fits here" (ftcli.plan's memory per GPU, or per CPU process, against this machine). It
returns exit code 1 with a one-line reason when either fails. The report is plain data (`doctor_report`), so
it can be tested against any machine description; `run_doctor` only renders it (tables or `--json`).

Importing this module is free: torch, transformers and ftcli.kernels are imported inside the functions.
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


@dataclass(frozen=True)
class Report:
    """Everything `doctor` says, as data: `run_doctor` renders it as tables or JSON."""

    versions: dict[str, str | None]
    gpu: str
    backends: list[tuple[str, str, str, str]]  # (model_type, op, backend, why)
    checks: list[Check]
    recipe: str | None = None
    kernels_correct: bool | None = None  # no blocking known-bad combination (None: no recipe)
    kernels_detail: str = ""
    fits: bool | None = None  # the plan's memory fits this machine
    fits_detail: str = ""

    @property
    def exit_code(self) -> int:
        return 1 if self.recipe is not None and not (self.kernels_correct and self.fits) else 0

    @property
    def verdict(self) -> str:
        if self.recipe is None:
            return ""
        if not self.kernels_correct:
            return f"recipe {self.recipe} cannot run correctly here: {self.kernels_detail}"
        if not self.fits:
            return f"recipe {self.recipe} cannot run here: {self.fits_detail}"
        return f"recipe {self.recipe} can run correctly here"

    def to_dict(self) -> dict:
        return {"versions": self.versions, "gpu": self.gpu,
                "backends": [dict(zip(("model_type", "op", "backend", "why"), b)) for b in self.backends],
                "checks": [{"name": c.name, "status": c.status, "detail": c.detail, "blocks_recipe": c.blocks_recipe}
                           for c in self.checks],
                "recipe": self.recipe, "kernels_correct_here": self.kernels_correct,
                "kernels_detail": self.kernels_detail or None, "fits_here": self.fits,
                "fits_detail": self.fits_detail or None, "exit_code": self.exit_code, "verdict": self.verdict or None}


def doctor_report(recipe, m, here, versions: dict[str, str | None] | None = None, gpu: str = "none") -> Report:
    """The report for `recipe` (or None) on machine `m` (ftcli.kernels.Machine) / `here` (ftcli.compat.Here)."""
    from ftcli import compat, kernels

    backends = []
    for model_type in [recipe.model.model_type] if recipe else list(kernels.FAMILY_OPS):
        chosen = kernels.decide_backends(model_type, m)
        if not chosen:
            backends.append((model_type, "-", kernels.UNAVAILABLE, "no segment-aware kernels for this model_type"))
        backends += [(model_type, b.op, b.name, b.reason) for b in chosen]
    problems = [*compat.known_bad(recipe, here), compat.matrix_check(here)]
    if recipe is not None:
        problems += compat.gpu_notes(recipe, here)
    checks = doctor_checks(recipe, m) + [Check(p.name, p.status, p.detail, p.blocks_recipe) for p in problems]
    report = Report(versions=versions or {}, gpu=gpu, backends=backends, checks=checks)
    if recipe is None:
        return report
    blocking = [c for c in checks if c.status == FAIL and c.blocks_recipe]
    fits, fits_detail = compat.fit_here(recipe, here)
    return Report(versions=report.versions, gpu=gpu, backends=backends, checks=checks, recipe=recipe.name,
                  kernels_correct=not blocking, kernels_detail=blocking[0].detail if blocking else
                  "every packed op has a correct backend and no known-bad combination applies",
                  fits=fits, fits_detail=fits_detail)


def run_doctor(recipe=None, as_json: bool = False) -> int:
    """Print the report (tables, or JSON); with a recipe, return 1 when it cannot run correctly here (else 0):
    a known-bad combination that breaks its training, or a plan that does not fit this machine."""
    import json

    import torch

    from ftcli import compat, kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = kernels.machine(device)
    versions = {dist: version(dist) for dist in PACKAGES}
    gpu = f"{torch.cuda.get_device_name(m.device)} (capability {m.capability[0]}.{m.capability[1]})" if m.capability \
        else "none"
    report = doctor_report(recipe, m, compat.detect_here(m), versions, gpu)
    if as_json:
        print(json.dumps({**report.to_dict(), "torch_cuda": torch.version.cuda}, indent=1))
        return report.exit_code

    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="Versions", title_justify="left")
    table.add_column("package")
    table.add_column("version")
    for dist, found in versions.items():
        shown = found or "-"
        if dist == "torch":
            shown += f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"
        table.add_row(dist, shown)
    table.add_row("GPU", gpu)
    console.print(table)

    table = Table(title=f"Packed kernels on {m.device}", title_justify="left")
    for column in ("model_type", "op", "backend", "why"):
        table.add_column(column)
    for row in report.backends:
        table.add_row(*row)
    console.print(table)

    table = Table(title="Known-bad combinations", title_justify="left")
    for column in ("check", "status", "detail"):
        table.add_column(column)
    style = {OK: "green", WARN: "yellow", FAIL: "bold red", NA: "dim"}
    for c in report.checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail)
    console.print(table)

    if recipe is None:
        return 0
    for label, ok, detail in (("kernels correct here", report.kernels_correct, report.kernels_detail),
                              ("fits here", report.fits, report.fits_detail)):
        mark = "[green]yes[/]" if ok else "[bold red]no[/]"
        console.print(f"{label}: {mark} ({detail})", highlight=False, soft_wrap=True)
    color = "green" if report.exit_code == 0 else "bold red"
    console.print(f"[{color}]{report.verdict}[/]", highlight=False, soft_wrap=True)
    return report.exit_code
