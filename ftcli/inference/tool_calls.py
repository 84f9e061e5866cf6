"""Tool calls in a generated reply, parsed into the OpenAI chat shape (`tool_calls` of an assistant message).

transformers 5.24's `tokenizer.parse_response` needs a `response_template` in the tokenizer config, which the
shipped tokenizers (and most hub ones) do not have, so ftcli parses the formats its templates write: each chat
format (ftcli.chat_formats) holds the parsers of its own calls (ChatML's Hermes JSON and Qwen3.5's XML, harmony's
commentary channel). Pure string code: no tokenizer, no torch.
"""

from __future__ import annotations

import json
from typing import Any

from ftcli import chat_formats
from ftcli.chat_formats import ChatFormat


def parse_tool_calls(raw: str, chat_format: ChatFormat | None = None) -> tuple[list[dict[str, Any]], str]:
    """The calls in `raw` (a decoded reply, special tokens kept) as [{"name", "arguments": dict}], and `raw`
    without them: by `chat_format`'s parsers, or by those of every registered format where it is None."""
    calls: list[dict[str, Any]] = []
    rest = raw
    for parse in chat_formats.tool_call_parsers(chat_format):
        found, rest = parse(rest)
        calls += found
    return calls, rest


def openai_tool_calls(calls: list[dict[str, Any]], like: list[dict] | None = None) -> list[dict[str, Any]]:
    """`calls` in the OpenAI chat shape, `{"id", "type": "function", "function": {"name", "arguments"}}`, with
    `arguments` a JSON string as OpenAI sends it, or an object where the conversation's own tool calls
    (`like`: its messages) give theirs as objects."""
    as_object = any(isinstance((c.get("function") or c).get("arguments"), dict)
                    for m in like or [] for c in (m.get("tool_calls") or []) if isinstance(c, dict))
    return [{"id": f"call_{i}", "type": "function",
             "function": {"name": c["name"],
                          "arguments": c["arguments"] if as_object else json.dumps(c["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(calls)]
