"""Row formats by name and `auto` (ftcli.data.formats): each format trains exactly the tokens of the
messages it says; auto says what it chose and why; compressed and JSON-array files read like JSONL."""

from __future__ import annotations

import bz2
import gzip
import json
import sys

import pytest
from _data_common import recipe, tokenizer, write_jsonl

from ftcli.config.errors import UserError
from ftcli.data import iter_examples, prepare_blocks
from ftcli.data.formats import DETECT_ROWS, conversation, detect
from ftcli.data.pipeline import recipe_cache_parts
from ftcli.data.stats import DataStats
from ftcli.data.validate import BadRow

SYS = {"role": "system", "content": "You are brief."}
U = {"role": "user", "content": "What is 7 plus 6?"}
A = {"role": "assistant", "content": "13"}
U2 = {"role": "user", "content": "And 2 plus 2?"}
A2 = {"role": "assistant", "content": "4"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 6}}}]}
TOOL = {"role": "tool", "content": '{"sum": 13}'}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _examples(tmp_path, rows, name="d.jsonl", path=None, **overrides):
    path = path or write_jsonl(tmp_path / name, rows)
    stats = DataStats()
    r = recipe(tmp_path, data__path=path, data__packing__enabled="false", **overrides)
    return [(e.input_ids, e.labels) for e in iter_examples(r, tokenizer("qwen"), stats)], stats


def test_sharegpt_rows_train_exactly_as_their_messages(tmp_path):
    sharegpt = [
        {"system": SYS["content"], "conversations": [{"from": "human", "value": U["content"]},
                                                     {"from": "gpt", "value": A["content"]},
                                                     {"from": "user", "value": U2["content"]},
                                                     {"from": "model", "value": A2["content"]}]},
        {"conversations": [{"from": "human", "value": U["content"]},
                           {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 7, "b": 6}}'},
                           {"from": "observation", "value": TOOL["content"]},
                           {"from": "assistant", "value": A["content"]}], "tools": json.dumps(TOOLS)},
    ]
    messages = [{"messages": [SYS, U, A, U2, A2]}, {"messages": [U, CALL, TOOL, A], "tools": TOOLS}]
    got, stats = _examples(tmp_path, sharegpt, data__format="sharegpt")
    want, _ = _examples(tmp_path, messages, name="m.jsonl", data__format="messages")
    assert got == want and stats.examples_kept == 2 and stats.skipped == {}


def test_sharegpt_list_under_messages_field_or_messages_is_found():
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    want = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert conversation({"chat": turns}, "sharegpt", messages_field="chat").messages == want
    assert conversation({"messages": turns}, "sharegpt").messages == want
    assert conversation({"conversations": turns}, "sharegpt", messages_field="messages").messages == want


def test_sharegpt_unknown_from_and_missing_list_are_counted_skips(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]},
            {"dialog": []},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "not json"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}]
    got, stats = _examples(tmp_path, rows, data__format="sharegpt")
    assert len(got) == 1
    assert stats.skipped == {"unknown role": 1, "conversations missing": 1, "invalid tool call": 1}
    assert stats.first_detail["unknown role"].startswith("turn 1 is from 'bot'; expected one of human, user, gpt")
    assert stats.first_detail["conversations missing"] == (
        "no 'messages' / 'conversations' list of from/value turns (fields: dialog)")


def test_alpaca_rows_train_as_system_history_user_assistant(tmp_path):
    alpaca = [{"instruction": U["content"], "input": "", "output": A["content"]},
              {"instruction": "Add these.", "input": "2 and 2", "output": "4", "system": SYS["content"],
               "history": [[U["content"], A["content"]]]}]
    messages = [{"messages": [U, A]},
                {"messages": [SYS, U, A, {"role": "user", "content": "Add these.\n2 and 2"}, A2]}]
    got, stats = _examples(tmp_path, alpaca, data__format="alpaca")
    want, _ = _examples(tmp_path, messages, name="m.jsonl", data__format="messages")
    assert got == want and stats.examples_kept == 2


def test_alpaca_missing_output_and_bad_history_are_counted_skips(tmp_path):
    rows = [{"instruction": "x"}, {"instruction": "x", "output": "y", "history": [["only one"]]},
            {"instruction": "x", "output": 5}, {"instruction": "x", "output": "y"}]
    got, stats = _examples(tmp_path, rows, data__format="alpaca")
    assert len(got) == 1
    assert stats.skipped == {"output missing": 1, "invalid history": 1, "content not a string": 1}


def test_text_rows_train_every_token_and_eos_without_a_template(tmp_path):
    tok = tokenizer("qwen")
    got, stats = _examples(tmp_path, [{"text": "The capital of Kenya is Nairobi."}, {"text": "  "}],
                           data__format="text")
    ids = tok("The capital of Kenya is Nairobi.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert got == [(ids, ids)] and stats.skipped == {"empty text": 1}


@pytest.mark.parametrize("fmt,row,why", [
    ("messages", {"messages": [U, A]}, "a 'messages' list of role/content turns"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
     "a 'conversations' list of from/value turns"),
    ("alpaca", {"instruction": "hi", "input": "", "output": "yo"}, "instruction/output fields"),
    ("prompt_completion", {"prompt": "hi ", "completion": "yo"}, "prompt/completion fields"),
    ("text", {"text": "hi yo"}, "a 'text' field"),
])
def test_auto_detects_each_format_says_why_and_trains_it_as_named(tmp_path, fmt, row, why):
    rows = [row] * 40
    auto, stats = _examples(tmp_path, rows, name="a.jsonl", data__format="auto")
    named, _ = _examples(tmp_path, rows, name="n.jsonl", data__format=fmt)
    assert auto == named and len(auto) == 40
    (src,) = stats.sources.values()
    assert (src.format, src.format_why) == (fmt, f"auto: {DETECT_ROWS} of the first {DETECT_ROWS} rows have {why}")


def test_auto_takes_the_most_common_format_of_the_first_rows():
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    rows = [{"text": "x"}] * 3 + [sharegpt] * 5 + [{"id": 1}] * 24 + [{"text": "x"}] * 100  # the first 32 count
    found = detect(iter(rows))
    assert (found.format, found.messages_field) == ("sharegpt", "conversations")
    assert found.why == "auto: 5 of the first 32 rows have a 'conversations' list of from/value turns"
    none = detect(iter([{"question": "q", "answer": "a"}] * 3))
    assert (none.format, none.why) == ("messages", "auto: none of the first 3 rows matches a format "
                                                   "(fields question, answer); read as messages")


def test_auto_per_row_without_a_source():
    """`conversation(row, "auto")` (what register's input example reads) decides per row."""
    assert conversation({"instruction": "hi", "output": "yo"}, "auto").messages == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(BadRow, match="unknown format"):
        conversation({"question": "q"}, "auto")


def test_pack_cache_key_includes_the_format(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [U, A]}])
    keys = {fmt: recipe_cache_parts(recipe(tmp_path, data__path=path, data__format=fmt))["sources"][0]["format"]
            for fmt in ("auto", "messages", "sharegpt")}
    assert keys == {"auto": "auto", "messages": "messages", "sharegpt": "sharegpt"}
    tok = tokenizer("qwen")
    paths = {prepare_blocks(recipe(tmp_path, data__path=path, data__format=f), tok).path for f in ("auto", "messages")}
    assert len(paths) == 2  # an auto entry is never served for a named format, nor the reverse


def _compress(path, suffix):
    raw = path.read_bytes()
    out = path.with_name(path.name + suffix)
    if suffix == ".gz":
        out.write_bytes(gzip.compress(raw))
    elif suffix == ".bz2":
        out.write_bytes(bz2.compress(raw))
    else:
        import zstandard

        out.write_bytes(zstandard.ZstdCompressor().compress(raw))
    return out


@pytest.mark.parametrize("name", ["d.jsonl.gz", "d.jsonl.bz2", "d.jsonl.zst", "d.json", "d.json.gz", "d.json.zst"])
def test_compressed_and_json_array_files_read_like_jsonl(tmp_path, name):
    rows = [{"messages": [U, A]}, {"conversations": []}, {"messages": [U, A, U2, A2]}]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    want, want_stats = _examples(tmp_path, rows)
    base = name.split(".")[1]
    plain = jsonl if base == "jsonl" else tmp_path / "d.json"
    if base == "json":
        plain.write_text(json.dumps(rows))
    path = plain if name == plain.name else _compress(plain, "." + name.rsplit(".", 1)[1])
    got, stats = _examples(tmp_path, [], path=path)
    assert got == want and stats.skipped == want_stats.skipped == {"messages missing": 1}


def test_zst_without_zstandard_is_one_line(tmp_path, monkeypatch):
    path = _compress(write_jsonl(tmp_path / "d.jsonl", [{"messages": [U, A]}]), ".zst")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as on a machine without it: import fails
    with pytest.raises(UserError, match=r"d\.jsonl\.zst: reading \.zst files needs the zstandard package"):
        _examples(tmp_path, [], path=path)


def test_other_compressed_types_are_refused_with_what_is_read(tmp_path):
    path = tmp_path / "d.parquet.gz"
    path.write_bytes(gzip.compress(b"x"))
    with pytest.raises(UserError, match=r"unsupported file type '\.parquet\.gz' \(use \.jsonl, .*\.gz, \.bz2, \.xz, "
                                        r"\.zst\)"):
        _examples(tmp_path, [], path=path)



def test_messages_of_a_row_in_each_format():
    """What a token estimate (plan) counts: the same turns for the same conversation in any format."""
    from ftcli.data.formats import messages_of

    want = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = {"messages": {"messages": want},
            "sharegpt": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            "alpaca": {"instruction": "hi", "output": "yo"}, "prompt_completion": {"prompt": "hi", "completion": "yo"}}
    for fmt, row in rows.items():
        assert messages_of(row, fmt) == messages_of(row, "auto") == want, fmt
    assert messages_of({"text": "hi yo"}, "auto") == [{"role": "user", "content": ""},
                                                      {"role": "assistant", "content": "hi yo"}]
    assert messages_of({"question": "q"}, "auto") is None


SHAPES = {  # one conversation (U, A) in each chat format
    "messages": {"messages": [U, A]},
    "sharegpt": {"conversations": [{"from": "human", "value": U["content"]}, {"from": "gpt", "value": A["content"]}]},
    "alpaca": {"instruction": U["content"], "input": "", "output": A["content"]},
    "prompt_completion": {"prompt": U["content"], "completion": A["content"]},
}


def test_auto_reads_each_row_of_a_mixed_file_in_its_own_format(tmp_path):
    """A file mixing four row shapes keeps every row under auto (it kept 30 of 120 when auto took the most
    common shape), each trained exactly as the same row of a file of its format alone."""
    mixed = [SHAPES[f] for f in SHAPES] * 30
    got, stats = _examples(tmp_path, mixed, name="mixed.jsonl", data__format="auto")
    assert stats.examples_kept == 120 and stats.skipped == {}
    (src,) = stats.sources.values()
    assert (src.format, src.format_why) == ("auto", "auto, per row: the first rows are 8 OpenAI messages, 8 ShareGPT, "
                                                    "8 Alpaca, 8 prompt/completion; each row is read in its own format")
    alone = {f: _examples(tmp_path, [row], name=f"{f}.jsonl", data__format=f)[0][0] for f, row in SHAPES.items()}
    assert got == [alone[f] for f in SHAPES] * 30


def test_auto_detects_the_files_of_a_folder_apart(tmp_path):
    """A folder holding a ShareGPT file and an Alpaca file trains both (the ShareGPT file was dropped whole)."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [SHAPES["alpaca"]] * 40)
    write_jsonl(folder / "b.jsonl", [SHAPES["sharegpt"]] * 40)
    got, stats = _examples(tmp_path, None, path=folder, data__format="auto")
    assert stats.examples_kept == 80 and stats.skipped == {}
    assert stats.sources[str(folder)].format_why == (
        "auto, per row: the first rows of 2 files are 32 Alpaca, 32 ShareGPT; each row is read in its own format")
    one, _ = _examples(tmp_path, [SHAPES["messages"]], name="m.jsonl", data__format="messages")
    assert got == one * 80


def test_a_source_losing_most_rows_to_a_missing_field_says_what_its_rows_are(tmp_path):
    from ftcli.data.checks import source_warnings

    path = write_jsonl(tmp_path / "mixed.jsonl", [SHAPES[f] for f in SHAPES] * 30)
    r = recipe(tmp_path, data__path=path, data__format="messages")
    packed = prepare_blocks(r, tokenizer("qwen"))
    assert packed.stats.examples_kept == 30
    assert source_warnings(r.data, packed.stats) == [
        f"data source '{path}' skips 90 of the 120 rows read for a missing field (messages missing 90, row 1: no "
        "'messages' field (fields: conversations)) [format messages]; its rows are 30 OpenAI messages, 30 ShareGPT, "
        "30 Alpaca, 30 prompt/completion: set data.format=auto to read each row in its own format"]
    auto = recipe(tmp_path, data__path=path, data__format="auto")
    assert source_warnings(auto.data, prepare_blocks(auto, tokenizer("qwen")).stats) == []
