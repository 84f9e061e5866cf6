"""A lone UTF-16 surrogate (JSON's "\\ud800") in a row is counted and skipped like any undecodable row:
pack-preview and the train preflight (the same pipeline) keep the other rows, and the held-out split
stays the same."""

from __future__ import annotations

import json

import pytest

GOOD = {"messages": [{"role": "user", "content": "What is 7 plus 6?"}, {"role": "assistant", "content": "13"}]}


@pytest.mark.parametrize("bad", [
    '{"messages": [{"role": "user", "content": "hi \\ud800 there"}, {"role": "assistant", "content": "13"}]}',
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "13"}], "\\udfff": 1}',
])
def test_lone_surrogate_row_is_skipped_and_counted(tmp_path, bad):
    from ftcli import data
    from ftcli.config.recipe import load_recipe

    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(GOOD)] * 3 + [bad] + [json.dumps(GOOD)] * 2
    path.write_text("\n".join(lines) + "\n")
    recipe = load_recipe("tiny-qwen-cpu", [f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "eval=null"])
    stats = data.prepare_blocks(recipe, data.load_tokenizer(recipe.model, recipe.data)).stats
    assert (stats.examples_read, stats.examples_kept, dict(stats.skipped)) == (6, 5, {"lone surrogate": 1})


def test_surrogate_detail_names_where_it_is():
    from ftcli.data.validate import BadRow, conversation

    row = {"messages": [{"role": "user", "content": "a\ud800"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(BadRow) as err:
        conversation(row, "messages")
    assert (err.value.reason, err.value.detail) == (
        "lone surrogate", "messages.0.content holds U+D800, a lone UTF-16 surrogate that is not valid Unicode text")


def test_holdout_unit_of_a_surrogate_row_needs_no_utf8():
    from ftcli.data.evalsplit import row_unit

    assert 0 <= row_unit({"x": "\ud800"}, 0) < 1
    assert row_unit(GOOD, 3) == row_unit(json.loads(json.dumps(GOOD)), 3)
