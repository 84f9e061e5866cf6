"""harmony, gpt-oss's format:

    <|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>final<|message|>Hello!<|return|>

A message is `<|start|>role[ to=recipient]<|channel|>channel[ type]<|message|>body`, closed by `<|end|>`, `<|call|>`
or `<|return|>`. Reasoning is the analysis channel (the template drops earlier turns' analysis), the answer the final
channel; the last final answer ends with `<|return|>`, earlier ones are stored with `<|end|>`. A tool call is a
commentary message `to=functions.NAME`, ended by `<|call|>` (so `<|call|>` ends a reply too); its result comes back as
a tool message. The template writes any `reasoning_effort` it is given; harmony's values are low, medium, high.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ftcli.chat_formats.base import ChatFormat, Replies, json_or_text

_PROMPT = "<|start|>assistant"  # the generation prompt


class HarmonyGrammar:
    """One assistant *generation* can hold several messages: after an analysis (or commentary preamble)
    message's `<|end|>` the model itself writes the next `<|start|>assistant`, so that header is trained; the
    header after a user/tool message is the generation prompt, and so is the one after a final answer. An earlier
    final answer is stored with `<|end|>` where the model emitted `<|return|>`: that `<|end|>` is history
    formatting, not trained."""

    name = "harmony"
    markers = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>")
    _message = re.compile(r"<\|start\|>(?P<head>.*?)<\|message\|>.*?(?P<end><\|end\|>|<\|call\|>|<\|return\|>)", re.S)
    _channel = re.compile(r"<\|channel\|>(\w+)")

    def spans(self, text: str, prefill: str = "") -> list[tuple[int, int]]:
        out: list[list[int]] = []
        prev_open = False  # the previous message was the assistant's and its generation goes on
        for m in self._message.finditer(text):
            head = m["head"]
            role = re.split(r"[ <]", head, maxsplit=1)[0]
            channel = (self._channel.search(head) or [None, ""])[1]
            if role != "assistant":
                prev_open = False
                continue
            start = m.start() if prev_open else m.start() + len(_PROMPT)
            end = m.start("end") if (m["end"] == "<|end|>" and channel == "final") else m.end()
            if prev_open and out and out[-1][1] == m.start():
                out[-1][1] = end  # one generation: analysis<|end|><|start|>assistant...
            else:
                out.append([start, end])
            prev_open = m["end"] == "<|end|>" and channel != "final"
        return [(s, e) for s, e in out]

    def prefill(self, head: str) -> str | None:
        return "" if head == _PROMPT else None


# ------------------------------------------------------------------------------------------ replies
_MESSAGE = re.compile(
    r"<\|channel\|>(?P<channel>[^<]*?)(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<body>.*?)"
    r"(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)",
    re.S,
)


def _split(raw: str, kind: str, clean: Callable[[str], str]) -> tuple[str | None, str]:
    """Analysis (and commentary) channels are reasoning, the final channel is the answer, and text outside any
    channel (an untrained model) is all answer."""
    messages = [(m["channel"].split()[0] if m["channel"].split() else "", m["body"]) for m in _MESSAGE.finditer(raw)]
    if not messages:
        return None, clean(raw)
    thoughts = [clean(b) for c, b in messages if c != "final"]
    answer = "\n".join(clean(b) for c, b in messages if c == "final")
    return ("\n".join(thoughts) if thoughts else None), answer


def _settled(raw: str) -> str:
    """Without a header (`<|start|>assistant<|channel|>final`) whose `<|message|>` has not come yet."""
    header = max(raw.rfind("<|start|>"), raw.rfind("<|channel|>"))
    if header >= 0 and "<|message|>" not in raw[header:]:
        return raw[:header]
    return raw


def _kind(prompt_tail: str) -> str:
    return "harmony"


def _answered(raw: str) -> bool:
    return "<|channel|>final" in raw


REPLIES = Replies(kinds=("harmony",), kind=_kind, split=_split, answered=_answered, settled=_settled)

# ---------------------------------------------------------------------------------------- tool calls
_CALL = re.compile(
    r"(?:<\|start\|>assistant)?\s*to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>commentary[^<]*"
    r"(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<args>.*?)(?=<\|call\|>|<\|end\|>|<\|start\|>|$)",
    re.S,
)


def parse_calls(raw: str) -> tuple[list[dict[str, Any]], str]:
    """`[<|start|>assistant] to=functions.NAME<|channel|>commentary json<|message|>{...}[<|call|>]`"""
    calls: list[dict[str, Any]] = []

    def take(m: re.Match) -> str:
        calls.append({"name": m["name"], "arguments": json_or_text(m["args"].strip())})
        return ""

    return calls, _CALL.sub(take, raw)


FORMAT = ChatFormat(
    name="harmony",
    title="harmony",
    detect=("<|start|>", "<|channel|>"),
    grammar=HarmonyGrammar(),
    end_of_turn="<|return|>",  # the last final answer; earlier ones are stored with <|end|>
    replies=REPLIES,
    tool_call_parsers=(parse_calls,),
    reasoning="analysis channel; the template drops earlier turns' analysis",
    tool_calls="commentary channel to=functions.NAME, ended by <|call|>; results as a tool message",
    stop_tokens=("<|call|>",),  # not <|end|>: it closes the analysis message, after which the model goes on
    call_marker="<|call|>",
    reasoning_efforts=("low", "medium", "high"),
)
