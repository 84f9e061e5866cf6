"""Preference rows: the forms users bring, each side rendered and masked exactly as an SFT conversation.

A preference row says one prompt and two completions of it, `chosen` (preferred) and `rejected`. The
forms read (`row_pair` names the one a row is in; `detect` looks at a source's first rows):

    explicit       {"prompt", "chosen", "rejected"}: TRL's standard form (three strings) or its
                   conversational form (prompt a message list, multi-turn and tool turns allowed; chosen and
                   rejected lists of assistant and tool messages, or strings: one assistant turn)
    implicit       {"chosen", "rejected"} full conversations sharing their prompt as a common prefix, the
                   prompt = the messages before the first one that differs (UltraFeedback binarized's
                   `train_prefs`, whose `prompt` string is the shared first user turn again: ignored)
    hh             {"chosen", "rejected"} strings of `\\n\\nHuman: ...\\n\\nAssistant: ...` turns sharing their
                   prefix (Anthropic hh-rlhf): parsed into user/assistant turns, then as implicit

Each side is the conversation `prompt + completion` through the SFT path (`validate.check_messages` with
`first_trained = len(prompt)`, `chat.ChatEncoder.encode`): the trained tokens of a side are exactly the
tokens SFT trains in its completion's assistant turns (content, reasoning, tool calls, the end-of-turn
token; nothing of the prompt, tool results or headers). A string prompt/completion is a user turn and an
assistant turn, as SFT renders it; a tokenizer without a chat template trains the plain text
prompt + completion + eos (TRL's standard form).

Bad pairs are skipped and counted with a reason (`BadRow`): chosen and rejected the same, an empty
completion, no shared prompt, or a prompt the template refuses ("template error"), besides every SFT
reason of the conversation itself.

Pure data code: no torch.distributed, MLflow or CLI imports.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ftcli.data.chat import ChatEncoder, TemplateBoundExceeded, encode_prompt_completion_text
from ftcli.data.validate import BadRow, _lone_surrogate, _tools, as_bad_row, check_messages

FORMS = ("explicit", "implicit", "hh")
IDENTICAL = "identical chosen and rejected"
EMPTY = "empty completion"
NO_PROMPT = "no shared prompt"
HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


@dataclass
class PreferencePair:
    """A valid preference row: the shared prompt and the two completions (messages), or plain text."""

    prompt: list[dict] | str
    chosen: list[dict] | str
    rejected: list[dict] | str
    tools: list[dict] | None = None
    form: str = "explicit"

    @property
    def is_text(self) -> bool:
        return isinstance(self.prompt, str)


@dataclass
class EncodedPair:
    """Both sides tokenized: input_ids (int32) and loss mask (bool) of chosen and of rejected."""

    chosen_ids: np.ndarray
    chosen_mask: np.ndarray
    rejected_ids: np.ndarray
    rejected_mask: np.ndarray
    dropped: dict[str, int]
    special_tokens: int = 0


# ---------------------------------------------------------------------------------------- row forms
def row_form(row: Any) -> str | None:
    """The preference form of one row by its shape, or None."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        return None
    chosen, prompt = row["chosen"], row.get("prompt")
    if isinstance(chosen, str):
        if prompt is None and HH_TURN.search(chosen):
            return "hh"
        return "explicit" if isinstance(prompt, (str, list)) else None
    if isinstance(chosen, list):
        if isinstance(prompt, list):
            return "explicit"
        starts_with_prompt = bool(chosen) and isinstance(chosen[0], dict) and chosen[0].get("role") != "assistant"
        if prompt is None or starts_with_prompt:
            return "implicit"
        return "explicit"
    return None


def detect(rows: Iterable[Any], limit: int = 32) -> tuple[str | None, str]:
    """(the form most of the first `limit` rows are in, why), or (None, why not)."""
    seen: Counter = Counter()
    looked = 0
    for row in rows:
        if looked >= limit:
            break
        looked += 1
        form = row_form(row)
        if form:
            seen[form] += 1
    if not seen:
        return None, f"none of the first {looked} rows has chosen/rejected fields of a preference form"
    form, n = seen.most_common(1)[0]
    return form, f"auto: {n} of the first {looked} rows are {form} preference pairs"


def hh_messages(text: str) -> list[dict]:
    """An hh-rlhf transcript (`\\n\\nHuman: ...\\n\\nAssistant: ...`) as user/assistant messages."""
    marks = list(HH_TURN.finditer(text))
    if not marks:
        raise BadRow("no turns", "an hh text without '\\n\\nHuman:' / '\\n\\nAssistant:' turns")
    messages = []
    for k, m in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
        messages.append({"role": HH_ROLES[m.group(1)], "content": text[m.end():end]})
    return messages


def _assistant_turns(value: Any, side: str) -> list[dict]:
    """A completion as messages: a string is one assistant turn; a list is checked by the SFT rules later."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list):
        return value
    raise BadRow("content not a string", f"{side} is {type(value).__name__}")


def _split_shared(chosen: list, rejected: list) -> tuple[list, list, list]:
    """(prompt, chosen completion, rejected completion) of two conversations sharing their prompt: the
    prompt is every message before the first that differs, and must end in a user or tool turn."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == len(chosen) == len(rejected):
        raise BadRow(IDENTICAL)
    while k > 0 and isinstance(chosen[k - 1], dict) and chosen[k - 1].get("role") == "assistant":
        k -= 1  # the completions start at an assistant turn; shared earlier assistant words belong to them
    if k == 0:
        raise BadRow(NO_PROMPT, "chosen and rejected share no user turn before they differ")
    return chosen[:k], chosen[k:], rejected[k:]


def pair(row: Any, form: str = "auto", tools_field: str | None = "tools") -> PreferencePair:
    """A source row -> PreferencePair, or BadRow."""
    if not isinstance(row, dict):
        raise BadRow("row not an object", f"got {type(row).__name__}")
    if form == "auto":
        form = row_form(row)
        missing = [key for key in ("chosen", "rejected") if row.get(key) is None]
        if form is None and len(missing) == 1:
            raise BadRow(f"{missing[0]} missing", f"no {missing[0]!r} field (fields: {', '.join(map(str, row))})")
        if form is None:
            raise BadRow("not a preference pair", f"fields {', '.join(map(str, row))} match no preference form")
    for key in ("chosen", "rejected"):
        if row.get(key) is None:
            raise BadRow(f"{key} missing", f"no {key!r} field (fields: {', '.join(map(str, row))})")
    surrogate = _lone_surrogate(row)
    if surrogate:
        raise BadRow("lone surrogate", f"{surrogate}, a lone UTF-16 surrogate that is not valid Unicode text")
    tools = _tools(row, tools_field)
    chosen, rejected = row["chosen"], row["rejected"]
    if form == "hh":
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            raise BadRow("content not a string", "hh chosen/rejected must be transcripts (strings)")
        chosen, rejected, form = hh_messages(chosen), hh_messages(rejected), "implicit"
    if form == "implicit":
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise BadRow("messages not a list", "implicit-prompt chosen/rejected must be message lists")
        prompt, chosen, rejected = _split_shared(chosen, rejected)
        return PreferencePair(prompt, chosen, rejected, tools, "implicit")
    if form != "explicit":
        raise BadRow("unknown format", f"preference form {form!r}; expected one of {', '.join(FORMS)}")
    prompt = row.get("prompt")
    if prompt is None:
        raise BadRow("prompt missing", "no 'prompt' field")
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        if not chosen.strip() or not rejected.strip():
            raise BadRow(EMPTY, "chosen" if not chosen.strip() else "rejected")
        if chosen == rejected:
            raise BadRow(IDENTICAL)
        return PreferencePair(prompt, chosen, rejected, tools)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise BadRow("content not a string", f"prompt is {type(prompt).__name__}")
    return PreferencePair(prompt, _assistant_turns(chosen, "chosen"), _assistant_turns(rejected, "rejected"), tools)


# --------------------------------------------------------------------------------------- encoding
class PairEncoder:
    """(source number, row) -> (EncodedPair,) or (BadRow,), the pair counterpart of pipeline.RowEncoder:
    each side is `prompt + completion` rendered, validated and masked by the SFT code. `sources`:
    data.source_list(); a source's `format` is a preference form or `auto`."""

    def __init__(self, data, tokenizer, sources_=None):
        self.sources = sources_ if sources_ is not None else data.source_list()
        self.train_on, self.special = data.train_on, data.special_tokens_in_text
        self.tokenizer = tokenizer
        self._chat: ChatEncoder | None = None

    def _side(self, p: PreferencePair, completion, what: str, info: dict) -> tuple[np.ndarray, np.ndarray, dict]:
        if p.is_text:  # standard form without a chat template: prompt + completion + eos, as TRL trains it
            ids, mask = encode_prompt_completion_text(self.tokenizer, p.prompt, completion, self.train_on)
            return ids, mask, {}
        conv = check_messages(p.prompt + completion, first_trained=len(p.prompt))
        if not any(m["role"] == "assistant" for m in conv.messages[conv.first_trained:]):
            raise BadRow(EMPTY, f"{what} has no assistant turn with content")
        if self._chat is None:
            self._chat = ChatEncoder(self.tokenizer, special_tokens_in_text=self.special)
        ids, mask = self._chat.encode(conv.messages, self.train_on, conv.first_trained, p.tools, info)
        return ids, mask, conv.dropped

    def encode(self, p: PreferencePair) -> EncodedPair:
        if not p.is_text and getattr(self.tokenizer, "chat_template", None) is None:
            raise BadRow("template error", "message-list pairs need a tokenizer with a chat template")
        if p.is_text and getattr(self.tokenizer, "chat_template", None):  # a string pair is asked as a chat
            p = PreferencePair([{"role": "user", "content": p.prompt}], _assistant_turns(p.chosen, "chosen"),
                               _assistant_turns(p.rejected, "rejected"), p.tools, p.form)
        for side, completion in (("chosen", p.chosen), ("rejected", p.rejected)):
            if not p.is_text and not any(isinstance(m, dict) and m.get("role") == "assistant" and (
                    (isinstance(m.get("content"), str) and m["content"].strip()) or m.get("tool_calls"))
                    for m in completion):
                raise BadRow(EMPTY, f"{side} has no assistant turn with content")
        info_c: dict = {}
        info_r: dict = {}
        ids_c, mask_c, dropped_c = self._side(p, p.chosen, "chosen", info_c)
        ids_r, mask_r, dropped_r = self._side(p, p.rejected, "rejected", info_r)
        if np.array_equal(ids_c, ids_r) and np.array_equal(mask_c, mask_r):
            raise BadRow(IDENTICAL, "the two sides tokenize the same")
        for ids, mask, side in ((ids_c, mask_c, "chosen"), (ids_r, mask_r, "rejected")):
            if not mask[1:].any():
                raise BadRow(EMPTY, f"{side} trains no token")
        dropped = Counter(dropped_c) + Counter(dropped_r)
        special = info_c.get("special_tokens_in_text", 0) + info_r.get("special_tokens_in_text", 0)
        return EncodedPair(ids_c, mask_c, ids_r, mask_r, dict(dropped), special)

    def __call__(self, k: int, row: Any) -> tuple:
        from ftcli.data import sources

        src = self.sources[k]
        try:
            if isinstance(row, sources.InvalidRow):
                raise BadRow(row.reason, row.detail)
            return (self.encode(pair(row, _form(src.format), src.tools_field)),)
        except TemplateBoundExceeded:
            raise  # the template's fault: every row would take as long
        except Exception as e:  # noqa: BLE001 - a template's raise_exception, odd field types, ...
            return (as_bad_row(e),)


def _form(fmt: str) -> str:
    """A source's data.format as a preference form (`auto` and `preference` detect per row)."""
    return fmt if fmt in FORMS else "auto"


# ------------------------------------------------------------------------------------- truncation
def fit_pair(len_chosen: int, len_rejected: int, room: int) -> tuple[int, int]:
    """The lengths two sides are cut to so that both fit `room` tokens (keep_start, as TRL truncates):
    a side shorter than half the room stays whole and the other gets the rest; else each gets half."""
    if len_chosen + len_rejected <= room:
        return len_chosen, len_rejected
    half = room // 2
    if len_chosen <= half:
        return len_chosen, room - len_chosen
    if len_rejected <= half:
        return room - len_rejected, len_rejected
    return half, room - half
