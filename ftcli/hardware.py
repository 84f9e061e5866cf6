"""This host as ftcli sees it (one `Machine`), and the GPU cards ftcli knows (one table, `CARDS`).

    Machine          what the machine has: device, CUDA capability, GPUs and RAM, package versions, the kernel
                     modules that import, the attention capabilities of its torch, nvcc; plain data, so every
                     decision on it (ftcli.model.kernels' backends, ftcli.model.compat's known-bad rules, each
                     training feature's doctor check) is tested on faked machines
    read(device)     the machine as one process on `device` sees it (torch imported only for a CUDA device)
    read_here(deep)  the machine as `ftcli doctor` reports it: nvidia-smi first, torch only when a GPU driver
                     is present (or `deep`)
    CARDS            name -> Card: peak dense bf16 FLOP/s (MFU), memory as sold and GPUs per node (`ftcli plan`)

Importing this module does not import torch. Low in the house: it imports nothing of ftcli's but config/.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# ------------------------------------------------------------------------------------------- cards
@dataclass(frozen=True)
class Card:
    """A GPU model. `bf16_flops`: peak dense bf16 tensor-core FLOP/s, datasheet, without sparsity (B200/B300
    ~2.25 PFLOP/s dense bf16, HGX). `memory_gb` (as sold) and `gpus_per_node`: the cards `ftcli plan` sizes
    runs for (None: not planned for)."""

    name: str  # matched as a substring of torch.cuda.get_device_name(), longest first
    bf16_flops: float
    memory_gb: float | None = None
    gpus_per_node: int | None = None


CARDS: dict[str, Card] = {c.name: c for c in (
    Card("H100", 989e12, memory_gb=80, gpus_per_node=8),
    Card("H200", 989e12, memory_gb=141, gpus_per_node=8),
    Card("B300", 2250e12, memory_gb=288, gpus_per_node=8),
    Card("A10", 125e12, memory_gb=24, gpus_per_node=1),
    Card("B200", 2250e12),
    Card("H100 PCIe", 756e12),
    Card("A100", 312e12),
    Card("L40S", 362e12),
    Card("L4", 121e12),
)}


def card_of(device_name: str) -> Card | None:
    """The card whose name is in `device_name` ("NVIDIA H100 PCIe" is the H100 PCIe, not the H100)."""
    for name in sorted(CARDS, key=len, reverse=True):
        if name in device_name:
            return CARDS[name]
    return None


# ----------------------------------------------------------------------------------------- machine
# Triton versions whose gated chunk backward is wrong on Hopper (fla #640): [3.4.0, 3.7.1)
_BAD_TRITON_ON_HOPPER = ((3, 4, 0), (3, 7, 1))
# the distributions every machine description reads (callers add theirs: the training features' packages)
PACKAGES = ("torch", "transformers", "trl", "peft", "triton", "flash-linear-attention", "fla-core", "tilelang",
            "causal-conv1d", "flash-attn")
KERNEL_MODULES = ("fla", "tilelang", "flash_attn", "causal_conv1d")  # whether they import, by module name
# a GPU driver is loaded (NVIDIA, ROCm) even when nvidia-smi does not list a GPU: then torch is asked
GPU_DRIVER_SIGNS = (Path("/proc/driver/nvidia/gpus"), Path("/dev/kfd"))


@dataclass(frozen=True)
class Machine:
    """What this machine has. `gpus`: (name, total memory in bytes) per visible GPU."""

    device: str = "cpu"  # "cpu", "cuda:0": the device one process uses
    capability: tuple[int, int] | None = None  # CUDA compute capability
    versions: dict[str, str | None] = field(default_factory=dict)  # distribution -> version (None: absent)
    importable: frozenset[str] = frozenset()  # of KERNEL_MODULES
    torch_varlen: bool = False  # attention: torch.nn.attention.varlen.varlen_attn exists
    flex: bool = False  # attention: torch.nn.attention.flex_attention exists (block masks, score mods: sinks)
    nvcc: bool = False  # tilelang JIT-compiles its kernels with nvcc
    fla_tilelang_env: str | None = None  # $FLA_TILELANG ("0" disables fla's tilelang backend)
    gpus: tuple[tuple[str, int], ...] = ()
    ram_bytes: int = 0
    gpu: str = "none"  # as doctor shows it: "NVIDIA H200 (capability 9.0)"
    gpu_source: str = ""  # how the GPUs were found (nvidia-smi, torch.cuda)
    torch_cuda: str | None = None  # torch.version.cuda (None: a CPU build)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def hopper_bad_triton(self) -> bool:
        """Hopper GPU with a Triton whose gated chunk backward is wrong (fla #640): fla needs tilelang."""
        triton = version_tuple(self.versions.get("triton"))
        return (self.capability or (0, 0))[0] == 9 and _BAD_TRITON_ON_HOPPER[0] <= triton < _BAD_TRITON_ON_HOPPER[1]

    @property
    def tilelang_usable(self) -> bool:
        return "tilelang" in self.importable and self.nvcc and self.fla_tilelang_env != "0"

    @property
    def fla_importable(self) -> bool:
        return "fla" in self.importable

    @property
    def blackwell(self) -> bool:
        return (self.capability or (0, 0))[0] in (10, 12)


def version_tuple(version: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (version or "0").split("+")[0].split(".")[:3]:
        digits = re.match(r"\d*", piece).group(0)
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    """Whether `name` can be imported. `find_spec` on a dotted name imports its parent packages (torch, for
    torch.nn.attention.varlen), so a submodule of a package not imported yet is looked up as a file instead."""
    top, _, rest = name.partition(".")
    try:
        if not rest or top in sys.modules:
            return importlib.util.find_spec(name) is not None
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root, *rest.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
    return False


def _has_nvcc() -> bool:
    """Mirrors fla's check for a usable nvcc (CUDA_HOME, PATH, /usr/local/cuda)."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return True
    return shutil.which("nvcc") is not None


def read(device: str | torch.device = "cpu", packages: tuple[str, ...] = ()) -> Machine:
    """The machine as a process on `device` sees it, with the versions of PACKAGES and `packages`; torch is
    imported only for a device other than the CPU (GPU names and memory as torch sees them:
    CUDA_VISIBLE_DEVICES applies)."""
    capability = None
    gpus: tuple[tuple[str, int], ...] = ()
    if str(device) != "cpu":
        import torch

        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            capability = tuple(torch.cuda.get_device_capability(device))
            gpus = tuple((torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
                         for i in range(torch.cuda.device_count()))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return Machine(
        device=str(device),
        capability=capability,
        versions={name: _dist_version(name) for name in dict.fromkeys((*PACKAGES, *packages))},
        importable=frozenset(m for m in KERNEL_MODULES if _has_module(m)),
        torch_varlen=_has_module("torch.nn.attention.varlen"),
        flex=_has_module("torch.nn.attention.flex_attention"),
        nvcc=_has_nvcc(),
        fla_tilelang_env=os.environ.get("FLA_TILELANG"),
        gpus=gpus,
        ram_bytes=ram,
    )


def read_here(deep: bool = False, packages: tuple[str, ...] = ()) -> Machine:
    """This machine as `ftcli doctor` reports it. GPUs from nvidia-smi: torch is imported only when a GPU
    driver is present (the kernel backends then depend on what torch sees) or with `deep`."""
    ask_torch, found = gpu_probe()
    if not (ask_torch or deep):
        return replace(read("cpu", packages), gpu_source=f"{found}; torch not imported", torch_cuda=torch_cuda_build())
    import torch

    cuda = torch.cuda.is_available()
    m = read("cuda" if cuda else "cpu", packages)
    gpu = f"{torch.cuda.get_device_name(m.device)} (capability {m.capability[0]}.{m.capability[1]})" if cuda else "none"
    source = f"torch.cuda: {torch.cuda.device_count()} GPU(s)" if cuda else "torch.cuda.is_available() is False"
    return replace(m, gpu=gpu, gpu_source=f"{source} ({found})", torch_cuda=torch.version.cuda)


def nvidia_smi_gpus() -> tuple[tuple[str, int], ...] | None:
    """(name, memory in bytes) of each GPU nvidia-smi lists, without importing torch; None when there is no
    nvidia-smi (no NVIDIA driver: no GPU torch could use) or it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    gpus = []
    for line in out.stdout.splitlines():
        name, _, mib = line.rpartition(",")
        if name.strip() and mib.strip().isdigit():
            gpus.append((name.strip(), int(mib) * 2**20))
    return tuple(gpus)


def gpu_probe() -> tuple[bool, str]:
    """(whether torch must be asked about GPUs, what was found), without importing torch: yes when nvidia-smi
    lists a GPU or a GPU driver is loaded (GPU_DRIVER_SIGNS); no GPU otherwise."""
    listed = nvidia_smi_gpus()
    if listed:
        return True, f"nvidia-smi: {len(listed)} x {listed[0][0]}"
    driver = next((str(p) for p in GPU_DRIVER_SIGNS if p.exists()), None)
    if driver:
        return True, f"{driver} exists but nvidia-smi lists no GPU"
    return False, "nvidia-smi lists no GPU" if listed == () else "no nvidia-smi (no NVIDIA driver): no GPU"


def torch_cuda_build() -> str | None:
    """`torch.version.cuda` (None: a CPU build or no torch), read from torch/version.py unless torch is
    imported already; torch is imported only when that file cannot be read."""
    if "torch" in sys.modules:
        return sys.modules["torch"].version.cuda
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    try:
        text = Path(next(iter(spec.submodule_search_locations)), "version.py").read_text()
        return ast.literal_eval(re.search(r"^cuda\s*(?::[^=]*)?=\s*(.+)$", text, re.M).group(1).strip())
    except (OSError, StopIteration, AttributeError, ValueError, SyntaxError):
        import torch

        return torch.version.cuda
