"""Malformed data rows: each one is skipped and counted by reason, the good rows around it still train,
and no row, however ugly, stops a lenient run or prints a traceback (`pack-preview --json` through the CLI)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

U = {"role": "user", "content": "What is 7 plus 6?"}
A = {"role": "assistant", "content": "13"}
GOOD = {"messages": [U, A]}

# (line written to the JSONL file, why it cannot train). Text lines are written as they are.
BAD_ROWS: list[tuple[str, str]] = [
    ("{", "truncated JSON"),
    ("not json at all", "plain text"),
    ('{"messages": [U, A]}', "JavaScript, not JSON"),
    ("[" * 200_000 + "]" * 200_000, "200,000 nested brackets"),
    ('{"messages": ' + "[" * 5_000 + "]" * 5_000 + "}", "5,000 nested lists as messages"),
    ('{"messages": ' + '{"a": ' * 3_000 + "1" + "}" * 3_000 + "}", "3,000 nested objects as messages"),
    ("42", "a number"),
    ('"a string row"', "a string"),
    ("null", "null"),
    ("true", "a boolean"),
    ("[]", "an empty list"),
    ('[{"role": "user", "content": "hi"}]', "a bare list of messages"),
    ("{}", "no messages field"),
    ('{"msgs": []}', "the wrong field name"),
    ('{"messages": null}', "messages null"),
    ('{"messages": 5}', "messages a number"),
    ('{"messages": "hello"}', "messages a string"),
    ('{"messages": {"role": "user"}}', "messages an object"),
    ('{"messages": []}', "no messages"),
    ('{"messages": [1, 2]}', "messages that are numbers"),
    ('{"messages": [null]}', "a null message"),
    ('{"messages": [[]]}', "a message that is a list"),
    ('{"messages": [{"content": "hi"}, {"content": "yo"}]}', "messages without roles"),
    ('{"messages": [{"role": 7, "content": "hi"}, {"role": "assistant", "content": "13"}]}', "a numeric role"),
    ('{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "13"}]}', "unknown role"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"messages": [{"role": "system", "content": "be brief"}]}', "only a system turn"),
    ('{"messages": [{"role": "assistant", "content": ""}]}', "only an empty assistant turn"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "   \\n\\t "}]}',
     "a whitespace-only answer"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "13"}]}', "numeric content"),
    ('{"messages": [{"role": "user", "content": {"x": 1}}, {"role": "assistant", "content": "13"}]}',
     "object content"),
    ('{"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, '
     '{"role": "assistant", "content": [{"type": "image", "url": "y.png"}]}]}', "image parts only"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}', "null answer"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "add(1, 2)"}]}',
     "tool_calls a string"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [5]}]}',
     "a tool call that is a number"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": '
     '[{"type": "function", "function": {"arguments": "{}"}}]}]}', "a tool call without a name"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": '
     '[{"type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]}', "tool arguments not JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "13"}], "tools": "add"}',
     "tools a string"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "13"}], "tools": [7]}',
     "a tool schema that is a number"),
    ('{"messages": [{"role": "tool", "content": "{\\"sum\\": 13}"}]}', "only a tool result"),
]


# Odd but trainable: kept, and they train the same answer tokens as GOOD (the template reads a bare string
# in a content list as text; a reasoning field that is not text is not reasoning, and the answer trains).
ODD_ROWS: list[tuple[str, str]] = [
    ('{"messages": [{"role": "user", "content": "What is 7 plus 6?"}, {"role": "assistant", "content": ["13"]}]}',
     "a list of bare strings as content"),
    ('{"messages": [{"role": "user", "content": "What is 7 plus 6?"}, {"role": "assistant", "content": "13", '
     '"thinking": 42}]}', "numeric reasoning"),
]


def _write(path, bad_lines: list[str]) -> None:
    good = json.dumps(GOOD)
    with open(path, "wb") as fh:
        fh.write(b"\xef\xbb\xbf" + good.encode() + b"\n")  # a BOM before row 0
        for line in bad_lines:
            fh.write(line.encode() + b"\n" + good.encode() + b"\n")
        fh.write(b"\xff\xfe not utf-8 \xc3\x28\n")  # undecodable bytes
        fh.write(good.encode() + b"\n")


def test_every_malformed_row_is_counted_and_every_good_row_trains(tmp_path):
    from ftcli import cli

    assert len(BAD_ROWS) >= 40
    path = tmp_path / "ugly.jsonl"
    _write(path, [line for line, _ in BAD_ROWS + ODD_ROWS])
    args = ["pack-preview", "--recipe", "tiny-qwen-cpu", "--set", f"data.path={path}",
            "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "eval=null", "--json"]
    res = CliRunner().invoke(cli.app, args)
    assert res.exit_code == 0, res.output[-2000:]
    assert "Traceback" not in res.output
    summary = json.loads(res.stdout)
    bad = len(BAD_ROWS) + 1  # + the undecodable line
    good = len(BAD_ROWS) + len(ODD_ROWS) + 2 + len(ODD_ROWS)  # the GOOD rows around every line, + the odd ones
    examples = summary["examples"]
    assert examples["read"] == good + bad
    # a row that cannot train is skipped and counted once; a row whose only problem is a turn that can be
    # dropped (an empty answer) is kept when something trainable is left, else skipped: never both
    assert examples["kept"] + examples["skipped"] == good + bad
    assert examples["kept"] == good  # every good row, none of the bad ones, trains
    assert sum(r["count"] for r in summary["skipped_by_reason"].values()) == bad
    assert summary["skipped_by_reason"]["undecodable line"]["count"] == 1
    # {, plain text, JavaScript, and the three nestings deeper than the parser allows
    assert summary["skipped_by_reason"]["invalid JSON"]["count"] == 6
    good_only = tmp_path / "good.jsonl"
    good_only.write_text((json.dumps(GOOD) + "\n") * good)
    res = CliRunner().invoke(cli.app, ["pack-preview", "--recipe", "tiny-qwen-cpu", "--set", f"data.path={good_only}",
                                       "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "eval=null", "--json"])
    assert json.loads(res.stdout)["trained_tokens"] == summary["trained_tokens"]  # exactly the good rows' tokens


def test_a_malformed_row_stops_a_strict_run_in_one_line(tmp_path):
    from ftcli import cli

    path = tmp_path / "ugly.jsonl"
    _write(path, ["[" * 200_000 + "]" * 200_000])
    res = CliRunner().invoke(cli.app, ["pack-preview", "--recipe", "tiny-qwen-cpu", "--set", f"data.path={path}",
                                       "--set", f"data.cache_dir={tmp_path / 'cache'}", "--strict"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nested deeper than the parser allows" in lines[0]
