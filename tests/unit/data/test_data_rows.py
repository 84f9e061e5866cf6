"""Rows a user expects to train are trained; what cannot be is counted once, by reason; encodings; the
cache key follows the masking code."""

from __future__ import annotations

import json

import pytest
from _data_common import recipe, runs, tokenizer, write_jsonl

from ftcli.data import chat, iter_examples, pipeline, prepare, prepare_blocks
from ftcli.data.chat import ChatEncoder
from ftcli.data.stats import DataStats
from ftcli.data.validate import normalize_turns
from ftcli.config.errors import UserError

U = {"role": "user", "content": "What is 7 plus 6?"}
U2 = {"role": "user", "content": "And 2 plus 2?"}
A = {"role": "assistant", "content": "13"}
A2 = {"role": "assistant", "content": "4"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": '{"a": 7, "b": 6}'}}]}
TOOL = {"role": "tool", "content": '{"sum": 13}'}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _examples(tmp_path, rows, **overrides):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    stats = DataStats()
    r = recipe(tmp_path, data__path=path, data__packing__enabled="false", **overrides)
    return list(iter_examples(r, tokenizer("qwen"), stats)), stats


def _trained(ex) -> list[str]:
    import numpy as np

    ids, labels = np.asarray(ex.input_ids), np.asarray(ex.labels)
    return runs(tokenizer("qwen"), ids, labels != -100)


def test_trailing_user_and_tool_turns_are_dropped_and_counted(tmp_path):
    rows = [{"messages": [U, A, U2]}, {"messages": [U, CALL, TOOL]}, {"messages": [U, A]}]
    examples, stats = _examples(tmp_path, rows)
    assert [e.index for e in examples] == [0, 1, 2] and stats.skipped == {}
    assert examples[0].input_ids == examples[2].input_ids  # [U, A, U2] trains as [U, A]
    assert stats.dropped_turns == {"trailing user/tool turn": 2} and stats.rows_with_dropped_turns == 2
    assert _trained(examples[1]) == [
        "\n</think>\n\n<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n<parameter=b>\n6\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
    ]


def test_empty_assistant_turn_is_skipped_not_the_conversation(tmp_path):
    rows = [{"messages": [U, {"role": "assistant", "content": "  "}, U2, A2]},
            {"messages": [U, {"role": "assistant", "content": None}, U2, A2]}]
    examples, stats = _examples(tmp_path, rows)
    assert len(examples) == 2 and stats.dropped_turns == {"empty assistant turn": 2}
    assert _trained(examples[0]) == _trained(examples[1]) == ["\n</think>\n\n4<|im_end|>\n"]


def test_reasoning_only_turn_is_trained(tmp_path):
    examples, stats = _examples(tmp_path, [{"messages": [U, {"role": "assistant", "content": "", "thinking": "7+6"}]}])
    assert stats.skipped == {} and _trained(examples[0]) == ["7+6\n</think>\n\n<|im_end|>\n"]


def test_list_of_parts_content_trains_like_the_string(tmp_path):
    parts = {"role": "user", "content": [{"type": "text", "text": "What is 7 "}, {"type": "text", "text": "plus 6?"}]}
    reply = {"role": "assistant", "content": [{"type": "text", "text": "13"}]}
    image = {"role": "user", "content": [{"type": "image", "url": "x.png"}]}
    rows = [{"messages": [parts, reply]}, {"messages": [U, A]}, {"messages": [image, A]}]
    examples, stats = _examples(tmp_path, rows)
    assert examples[0].input_ids == examples[1].input_ids and examples[0].labels == examples[1].labels
    assert stats.skipped == {"non-text content part": 1}


def test_tools_column_is_passed_to_the_template(tmp_path):
    rows = [{"messages": [U, CALL, TOOL, A], "tools": TOOLS},
            {"messages": [U, CALL, TOOL, A], "tools": json.dumps(TOOLS)},
            {"messages": [U, CALL, TOOL, A], "functions": TOOLS}]
    examples, _ = _examples(tmp_path, rows)
    tok = tokenizer("qwen")
    want_ids, want_mask = ChatEncoder(tok).encode(normalize_turns([U, CALL, TOOL, A]), tools=TOOLS)  # as rows read
    assert examples[0].input_ids == examples[1].input_ids == want_ids.tolist()
    assert '"name": "add"' in tok.decode(examples[0].input_ids) and "# Tools" in tok.decode(examples[0].input_ids)
    assert "# Tools" not in tok.decode(examples[2].input_ids)  # not the tools field
    (tmp_path / "b").mkdir()
    custom, _ = _examples(tmp_path / "b", rows[2:], data__tools_field="functions")
    assert custom[0].input_ids == want_ids.tolist()


def test_bom_is_stripped_and_undecodable_lines_are_skipped_and_counted(tmp_path):
    good = json.dumps({"messages": [U, A]}).encode()
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good + b"\n" + b'{"messages": "\xff\xfe"}\n' + good + b"\n")
    r = recipe(tmp_path, data__path=path, data__packing__enabled="false")
    stats = DataStats()
    examples = list(iter_examples(r, tokenizer("qwen"), stats))
    assert [e.index for e in examples] == [0, 1, 3]
    assert stats.skipped == {"undecodable line": 1} and stats.first_skipped == {"undecodable line": [2]}


def test_csv_rows_with_json_messages(tmp_path):
    import csv

    with open(tmp_path / "d.csv", "w", newline="", encoding="utf-8-sig") as f:
        w = csv.DictWriter(f, ["messages"])
        w.writeheader()
        w.writerow({"messages": json.dumps([U, A])})
        w.writerow({"messages": "not json"})
    r = recipe(tmp_path, data__path=tmp_path / "d.csv", data__packing__enabled="false")
    stats = DataStats()
    examples = list(iter_examples(r, tokenizer("qwen"), stats))
    assert len(examples) == 1 and stats.skipped == {"messages not a list": 1}
    assert examples[0].input_ids == _examples(_mkdir(tmp_path / "j"), [{"messages": [U, A]}])[0][0].input_ids


def _mkdir(p):
    p.mkdir(exist_ok=True)
    return p


def test_bfd_counts_each_example_once_and_reports_lost_trained_tokens(tmp_path):
    long_user = {"role": "user", "content": "count " * 100}
    long_reply = {"role": "assistant", "content": "one two three " * 30}
    rows = [{"messages": [U, A]}, {"messages": [long_user, A]}, {"messages": [U, long_reply]}]
    tok = tokenizer("qwen")
    full = [ChatEncoder(tok).encode(r["messages"]) for r in rows]
    block = 64
    r = recipe(tmp_path, data__path=write_jsonl(tmp_path / "d.jsonl", rows), data__packing__strategy="bfd",
               data__packing__block_len=block)
    stats = prepare_blocks(r, tok).stats
    assert stats.skipped == {"zero trained tokens": 1} and stats.truncated == 1  # row 1 counted once
    assert stats.examples_kept == 2 and stats.examples_read == 3
    assert stats.trained_lost_truncation == int(full[1][1][block:].sum() + full[2][1][block:].sum()) == 275
    drop = recipe(tmp_path, data__path=tmp_path / "d.jsonl", data__packing__strategy="bfd",
                  data__packing__block_len=block, data__packing__overlong="drop")
    stats = prepare_blocks(drop, tok).stats
    assert stats.skipped == {"longer than block": 2} and stats.truncated == 0
    assert stats.trained_lost_overlong == int(full[1][1].sum() + full[2][1].sum())
    assert stats.trained_lost_truncation == 0


def test_special_token_strings_in_text_are_counted_and_the_mode_applies(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "say <|im_end|> twice <|im_end|>"}, A]}, {"messages": [U, A]}]
    examples, stats = _examples(tmp_path, rows)
    assert len(examples) == 2 and stats.special_tokens_in_text == 2 and stats.rows_with_special_tokens == 1
    assert "say <|im_end|> twice <|im_end|>" in tokenizer("qwen").decode(examples[0].input_ids)
    (tmp_path / "e").mkdir()
    examples, stats = _examples(tmp_path / "e", rows, data__special_tokens_in_text="error")
    assert [e.index for e in examples] == [1] and stats.skipped == {"special token in text": 1}
    (tmp_path / "s").mkdir()
    with pytest.raises(UserError, match="^data row 0: special token in text"):
        _examples(tmp_path / "s", rows, data__special_tokens_in_text="error", data__strict="true")


def test_changing_the_masking_code_invalidates_cached_blocks(tmp_path, monkeypatch):
    r = recipe(tmp_path, data__max_examples=20)
    tok = tokenizer("qwen")
    first = prepare(r, tok)
    builds = pipeline.BUILDS["count"]
    assert prepare(r, tok) == first and pipeline.BUILDS["count"] == builds  # a cache hit
    monkeypatch.setattr(chat, "ENCODER_VERSION", chat.ENCODER_VERSION + 1)
    bumped = prepare(r, tok)
    assert bumped != first and pipeline.BUILDS["count"] == builds + 1
    monkeypatch.setattr(pipeline, "ENCODER_MODULES", pipeline.ENCODER_MODULES[:-1])  # other code text
    assert prepare(r, tok) not in (first, bumped) and pipeline.BUILDS["count"] == builds + 2
    parts = pipeline.cache_parts(r, tok)
    assert parts["encoder"]["version"] == chat.ENCODER_VERSION and len(parts["encoder"]["code_sha256"]) == 64


def test_parallel_calls_gpt_oss_leaves_out_are_counted(tmp_path):
    """gpt-oss's template renders one tool call per message (the first): the others are counted."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    parallel = {"role": "assistant", "content": "", "tool_calls": [call, call, call]}
    rows = [{"messages": [U, parallel, TOOL, TOOL, TOOL, A]}, {"messages": [U, CALL, TOOL, A]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    stats = DataStats()
    r = recipe(tmp_path, name="tiny-gpt-oss-cpu", data__path=path, data__packing__enabled="false")
    assert len(list(iter_examples(r, tokenizer("gpt-oss"), stats))) == 2
    assert stats.dropped_turns == {"tool call the template does not render": 2} and stats.rows_with_dropped_turns == 1
