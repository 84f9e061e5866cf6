"""DataSummary: the one data summary pack-preview shows and train prints / stores (run.json, MLflow)."""

from __future__ import annotations

import json

from _data_common import recipe, tokenizer, write_jsonl

from ftcli.data import open_prepared, prepare_blocks
from ftcli.data.summary import data_summary

U = {"role": "user", "content": "What is 7 plus 6?"}
A = {"role": "assistant", "content": "13"}


def test_summary_lines_dict_and_metrics_hold_the_exact_counts(tmp_path):
    rows = [{"messages": [U, A]}, {"messages": [U]}, {"messages": [U, A, U]},
            {"messages": [{"role": "user", "content": "a <|im_end|> b"}, A]}, {"messages": [U, A]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    r = recipe(tmp_path, data__path=path, data__packing__block_len=256, data__packing__strategy="bfd")
    tok = tokenizer("qwen")
    packed = prepare_blocks(r, tok)
    s = data_summary(r, packed)
    assert (s.blocks, s.tokens, s.trained_tokens) == (len(packed), packed.stats.tokens, int(packed.block_trained.sum()))
    assert s.examples == {"read": 5, "kept": 4, "skipped": 1, "truncated": 0, "split": 0, "zero_trained": 0}
    assert s.skipped_by_reason == {"no assistant turn": {"count": 1, "first_rows": [1]}}
    assert s.dropped_turns == {"trailing user/tool turn": 1}
    assert s.special_tokens_in_text == {"strings": 1, "rows": 1, "mode": "keep"}
    assert s.trained_tokens_lost == {"truncation": 0, "overlong": 0}
    assert list(s.sources) == [str(path)] and s.sources[str(path)].trained_tokens == s.trained_tokens
    lines = s.lines()
    assert lines[3] == f"trained tokens: {s.trained_tokens} of {s.tokens} ({s.trained_pct:.2f}%)"
    assert "examples: read 5, kept 4, skipped 1" in lines
    assert "  skipped: no assistant turn: 1 (first rows 1)" in lines
    assert "  dropped: trailing user/tool turn: 1 (the rest of each row is kept)" in lines
    assert "special tokens in text: 1 in 1 rows (data.special_tokens_in_text=keep)" in lines
    assert json.loads(json.dumps(s.to_dict())) == s.to_dict()
    m = s.metrics()
    assert m["data/trained_tokens"] == s.trained_tokens and m["data/examples_skipped"] == 1.0
    assert m["data/special_tokens_in_text"] == 1.0 and all(isinstance(v, float) for v in m.values())
    # another rank, or a later run, reads the same summary from the cache
    again = data_summary(r, open_prepared(r, tok))
    assert {**again.to_dict(), "from_cache": False} == s.to_dict()
