"""`ftcli doctor`: versions, the packed-kernel backends this machine will use, and known-bad combinations.

With a recipe it answers "can this recipe run here?" in two parts, said separately: "kernels correct here"
(every packed op has a correct backend, no known-bad version combination applies: `doctor_checks` and
ftcli.model.compat) and "fits here" (ftcli.estimate.fit's memory per GPU, or per CPU process, against this machine). It
returns exit code 1 with a one-line reason when either fails. The report is plain data (`doctor_report`), so
it can be tested against any machine description; `run_doctor` only renders it (tables or `--json`).

Fast without guessing: versions come from package metadata, GPUs from nvidia-smi (`read_machine`), and the
two checks that would import transformers (and torch, ~3 s) answer from RECORDED_TRANSFORMERS when the
installed transformers is in the tested matrix; each such check says so (`Check.version_based`, one line in
the tables). Torch is imported only when a GPU driver is present (the backends depend on what torch sees
there), for a transformers outside the matrix, or with `--deep` (everything imported). Outside the matrix (a
release newer than the tested one, say) the report says so in one line (`transformers_imported_because` in the
JSON, the last line of the text) and the "versions vs the tested matrix" check names every untested release. The
checks are named functions, run in the order of CHECKS.

Importing this module is free: torch, transformers and ftcli.model.kernels are imported inside the functions.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, replace

from ftcli.families import FAMILIES, find_family
from ftcli.objectives import method_of
from ftcli import features

OK, WARN, FAIL, NA = "ok", "warn", "FAIL", "n/a"

# distribution names, in the order shown: the kernels', then the training features' (ftcli.features), then mlflow
_KERNEL_PACKAGES = ("torch", "transformers", "trl", "peft", "flash-linear-attention", "fla-core", "tilelang",
                    "triton", "causal-conv1d", "flash-attn")
PACKAGES = (*_KERNEL_PACKAGES, *(p for p in features.packages() if p not in _KERNEL_PACKAGES), "mlflow")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | FAIL | n/a
    detail: str  # what was found, and the fix when it is not ok
    blocks_recipe: bool = False  # a FAIL that makes the given recipe train wrongly (or not at all) here
    version_based: bool = False  # answered from RECORDED_TRANSFORMERS for a tested version, nothing imported


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# What two checks would import transformers (and torch, ~3 s) to learn, as found by importing the transformers
# versions of the tested matrix (constraints/*.txt); tests/e2e/test_doctor.py compares it with the import on the
# installed one. Another transformers version is imported; `ftcli doctor --deep` always imports.
RECORDED_TRANSFORMERS = {
    # the kernels.QWEN35_GLOBALS the Qwen3.5 modeling module lacks
    "qwen35_missing_globals": (),
    # model_type -> its image-text-to-text class and that class's accepts_loss_kwargs (None: no such class), as
    # each family (ftcli.families) records it
    "vlm_classes": {t: c for f in FAMILIES.values() for t, c in f.vlm_classes.items()},
}


class Transformers:
    """The installed transformers as the checks need it: recorded facts for a tested version (`version_based`),
    else (or with `deep`) read by importing it."""

    def __init__(self, deep: bool = False, installed: str | None = None):
        from ftcli.model import compat

        self.version = installed or version("transformers")
        self.tested_in = compat.tested_in("transformers", self.version)
        self.version_based = self.tested_in is not None and not deep

    @property
    def basis(self) -> str:
        """One line: why the checks that read transformers did or did not import it."""
        if self.version_based:
            return (f"transformers {self.version} is in the tested matrix ({self.tested_in}): its recorded facts are "
                    "used, ftcli doctor --deep imports it")
        if self.tested_in is None and self.version:
            return (f"transformers {self.version} is outside the tested matrix (constraints/*.txt): the checks that "
                    "read it imported it (torch too, a few seconds) instead of trusting facts recorded for tested "
                    "releases")
        return ""

    def qwen35_missing_globals(self) -> list[str]:
        from ftcli.model import kernels

        if self.version_based:
            return list(RECORDED_TRANSFORMERS["qwen35_missing_globals"])
        return kernels.qwen35_missing_globals()

    def recorded(self, model_type: str) -> bool:
        return self.version_based and model_type in RECORDED_TRANSFORMERS["vlm_classes"]

    def vlm_class(self, model_type: str) -> tuple[str, bool] | None:
        """(class name, accepts_loss_kwargs) of `model_type`'s image-text-to-text class; None: it has none."""
        if self.recorded(model_type):
            return RECORDED_TRANSFORMERS["vlm_classes"][model_type]
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
        cls = getattr(transformers, name, None) if name else None
        return None if cls is None else (cls.__name__, getattr(cls, "accepts_loss_kwargs", True))


# ----------------------------------------------------------------------------------- the named checks
# Each takes (recipe or None, machine `m` (a `ftcli.hardware.Machine`), `tf` (Transformers)), returns its rows.
def _is_qwen(recipe) -> bool:
    """Whether the recipe (any, without one) has gated-delta layers (Qwen3.5's: ftcli.families)."""
    family = find_family(recipe.model.model_type) if recipe is not None else None
    return recipe is None or (family is not None and family.uses("gated_delta_rule"))


def _is_vlm_lora(recipe) -> bool:
    return (recipe is not None and recipe.model.model_class == "image_text_to_text"
            and not method_of(recipe.training).trains_base)


def check_fla_on_cpu(recipe, m, tf: Transformers) -> list[Check]:
    """fla on a machine without CUDA: transformers binds it and every Qwen3.5 forward fails."""
    name = "fla on a CPU-only machine"
    if "fla" in m.importable and m.device_type == "cpu":
        return [Check(name, FAIL, "flash-linear-attention is installed but there is no GPU: transformers binds it "
                      "and every Qwen3.5 forward fails; pip uninstall flash-linear-attention fla-core",
                      blocks_recipe=_is_qwen(recipe) and recipe is not None)]
    return [Check(name, NA if m.device_type == "cpu" else OK,
                  "fla not installed" if m.device_type == "cpu" else f"GPU present ({m.device})")]


def check_hopper_triton(recipe, m, tf: Transformers) -> list[Check]:
    """Hopper + Triton [3.4, 3.7.1): fla's gated-delta backward is wrong unless tilelang takes over."""
    name = "Hopper + Triton 3.4-3.7.0 (fla gradients)"
    triton = m.versions.get("triton")
    if not m.hopper_bad_triton:
        return [Check(name, NA, f"capability {m.capability or '-'}, Triton {triton or '-'}")]
    if m.tilelang_usable:
        return [Check(name, OK, f"Triton {triton} on capability {m.capability}: fla uses its tilelang "
                      f"{m.versions.get('tilelang')} kernels")]
    return [Check(name, FAIL, f"Triton {triton} on capability {m.capability} gives wrong gated-delta gradients and "
                  "tilelang is not usable: install tilelang (and a CUDA toolkit's nvcc) or Triton >= 3.7.1",
                  blocks_recipe=_is_qwen(recipe) and recipe is not None)]


def check_packing(recipe, m, tf: Transformers) -> list[Check]:
    """Every op of a packed block keeps the segments apart (per family without a recipe)."""
    from ftcli.model import kernels

    def problems(model_type: str) -> tuple[list[str], bool]:
        found = kernels.backend_problems(model_type, m)
        family = find_family(model_type)
        if family is None or not family.module_globals:
            return found, False
        return found + [kernels.missing_global_problem(g) for g in tf.qwen35_missing_globals()], tf.version_based

    def row(name: str, model_type: str, blocks: bool) -> Check:
        found, version_based = problems(model_type)
        return Check(name, FAIL if found else OK, found[0] if found else "every op has a segment-aware backend",
                     blocks_recipe=blocks, version_based=version_based)

    if recipe is None:
        return [row(f"packing keeps segments apart ({name})", f.model_type, False) for name, f in FAMILIES.items()]
    if not recipe.data.packing.enabled:
        return [Check("packing keeps segments apart", NA, "data.packing.enabled is false")]
    return [row("packing keeps segments apart", recipe.model.model_type, True)]


def check_vlm_loss(recipe, m, tf: Transformers) -> list[Check]:
    """A VLM class whose loss is a per-micro-batch mean (accepts_loss_kwargs=False), trained through TRL: ftcli's
    LoRA path always divides by the step's trained tokens instead (train_lora.normalize_loss_by_tokens)."""
    name = "VLM loss across grad accumulation"
    if recipe is not None and not _is_vlm_lora(recipe):
        return [Check(name, NA, "not a LoRA run of a VLM class")]
    model_type = recipe.model.model_type if recipe else next(t for f in FAMILIES.values()
                                                              for t, c in f.vlm_classes.items() if c)
    found = tf.vlm_class(model_type)
    if found is None or found[1]:
        detail = f"{found[0] if found else model_type} normalizes its loss by the step's tokens"
    else:
        detail = (f"{found[0]}.accepts_loss_kwargs=False (a mean per micro-batch); ftcli's LoRA path divides by the "
                  "step's trained tokens instead (train_lora.normalize_loss_by_tokens)")
    return [Check(name, OK, detail, version_based=tf.recorded(model_type))]


def check_lora_vision(recipe, m, tf: Transformers) -> list[Check]:
    """LoRA all-linear on a VLM class also wraps the vision tower."""
    name = "LoRA all-linear reaching a vision tower"
    if recipe is None:
        return [Check(name, NA, "needs a recipe")]
    if not _is_vlm_lora(recipe):
        return [Check(name, NA, "not a LoRA run of a VLM class")]
    if recipe.lora.target_modules != "all-linear":
        return [Check(name, OK, "explicit lora.target_modules")]
    if recipe.lora.exclude_vision:
        return [Check(name, OK, "excluded by lora.exclude_vision")]
    return [Check(name, WARN, "all-linear also wraps the vision tower, which text-only data never trains; set "
                  "lora.exclude_vision: true")]


def check_speed_settings(recipe, m, tf: Transformers) -> list[Check]:
    """A full-SFT recipe's training features where they run (ftcli.features: each checks machine `m` torch-free)."""
    from ftcli import features

    checked = features.checked()
    name = " and ".join(f.label for f in checked)
    on = [f for f in checked if recipe is not None and f.applies(recipe.training)]
    if not on:
        return [Check(name, NA, f"the recipe uses neither {' nor '.join(f.setting for f in checked)}")]
    if m.device_type != "cuda":
        return [Check(name, NA, f"no GPU here ({'both' if len(checked) == 2 else 'they'} run on the training "
                                "machine's GPUs)")]
    seen = [f.check(recipe.training, m) for f in on]
    problems = [p for found in seen for p in found.problems]
    if problems:
        return [Check(name, FAIL, "; ".join(problems), blocks_recipe=True)]
    return [Check(name, OK, ", ".join(x for found in seen for x in found.found))]


def _grouped_expert_lora(recipe) -> bool:
    """Whether `recipe` trains MoE experts through ftcli.model.moe_lora."""
    from ftcli.estimate.fit import grouped_expert_lora

    return recipe is not None and grouped_expert_lora(recipe.model, recipe.training, recipe.lora)


def check_expert_lora_kernels(recipe, m, tf: Transformers) -> list[Check]:
    """The grouped expert LoRA's kernels on machine `m`: torch.nn.functional.grouped_mm (torch 2.10+, bf16 on
    capability 8.0+), else an exact per-expert loop; the MXFP4 decode and SwiGLU fused by torch.compile where
    Triton is installed, else eager. Both fallbacks compute the same values, only slower: warnings."""
    from ftcli.hardware import version_tuple

    name = "MoE expert LoRA kernels"
    if not _grouped_expert_lora(recipe):
        return [Check(name, NA, "no MoE expert LoRA through lora.experts=grouped in this recipe")]
    if m.device_type != "cuda":
        return [Check(name, NA, "no GPU here (CPU: torch's grouped_mm or the exact per-expert loop)")]
    torch_v, triton_v = m.versions.get("torch"), m.versions.get("triton")
    slow = []
    if version_tuple(torch_v) < (2, 10) or (m.capability or (0, 0)) < (8, 0):
        slow.append(f"torch {torch_v or '-'} on capability {m.capability or '-'} has no bf16 grouped_mm (torch "
                    "2.10+, capability 8.0+): the experts run an exact loop, one GEMM per expert")
    if not triton_v:
        slow.append("no Triton: the MXFP4 decode and the SwiGLU run eagerly (a kept-MXFP4 20b step on an H200: "
                    "1.21 s eager vs 0.76 s fused)")
    if slow:
        return [Check(name, WARN, "; ".join(slow))]
    return [Check(name, OK, f"grouped_mm (torch {torch_v}), decode and SwiGLU fused by torch.compile "
                            f"(Triton {triton_v})")]


CHECKS = (check_fla_on_cpu, check_hopper_triton, check_packing, check_vlm_loss, check_lora_vision,
          check_speed_settings, check_expert_lora_kernels)


def doctor_checks(recipe, m, tf: Transformers | None = None) -> list[Check]:
    """Known-bad combinations on machine `m` (a `ftcli.hardware.Machine`), for `recipe` if one is given."""
    tf = tf or Transformers()
    return [row for check in CHECKS for row in check(recipe, m, tf)]


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
    gpu_source: str = ""  # how the GPUs were found (nvidia-smi, torch.cuda)
    torch_cuda: str | None = None  # torch.version.cuda (None: a CPU build)
    deep: bool = False  # every check imported what it reads (--deep)
    transformers_basis: str = ""  # why the checks that read transformers imported it or not (Transformers.basis)
    version_based: bool = False  # the basis is the tested matrix's recorded facts (nothing imported)

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
        return {"versions": self.versions, "torch_cuda": self.torch_cuda, "gpu": self.gpu,
                "gpu_source": self.gpu_source or None, "deep": self.deep,
                "backends": [dict(zip(("model_type", "op", "backend", "why"), b)) for b in self.backends],
                "checks": [{"name": c.name, "status": c.status, "detail": c.detail, "blocks_recipe": c.blocks_recipe,
                            "version_based": c.version_based} for c in self.checks],
                "version_based_because": self.transformers_basis if self.version_based else None,
                "transformers_imported_because": None if self.version_based or self.deep else
                self.transformers_basis or None,
                "recipe": self.recipe, "kernels_correct_here": self.kernels_correct,
                "kernels_detail": self.kernels_detail or None, "fits_here": self.fits,
                "fits_detail": self.fits_detail or None, "exit_code": self.exit_code, "verdict": self.verdict or None}


def read_machine(deep: bool = False):
    """This machine (a ftcli.hardware.Machine) with the training features' package versions: torch is imported
    only when a GPU driver is present or with `deep` (`hardware.read_here`)."""
    from ftcli import hardware

    return hardware.read_here(deep, tuple(features.packages()))


def doctor_report(recipe, m, versions: dict[str, str | None] | None = None, tf: Transformers | None = None,
                  deep: bool = False) -> Report:
    """The report for `recipe` (or None) on machine `m` (a ftcli.hardware.Machine); `deep`: every check imported
    what it reads."""
    from ftcli.estimate import fit
    from ftcli.model import compat
    from ftcli.model import kernels

    tf = tf or Transformers(deep=deep)
    backends = []
    for model_type in [recipe.model.model_type] if recipe else [f.model_type for f in FAMILIES.values()]:
        chosen = kernels.decide_backends(model_type, m)
        if not chosen:
            backends.append((model_type, "-", kernels.UNAVAILABLE, "no segment-aware kernels for this model_type"))
        backends += [(model_type, b.op, b.name, b.reason) for b in chosen]
    if recipe is None:
        problems = [*compat.known_bad(None, None, m), compat.matrix_check(m)]
    else:
        problems = [*compat.known_bad(recipe.model, recipe.data.packing, m), compat.matrix_check(m)]
        problems += compat.gpu_notes(recipe.model, recipe.training, recipe.compute, m)
    checks = doctor_checks(recipe, m, tf) + [Check(p.name, p.status, p.detail, p.blocks_recipe) for p in problems]
    version_based = any(c.version_based for c in checks)
    basis = tf.basis if version_based or not tf.version_based else ""
    report = Report(versions=versions or {}, gpu=m.gpu, backends=backends, checks=checks, transformers_basis=basis,
                    version_based=version_based,
                    gpu_source=m.gpu_source, torch_cuda=m.torch_cuda, deep=deep)
    if recipe is None:
        return report
    blocking = [c for c in checks if c.status == FAIL and c.blocks_recipe]
    fits, fits_detail = fit.fit_here(recipe, m)
    return replace(report, recipe=recipe.name, kernels_correct=not blocking,
                   kernels_detail=blocking[0].detail if blocking else
                   "every packed op has a correct backend and no known-bad combination applies",
                   fits=fits, fits_detail=fits_detail)


def run_doctor(recipe=None, as_json: bool = False, deep: bool = False) -> int:
    """Print the report (tables, or JSON); with a recipe, return 1 when it cannot run correctly here (else 0):
    a known-bad combination that breaks its training, or a plan that does not fit this machine."""
    import json

    here = read_machine(deep)
    versions = {dist: version(dist) for dist in PACKAGES}
    report = doctor_report(recipe, here, versions, deep=deep)
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
        return report.exit_code

    from rich.console import Console
    from rich.table import Table
    from rich.markup import escape

    console = Console()
    table = Table(title="Versions", title_justify="left")
    table.add_column("package", overflow="fold")  # fold, never cut, at any width (80 columns: test_cli_real_process)
    table.add_column("version", overflow="fold")
    for dist, found in versions.items():
        shown = found or "-"
        if dist == "torch":
            shown += f" (CUDA {report.torch_cuda})" if report.torch_cuda else " (CPU build)"
        table.add_row(dist, shown)
    table.add_row("GPU", report.gpu)
    table.add_row("GPU found by", report.gpu_source)
    console.print(table)

    table = Table(title=f"Packed kernels on {here.device}", title_justify="left")
    for column in ("model_type", "op", "backend", "why"):
        table.add_column(column, overflow="fold")
    for row in report.backends:
        table.add_row(*row)
    console.print(table)

    table = Table(title="Known-bad combinations", title_justify="left")
    for column in ("check", "status", "detail"):
        table.add_column(column, overflow="fold")
    style = {OK: "green", WARN: "yellow", FAIL: "bold red", NA: "dim"}
    for c in report.checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail)
    console.print(table)
    version_based = [c.name for c in report.checks if c.version_based]
    if version_based:
        console.print(f"version-based, nothing imported: {'; '.join(version_based)} ({report.transformers_basis})",
                      highlight=False, soft_wrap=True)
    elif report.transformers_basis and not deep:
        console.print(f"[yellow]{report.transformers_basis}[/]", highlight=False, soft_wrap=True)

    if recipe is None:
        return 0
    for label, ok, detail in (("kernels correct here", report.kernels_correct, report.kernels_detail),
                              ("fits here", report.fits, report.fits_detail)):
        mark = "[green]yes[/]" if ok else "[bold red]no[/]"
        said = f" ({escape(detail)})" if detail and detail not in report.verdict else ""  # the verdict says why not
        console.print(f"{label}: {mark}{said}", highlight=False)
    color = "green" if report.exit_code == 0 else "bold red"
    console.print(f"[{color}]{escape(report.verdict)}[/]", highlight=False)
    return report.exit_code
