"""Llama 3.x headers (the 3.1 / 3.2 / 3.3 templates):

    <|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\nHello!<|eot_id|>     (no newline between turns)

Every turn ends with `<|eot_id|>` (`<|eom_id|>` where a built-in tool call waits for its result); the template writes a
dated system header on every conversation, also without a system message. No reasoning. Tool calls are JSON
`{"name": ..., "parameters": ...}` in the assistant turn, results in an `ipython` turn; the 3.1 template puts the tool
list in the first user turn. ftcli parses no Llama tool calls out of replies yet.
"""

from __future__ import annotations

from ftcli.chat_formats.base import THINK_BLOCKS, ChatFormat, header_grammar

FORMAT = ChatFormat(
    name="llama3",
    title="Llama 3 headers",
    detect=("<|start_header_id|>",),
    grammar=header_grammar("llama3", "<|start_header_id|>", r"<\|end_header_id\|>\n\n", r"<\|eot_id\|>|<\|eom_id\|>",
                           markers=("<|end_header_id|>", "<|eot_id|>", "<|eom_id|>")),
    end_of_turn="<|eot_id|>",
    replies=THINK_BLOCKS,  # none in the template: a <think> block the model opens itself is still split off
    tool_call_parsers=(),
    reasoning="none",
    tool_calls="JSON {name, parameters} in the assistant turn (ipython role for results); the 3.1 template puts "
               "the tool list in the first user turn",
)
