"""data.num_workers: the rows tokenized in spawned worker processes give the same blocks, and the same skip counts,
as one process. Starting the workers (spawn: a fresh interpreter each) takes seconds, so it lives here rather than
in the fast tier (tests/unit/data/test_data_pipeline.py)."""

from __future__ import annotations

import json

from _data_common import ASSETS, BAD_ROWS, recipe, tokenizer, write_jsonl

from ftcli.data import prepare_blocks


def test_num_workers_give_the_same_blocks_and_counts(tmp_path):
    rows = BAD_ROWS * 3 + [json.loads(x) for x in (ASSETS / "tiny_chat.jsonl").read_text().splitlines()[:300]]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    tok = tokenizer("qwen")
    serial = prepare_blocks(recipe(tmp_path / "a", data__path=path, data__packing__block_len=256), tok)
    parallel = prepare_blocks(recipe(tmp_path / "b", data__path=path, data__packing__block_len=256,
                                     data__num_workers=2), tok)
    assert parallel.stats.skipped == serial.stats.skipped and parallel.stats.first_skipped == serial.stats.first_skipped
    assert len(parallel) == len(serial) == 114
    for i in range(len(serial)):
        assert parallel.block(i).input_ids.tolist() == serial.block(i).input_ids.tolist()
        assert parallel.block(i).labels.tolist() == serial.block(i).labels.tolist()
