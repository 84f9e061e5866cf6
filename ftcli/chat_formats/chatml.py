"""ChatML with think blocks, as Qwen 2.5-3.8 write it (also LFM2 and Nemotron 3 templates):

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n<think>\\n...\\n</think>\\n\\nHello!<|im_end|>\\n

Reasoning is a `<think>` block (from `reasoning_content`); the Qwen3/3.5 templates drop it from turns before the last
user turn, Qwen3.8 keeps it. The generation prompt may prefill `<think>\\n` (then the reply is reasoning until
`</think>`). Tool calls sit in the assistant turn, as Hermes JSON (Qwen2.5 / 3) or as XML (Qwen3.5 / 3.8):

    <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>
    <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

and their results come back as `<tool_response>` in a user turn.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ftcli.chat_formats.base import THINK_BLOCKS, ChatFormat, header_grammar, json_or_text

_XML_CALL = re.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>\s*</tool_call>", re.S)
_XML_PARAM = re.compile(r"<parameter=(?P<name>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>", re.S)
_JSON_CALL = re.compile(r"<tool_call>\s*(?P<json>\{.*?\})\s*</tool_call>", re.S)


def parse_xml_calls(raw: str) -> tuple[list[dict[str, Any]], str]:
    calls: list[dict[str, Any]] = []

    def take(m: re.Match) -> str:
        args = {p["name"].strip(): json_or_text(p["value"]) for p in _XML_PARAM.finditer(m["body"])}
        calls.append({"name": m["name"].strip(), "arguments": args})
        return ""

    return calls, _XML_CALL.sub(take, raw)


def parse_hermes_calls(raw: str) -> tuple[list[dict[str, Any]], str]:
    calls: list[dict[str, Any]] = []

    def take(m: re.Match) -> str:
        try:
            call = json.loads(m["json"])
        except ValueError:
            return m[0]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return m[0]
        args = call.get("arguments", call.get("parameters", {}))
        calls.append({"name": call["name"], "arguments": json_or_text(args) if isinstance(args, str) else args})
        return ""

    return calls, _JSON_CALL.sub(take, raw)


FORMAT = ChatFormat(
    name="chatml",
    title="ChatML",
    detect=("<|im_start|>",),
    grammar=header_grammar("chatml", "<|im_start|>", r"\n", r"<\|im_end\|>", markers=("<|im_end|>",)),
    end_of_turn="<|im_end|>",
    replies=THINK_BLOCKS,
    tool_call_parsers=(parse_xml_calls, parse_hermes_calls),
    reasoning="<think> blocks from reasoning_content; Qwen3/3.5 templates drop those of turns before the last user "
              "turn (Qwen3.8 keeps them)",
    tool_calls="<tool_call> in the assistant turn (Hermes JSON on Qwen2.5/3, XML function/parameter on Qwen3.5/3.8); "
               "results as <tool_response> in a user turn",
)
