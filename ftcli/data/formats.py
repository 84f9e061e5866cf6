"""Row formats by name (`data.format`), and `auto`: which one a source's rows are in.

Every format becomes the same `validate.Conversation` before the chat template sees it, so the masks
and the counting rules are those of `messages` rows (tests/unit/data/test_data_masks.py runs its oracle on rows of
each format):

    messages           {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
                       (`data.messages_field` names the list; OpenAI / TRL conversational rows)
    sharegpt           {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}
                       from: human/user -> user, gpt/assistant/model -> assistant, system -> system,
                       function_call -> an assistant tool call (value: {"name", "arguments"} JSON, or a list),
                       tool/observation -> tool; a top-level `system` string becomes the system turn
                       (axolotl's and LLaMA-Factory's ShareGPT); the list is under `data.messages_field`,
                       else `conversations`, else `messages`
    alpaca             {"instruction": ..., "input": ..., "output": ...} (+ "system", and "history":
                       [[instruction, output], ...] earlier turns): system, user = instruction + "\\n" + input
                       (input left out when empty), assistant = output (LLaMA-Factory's Alpaca)
    prompt_completion  {"prompt": ..., "completion": ...}: strings (plain text, no template) or message lists
    text               {"text": ...}: plain text, every token trained (continued pretraining), no template
    auto               the format of the first `DETECT_ROWS` rows of each file (the most common of them), said
                       on screen with the reason (`pack-preview`, the train log, run.json); where those rows
                       are of several formats (a mixed file, a folder of files in different formats), every
                       row is read in its own format

Pure data code: no torch.distributed, MLflow or CLI imports.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from ftcli.data import sources
from ftcli.data.validate import BadRow, Conversation, _tools, check_messages, normalize_turns
from ftcli.data.validate import conversation as messages_conversation

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")
TEMPLATED = ("messages", "sharegpt", "alpaca")  # formats whose rows are rendered with the chat template
DETECT_ROWS = 32  # rows `auto` looks at
NAMES = {"messages": "OpenAI messages", "sharegpt": "ShareGPT", "alpaca": "Alpaca",
         "prompt_completion": "prompt/completion", "text": "plain text"}

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "observation": "tool",
    "function_call": "assistant",  # its value is the call: becomes the turn's tool_calls
}


@dataclass(frozen=True)
class Detected:
    """What `auto` chose for a source: the format, the field holding its turns, and why."""

    format: str  # "auto" when the rows disagree: each row is then read in its own format
    messages_field: str | None
    why: str
    matched: int = 0  # rows of that format among those looked at (0: none matched any format)
    seen: tuple[tuple[str, int], ...] = ()  # (format, rows) of every format among those looked at


# --------------------------------------------------------------------------------------- one row
def _turn_list(row: dict, messages_field: str | None, key: str) -> tuple[str, list] | None:
    """(field, turns) of the first candidate field holding a non-empty list of objects with `key`."""
    for name in dict.fromkeys(f for f in (messages_field, "conversations", "messages") if f):
        turns = row.get(name)
        if isinstance(turns, list) and turns and isinstance(turns[0], dict) and key in turns[0]:
            return name, turns
    return None


def row_format(row: Any, messages_field: str | None = "messages") -> tuple[str, str | None, str] | None:
    """(format, field of the turns, what gave it away) of one row by its shape, or None."""
    if not isinstance(row, dict):
        return None
    found = _turn_list(row, messages_field, "role")
    if found:
        return "messages", found[0], f"a {found[0]!r} list of role/content turns"
    found = _turn_list(row, messages_field, "from")
    if found:
        return "sharegpt", found[0], f"a {found[0]!r} list of from/value turns"
    if "instruction" in row and "output" in row:
        return "alpaca", None, "instruction/output fields"
    if "prompt" in row and "completion" in row:
        return "prompt_completion", None, "prompt/completion fields"
    if isinstance(row.get("text"), str):
        return "text", None, "a 'text' field"
    return None


def _text(value: Any, what: str) -> str | list:
    """A turn's value as message content: a string, or a list of text parts (check_messages joins them)."""
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise BadRow("content not a string", f"{what} is {type(value).__name__}")
    return value


def _tool_calls(value: Any, i: int) -> list[dict]:
    """A ShareGPT function_call value -> OpenAI tool_calls: {"name", "arguments"} (JSON text or an object),
    or a list of them (parallel calls)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRow("invalid tool call", f"turn {i} (function_call) is not JSON") from None
    calls = value if isinstance(value, list) else [value]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise BadRow("invalid tool call", f"turn {i} (function_call) needs a 'name' (and 'arguments')")
        out.append({"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}})
    return out


def sharegpt_messages(row: dict, messages_field: str | None = None) -> list[dict]:
    """A ShareGPT row's turns as messages (roles mapped, function_call as tool_calls), or BadRow."""
    found = _turn_list(row, messages_field, "from")
    if found is None:
        fields = [f for f in dict.fromkeys((messages_field, "conversations", "messages")) if f]
        if any(isinstance(row.get(f), list) and not row[f] for f in fields):
            raise BadRow("no messages")
        raise BadRow("conversations missing", f"no {' / '.join(map(repr, fields))} list of from/value turns "
                                              f"(fields: {', '.join(map(str, row))})")
    messages = []
    system = row.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(found[1]):
        if not isinstance(turn, dict):
            raise BadRow("message not an object", f"turn {i} is {type(turn).__name__}")
        source = turn.get("from")
        role = SHAREGPT_ROLES.get(source.lower()) if isinstance(source, str) else None
        if role is None:
            raise BadRow("unknown role", f"turn {i} is from {source!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
        if "value" not in turn:
            raise BadRow("missing content", f"turn {i} ({source}) has no 'value'")
        if source.lower() == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": _tool_calls(turn["value"], i)})
        elif role == "system" and messages and messages[0]["role"] == "system" and i == 0:
            messages[0] = {"role": "system", "content": _text(turn["value"], f"turn {i}")}  # the turn wins
        else:
            messages.append({"role": role, "content": _text(turn["value"], f"turn {i} ({source})")})
    return messages


def alpaca_messages(row: dict) -> list[dict]:
    """An Alpaca row as messages: system, history pairs, then instruction (+ input) and output; or BadRow."""
    for key in ("instruction", "output"):
        if row.get(key) is None:
            raise BadRow(f"{key} missing", f"no {key!r} field (fields: {', '.join(map(str, row))})")
    for key in ("instruction", "input", "output", "system"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise BadRow("content not a string", f"{key!r} is {type(row[key]).__name__}")
    messages = []
    if (row.get("system") or "").strip():
        messages.append({"role": "system", "content": row["system"]})
    history = row.get("history") or []
    if not isinstance(history, list):
        raise BadRow("invalid history", f"'history' is {type(history).__name__}; expected [[instruction, output], ...]")
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise BadRow("invalid history", f"history item {i} is not an [instruction, output] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    query = row["instruction"] + ("\n" + row["input"] if (row.get("input") or "") else "")
    return [*messages, {"role": "user", "content": query}, {"role": "assistant", "content": row["output"]}]


def conversation(row: Any, fmt: str, messages_field: str | None = "messages",
                 tools_field: str | None = "tools") -> Conversation:
    """A source row in format `fmt` -> Conversation, or BadRow. `auto` decides per row (the pipeline decides
    once per source, `detect`, and passes the result)."""
    if fmt == "auto":
        if not isinstance(row, dict):
            raise BadRow("row not an object", f"got {type(row).__name__}")
        found = row_format(row, messages_field)
        if found is None:
            raise BadRow("unknown format", f"fields {', '.join(map(str, row))} match no format ({', '.join(FORMATS[1:])})")
        fmt, messages_field = found[0], found[1] or messages_field
    if fmt in ("messages", "prompt_completion"):
        return messages_conversation(row, fmt, messages_field or "messages", tools_field)
    if not isinstance(row, dict):
        raise BadRow("row not an object", f"got {type(row).__name__}")
    if fmt == "text":
        text = row.get("text")
        if text is None:
            raise BadRow("text missing", f"no 'text' field (fields: {', '.join(map(str, row))})")
        if not isinstance(text, str):
            raise BadRow("content not a string", f"'text' is {type(text).__name__}")
        if not text.strip():
            raise BadRow("empty text")
        return Conversation(prompt="", completion=text, plain=True)
    if fmt == "sharegpt":
        messages = sharegpt_messages(row, messages_field)
    elif fmt == "alpaca":
        messages = alpaca_messages(row)
    else:
        raise BadRow("unknown format", f"data.format {fmt!r}; expected one of {', '.join(FORMATS)}")
    tools = _tools(row, tools_field)
    conv = check_messages(messages)
    conv.tools = tools
    return conv


def row_messages(row: Any, messages_field: str | None = "messages") -> list[dict]:
    """Every turn a row holds, whatever its format (told by its shape, `row_format`), normalized as training
    reads them (`validate.normalize_turns`: tool-call arguments parsed, text parts joined), nothing
    dropped: what `generate --input` reads. A prompt/completion row's completion and an Alpaca row's
    output are its last (assistant) turn. BadRow for a row of no known shape."""
    if not isinstance(row, dict):
        raise BadRow("row not an object", f"got {type(row).__name__}")
    found = row_format(row, messages_field)
    if found is None and messages_field in row:  # a messages field of the wrong shape: say what is wrong with it
        return normalize_turns(row[messages_field])
    if found is None or found[0] == "text":
        raise BadRow("unknown format", f"fields {', '.join(map(str, row)) or 'none'} match no chat format "
                                       f"(messages, sharegpt, alpaca, prompt_completion)")
    fmt, field = found[0], found[1]
    if fmt == "messages":
        return normalize_turns(row[field])
    if fmt == "sharegpt":
        return normalize_turns(sharegpt_messages(row, field))
    if fmt == "alpaca":
        return normalize_turns(alpaca_messages(row))
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if isinstance(prompt, list) and isinstance(completion, list):
        return normalize_turns(prompt + completion)
    raise BadRow("prompt/completion types differ", f"prompt is {type(prompt).__name__}, completion is "
                                                   f"{type(completion).__name__} (both str or both lists)")


# ------------------------------------------------------------------------------------------ a source
def detect(rows: Iterable[Any], messages_field: str | None = "messages", limit: int = DETECT_ROWS) -> Detected:
    """The format of most of the first `limit` rows (the first one seen wins a tie), and why. Rows of
    no known shape leave `messages`, whose skip reasons then name the fields the rows have."""
    seen: Counter = Counter()
    first: dict[tuple, str] = {}
    looked = 0
    fields: list[str] = []
    for row in rows:
        if looked >= limit:
            break
        looked += 1
        found = row_format(row, messages_field)
        if found is None:
            if isinstance(row, dict) and not fields:
                fields = list(map(str, row))
            continue
        seen[found[:2]] += 1
        first.setdefault(found[:2], found[2])
    if not seen:
        what = f"fields {', '.join(fields)}" if fields else "no readable row"
        return Detected("messages", messages_field, f"auto: none of the first {looked} rows matches a format "
                                                    f"({what}); read as messages")
    best = max(seen, key=lambda k: (seen[k], -list(first).index(k)))
    by_format: Counter = Counter()
    for (fmt, _), n in seen.items():
        by_format[fmt] += n
    return Detected(best[0], best[1] or messages_field,
                    f"auto: {seen[best]} of the first {looked} rows have {first[best]}", seen[best],
                    tuple(by_format.items()))


def shapes(seen: Iterable[tuple[str, int]]) -> str:
    """`(format, rows)` pairs as `30 OpenAI messages, 30 ShareGPT` (most first)."""
    return ", ".join(f"{n} {NAMES[fmt]}" for fmt, n in sorted(seen, key=lambda kv: -kv[1]))


def resolve(src) -> tuple[Any, Detected | None]:
    """A source (`SourceConfig`) with `format: auto` replaced by the detected format and its field, and what
    was detected (None when the recipe named the format, or for synthetic data). The first DETECT_ROWS rows
    of each file are looked at (a folder's files apart); where they are of more than one format, the source
    stays `auto` and every row is read in its own format (`conversation(row, "auto")`), said in `why`."""
    if src.source == "synthetic" or src.format != "auto":
        return src, None
    found = [detect(rows, src.messages_field) for rows in sources.sample_rows(src, DETECT_ROWS)]
    total: Counter = Counter()
    for f in found:
        total.update(dict(f.seen))
    if len(total) > 1:
        files = f" of {len(found)} files" if len(found) > 1 else ""
        mixed = Detected("auto", src.messages_field, f"auto, per row: the first rows{files} are "
                         f"{shapes(total.items())}; each row is read in its own format", sum(total.values()),
                         tuple(total.items()))
        return src.model_copy(update={"format": "auto"}), mixed
    best = next((f for f in found if f.matched), found[0])
    return src.model_copy(update={"format": best.format, "messages_field": best.messages_field}), best


def messages_of(row: Any, fmt: str, messages_field: str | None = "messages") -> list[dict] | None:
    """The messages a row says in format `fmt`, for counting its tokens without the data path (`plan`'s data
    estimate): a chat row's turns, a string prompt/completion or a text row as one user/assistant pair; None
    for a row that is no valid conversation."""
    try:
        conv = conversation(row, fmt, messages_field, tools_field=None)
    except BadRow:
        return None
    if conv.messages is not None:
        return conv.messages
    return [{"role": "user", "content": conv.prompt}, {"role": "assistant", "content": conv.completion}]
