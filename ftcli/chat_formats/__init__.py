"""The chat formats: `CHAT_FORMATS` (name -> ChatFormat) and `detect(template)`. See ftcli/chat_formats/base.py.

One module per format holds all ftcli knows of it: its training grammar (ftcli.data.chat masks by it), how a
reply splits into reasoning and answer, its tool calls and its stop tokens (ftcli.inference). A model family names
its format (`Family.chat_format`); a template is matched to a format by the marker strings it writes.

Adding a format: one module here with its `FORMAT = ChatFormat(...)` and one line in `CHAT_FORMATS`. A template that
writes a registered format's markers but does not parse as that format is refused with one line (ftcli.data.chat),
never trained by a guess; templates of no registered format's markers are measured by re-rendering turns.
"""

from __future__ import annotations

from ftcli.chat_formats import chatml, gemma, harmony, llama3
from ftcli.chat_formats.base import THINK_BLOCKS, ChatFormat, Replies
from ftcli.config.errors import UserError

# On a tie of marker counts the earlier format wins.
CHAT_FORMATS: dict[str, ChatFormat] = {f.name: f for f in (chatml.FORMAT, llama3.FORMAT, gemma.FORMAT, harmony.FORMAT)}


def detect(template: str | None) -> ChatFormat | None:
    """The format whose marker strings the template writes (the one naming the most of them), or None."""
    found = [f for f in CHAT_FORMATS.values() if template and all(s in template for s in f.detect)]
    return max(found, key=lambda f: len(f.detect), default=None)


def format_named(name: str) -> ChatFormat:
    """The registered format `name`; a one-line UserError naming the known ones when there is none."""
    fmt = CHAT_FORMATS.get(name)
    if fmt is None:
        raise UserError(f"ftcli has no chat format {name!r} (known: {', '.join(sorted(CHAT_FORMATS))}); add a module "
                        "under ftcli/chat_formats/ and a line in CHAT_FORMATS")
    return fmt


def replies_of_kind(kind: str) -> Replies:
    """The reply style that splits replies of `kind` (`Replies.kinds`); think blocks for any other kind."""
    return next((f.replies for f in CHAT_FORMATS.values() if kind in f.replies.kinds), THINK_BLOCKS)


def tool_call_parsers(fmt: ChatFormat | None) -> tuple:
    """The parsers of `fmt`'s tool calls; of every registered format (in registry order) where it is None."""
    if fmt is not None:
        return fmt.tool_call_parsers
    parsers: list = []
    for f in CHAT_FORMATS.values():
        parsers += [p for p in f.tool_call_parsers if p not in parsers]
    return tuple(parsers)


__all__ = ["CHAT_FORMATS", "ChatFormat", "Replies", "detect", "format_named", "replies_of_kind", "tool_call_parsers"]
