"""A chat template is code from a model repo: one render is bounded in time (a loop that never ends) and in size
(gigabytes of output), and either is one line naming the template, in pack-preview (the data path), plan (its
token count) and generate (the prompt), never a hang or a tokenizers panic (#47 item 8)."""

from __future__ import annotations

import time

import pytest
from _data_common import tokenizer
from typer.testing import CliRunner

from ftcli.config.errors import UserError
from ftcli.data import chat

LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
         "{% for m in messages %}{{ m.content }}{% endfor %}")
FLOOD = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)


def _slow(name: str) -> str:
    return (f"{name} did not finish rendering one conversation in 0 s (a loop that does not end?); fix or replace the "
            "template (data.chat_template)")


def _flood(name: str) -> str:
    return (f"{name} rendered more than {chat.RENDER_MAX_CHARS:,} characters for one conversation; fix or replace the "
            "template (data.chat_template)")


@pytest.mark.parametrize("template, message", [(LOOPS, _slow), (FLOOD, _flood)], ids=["loops", "flood"])
def test_a_looping_or_flooding_template_is_one_line_in_the_encoder_and_generate(quick, monkeypatch, template, message):
    from ftcli.inference import render_prompt

    tok = tokenizer("qwen")  # shared by the tests: its template is put back afterwards
    monkeypatch.setattr(tok, "chat_template", template)
    name = f"the chat template of {tok.name_or_path}"
    started = time.monotonic()
    with pytest.raises(UserError) as err:
        chat.ChatEncoder(tok).render(CHAT)
    assert str(err.value) == message(name)
    with pytest.raises(UserError) as err:
        render_prompt(tok, CHAT[:1])  # generate / chat: checked before apply_chat_template
    assert str(err.value) == message(name)
    assert time.monotonic() - started < 20


def test_pack_preview_and_plan_name_the_template_file(quick, tmp_path):
    from ftcli import cli

    path = tmp_path / "loops.jinja"
    path.write_text(LOOPS)
    for command in (["pack-preview"], ["plan"]):
        res = CliRunner().invoke(cli.app, [*command, "--recipe", "tiny-qwen-cpu", "--set", f"data.chat_template={path}",
                                           "--set", f"data.cache_dir={tmp_path / 'cache'}"])
        assert res.exit_code == 2, res.output
        assert " ".join(res.output.split()) == "error: " + _slow(f"the chat template {path}"), command


def test_an_ordinary_template_renders_as_before():
    tok = tokenizer("qwen")
    kwargs = dict(tok.special_tokens_map)
    bounded = chat.compile_template(tok.chat_template).render(messages=CHAT, tools=None, documents=None, **kwargs)
    assert bounded == tok.apply_chat_template(CHAT, tokenize=False)
