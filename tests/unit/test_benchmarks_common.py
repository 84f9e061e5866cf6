"""benchmarks/common.py, what the GPU harnesses share: its table is BENCHMARKS.md's format, its timing brackets
each call, its staging line names what imports and what does not (on CPU: the GPU paths fall back)."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common  # noqa: E402


def test_table_is_the_benchmarks_md_format():
    out = common.table(["variant", "s/step", "peak GiB"], [["ftcli", "0.265", 61.2], ["reference", "0.729", None]])
    assert out == ("| variant | s/step | peak GiB |\n"
                   "|---|---|---|\n"
                   "| ftcli | 0.265 | 61.2 |\n"
                   "| reference | 0.729 | - |")
    aligned = common.table(["model", "GiB"], [["a", 1]], sep=["---", "---:"])
    assert aligned.splitlines()[1] == "|---|---:|"
    assert common.table(["a", "b"], [], sep=" --- ").splitlines() == ["| a | b |", "| --- | --- |"]


def test_timed_runs_warmup_untimed_and_times_each_call():
    calls = []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(0.01)
        return len(calls)

    out, seconds = common.timed(fn, warmup=2, repeats=3, device="cpu")
    assert len(calls) == 5 and out == 5 and len(seconds) == 3
    assert all(0.009 < s < 0.5 for s in seconds)
    assert common.timed(lambda: "x", device=torch.device("cpu"))[0] == "x"


def test_peak_memory_is_none_on_cpu():
    assert common.peak_gib("cpu") is None
    assert common.card("cpu") == "cpu"


def test_staging_line_names_versions_and_missing_packages():
    line = common.staging_line("torch", "no_such_package_xyz")
    cuda = f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu"
    assert line == f"staged: torch {torch.__version__} ({cuda}) | no_such_package_xyz missing " \
                   "(No module named 'no_such_package_xyz')"


def test_header_names_the_command_card_and_date():
    line = common.header(["/somewhere/benchmarks/cp_gpu.py", "--device", "cpu"], device="cpu")
    assert line.startswith("Command: `python benchmarks/cp_gpu.py --device cpu`; cpu, 20")
    assert line.endswith(" UTC")
