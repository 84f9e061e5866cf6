"""Can this recipe run on this machine: known-bad version combinations, the tested version matrix, and
whether the recipe's GPUs (count, type, memory) are here.

Everything is a pure function of a `ftcli.hardware.Machine` (what the machine has) and a recipe, so each rule is
tested on faked versions and machines (tests/unit/model/test_compat.py); `hardware.read_here` reads the real
machine (torch is imported there only, and only on a CUDA device; `gpu_probe` asks nvidia-smi first, so a machine
without a GPU never imports torch). `ftcli doctor` renders the results; it says "kernels correct here" (ftcli.model.kernels and the
known-bad rules) and "fits here" (ftcli.estimate.fit's memory model against this machine) separately.

Known-bad combinations:

    transformers 5.2.0-5.8.1      drops cu_seq_lens / seq_idx on the way to Qwen3.5's gated-delta layers:
                                  packed documents leak into each other
    Blackwell + fla <= 0.5.1      silent NaN gradients / misaligned-address errors in chunk_gated_delta_rule
      or Triton 3.7.0             (fla-org/flash-linear-attention#913: still reproduced on fla 0.5.1 main
                                  @ c525f49 with Triton 3.7.0 on B200 on 2026-06-10; the issue was closed as
                                  stale with no release named as the fix; fla#1000 later restricted the
                                  Blackwell backward autotune configs for a hang). Later fla: a warning,
                                  since no fix is confirmed and ftcli has not run on Blackwell.
    no fla on a GPU, Qwen3.5      the gated-delta rule falls back to ftcli's exact torch path per segment:
                                  correct but many times slower (transformers' own torch fallback would
                                  raise or leak across documents)
    gpt-oss packed without sinks  an attention path without the learned sinks computes a different model
    outside the tested matrix     installed versions that differ from constraints/<platform>.txt
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ftcli.families import find_family
from ftcli.families.base import (
    BLACKWELL_GATED_DELTA,
    FLA_ON_GPU,
    SINK_ATTENTION as SINKS_RULE,
    SINKS,
    TRANSFORMERS_PACKING_ARGS,
)
from ftcli import features
from ftcli.hardware import Machine, version_tuple

OK, WARN, FAIL, NA = "ok", "warn", "FAIL", "n/a"
SINK_ATTENTION = ("flex_sinks", "eager_segments")  # ftcli.model.kernels backends that apply gpt-oss's sinks
# the packages compared with the tested matrix: the kernels', then the training features' (ftcli.features)
_KERNEL_PACKAGES = ("torch", "triton", "transformers", "trl", "peft", "flash-linear-attention", "tilelang",
                    "causal-conv1d", "flash-attn")
MATRIX_PACKAGES = (*_KERNEL_PACKAGES, *(p for p in features.packages() if p not in _KERNEL_PACKAGES))
BAD_TRANSFORMERS = ((5, 2, 0), (5, 8, 1))  # inclusive
FLA_913 = "fla-org/flash-linear-attention#913"


@dataclass(frozen=True)
class Problem:
    name: str
    status: str  # ok | warn | FAIL | n/a
    detail: str
    blocks_recipe: bool = False  # the recipe would train wrongly (or not at all) here


def _applies(model, rule: str) -> bool:
    """Whether known-bad `rule` concerns the family of `model` (the model section; ftcli.families; every rule when
    there is no recipe)."""
    family = find_family(model.model_type) if model is not None else None
    return model is None or (family is not None and family.has_rule(rule))


# ------------------------------------------------------------------------------------------ known bad
def sink_model_attention(here: Machine) -> str | None:
    """The attention backend ftcli.model.kernels picks on `here` for gpt-oss's packed blocks (from the
    machine's attention capabilities: flex attention on CUDA, else eager per segment)."""
    from ftcli.model import kernels

    return kernels.attention_backend(SINKS, here).name


def known_bad(model, packing, here: Machine) -> list[Problem]:
    """The known-bad combinations for a recipe's `model` and `data.packing` sections (or for both families when
    both are None: no recipe) on `here`."""
    given = model is not None  # a recipe was given
    packed = packing is None or packing.enabled
    v = here.versions
    out = []

    name = "transformers 5.2.0-5.8.1 (Qwen3.5 packing arguments)"
    tv = v.get("transformers")
    if not (_applies(model, TRANSFORMERS_PACKING_ARGS) and packed):
        out.append(Problem(name, NA, "no packed Qwen3.5 blocks in this recipe"))
    elif tv and BAD_TRANSFORMERS[0] <= version_tuple(tv) <= BAD_TRANSFORMERS[1]:
        out.append(Problem(name, FAIL, f"transformers {tv} drops cu_seq_lens / seq_idx before Qwen3.5's gated-delta "
                           "layers: packed documents leak into each other; install transformers 5.24.0 "
                           "(constraints/gpu-h200.txt)", blocks_recipe=given))
    else:
        out.append(Problem(name, OK, f"transformers {tv or '-'}"))

    name = f"Blackwell gated-delta NaN gradients ({FLA_913})"
    fla = v.get("flash-linear-attention") or v.get("fla-core")
    triton = v.get("triton")
    qwen = _applies(model, BLACKWELL_GATED_DELTA)
    if not here.blackwell or not qwen:
        out.append(Problem(name, NA, f"capability {here.capability or '-'}" if qwen else "no gated-delta layers"))
    elif not here.fla_importable:
        out.append(Problem(name, NA, "fla not installed"))
    elif version_tuple(fla) <= (0, 5, 1) or version_tuple(triton) == (3, 7, 0):
        out.append(Problem(name, FAIL, f"fla {fla} / Triton {triton} on capability {here.capability}: "
                           f"chunk_gated_delta_rule gives NaN gradients on Blackwell ({FLA_913}, reproduced with fla "
                           "0.5.0 and 0.5.1 on Triton 3.7.0); no release is confirmed to fix it: check this machine "
                           "with benchmarks/packed_kernels_gpu.py first", blocks_recipe=given))
    else:
        out.append(Problem(name, WARN, f"fla {fla} / Triton {triton} on Blackwell: {FLA_913} was closed without a "
                           "named fix and ftcli has not run on Blackwell; run benchmarks/packed_kernels_gpu.py once"))

    name = "fla on a GPU machine (Qwen3.5 gated delta)"
    if not here.gpus or not _applies(model, FLA_ON_GPU):
        out.append(Problem(name, NA, "no GPU" if not here.gpus else "no gated-delta layers"))
    elif not here.fla_importable:
        out.append(Problem(name, WARN, "flash-linear-attention is not installed: the gated-delta rule runs ftcli's "
                           "exact torch path per segment, many times slower; pip install flash-linear-attention"))
    else:
        out.append(Problem(name, OK, f"fla {fla}"))

    name = "gpt-oss packed attention keeps the sinks"
    attention = sink_model_attention(here)
    if given and not (_applies(model, SINKS_RULE) and packed):
        out.append(Problem(name, NA, "no packed gpt-oss blocks in this recipe"))
    elif attention in SINK_ATTENTION:
        out.append(Problem(name, OK, f"{attention} applies the learned sinks"))
    else:
        out.append(Problem(name, FAIL, f"attention backend {attention or 'none'} has no learned sinks: "
                           "gpt-oss would train as a different model; use model.attn_implementation=auto on a "
                           "torch with flex attention", blocks_recipe=given))
    return out


# -------------------------------------------------------------------------------------- tested matrix
def constraints_dir() -> Path | None:
    """constraints/ of the source tree (next to the package, or under $CODE_SOURCE_PATH on AI Runtime)."""
    for root in (Path(__file__).resolve().parents[2], Path(os.environ.get("CODE_SOURCE_PATH", "/nonexistent"))):
        if (root / "constraints").is_dir():
            return root / "constraints"
    return None


def platform_of(here: Machine) -> str | None:
    """The constraints file name for this machine: cpu, gpu-h100, gpu-h200; None for an untested card."""
    if not here.gpus:
        return "cpu"
    name = here.gpus[0][0]
    for card in ("H100", "H200"):
        if card in name:
            return f"gpu-{card.lower()}"
    return None


def read_constraints(path: Path, follow: bool = True) -> dict[str, str]:
    """`name==version` pins (following `-c other.txt` lines unless not `follow`), lower-case names."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-c ") and follow:
            pins.update(read_constraints(path.parent / line[3:].strip()))
        elif "==" in line:
            name, ver = line.split("==", 1)
            pins[name.strip().lower()] = ver.strip()
    return pins


def _matches(installed: str, pin: str) -> bool:
    base = installed.split("+")[0]
    if pin.endswith(".*"):
        return base == pin[:-2] or base.startswith(pin[:-1])
    return version_tuple(base) == version_tuple(pin)


def matrix_check(here: Machine, directory: Path | None = None) -> Problem:
    name = "versions vs the tested matrix"
    directory = directory or constraints_dir()
    platform = platform_of(here)
    if platform is None:
        return Problem(name, WARN, f"no tested matrix for {here.gpus[0][0]}: ftcli was tested on CPU and H200")
    path = directory / f"{platform}.txt" if directory else None
    if path is None or not path.is_file():
        return Problem(name, NA, f"constraints/{platform}.txt not found (it ships in the source tree)")
    pins = read_constraints(path)
    off = outside_matrix(here.versions, pins)
    if off:
        return Problem(name, WARN, f"outside constraints/{platform}.txt: {', '.join(off)}; the checks still apply, "
                                   f"but these releases are untested: pin them with pip install -c "
                                   f"constraints/{platform}.txt")
    return Problem(name, OK, f"within constraints/{platform}.txt ({len(pins)} pins)")


def outside_matrix(versions: dict[str, str | None], pins: dict[str, str]) -> list[str]:
    """`name version (tested pin)` for each installed matrix package whose version the pins do not match."""
    return [f"{d} {versions[d]} (tested {pins[d]})" for d in MATRIX_PACKAGES
            if d in pins and versions.get(d) and not _matches(versions[d], pins[d])]


# ---------------------------------------------------------------------------------------- can it run
def gpu_notes(model, training, compute, here: Machine) -> list[Problem]:
    """Type and count against compute.accelerator_type (a different card or fewer GPUs is not an error when
    the memory fits: the launcher uses the GPUs that are here)."""
    wanted_card = compute.accelerator.card
    if not here.gpus:
        return [Problem("GPUs vs compute.accelerator_type", NA if model.init == "random" else WARN,
                        f"no GPU: {training.cpu_processes} CPU processes instead of {compute.accelerator_type}")]
    name = here.gpus[0][0]
    detail = f"{len(here.gpus)} x {name} here, recipe: {compute.num_accelerators} x {wanted_card}"
    same = wanted_card in name and len(here.gpus) >= compute.gpus_per_node
    return [Problem("GPUs vs compute.accelerator_type", OK if same else WARN, detail)]


def tested_in(dist: str, installed: str | None, directory: Path | None = None) -> str | None:
    """The constraints file (constraints/<platform>.txt, the tested matrix) that pins `dist` to `installed`,
    or None when no file does."""
    directory = directory or constraints_dir()
    for path in sorted(directory.glob("*.txt")) if directory and installed else []:
        pin = read_constraints(path, follow=False).get(dist)  # the file that pins it, not one that includes it
        if pin and _matches(installed, pin):
            return f"constraints/{path.name}"
    return None
