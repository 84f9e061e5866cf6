"""Stage flash-attn and causal-conv1d sources for a build on a GPU machine without network (one H200 here).

The Databricks image ships flash-attn, so a real qwen-b300 run takes flash-attn's varlen attention; a user image
with causal-conv1d takes that conv. Neither has a wheel on PyPI, and the GPU machine cannot download, so this
script (run where PyPI is reachable) fetches the two sdists and trims them to what an H200 check needs:

    causal-conv1d 1.7.0     sm_90 only (its setup.py hard-codes nine architectures, ~7 min each on 16 cores)
    flash-attn 2.8.3.post2  sm_90 only, and only the bf16 head-dim-256 kernels (Qwen3.5-27B's full attention:
                            head_dim 256); its dtype checks then refuse fp16 and its head-dim switch refuses
                            any other head dim (flash-attn sizes some buffers by a rounded head dim that a
                            256 kernel would overrun). Same templates, fewer instantiations: 7 compile units
                            instead of 73. Nothing else (gpt-oss: flex attention with sinks) may use it.

It writes DEST/builds.tar.xz (~3.5 MB) plus the build-time wheels the image may lack (setuptools, wheel,
packaging, psutil, ninja, einops), and copies build.sh next to them. On the device, from the project root:

    setsid nohup bash .sdist/build.sh > /tmp/build.out 2>&1 &      # background; chain other calls meanwhile
    cat /tmp/build/*.done                                           # "<exit code> <seconds> s" per package

Measured on one H200 (16 cores, nvcc 13.0, torch 2.11.0+cu130), 2026-12-01: causal-conv1d 416 s, flash-attn
365 s, side by side, with `setup.py build_ext --inplace`; build.sh now goes straight to `bdist_wheel` (a
`bdist_wheel` after the in-place build compiled flash-attn again), and the head-dim guard was added after that
run: neither has been compiled on the device yet. Usage: python benchmarks/kernel_builds/stage.py [--dest .sdist]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLASH_ATTN, CAUSAL_CONV1D = "flash_attn-2.8.3.post2", "causal_conv1d-1.7.0"
BUILD_WHEELS = ("setuptools", "wheel", "packaging", "psutil", "ninja", "einops")


def pip(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, check=True,
                   env={"CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE", "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE",
                        **os.environ})


def trim_flash_attn(root: Path) -> list[str]:
    setup = root / "setup.py"
    text = setup.read_text()
    start = text.index('sources=[\n                "csrc/flash_attn/flash_api.cpp",')
    end = text.index("],", start)
    keep = [line for line in text[start:end].splitlines() if "flash_api.cpp" in line or "hdim256_bf16" in line]
    setup.write_text(text[:start] + "sources=[\n" + "\n".join(keep) + "\n            " + text[end:])
    switch = root / "csrc/flash_attn/src/static_switch.h"
    s = switch.read_text()
    s, n1 = re.subn(r"#define FP16_SWITCH\(COND, \.\.\.\).*?\}\(\)\n", "#define FP16_SWITCH(COND, ...) [&] { using "
                    "elem_type = cutlass::bfloat16_t; return __VA_ARGS__(); }()\n", s, flags=re.S)
    s, n2 = re.subn(r"#define HEADDIM_SWITCH\(HEADDIM, \.\.\.\).*?\}\(\)\n", "#define HEADDIM_SWITCH(HEADDIM, ...) "
                    "[&] { TORCH_CHECK(HEADDIM == 256, \"this flash-attn build has head-dim-256 kernels only\"); "
                    "constexpr static int kHeadDim = 256; return __VA_ARGS__(); }()\n", s, flags=re.S)
    switch.write_text(s)
    api = root / "csrc/flash_attn/flash_api.cpp"
    a = api.read_text()
    n3 = a.count("q_dtype == torch::kFloat16 || q_dtype == torch::kBFloat16")
    api.write_text(a.replace("q_dtype == torch::kFloat16 || q_dtype == torch::kBFloat16", "q_dtype == torch::kBFloat16"))
    if (n1, n2) != (1, 1) or n3 != 5 or len(keep) != 7:
        raise SystemExit(f"flash-attn sources changed shape: switches {n1}/{n2}, dtype checks {n3}, units {len(keep)}")
    for unused in ("csrc/composable_kernel", "hopper", "tests"):  # ROCm, flash-attn 3, tests: not built here
        shutil.rmtree(root / unused, ignore_errors=True)
    return [line.strip().strip('",') for line in keep]


def trim_causal_conv1d(root: Path) -> list[str]:
    setup = root / "setup.py"
    text = re.sub(r'cc_flag\.append\("arch=compute_(?!90)\d+,code=sm_\d+"\)', "pass", setup.read_text())
    text = re.sub(r'cc_flag\.append\("-gencode"\)\n(\s+)pass', r"pass\n\1pass", text)
    setup.write_text(text)
    left = re.findall(r"arch=compute_\d+,code=sm_\d+", text)
    flags = text.count('cc_flag.append("-gencode")')
    if left != ["arch=compute_90,code=sm_90"] or flags != 1:
        raise SystemExit(f"causal-conv1d setup.py changed shape: gencodes left {left}, -gencode flags {flags}")
    return left


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=Path(".sdist"))
    args = p.parse_args()
    dest = args.dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pip("download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
            f"flash-attn=={FLASH_ATTN.split('-')[1]}", f"causal-conv1d=={CAUSAL_CONV1D.split('-')[1]}", cwd=work)
        pip("download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(dest), *BUILD_WHEELS, cwd=work)
        for sdist in work.glob("*.tar.gz"):
            with tarfile.open(sdist) as t:
                t.extractall(work, filter="data")
        print("flash-attn compile units:", trim_flash_attn(work / FLASH_ATTN))
        print("causal-conv1d gencode:", trim_causal_conv1d(work / CAUSAL_CONV1D))
        with tarfile.open(dest / "builds.tar.xz", "w:xz") as t:
            for name in (FLASH_ATTN, CAUSAL_CONV1D):
                t.add(work / name, arcname=name)
    shutil.copy(HERE / "build.sh", dest / "build.sh")
    print(f"staged in {dest}: {sorted(x.name for x in dest.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
