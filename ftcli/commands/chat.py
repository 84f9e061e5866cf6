"""`ftcli chat`: a multi-turn conversation with a trained model in the terminal.

    you> text        the reply streams as it is generated, then its tokens/s
    /system TEXT     set the system prompt (kept for the next turns; `/system` alone clears it)
    /reset           forget the conversation (the system prompt stays)
    /exit            leave (so does end of input, Ctrl-D)
    Ctrl-C           while a reply streams: stop it (that turn is not kept)

The history is the list of messages sent to the chat template on every turn: the system prompt,
then user and assistant turns. An assistant turn is stored as its answer only (gpt-oss's template
drops the reasoning of earlier turns anyway; Qwen3.x renders earlier think blocks from
`reasoning_content`, which ftcli keeps out of the history too, so both see answers only).
"""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from ftcli.artifacts.resolve import model_source
from ftcli.config.errors import UserError
from ftcli.inference import (LoadedModel, Sampling, check_reasoning_effort, load, render_prompt, stream_reply,
                             system_prompt, template_kwargs)
from ftcli.inference.prompt_checks import check_prompt_length, check_rendered_length, context_of, text_problem

HELP = "/system TEXT sets the system prompt, /reset forgets the chat, /exit leaves"  # under 80 columns


class Chat:
    """The conversation state, separate from the terminal so it can be tested on its own."""

    def __init__(self, system: str | None = None):
        self.system = system
        self.turns: list[dict] = []

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def command(self, line: str) -> str | None:
        """Handle a /command; returns what to print, or None for /exit."""
        name, _, arg = line.partition(" ")
        if name in ("/exit", "/quit"):
            return None
        if name == "/reset":
            self.turns = []
            return "conversation reset"
        if name == "/system":
            self.system = arg.strip() or None
            return f"system prompt set: {self.system}" if self.system else "system prompt cleared"
        return f"unknown command {name}; {HELP}"


def run_chat_command(ref: str, *, system: str | None, sampling: Sampling, reasoning_effort: str | None,
                     reasoning_language: str | None, dtype: str, device: str, revision: str | None) -> None:
    """`ftcli chat`: resolve and load the model, then talk."""
    from rich.console import Console

    source = model_source(ref, revision)
    with Console(stderr=True).status(f"loading {source.describe()}"):
        loaded = load(source, dtype=dtype, device=device)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach the loop as lone surrogates: skipped there
        sys.stdin.reconfigure(errors="surrogateescape")
    check_reasoning_effort(loaded.tokenizer, reasoning_effort, source.describe())
    run_chat(loaded, sampling, system=system_prompt(system, reasoning_language),
             template_kwargs=template_kwargs(reasoning_effort))


def run_chat(loaded: LoadedModel, sampling: Sampling, *, system: str | None, template_kwargs: dict,
             stdin: TextIO | None = None, write: Callable[[str], None] | None = None,
             reply=stream_reply) -> None:
    """The loop: read a line, run a command or generate a reply with the whole history."""
    stdin = stdin or sys.stdin
    write = write or _stdout
    chat = Chat(system)
    interactive = stdin.isatty()
    if interactive:
        import readline  # noqa: F401 - line editing and history for input()
    write(f"chatting with {loaded.source.describe()}\n{HELP}\n")  # two lines: each reads whole at 80 columns
    context = context_of(loaded.model, loaded.source.run_dir)
    while True:
        try:
            line = input("you> ") if interactive else stdin.readline()
        except (EOFError, KeyboardInterrupt):
            line = ""
        except UnicodeDecodeError as e:
            raise UserError(f"the input is not UTF-8 text ({e.reason} at byte {e.start}); chat reads UTF-8") from None
        if not line:  # end of input
            write("\n" if interactive else "")
            return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            said = chat.command(line)
            if said is None:
                return
            write(said + "\n")
            continue
        messages = chat.messages() + [{"role": "user", "content": line}]
        problem = text_problem(line)
        try:
            if problem:
                raise UserError(f"this line is {problem}")
            fix = "shorten it" + (" or /reset the conversation" if chat.turns else "")
            check_prompt_length(loaded.tokenizer, messages, context, fix)
            if context is not None and loaded.tokenizer is not None:
                check_rendered_length(len(render_prompt(loaded.tokenizer, messages, template_kwargs)), context, fix)
        except UserError as e:  # this turn is left out; the conversation goes on
            write(f"[skipped: {e}]\n")
            continue
        write("assistant> ")
        try:
            completion, stats = reply(loaded, messages, sampling, write=write, template_kwargs=template_kwargs)
        except KeyboardInterrupt:  # Ctrl-C stops this reply; the turn is left out of the history
            write("\n[interrupted]\n")
            continue
        chat.turns += [messages[-1], {"role": "assistant", "content": completion.text}]
        write(f"\n[{stats.line()}]\n")


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
