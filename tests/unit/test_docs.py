"""The README and docs/ say what runs: the quickstart and test commands are exactly what CI and the suite run,
every `ftcli ...` line in them parses with today's CLI, and docs/data.md's examples train as it says (the
quickstart's train and generate run in tests/e2e/test_train_full.py, on the suite's reference run)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from _data_common import tokenizer, write_jsonl
from _run_common import QUICKSTART_GENERATE, QUICKSTART_TRAIN, TESTS
from typer.testing import CliRunner

from ftcli import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bash_blocks(text: str, section: str | None = None) -> list[str]:
    """The ```bash blocks of `text` (of one `## section` only when given), backslash continuations joined."""
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def ftcli_lines(text: str) -> list[str]:
    out = []
    for block in bash_blocks(text):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line.split(" && ")[-1]).strip()
            if line.startswith("ftcli "):
                out.append(line)
    return out


def test_readme_quickstart_and_test_commands_are_what_ci_and_the_suite_run():
    readme = (ROOT / "README.md").read_text()
    assert [b.strip() for b in bash_blocks(readme, "Quickstart")] == [QUICKSTART_TRAIN, QUICKSTART_GENERATE]
    assert [b.strip() for b in bash_blocks(readme, "Tests")] == [TESTS]
    ci = (ROOT / ".ci" / "run").read_text()
    for step in ("python3 -m venv .venv", ". .venv/bin/activate", 'pip install -c constraints/cpu.txt -e ".[dev]"'):
        assert f"\n{step}\n" in ci, step
    assert re.search(r"^pytest \|\| status=\$\?$", ci, re.M)
    from _run_common import train_args

    assert train_args(Path("runs/x"))[:3] == shlex.split(QUICKSTART_TRAIN.split(" && ")[-1])[1:]  # the suite's train
    assert len(readme.splitlines()) < 160  # a newcomer's page; the rest lives in docs/


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_ftcli_line_in_the_docs_parses(doc):
    """Each `ftcli ...` line of a bash block parses: its command exists, and so do its options and arguments."""
    from typer.main import get_command

    lines = ftcli_lines(doc.read_text())
    assert lines or doc.name in ("architecture.md", "commands.md"), doc
    for line in lines:
        args = cli._normalize_argv(shlex.split(line)[1:])  # what `ftcli` does first (a bare --resume)
        command, ctx, name = get_command(cli.app), None, "ftcli"
        while hasattr(command, "get_command"):  # a group (no line gives group options): its subcommand
            ctx = command.make_context(name, [], parent=ctx, resilient_parsing=True)
            name, args = args[0], args[1:]
            command = command.get_command(ctx, name)
            assert command is not None, line
        command.make_context(name, list(args), parent=ctx)  # raises on an unknown option or a missing argument


FORMAT_ROW = re.compile(r"^\| `(\w+)` \| `(\{.*?\})` \|", re.M)


def test_docs_data_format_examples_are_read_as_their_format_and_train():
    from ftcli.data.formats import conversation, detect

    rows = FORMAT_ROW.findall((ROOT / "docs" / "data.md").read_text())
    assert [f for f, _ in rows] == ["messages", "sharegpt", "alpaca", "prompt_completion", "text"]
    for fmt, example in rows:
        row = json.loads(example)
        assert detect([row]).format == fmt
        conv = conversation(row, fmt)
        assert conv.messages or conv.completion, fmt


def test_docs_data_prompt_completion_strings_train_as_a_templated_user_and_assistant_turn(tmp_path):
    """docs/data.md: prompt/completion strings are rendered with the chat template as a user turn and the
    answer; only the answer and its end-of-turn are trained: exactly the messages row's tokens and labels."""
    from ftcli.config.recipe import load_recipe
    from ftcli.data import iter_examples

    pair = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    chat = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "2+2="},
                                                            {"role": "assistant", "content": "4"}]}])

    def examples(path, fmt):
        r = load_recipe("tiny-qwen-cpu", ["eval=null", f"data.path={path}", f"data.format={fmt}",
                                          "data.packing.enabled=false", f"data.cache_dir={tmp_path / 'c'}"])
        return [(e.input_ids, e.labels) for e in iter_examples(r, tokenizer("qwen"))]

    assert examples(pair, "prompt_completion") == examples(chat, "messages")


def test_docs_data_first_commands_run_on_a_small_file(tmp_path, monkeypatch):
    """docs/data.md's "Point a recipe at your file": recipes cp, then pack-preview (--json) on the file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FTCLI_CACHE", str(tmp_path / "cache"))
    write_jsonl(tmp_path / "my_chats.jsonl", [{"conversations": [{"from": "human", "value": f"Add {a} and 1."},
                                                                 {"from": "gpt", "value": str(a + 1)}]}
                                              for a in range(40)])
    lines = ftcli_lines((ROOT / "docs" / "data.md").read_text())
    assert lines[:2] == ["ftcli recipes cp tiny-qwen-cpu my.yaml",
                         "ftcli pack-preview --recipe my.yaml --set data.path=my_chats.jsonl --set data.format=auto"]
    runner = CliRunner()
    assert runner.invoke(cli.app, shlex.split(lines[0])[1:]).exit_code == 0
    res = runner.invoke(cli.app, [*shlex.split(lines[1])[1:], "--set", "eval.holdout=4", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["examples"]["kept"] == 36 and summary["recipe"] == "my"
