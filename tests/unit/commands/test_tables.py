"""Every table command reads at 80 columns (a pipe, a narrow terminal) and at 200: no header cell is cut
(rich cuts with "…"), and no cell either: long cells fold onto more lines, long provenance goes to notes. `plan` and
`pack-preview` here, in-process; `recipes list` and `doctor` through a real process and rich's real console at
COLUMNS: tests/e2e/test_cli_real_process.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from _data_common import write_jsonl
from _tables_common import WIDTHS, assert_whole

PLAN = ("accelerator", "GPUs", "nodes", "params", "grads", "optim", "activ", "loss", "other", "total", "limit", "fits",
        "keep", "s/step", "wall", "GPU-h", "from")
PACK_PREVIEW = ("segment", "tokens", "length", "position_ids", "trained", "source", "format", "rows", "kept",
                "skipped", "trained tokens", "trained lost", "skipped by reason", "split", "blocks", "packing")


@pytest.mark.parametrize("width", WIDTHS)
def test_plan_headers_whole_gpus_per_row_and_provenance_in_notes(width, monkeypatch, capsys):
    from ftcli.commands import plan
    from ftcli.config.recipe import load_recipe

    monkeypatch.setenv("COLUMNS", str(width))
    plan.print_plan(plan.make_plan(load_recipe("qwen-b300")))
    out = capsys.readouterr().out
    assert_whole(out, PLAN, width)
    rows = [line.split() for line in out.splitlines() if line.startswith("GPU_") and " fit" not in line]
    assert [r[:3] for r in rows[:4]] == [["GPU_8xB300", "8", "1"], ["GPU_8xH100", "8", "1"], ["GPU_8xH200", "8", "1"],
                                         ["GPU_1xA10", "1", "8"]]
    assert [r[-2:] for r in rows[4:]] == [["[1]", "[2]"], ["[3]", "[2]"], ["[4]", "[2]"], ["[5]", "[2]"]]
    notes = [line for line in out.splitlines() if line.startswith("[")]
    assert [n[:4] for n in notes] == ["[1] ", "[2] ", "[3] ", "[4] ", "[5] "]
    flat = " ".join(out.split())
    assert notes[0].startswith("[1] scaled from H200, 1 GPU, Qwen/Qwen3.8-27B") and (
        "[2] measured by benchmarks/levers_gpu.py (the command: plan --json, BENCHMARKS.md) [3]" in flat)
    assert all(len(line) <= width for line in out.splitlines()), max(out.splitlines(), key=len)  # nothing runs on


@pytest.mark.parametrize("width", WIDTHS)
def test_pack_preview_headers_whole(width, tmp_path, monkeypatch, capsys):
    from ftcli.commands.preview import run_preview
    from ftcli.config.recipe import load_recipe

    monkeypatch.setenv("COLUMNS", str(width))
    sharegpt = {"conversations": [{"from": "human", "value": "What is 7 plus 6?"}, {"from": "gpt", "value": "13"}]}
    path = write_jsonl(tmp_path / "a_rather_long_file_name_for_a_narrow_terminal.jsonl", [sharegpt] * 30)
    r = load_recipe("tiny-qwen-cpu", [f"data.cache_dir={tmp_path / 'cache'}", "data.path=null", "data.sources=[{source: local, path: "
                                      f"{path}, format: sharegpt}}, {{source: local, path: pkg://assets/tiny_chat.jsonl, "
                                      "name: shipped, format: auto}]", "eval.holdout=0.2"])
    run_preview(r, blocks=1, examples=30, as_json=False, dump=None, strict=False)
    out = capsys.readouterr().out
    assert_whole(out, PACK_PREVIEW, width)
    # the cache path (longer than 80 columns here) on a line of its own, whole: it can be copied (issue 46, item 5)
    cache = [line for line in out.splitlines() if line.startswith(str(tmp_path / "cache"))]
    assert len(cache) == 1 and len(cache[0]) > 80 and (Path(cache[0]) / "meta.json").is_file(), out
