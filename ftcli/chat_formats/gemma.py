"""Gemma turns (Gemma 1-3 templates):

    <start_of_turn>user\\nHi<end_of_turn>\\n<start_of_turn>model\\nHello!<end_of_turn>\\n

The assistant role is written `model`; text is trimmed by the template. No system role: Gemma 3's template folds a
system message into the first user turn, and roles must alternate user/model (the template raises otherwise). No
reasoning, no tool calls (tool messages are refused by its role check).
"""

from __future__ import annotations

from ftcli.chat_formats.base import THINK_BLOCKS, ChatFormat, header_grammar

FORMAT = ChatFormat(
    name="gemma",
    title="Gemma turns",
    detect=("<start_of_turn>",),
    grammar=header_grammar("gemma", "<start_of_turn>", r"\n", r"<end_of_turn>", assistant=("model", "assistant"),
                           markers=("<end_of_turn>",)),
    end_of_turn="<end_of_turn>",
    replies=THINK_BLOCKS,  # none in the template: a <think> block the model opens itself is still split off
    tool_call_parsers=(),
    reasoning="none",
    tool_calls="none in the template (tool messages are refused by its role check)",
    system_role=False,
)
