"""Row validation: every row becomes a conversation or a (reason, detail) the pipeline counts.

Reasons are short stable strings (they are the keys of `DataStats.skipped`); the detail says what exactly
was wrong and only appears in strict mode's error message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRow(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclass
class Conversation:
    """A valid row. `messages` for chat rows; `prompt`/`completion` strings for plain-text rows."""

    messages: list[dict] | None = None
    first_trained: int = 0  # messages before this index never get loss (a conversational prompt)
    prompt: str | None = None
    completion: str | None = None


def check_messages(messages: Any) -> None:
    """Raise BadRow unless `messages` is a trainable conversation."""
    if not isinstance(messages, list):
        raise BadRow("messages not a list", f"got {type(messages).__name__}")
    if not messages:
        raise BadRow("no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRow("message not an object", f"message {i} is {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRow("unknown role", f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is None:
            if role == "assistant" and m.get("tool_calls"):
                continue
            raise BadRow("missing content", f"message {i} ({role}) has no content")
        if not isinstance(content, str):
            raise BadRow("content not a string", f"message {i} ({role}) content is {type(content).__name__}")
        if not content.strip() and not (role == "assistant" and m.get("tool_calls")):
            raise BadRow("empty content", f"message {i} ({role}) is empty")
        if role == "system" and i > 0:
            raise BadRow("system not first", f"system message at position {i}")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn")
    last = messages[-1]["role"]
    if last != "assistant":
        raise BadRow(f"ends on a {last} turn", "the last message gets no response to train on")


def conversation(row: Any, fmt: str, messages_field: str = "messages") -> Conversation:
    """A source row -> Conversation, or BadRow."""
    if not isinstance(row, dict):
        raise BadRow("row not an object", f"got {type(row).__name__}")
    if fmt == "messages":
        if messages_field not in row:
            raise BadRow("messages missing", f"no {messages_field!r} field (fields: {', '.join(map(str, row))})")
        messages = row[messages_field]
        check_messages(messages)
        return Conversation(messages=messages)
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
        check_messages(prompt + completion)
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
            raise BadRow("no assistant turn", "the completion has no assistant message")
        return Conversation(messages=prompt + completion, first_trained=len(prompt))
    raise BadRow(
        "prompt/completion types differ",
        f"prompt is {type(prompt).__name__}, completion is {type(completion).__name__} (both str or both lists)",
    )
