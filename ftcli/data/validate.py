"""Row validation: every row becomes a conversation or a (reason, detail) the pipeline counts.

Reasons are short stable strings (they are the keys of `DataStats.skipped`); the detail says what exactly
was wrong and only appears in strict mode's error message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRow(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def as_bad_row(e: Exception) -> BadRow:
    """What encoding a row raised, as the BadRow the pipeline counts: a BadRow as it is, anything else (a
    template's raise_exception, a one-line UserError, odd field types) a "template error" with its first line."""
    if isinstance(e, BadRow):
        return e
    return BadRow("template error", (str(e).strip() or type(e).__name__).splitlines()[0])


# Turns dropped from a row that is otherwise kept (the keys of `DataStats.dropped_turns`).
TRAILING = "trailing user/tool turn"  # nothing answers it: no response to train on
EMPTY_ASSISTANT = "empty assistant turn"  # no content, reasoning or tool call: nothing to learn from
CALL_NOT_RENDERED = "tool call the template does not render"  # gpt-oss: one call per message, the first


@dataclass
class Conversation:
    """A valid row. `messages` for chat rows; `prompt`/`completion` strings for plain-text rows."""

    messages: list[dict] | None = None
    first_trained: int = 0  # messages before this index never get loss (a conversational prompt)
    prompt: str | None = None
    completion: str | None = None
    tools: list[dict] | None = None  # function schemas, passed to the template as `tools=`
    dropped: dict[str, int] = field(default_factory=dict)  # turns dropped from the row, by reason
    plain: bool = False  # a `text` row: no template, every token trained (continued pretraining)


def content_text(parts: list) -> str:
    """A list-of-parts content as one string (text parts joined as the templates join them)."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRow("non-text content part", f"a content part of type {kind!r}; only text parts are trained")
    return "".join(texts)


def _content(m: dict, i: int) -> dict:
    """The message with its content checked: a string, a list of text parts, or (tool results) JSON."""
    role, content = m["role"], m.get("content")
    if content is None:
        if role == "assistant":  # a tool call or reasoning only, or an empty turn (dropped by the caller)
            return m
        raise BadRow("missing content", f"message {i} ({role}) has no content")
    if isinstance(content, list) and all(isinstance(p, (dict, str)) for p in content):
        return {**m, "content": content_text(content)}
    if role == "tool" and isinstance(content, (dict, list, int, float, bool)):
        return {**m, "content": json.dumps(content, ensure_ascii=False)}
    if not isinstance(content, str):
        raise BadRow("content not a string", f"message {i} ({role}) content is {type(content).__name__}")
    return m


def tool_calls(calls: Any, i: int) -> list[dict]:
    """A message's `tool_calls`, checked, with each call's `arguments` the object every chat template
    iterates over: OpenAI's wire format sends it as a JSON string, which is parsed here, once, for train
    and generate alike. A call is `{"type": "function", "function": {"name", "arguments"}}` or the flat
    `{"name", "arguments"}`; anything else is a BadRow naming the message and the field."""
    if not isinstance(calls, list):
        raise BadRow("invalid tool call", f"message {i} tool_calls is {type(calls).__name__}, not a list")
    out = []
    for j, call in enumerate(calls):
        where = f"message {i} tool_calls[{j}]"
        if not isinstance(call, dict):
            raise BadRow("invalid tool call", f"{where} is {type(call).__name__}, not an object")
        nested = isinstance(call.get("function"), dict)
        fn = call["function"] if nested else call
        field = f"{where}{'.function' if nested else ''}"
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise BadRow("invalid tool call", f"{field}.name is missing")
        args = fn.get("arguments")
        if args is None:
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise BadRow("invalid tool call", f"{field}.arguments is a string that is not JSON") from None
        if not isinstance(args, dict):
            raise BadRow("invalid tool call", f"{field}.arguments is {type(args).__name__}, not a JSON object")
        fn = {**fn, "arguments": args}
        out.append({**call, "function": fn} if nested else fn)
    return out


def normalize_turns(messages: Any) -> list[dict]:
    """The messages of a row as every reader of rows takes them (training's `check_messages`, `generate
    --input`): a list of objects with a known role, system first, content a string (text parts joined,
    a tool result's JSON as text), tool calls checked with their arguments parsed; or BadRow."""
    if isinstance(messages, str) and messages.lstrip().startswith("["):  # CSV / Parquet string columns
        try:
            messages = json.loads(messages)
        except ValueError:
            raise BadRow("messages not a list", "a string that is not a JSON list") from None
    if not isinstance(messages, list):
        raise BadRow("messages not a list", f"got {type(messages).__name__}")
    if not messages:
        raise BadRow("no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRow("message not an object", f"message {i} is {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRow("unknown role", f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if role == "system" and i > 0:
            raise BadRow("system not first", f"system message at position {i}")
        m = _content(m, i)
        if m.get("tool_calls") is not None:
            m = {**m, "tool_calls": tool_calls(m["tool_calls"], i)}
        out.append(m)
    return out


def _reasoning(m: dict) -> bool:
    return any(isinstance(m.get(k), str) and m[k].strip() for k in ("reasoning_content", "thinking", "reasoning"))


def check_messages(messages: Any, first_trained: int = 0) -> Conversation:
    """The trainable part of a conversation, or BadRow. Keeps what can be trained: an assistant turn with
    nothing in it is dropped (the rest of the conversation stays), and so are trailing user/tool turns
    (nothing answers them); both are counted in `Conversation.dropped`."""
    kept, dropped = [], {}
    for i, m in enumerate(normalize_turns(messages)):
        role = m["role"]
        empty = not (m.get("content") or "").strip() and not m.get("tool_calls") and not _reasoning(m)
        if role == "assistant" and empty:
            dropped[EMPTY_ASSISTANT] = dropped.get(EMPTY_ASSISTANT, 0) + 1
            first_trained -= i < first_trained
            continue
        kept.append(m)
    while kept and kept[-1]["role"] != "assistant" and len(kept) > first_trained:
        kept.pop()
        dropped[TRAILING] = dropped.get(TRAILING, 0) + 1
    if not any(m["role"] == "assistant" for m in kept[first_trained:]):
        raise BadRow("no assistant turn", "no assistant message to train on")
    return Conversation(messages=kept, first_trained=first_trained, dropped=dropped)


def _tools(row: dict, tools_field: str | None) -> list[dict] | None:
    tools = row.get(tools_field) if tools_field else None
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise BadRow("invalid tools", f"{tools_field!r} is a string that is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow("invalid tools", f"{tools_field!r} must be a list of function schemas")
    return tools or None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(row: Any) -> str | None:
    """Where a string of `row` (a value or a key, at any depth) holds a lone UTF-16 surrogate (JSON's
    "\\ud800" escape parses to one): no UTF-8 text has it, so no tokenizer can encode it. None when none does."""
    stack: list[tuple[Any, str]] = [(row, "")]
    while stack:  # a loop, not recursion: a row may nest deeper than the interpreter's stack
        value, where = stack.pop()
        if isinstance(value, str):
            found = None if value.isascii() else _SURROGATE.search(value)
            if found:
                return f"{where or 'the row'} holds U+{ord(found.group()):04X}"
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in reversed(list(items)):
            path = f"{where}.{key}" if where else str(key)
            stack.append((item, path))
            if isinstance(key, str):
                stack.append((key, f"a key in {where or 'the row'}"))
    return None


def conversation(
    row: Any, fmt: str, messages_field: str = "messages", tools_field: str | None = "tools"
) -> Conversation:
    """A source row -> Conversation, or BadRow."""
    if not isinstance(row, dict):
        raise BadRow("row not an object", f"got {type(row).__name__}")
    surrogate = _lone_surrogate(row)
    if surrogate:
        raise BadRow("lone surrogate", f"{surrogate}, a lone UTF-16 surrogate that is not valid Unicode text")
    tools = _tools(row, tools_field)
    if fmt == "messages":
        if messages_field not in row:
            raise BadRow("messages missing", f"no {messages_field!r} field (fields: {', '.join(map(str, row))})")
        conv = check_messages(row[messages_field])
        conv.tools = tools
        return conv
    for key in ("prompt", "completion"):
        if row.get(key) is None:
            raise BadRow(f"{key} missing", f"no {key!r} field")
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise BadRow("empty completion")
        return Conversation(prompt=prompt, completion=completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        if not completion:
            raise BadRow("empty completion")
        conv = check_messages(prompt + completion, first_trained=len(prompt))
        conv.tools = tools
        return conv
    raise BadRow(
        "prompt/completion types differ",
        f"prompt is {type(prompt).__name__}, completion is {type(completion).__name__} (both str or both lists)",
    )


def chat_turns(conv: Conversation) -> Conversation:
    """A plain-text prompt/completion pair as the chat it will be asked in: the prompt a user turn, the
    completion the assistant's answer (only the answer trained, unless train_on=all)."""
    messages = [{"role": "user", "content": conv.prompt}, {"role": "assistant", "content": conv.completion}]
    return Conversation(messages=messages, first_trained=1, tools=conv.tools, dropped=dict(conv.dropped))
