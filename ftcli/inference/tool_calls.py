"""Tool calls in a generated reply, parsed into the OpenAI chat shape (`tool_calls` of an assistant message).

transformers 5.24's `tokenizer.parse_response` needs a `response_template` in the tokenizer config, which the
shipped tokenizers (and most hub ones) do not have, so ftcli parses the formats its templates write:

    Qwen3.5 / 3.8 (XML)   <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
    Hermes JSON (Qwen2.5 / 3)   <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>
    harmony (gpt-oss)     [<|start|>assistant] to=functions.NAME<|channel|>commentary json<|message|>{...}[<|call|>]

A parameter value is JSON where it parses as JSON (the Qwen template writes non-strings with `tojson`), else
the string itself. Pure string code: no tokenizer, no torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

_XML_CALL = re.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>\s*</tool_call>", re.S)
_XML_PARAM = re.compile(r"<parameter=(?P<name>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>", re.S)
_JSON_CALL = re.compile(r"<tool_call>\s*(?P<json>\{.*?\})\s*</tool_call>", re.S)
_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>assistant)?\s*to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>commentary[^<]*"
    r"(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<args>.*?)(?=<\|call\|>|<\|end\|>|<\|start\|>|$)",
    re.S,
)


def parse_tool_calls(raw: str) -> tuple[list[dict[str, Any]], str]:
    """The calls in `raw` (a decoded reply, special tokens kept) as [{"name", "arguments": dict}], and `raw`
    without them."""
    calls: list[dict[str, Any]] = []

    def xml(m: re.Match) -> str:
        args = {p["name"].strip(): _value(p["value"]) for p in _XML_PARAM.finditer(m["body"])}
        calls.append({"name": m["name"].strip(), "arguments": args})
        return ""

    def hermes(m: re.Match) -> str:
        try:
            call = json.loads(m["json"])
        except ValueError:
            return m[0]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return m[0]
        args = call.get("arguments", call.get("parameters", {}))
        calls.append({"name": call["name"], "arguments": _value(args) if isinstance(args, str) else args})
        return ""

    def harmony(m: re.Match) -> str:
        calls.append({"name": m["name"], "arguments": _value(m["args"].strip())})
        return ""

    rest = _XML_CALL.sub(xml, raw)
    rest = _JSON_CALL.sub(hermes, rest)
    rest = _HARMONY_CALL.sub(harmony, rest)
    return calls, rest


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


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
