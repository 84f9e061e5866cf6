"""`ftcli pack-preview`: its JSON numbers and its dump are exactly the blocks BlockStream yields."""

from __future__ import annotations

import json

from _data_common import recipe, write_jsonl
from typer.testing import CliRunner

from ftcli.cli import app
from ftcli.data import BlockStream, load_tokenizer, prepare_blocks

runner = CliRunner()


def _invoke(tmp_path, *args):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    return runner.invoke(app, ["pack-preview", "-r", "tiny-qwen-cpu", "--set", cache, "--set", "eval=null", *args])


def test_pack_preview_json_numbers_equal_block_stream(tmp_path):
    res = _invoke(tmp_path, "--examples", "120", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)  # nothing but JSON on stdout
    r = recipe(tmp_path, data__max_examples=120)
    packed = prepare_blocks(r, load_tokenizer(r.model, r.data))
    assert packed.from_cache  # the preview filled the cache training reads
    blocks = list(BlockStream(packed, 0, 1))
    assert summary["blocks"] == len(blocks) == 12
    assert summary["trained_tokens"] == sum(b.num_trained_tokens for b in blocks)
    assert summary["tokens"] + summary["padding_tokens"] == sum(len(b.input_ids) for b in blocks) == 12 * 1024
    assert summary["segments_per_block"]["max"] == max(len(b.cu_seqlens) - 1 for b in blocks)
    assert summary["examples"] == {
        "read": 120, "kept": 120, "skipped": 0, "truncated": 0, "split": 11, "zero_trained": 0,
    }
    assert summary["fill_pct"] == round(100 * summary["tokens"] / (12 * 1024), 2)
    assert summary["tokens_per_second"] > 0


def test_pack_preview_dump_equals_block_stream(tmp_path):
    dump = tmp_path / "blocks.jsonl"
    res = _invoke(tmp_path, "--examples", "60", "--blocks", "1", "--dump", str(dump))
    assert res.exit_code == 0, res.output
    assert "segment" in res.stdout and "trained tokens" in res.stdout and "fill" in res.stdout
    r = recipe(tmp_path, data__max_examples=60)
    packed = prepare_blocks(r, load_tokenizer(r.model, r.data))
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    blocks = list(BlockStream(packed, 0, 1))
    assert len(rows) == len(blocks) == 6
    for row, b in zip(rows, blocks):
        assert row == {
            "index": b.index, "input_ids": b.input_ids.tolist(), "labels": b.labels.tolist(),
            "position_ids": b.position_ids.tolist(), "seq_idx": b.seq_idx.tolist(),
            "cu_seqlens": b.cu_seqlens.tolist(), "max_seqlen": b.max_seqlen,
            "num_trained_tokens": b.num_trained_tokens,
        }


def test_pack_preview_reports_skips_and_strict_stops_with_one_line(tmp_path):
    u, a = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [u, a]}, {"messages": [u]}, {"messages": [u, a, u]}])
    res = _invoke(tmp_path, "--set", f"data.path={path}", "--json")
    summary = json.loads(res.stdout)
    assert summary["skipped_by_reason"] == {"no assistant turn": {"count": 1, "first_rows": [1]}}
    assert summary["dropped_turns"] == {"trailing user/tool turn": 1}
    res = _invoke(tmp_path, "--set", f"data.path={path}", "--strict")
    assert res.exit_code == 2
    assert res.stderr.strip() == (
        "error: data row 1: no assistant turn: no assistant message to train on "
        "(data.strict is on; turn it off to skip and count bad rows)"
    )


def test_pack_preview_marks_trained_tokens_in_plain_text_without_colour(tmp_path):
    """Piped (no colour), the block view brackets exactly the trained tokens in «...», and its title says
    which block of the training order it is and where that block lies in the cache."""
    import re

    import numpy as np

    res = _invoke(tmp_path, "--examples", "4", "--blocks", "1")
    assert res.exit_code == 0, res.output
    r = recipe(tmp_path, data__max_examples=4)
    tokenizer = load_tokenizer(r.model, r.data)
    block = next(iter(BlockStream(prepare_blocks(r, tokenizer), 0, 1)))
    assert f"block 0 in training order (packed block #{block.index} in the cache)" in " ".join(res.stdout.split())
    assert "trained tokens are marked «...»" in res.stdout
    trained = block.labels != -100
    trained[0] = False  # label 0 is never used by the loss
    cuts = np.flatnonzero(np.diff(trained.astype(int))) + 1
    runs = [tokenizer.decode(block.input_ids[a:b].tolist()) for a, b in zip([0, *cuts], [*cuts, len(trained)])
            if trained[a]]
    text = res.stdout.split("trained tokens are marked «...»\n", 1)[1]
    assert "".join(re.findall("«(.*?)»", text, re.S)) == "".join(runs)
