"""What a chat format is (`ChatFormat`), the header grammar most formats share, and think-block replies.

A chat format is everything ftcli knows about how one marker family of chat templates lays out a conversation:

    training   `grammar.spans(render, prefill)`: where each assistant message starts and ends in one render
               (ftcli.data.chat masks those characters); `grammar.prefill(head)`: what the generation prompt
               adds after the assistant header (Qwen3's `<think>\\n`), None when the head is not this format's
    inference  `end_of_turn` and `stop_tokens` (where a reply ends), `replies` (how a reply splits into
               reasoning and answer, as it streams and when done), `tool_call_parsers` (the calls a reply
               holds), `reasoning_efforts` (the values a template that reads `reasoning_effort` takes)

Pure string code: no torch, no transformers (ftcli.data and ftcli.inference both import it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# (calls as [{"name", "arguments"}], the text without them) of a decoded reply, special tokens kept
ToolCallParser = Callable[[str], tuple[list[dict[str, Any]], str]]


class Grammar(Protocol):
    name: str
    markers: tuple[str, ...]  # marker strings message text must not fake (swapped for placeholders while parsed)

    def spans(self, text: str, prefill: str) -> list[tuple[int, int]]: ...

    def prefill(self, head: str) -> str | None: ...


@dataclass(frozen=True)
class Replies:
    """How a generated reply splits into reasoning and answer. `kind(prompt_tail)` names the reply's structure
    from the end of its prompt (`reply_kind`), and the other functions take that kind back."""

    kinds: tuple[str, ...]  # the kinds `kind` returns
    kind: Callable[[str], str]  # the decoded tail of the prompt -> a kind
    # (raw, kind, clean: strips special tokens and whitespace) -> (reasoning or None, answer)
    split: Callable[[str, str, Callable[[str], str]], tuple[str | None, str]]
    answered: Callable[[str], bool]  # the raw text so far has reached the answer
    settled: Callable[[str], str]  # the raw text without a header whose meaning may still change as tokens arrive


@dataclass(frozen=True)
class ChatFormat:
    name: str  # registry key (ftcli.chat_formats.CHAT_FORMATS); Family.chat_format
    title: str  # as people write it, for messages
    detect: tuple[str, ...]  # strings every template of the format writes; the format naming the most of them wins
    grammar: Grammar  # where assistant messages start and end in a render (training masks)
    end_of_turn: str  # the token that ends a final assistant turn (the shipped tokenizers' eos)
    replies: Replies  # how a reply splits into reasoning and answer
    tool_call_parsers: tuple[ToolCallParser, ...]  # in order; each takes its calls out of the text it leaves
    reasoning: str  # where reasoning goes, in words
    tool_calls: str  # how tool calls are written, in words
    stop_tokens: tuple[str, ...] = ()  # more tokens ending a reply where the template writes them (harmony's <|call|>)
    call_marker: str | None = None  # written once per rendered tool call: calls the template leaves out are counted
    reasoning_efforts: tuple[str, ...] | None = None  # `reasoning_effort` values where the template checks none itself
    system_role: bool = True  # the template renders a system message as a turn of its own

    @property
    def markers(self) -> tuple[str, ...]:
        return self.grammar.markers


# ------------------------------------------------------------------------------------- header grammar
@dataclass(frozen=True)
class HeaderGrammar:
    """`<start>role<sep> body <end>`-style templates (ChatML, Llama-3, Gemma). An assistant message trains
    from after its header (and after the generation prompt's prefill, e.g. Qwen3's `<think>\\n`) through
    its end token and the whitespace that follows it up to the next header (Qwen's `\\n`, as the
    published example trains it)."""

    name: str
    header: re.Pattern  # one message header; group "role"
    end: re.Pattern  # end-of-message token(s)
    assistant: frozenset
    markers: tuple[str, ...]

    def spans(self, text: str, prefill: str) -> list[tuple[int, int]]:
        heads = list(self.header.finditer(text))
        out = []
        for k, h in enumerate(heads):
            if h["role"] not in self.assistant:
                continue
            start = h.end()
            if prefill and text.startswith(prefill, start):
                start += len(prefill)
            nxt = heads[k + 1].start() if k + 1 < len(heads) else len(text)
            ends = list(self.end.finditer(text, start, nxt))
            end = nxt
            if ends and text[ends[-1].end() : nxt].strip():
                end = ends[-1].end()  # something other than whitespace follows the end token: not the turn's
            out.append((start, max(start, end)))
        return out

    def prefill(self, head: str) -> str | None:
        m = self.header.match(head)
        if m is None or m["role"] not in self.assistant:
            return None
        return head[m.end() :]


def header_grammar(name: str, start: str, sep: str, end: str, assistant: tuple[str, ...] = ("assistant",),
                   markers: tuple[str, ...] = ()) -> HeaderGrammar:
    """The grammar of `start`role`sep` ... `end` messages; `sep` and `end` are regular expressions, `markers`
    the template's marker strings (`start` is always one)."""
    return HeaderGrammar(
        name,
        re.compile(re.escape(start) + r"(?P<role>[^\n<>|]*)" + sep),
        re.compile(end),
        frozenset(assistant),
        (start, *(m for m in markers if m != start)),
    )


# ---------------------------------------------------------------------------------------- think blocks
def _think_kind(prompt_tail: str) -> str:
    """'think' where the generation prompt opened a <think> block (Qwen3.x: the reply is reasoning until
    </think>), else 'plain'."""
    return "think" if prompt_tail.rstrip().endswith("<think>") else "plain"


def _think_split(raw: str, kind: str, clean: Callable[[str], str]) -> tuple[str | None, str]:
    """think: the prompt opened <think>, so the text before </think> (all of it while unclosed) is reasoning;
    plain: a <think>...</think> block the model opened itself is reasoning, the rest the answer."""
    if kind == "think" or "</think>" in raw:
        before, closed, after = raw.partition("</think>")
        if kind == "plain" or closed:
            return clean(before.replace("<think>", "")), clean(after)
        return clean(before), ""
    return None, clean(raw)


def _think_answered(raw: str) -> bool:
    return "</think>" in raw


def _as_is(raw: str) -> str:
    return raw


THINK_BLOCKS = Replies(kinds=("think", "plain"), kind=_think_kind, split=_think_split, answered=_think_answered,
                       settled=_as_is)
EMPTY_THINK = re.compile(r"^\s*(?:<think>)?\s*</think>\s*")  # Qwen's `\n</think>\n\n` after the prompt's `<think>\n`


# ---------------------------------------------------------------------------------------- tool calls
def json_or_text(text: str) -> Any:
    """A tool-call value: JSON where it parses as JSON (templates write non-strings with `tojson`), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text
