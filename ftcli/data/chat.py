"""Chat rendering and loss masks: which tokens of a conversation the model is trained on.

What is trained (train_on=assistant) is what the assistant generates in its turns: content, reasoning
where the template keeps it, tool calls, the end-of-turn token; nothing of system/user/tool messages or
role headers, nor the generation prompt's prefill (Qwen3's `<think>\n`, which the prompt supplies):

    <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n | \n</think>\n\nHello!<|im_end|>\n |
    '------------------- prompt and header (masked) ---------------' '-------- trained ---------'

How ftcli finds it (`ChatEncoder`):

* Structurally, for templates of a registered chat format (ftcli.chat_formats: ChatML, Qwen 2.5-3.8;
  harmony, gpt-oss; Llama-3 headers; Gemma turns): render the whole conversation once and parse each
  message by the template's own markers (the format's `grammar`). This is right by construction where
  a template rewrites earlier turns once later ones exist (gpt-oss drops earlier analysis and stores
  earlier final answers with `<|end|>`, Qwen3.5 drops earlier think blocks). A template that writes a
  format's markers but does not parse as it (Phi-4's `<|im_sep|>`) is refused with one line
  (`_fit_format`), never masked by a guess. Message text cannot fake a marker: special-token and marker
  strings in the text are swapped for private-use placeholders before rendering and tokenized as plain
  text afterwards (`special_tokens_in_text`). tests/unit/data/test_data_masks.py checks every mask against an
  independent token-level oracle on 46 edge-case conversations and 7 real templates.
* For templates of no registered format's markers, the published example's definition: for assistant
  turn i, the text that `render(messages[:i+1])` adds after `render(messages[:i], add_generation_prompt=True)`.
  ftcli computes it once per conversation *shape* (roles, which fields are set) on a skeleton with
  sentinel strings in place of the text (`skeleton_spans`), checks the filled skeleton equals the real
  render, and otherwise re-renders per turn on the real text (`rerender_spans`, also the comparison
  method; it is wrong wherever a template rewrites earlier turns: tests/unit/data/test_data_masks.py counts it on
  gpt-oss).
* `reference_encode` is the published method verbatim (token-count differences of per-turn renders);
  kept as an oracle for prefix-preserving templates and the benchmark baseline.

Tokens: the conversation is tokenized once and character spans become token spans with the fast
tokenizer's offsets (a token is trained iff it *starts* inside the span: this reproduces the published
example's
token counts where BPE merges across a boundary, e.g. `<think>\n|\n`). For byte-level BPE tokenizers the
one tokenization is itself done the tokenizer's own way: cut at added tokens (`<|im_end|>`), encode the
pieces in one batch without offsets, and ask for offsets only in the pieces a span edge falls in.

Template quirks, and what ftcli does:

* Prefix property failures. Several real templates render a turn differently once a later turn exists
  (Qwen3/3.5/3.6 drop the empty think block of earlier turns, gpt-oss ends the last final message with
  `<|return|>` but earlier ones with `<|end|>` and drops earlier reasoning, phi3, deepseek, nemotron add a
  prefill to the generation prompt). There the published method's token counts land on the wrong tokens. The
  marker families are parsed structurally (above); for the rest, ftcli measures both edges in the full
  render instead: the turn starts where the generation-prompt render and
  the full render stop agreeing, and ends where the turn's own closing text (what follows its last text
  field when it is the final turn) stops agreeing with the full render, both counted in whole tokens
  (`<|end|>` vs `<|return|>` agree on nothing). The structural parse gives the same on gpt-oss: earlier turns train
  `<|channel|>final<|message|>text` (at inference a final answer ends with `<|return|>`; `<|end|>` is how
  the template stores it in history) and the last turn trains through `<|return|>`; on Qwen3.5, earlier
  turns train `text<|im_end|>\\n`.
* Token-level prefix failures. Where a vocabulary tokenizes the generation prompt alone differently from
  the same characters inside the conversation (Llama-3's header ends in "\\n\\n": one token alone, two
  before text in a whitespace-merging BPE), the published method's count trains a prompt token; ftcli follows
  the characters.
* The `{% generation %}` twins (`*_training.jinja`) mark the same tokens except the generation prompt's
  text inside their blocks (`<think>\\n` on Qwen3.x, `\\n` on Qwen2.5, `<|start|>assistant` on gpt-oss) and
  gpt-oss's earlier `<|end|>`: the prompt supplies the former at inference; the latter is history formatting.
* Dates. The gpt-oss template embeds `strftime_now("%Y-%m-%d")`. ftcli renders with a pinned date
  (`TEMPLATE_DATE`) so tokenization is reproducible, cacheable and identical on every rank.
* Qwen3.8 keeps reasoning by default (`preserve_thinking` unset), so it is prefix-preserving as shipped.
"""

from __future__ import annotations

import bisect
import contextvars
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

import numpy as np

from ftcli import chat_formats
from ftcli.data.validate import BadRow, content_text
from ftcli.config.errors import UserError

TEMPLATE_DATE = datetime(2025, 1, 1)
# A chat template is code from a model repo: one render is bounded in time and size (a loop that never ends, an
# output of gigabytes), one line naming the template otherwise (`BoundedTemplate`).
RENDER_SECONDS = 10.0
RENDER_MAX_CHARS = 64 * 2**20
# Bump when a change to this module (or to validate.py) changes which tokens are trained: it is part of
# the cache key, so blocks masked by older code are never served again.
ENCODER_VERSION = 3  # 3: plain-text prompt/completion rows go through the chat template
SPECIAL_TEXT_MODES = ("keep", "escape", "error")
ESCAPE = "\u200b"  # escape mode: a zero-width space after a special-token string's first character
_PLACEHOLDER0 = 0xF0000  # supplementary private use area A: one character per protected string
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PROTECTED_FIELDS = ("content", "tool_calls", *_REASONING_FIELDS)
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


# ----------------------------------------------------------------------------------------- tokenizer
def load_tokenizer(model, data):
    """The tokenizer of `model` (the model section): `model.tokenizer`, else `model.id` at `model.revision`;
    `data.chat_template` (a Jinja file) replaces its chat template. Paths may be `pkg://`."""
    from transformers import AutoTokenizer

    from ftcli.config.recipe import resolve_path

    from ftcli import hub

    name = resolve_path(model.tokenizer or model.id)
    revision = None if model.tokenizer else model.revision
    offline = hub.offline_for(name)  # no Hub: the local HF cache only, no retries
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=revision, trust_remote_code=model.trust_remote_code, local_files_only=bool(offline)
        )
    except Exception as e:  # noqa: BLE001 - hub/IO errors of every kind become one line
        if offline:
            raise UserError(hub.no_connection(f"tokenizer {name!r}", offline)) from None
        raise UserError(f"cannot load tokenizer {name!r}: {_first_line(e)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"tokenizer {name!r} is not a fast tokenizer; ftcli needs character offsets to mask turns")
    if data.chat_template:
        path = resolve_path(data.chat_template)
        try:
            with open(path, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        except OSError as e:
            raise UserError(f"data.chat_template: cannot read {path}: {e.strerror}") from None
        tokenizer.ftcli_chat_template_file = str(path)  # named in its errors (`template_name`)
    return tokenizer


def pad_token_id(tokenizer) -> int:
    """The id padding segments use: pad, else eos, else 0 (padding is never trained or attended across)."""
    for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(tid, int):
            return tid
    return 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


# ------------------------------------------------------------------------------------------ template
def compile_template(template: str, date: datetime | None = TEMPLATE_DATE, name: str = "the chat template"):
    """Compile a chat template in transformers' sandbox (same filters, globals and `{% generation %}`
    support as `apply_chat_template`), with `strftime_now` pinned to `date` (None: today's), as a
    `BoundedTemplate` named `name` in its errors."""
    from transformers.utils import chat_template_utils as ctu

    compile_fn = getattr(ctu, "_cached_compile_jinja_template", None) or ctu._compile_jinja_template.__wrapped__
    compiled = compile_fn(template)  # a fresh environment: pinning the date leaves transformers' alone
    if date is not None:
        compiled.environment.globals["strftime_now"] = lambda fmt: date.strftime(fmt)
    compiled.environment.globals["range"] = _bounded_range(compiled.environment.globals["range"])
    return BoundedTemplate(compiled, name)


_RENDERING: contextvars.ContextVar[tuple[float, str] | None] = contextvars.ContextVar("ftcli_render", default=None)


def _bounded_range(safe_range):
    """The sandbox's `range` (at most 100,000 items), checking the render's deadline as it goes: nested loops
    of empty bodies yield no output to check between."""
    def bounded(*args):
        for k, value in enumerate(safe_range(*args)):
            if k % 1024 == 0 and (rendering := _RENDERING.get()) is not None and time.monotonic() > rendering[0]:
                raise _too_slow(rendering[1])
            yield value
    return bounded


class TemplateBoundExceeded(UserError):
    """A render that ran out of time or size: the template's fault, not the row's, so it ends the command
    (every row would cost the same) rather than being counted as a bad row."""


def _too_slow(name: str) -> TemplateBoundExceeded:
    return TemplateBoundExceeded(f"{name} did not finish rendering one conversation in {RENDER_SECONDS:.0f} s (a loop that does "
                     "not end?); fix or replace the template (data.chat_template)")


class BoundedTemplate:
    """A compiled chat template whose `render` stops with one UserError naming the template after RENDER_SECONDS
    or RENDER_MAX_CHARS characters of output (checked between output chunks and in every `range` loop)."""

    def __init__(self, compiled, name: str):
        self.compiled, self.name = compiled, name

    def render(self, **context) -> str:
        deadline = time.monotonic() + RENDER_SECONDS
        token = _RENDERING.set((deadline, self.name))
        try:
            chunks, size = [], 0
            for chunk in self.compiled.generate(**context):
                size += len(chunk)
                if size > RENDER_MAX_CHARS:
                    raise TemplateBoundExceeded(f"{self.name} rendered more than {RENDER_MAX_CHARS:,} characters for one "
                                    "conversation; fix or replace the template (data.chat_template)")
                if time.monotonic() > deadline:
                    raise _too_slow(self.name)
                chunks.append(chunk)
            return "".join(chunks)
        finally:
            _RENDERING.reset(token)


def template_name(tokenizer) -> str:
    """How errors name a tokenizer's chat template: data.chat_template's file when it replaced it."""
    source = getattr(tokenizer, "ftcli_chat_template_file", None)
    if source:
        return f"the chat template {source}"
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"


def check_render(tokenizer, messages: list[dict], **context) -> None:
    """Render `messages` with the tokenizer's chat template under the bounds of `BoundedTemplate` (one line
    naming the template when it loops or floods): what `apply_chat_template` is about to do, checked first."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    if not isinstance(template, str):
        return
    try:
        compile_template(template, None, template_name(tokenizer)).render(
            messages=messages, documents=None, **{"tools": None, **dict(tokenizer.special_tokens_map), **context})
    except TemplateBoundExceeded:
        raise
    except Exception:  # noqa: BLE001 - TemplateError and the rest: apply_chat_template raises them again, and its caller handles them
        pass


def normalize_messages(messages: list[dict]) -> list[dict]:
    """What `apply_chat_template` does to messages before rendering (drop None values, alias reasoning),
    plus text given as a list of parts (`[{"type": "text", "text": ...}]`) joined into one string. The
    messages come as the row readers give them (`ftcli.data.validate.normalize_turns`, the one parser of
    tool calls: OpenAI's JSON-string `arguments` are objects by then, as every template iterates them)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if isinstance(m.get("content"), list):
            m["content"] = content_text(m["content"])
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _lcp(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search on slices: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ------------------------------------------------------------------------------------ turn grammars
# The templates of a registered chat format (ftcli.chat_formats: ChatML, Llama-3, Gemma, harmony) delimit every
# message with their own marker tokens, so the full render alone says where each assistant message starts and ends:
# ftcli parses it once with the format's grammar (no per-turn re-renders, which are wrong wherever a template
# rewrites earlier turns). Message text never contains a marker while it is parsed: `ChatEncoder` swaps marker and
# special-token strings in the text for private-use placeholders first (see `special_tokens_in_text`).


@dataclass
class _Skeleton:
    """A conversation shape rendered once: literal text around text slots, and turn spans as
    (literal index, offset) pairs. `spans` is None when the shape cannot be filled (a span edge falls
    inside a text field): such conversations take the per-turn renders on their real text."""

    literals: list[str]
    slots: list[tuple[int, str]]  # (message index, field) filling the gap after literals[k]
    spans: list[tuple[int, tuple[int, int], tuple[int, int]]] | None


class ChatEncoder:
    """Tokenize + mask conversations with one chat template (see the module docstring)."""

    def __init__(
        self,
        tokenizer,
        chat_template: str | None = None,
        date: datetime = TEMPLATE_DATE,
        special_tokens_in_text: str = "keep",
    ):
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()))
        if not template:
            raise UserError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "set data.chat_template to a Jinja file"
            )
        if special_tokens_in_text not in SPECIAL_TEXT_MODES:
            raise ValueError(f"special_tokens_in_text={special_tokens_in_text!r}; use one of {SPECIAL_TEXT_MODES}")
        self.tokenizer = tokenizer
        self.template = template
        self.date = date
        self.special_tokens_in_text = special_tokens_in_text
        self._compiled = compile_template(template, date, template_name(tokenizer))
        self._kwargs = dict(tokenizer.special_tokens_map)
        self._backend = tokenizer.backend_tokenizer
        self._split, self._added = _piecewise_split(tokenizer)
        self._plain = None  # the tokenizer without added tokens, built when text first needs it
        self._skeletons: dict[tuple, _Skeleton] = {}
        self.calls = {"encode": 0, "structural": 0, "skeleton": 0, "fallback": 0}
        self.format = chat_formats.detect(template)  # None: no registered format's markers (turns by re-rendering)
        self.grammar = self.format.grammar if self.format else None
        self._special = {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
        self._special.discard("")
        protected = sorted(self._special | set(self.grammar.markers if self.grammar else ()), key=len, reverse=True)
        self._protect_re = re.compile("|".join(map(re.escape, protected))) if protected else None
        self._placeholder = {t: chr(_PLACEHOLDER0 + k) for k, t in enumerate(protected)}
        self._original = {c: t for t, c in self._placeholder.items()}
        self._placeholder_re = re.compile("[" + "".join(self._original) + "]") if protected else None
        self.prefill = ""
        if self.format is not None:
            self._fit_format()

    def _fit_format(self) -> None:
        """Check that the format's grammar parses this template's own probe render (one assistant span holding
        the reply, and a generation prompt that is the format's assistant header + prefill, e.g. Qwen3's
        `<think>\n`) and keep the prefill. A template that writes the format's markers but does not parse as it
        (Phi-4's `<|im_start|>assistant<|im_sep|>`) is refused: its masks would be a guess. One that cannot render
        the probe at all (it needs more than a plain exchange) is measured by re-rendering turns."""
        fmt = self.format
        user, reply = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
        try:
            base = self.render([user])
            prompt = self.render([user], add_generation_prompt=True)
            full = self.render([user, reply])
        except TemplateBoundExceeded:
            raise
        except Exception:  # noqa: BLE001 - a template that needs more than this probe
            self.format = self.grammar = None
            return
        head = prompt[len(base) :] if prompt.startswith(base) else prompt
        prefill = fmt.grammar.prefill(head) if prompt.startswith(base) else None
        spans = fmt.grammar.spans(full, prefill) if prefill is not None else []
        if not (len(spans) == 1 and "Hello" in full[spans[0][0] : spans[0][1]]):
            raise UserError(
                f"the chat template writes {fmt.title} markers ({', '.join(fmt.detect)}) but its turns do not parse "
                f"as the {fmt.name!r} chat format (generation prompt {head[:60]!r}): ftcli has no chat format for it; "
                "add one in ftcli/chat_formats/ (a module and a line in CHAT_FORMATS), or give data.chat_template a "
                f"template of a known format ({', '.join(chat_formats.CHAT_FORMATS)})"
            )
        self.prefill = prefill

    # -- rendering
    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        return self._compiled.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self._kwargs
        )

    # -- special-token strings inside message text
    def protect(self, messages: list[dict], tools: list | None = None) -> tuple[list[dict], list | None, int]:
        """Messages with every special-token or marker string in their text (content, reasoning, tool-call
        arguments) replaced by a private-use placeholder (restored when tokenizing: see
        `special_tokens_in_text`), the tool schemas protected the same way, and how many special-token
        strings they held. `error` mode raises BadRow instead."""
        found = 0

        def sub(x):
            nonlocal found
            if isinstance(x, str):
                hits = self._protect_re.findall(x)
                found += sum(t in self._special for t in hits)
                return self._protect_re.sub(lambda m: self._placeholder[m.group(0)], x) if hits else x
            if isinstance(x, dict):
                return {k: sub(v) for k, v in x.items()}
            if isinstance(x, list):
                return [sub(v) for v in x]
            return x

        if self._protect_re is not None:
            messages = [
                {k: sub(v) if k in _PROTECTED_FIELDS else v for k, v in m.items()} for m in messages
            ]
            tools = sub(tools)
        if found and self.special_tokens_in_text == "error":
            raise BadRow("special token in text", f"{found} special-token string(s) in message text")
        return messages, tools, found

    def _restore(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """`text` with placeholders back as their strings (keep) or broken by a zero-width space (escape),
        and (position in `text`, cumulative shift after it) for mapping span edges."""
        if self._placeholder_re is None or not self._placeholder_re.search(text):
            return text, []
        parts, shifts, last, shift = [], [], 0, 0
        for m in self._placeholder_re.finditer(text):
            token = self._original[m.group(0)]
            if self.special_tokens_in_text == "escape":
                token = token[0] + ESCAPE + token[1:]
            parts += [text[last : m.start()], token]
            shift += len(token) - 1
            shifts.append((m.end(), shift))
            last = m.end()
        parts.append(text[last:])
        return "".join(parts), shifts

    def _agree(self, a: str, b: str, offset: int = 0) -> int:
        """How far (in characters, from `offset`) `a` and `b` agree, in whole tokens: tokenize both from a
        point a little before their first differing character and keep the common leading tokens. So
        `<|end|>` vs `<|return|>` agree on nothing, and a partial word never counts as agreement."""
        c = offset + _lcp(a[offset:], b[offset:])
        if c == len(a) == len(b):
            return c
        p0 = max(offset, c - 256)
        ta = self._backend.encode(a[p0 : c + 256], add_special_tokens=False)
        tb = self._backend.encode(b[p0 : c + 256], add_special_tokens=False)
        k = 0
        for x, y in zip(ta.ids, tb.ids):
            if x != y or ta.offsets[k] != tb.offsets[k]:
                break
            k += 1
        return min(c, p0 + (ta.offsets[k - 1][1] if k else 0))

    def _turn_spans(
        self,
        messages: list[dict],
        full: str,
        anchor: Callable[[int, str, str, int], tuple[int, int] | None],
        tools: list | None = None,
    ) -> list[tuple[int, int, int]]:
        """(message index, start, end) in `full` for every assistant turn: the published per-turn renders,
        on characters, with the prefix-failure rules of the module docstring."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            start = len(prompt) if full.startswith(prompt) else self._agree(prompt, full)
            turn = self.render(messages[: i + 1], tools=tools)
            if full.startswith(turn):
                end = len(turn)
            else:
                at = anchor(i, turn, full, start)
                if at is None:
                    end = self._agree(turn, full)
                else:
                    in_turn, in_full = at
                    end = in_full + self._agree(turn[in_turn:], full[in_full:])
            spans.append((i, start, max(start, end)))
        return spans

    # -- the skeleton (fast path)
    @staticmethod
    def _shape(messages: list[dict]) -> tuple:
        """A conversation's shape: roles, which fields are set, and every non-text value."""
        return tuple(
            tuple(
                (k, None) if k != "role" and isinstance(v, str) and v
                else (k, v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str))
                for k, v in sorted(m.items())
            )
            for m in messages
        )

    @staticmethod
    def _shaped(messages: list[dict]) -> tuple[list[tuple[int, str]], list[dict]]:
        """The conversation with every non-empty text field replaced by a numbered sentinel."""
        slots, shaped = [], []
        for i, m in enumerate(messages):
            s = {}
            for k, v in m.items():
                if k != "role" and isinstance(v, str) and v:
                    s[k] = _SENTINEL.format(len(slots))
                    slots.append((i, k))
                else:
                    s[k] = v
            shaped.append(s)
        return slots, shaped

    def _build_skeleton(self, shaped: list[dict], slots: list[tuple[int, str]]) -> _Skeleton:
        try:
            full = self.render(shaped)
        except TemplateBoundExceeded:
            raise
        except Exception:  # noqa: BLE001 - the real text decides (the per-turn path raises its own error)
            return _Skeleton([], [], None)
        pieces = _SENTINEL_RE.split(full)  # literal, slot id, literal, slot id, ..., literal
        literals = pieces[0::2]
        order = [slots[int(k)] for k in pieces[1::2]]
        starts, pos = [], 0
        for k, lit in enumerate(literals):
            starts.append(pos)
            pos += len(lit)
            if k < len(order):
                pos += len(_SENTINEL.format(pieces[2 * k + 1]))

        def anchor(i, turn, text, start):
            marks = [_SENTINEL.format(n) for n, (mi, _) in enumerate(slots) if mi == i]
            return _last_shared(marks, turn, text, start)

        def locate(p: int) -> tuple[int, int] | None:
            for k, (s, lit) in enumerate(zip(starts, literals)):
                if s <= p <= s + len(lit):
                    return k, p - s
            return None

        try:
            raw = self._turn_spans(shaped, full, anchor)
        except TemplateBoundExceeded:
            raise
        except Exception:  # noqa: BLE001 - the real conversation will raise the same error with its text
            return _Skeleton(literals, order, None)
        spans = []
        for i, s, e in raw:
            ls, le = locate(s), locate(e)
            if ls is None or le is None:
                return _Skeleton(literals, order, None)
            spans.append((i, ls, le))
        return _Skeleton(literals, order, spans)

    def spans(
        self, messages: list[dict], first_message: int = 0, tools: list | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and (start char, end char) of every trained assistant span, from the
        template's markers (one render), else from the per-turn renders (`skeleton_spans`). Spans before
        message `first_message` are left out. Messages must be `protect`ed already."""
        messages = normalize_messages(messages)
        if self.grammar is None:
            full, spans = self.skeleton_spans(messages, tools)
            return full, [(s, e) for i, s, e in spans if i >= first_message]
        self.calls["structural"] += 1
        full = self.render(messages, tools=tools)
        spans = self.grammar.spans(full, self.prefill)
        if first_message:
            prompt = self.render(messages[:first_message], add_generation_prompt=True, tools=tools)
            boundary = len(prompt) if full.startswith(prompt) else self._agree(prompt, full)
            spans = [(s, e) for s, e in spans if s >= boundary]
        return full, spans

    def skeleton_spans(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[tuple[int, int, int]]]:
        """(message index, start char, end char) of every assistant turn by the per-turn renders, computed
        once per conversation shape (the fallback for templates of no known marker family)."""
        messages = normalize_messages(messages)
        if tools:
            full = self.render(messages, tools=tools)
            return full, self._turn_spans(messages, full, self._text_anchor(messages), tools)
        key = self._shape(messages)
        sk = self._skeletons.get(key)
        if sk is None:
            sk = self._skeletons[key] = self._build_skeleton(*reversed(self._shaped(messages)))
        full = self.render(messages)
        if sk.spans is not None:
            # Templates commonly trim text fields (Qwen, Llama): try the text as is, then stripped.
            for fill in (None, str.strip):
                text, starts = self._fill(sk, messages, fill)
                if text == full:
                    self.calls["skeleton"] += 1
                    return full, [(i, starts[ks] + os_, starts[ke] + oe) for i, (ks, os_), (ke, oe) in sk.spans]
        self.calls["fallback"] += 1
        return full, self._turn_spans(messages, full, self._text_anchor(messages))

    def rerender_spans(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[tuple[int, int, int]]]:
        """The per-turn renders on the real text (no skeleton): what `skeleton_spans` is proven equal to,
        and the comparison for the structural spans (wrong where a template rewrites earlier turns)."""
        messages = normalize_messages(messages)
        full = self.render(messages, tools=tools)
        return full, self._turn_spans(messages, full, self._text_anchor(messages), tools)

    @staticmethod
    def _fill(sk: _Skeleton, messages: list[dict], fill) -> tuple[str, list[int]]:
        parts, starts, pos = [], [], 0
        for k, lit in enumerate(sk.literals):
            starts.append(pos)
            parts.append(lit)
            pos += len(lit)
            if k < len(sk.slots):
                i, field = sk.slots[k]
                text = messages[i][field] if fill is None else fill(messages[i][field])
                parts.append(text)
                pos += len(text)
        return "".join(parts), starts

    @staticmethod
    def _text_anchor(messages):
        def anchor(i, turn, text, start):
            m = messages[i]
            fields = [v.strip() for k, v in m.items() if k != "role" and isinstance(v, str) and v.strip()]
            return _last_shared(fields, turn, text, start)

        return anchor

    # -- tokens
    def encode(
        self,
        messages: list[dict],
        train_on: str = "assistant",
        first_message: int = 0,
        tools: list | None = None,
        info: dict | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """input_ids (int32) and loss mask (bool) of one conversation.

        train_on: assistant = every assistant turn, last = the last one, all = every token. Turns before
        message `first_message` are never trained (prompt/completion rows: the prompt's turns). `tools`
        (function schemas) go to the template as `tools=`. `info`, if given, gets
        `special_tokens_in_text` (how many special-token strings the message text held) and
        `tool_calls_not_rendered` (calls the template leaves out: gpt-oss renders one per message)."""
        self.calls["encode"] += 1
        messages, tools, found = self.protect(normalize_messages(messages), tools)
        if train_on == "all":
            text, spans = self.render(messages, tools=tools), None
        else:
            text, spans = self.spans(messages, first_message, tools)
        if info is not None:
            info["special_tokens_in_text"] = found
            info["tool_calls_not_rendered"] = self._calls_not_rendered(messages, text)
        if spans is None:
            return self.encode_text(text, [(0, len(text))])
        if train_on == "last":
            spans = spans[-1:]
        return self.encode_text(text, spans)

    def _calls_not_rendered(self, messages: list[dict], text: str) -> int:
        """Tool calls of the messages missing from the render, where the render shows each one by a
        marker (harmony: `<|call|>`; placeholders keep message text from faking one)."""
        marker = self.format.call_marker if self.format else None
        if marker is None:
            return 0
        calls = sum(len(m["tool_calls"]) for m in messages if isinstance(m.get("tool_calls"), list))
        return max(0, calls - text.count(marker))

    def encode_text(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize `text` once; a token is trained iff its first character lies in one of `spans`.
        Placeholders (`protect`) become their strings tokenized as plain text (keep) or escaped."""
        if self._split is not None:
            return self._encode_pieces(text, spans)
        text, shifts = self._restore(text)  # no piecewise path: `keep` tokenizes like `escape`
        if shifts:
            spans = [(_shifted(s, shifts), _shifted(e, shifts)) for s, e in spans]
        enc = self._backend.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=bool)
        starts = None
        for s, e in spans:
            if e <= s:
                continue
            a, starts = _first_token_at(enc, s, len(text), len(ids), starts)
            b, starts = _first_token_at(enc, e, len(text), len(ids), starts)
            mask[a:b] = True
        return ids, mask

    def _encode_pieces(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The same tokens, computed the way the tokenizer itself does: cut at added tokens (`<|im_end|>`),
        tokenize the plain pieces in one batch without offsets, and ask for offsets only inside the few
        pieces a span edge falls in. Exact for the tokenizers `_piecewise_split` accepts. A piece holding
        placeholders is restored and tokenized without added-token matching (plain text)."""
        pieces = self._split.split(text)  # plain, added, plain, added, ..., plain
        plain = pieces[0::2]
        marked = self._placeholder_re
        restored = {k: self._restore(p) for k, p in enumerate(plain) if marked is not None and marked.search(p)}
        encs = self._backend.encode_batch_fast([restored[k][0] if k in restored else p for k, p in enumerate(plain)],
                                               add_special_tokens=False)
        if restored and self._plain is None:
            self._plain = _plain_backend(self._backend)
        for k, (piece, _) in restored.items():
            encs[k] = self._plain.encode(piece, add_special_tokens=False)
        ids: list[int] = []
        char_starts, tok_starts = [], []  # per piece: first character, first token
        pos = 0
        for k, piece in enumerate(pieces):
            char_starts.append(pos)
            tok_starts.append(len(ids))
            pos += len(piece)
            if k % 2 == 0:
                ids.extend(encs[k // 2].ids)
            else:
                ids.append(self._added[piece])
        char_starts.append(pos)
        tok_starts.append(len(ids))
        mask = np.zeros(len(ids), dtype=bool)

        def token_at(c: int) -> int:
            k = bisect.bisect_right(char_starts, c) - 1
            if c == char_starts[k] or k == len(pieces):
                return tok_starts[k]
            if k % 2 == 1:  # inside an added token: it starts before c
                return tok_starts[k] + 1
            local = c - char_starts[k]
            if k // 2 in restored:
                piece, shifts = restored[k // 2]
                offsets = encs[k // 2].offsets
                local = _shifted(local, shifts)
            else:
                offsets = self._backend.encode(pieces[k], add_special_tokens=False).offsets
            return tok_starts[k] + sum(1 for o in offsets if o[0] < local)

        for s, e in spans:
            if e > s:
                mask[token_at(s) : token_at(e)] = True
        return np.asarray(ids, dtype=np.int32), mask


def _shifted(pos: int, shifts: list[tuple[int, int]]) -> int:
    """A position in placeholder text -> the same position in restored text."""
    k = bisect.bisect_right(shifts, (pos, float("inf"))) - 1
    return pos + (shifts[k][1] if k >= 0 else 0)


def _plain_backend(backend):
    """The same tokenizer without its added tokens: special-token strings in message text tokenize as
    the characters they are (`special_tokens_in_text: keep`)."""
    from tokenizers import Tokenizer

    config = json.loads(backend.to_str())
    config["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(config))


def _piecewise_split(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """A regex cutting text at added tokens, when tokenizing the pieces separately is *exactly* tokenizing
    the whole (the tokenizer cuts there first and handles each piece on its own): a byte-level or
    regex-split pre-tokenizer, and added tokens matched before normalization that do not eat spaces.
    Otherwise None (full tokenization with offsets)."""
    backend = tokenizer.backend_tokenizer
    try:
        config = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001
        return None, {}
    pre = config.get("pre_tokenizer") or {}
    kinds = {p.get("type") for p in pre.get("pretokenizers", [pre])}
    if not kinds or not kinds <= {"ByteLevel", "Split", "Digits"}:
        return None, {}
    added = config.get("added_tokens") or []
    # Added tokens are cut out before normalization (normalized=false), so a normalizer (Qwen's NFC)
    # already sees each piece on its own.
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized") for t in added):
        return None, {}
    if not added:
        return None, {}
    tokens = {t["content"]: t["id"] for t in added}
    pattern = "(" + "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) + ")"
    return re.compile(pattern), tokens


def _last_shared(pieces: list[str], turn: str, full: str, start: int) -> tuple[int, int] | None:
    """Where the turn's last rendered text field ends, in the turn's own render and in the full render
    (the anchor for comparing what follows it). Fields the full render dropped are skipped."""
    for pos, piece in sorted(((turn.rfind(p), p) for p in pieces), reverse=True):
        if pos < 0:
            break
        at = full.find(piece, start)
        if at >= 0:
            return pos + len(piece), at + len(piece)
    return None


def _first_token_at(enc, char: int, text_len: int, n: int, starts):
    """Index of the first token whose first character is at or after `char`."""
    if char >= text_len:
        return n, starts
    if starts is None:
        t = enc.char_to_token(char)
        if t is not None:
            return (t if enc.token_to_chars(t)[0] >= char else t + 1), starts
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
    return int(np.searchsorted(starts, char, side="left")), starts


# ------------------------------------------------------------------ the published method (comparison)
def reference_encode(
    tokenizer, messages: list[dict], train_on: str = "assistant", chat_template: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The published qwen-b300 example's method, verbatim: for each assistant turn i, tokenize messages[:i]
    with the generation prompt and messages[:i+1]; the tokens between the two lengths are that turn's
    response tokens.
    Uses `tokenizer.apply_chat_template` as-is (the real date on gpt-oss). Oracle and benchmark baseline."""

    def ids(msgs: list[dict], gen: bool = False) -> list[int]:
        out = tokenizer.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=gen, chat_template=chat_template, return_dict=True
        )
        return list(out["input_ids"])

    full = np.asarray(ids(messages), dtype=np.int32)
    mask = np.zeros(len(full), dtype=bool)
    if train_on == "all":
        mask[:] = True
        return full, mask
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if train_on == "last":
        turns = turns[-1:]
    for i in turns:
        mask[len(ids(messages[:i], gen=True)) : len(ids(messages[: i + 1]))] = True
    return full, mask


def encode_prompt_completion_text(tokenizer, prompt: str, completion: str, train_on: str):
    """Plain-text prompt/completion rows (no chat template): prompt + completion + eos, loss on the
    completion and eos (train_on=all: on everything)."""
    text = prompt + completion
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    ids = list(enc.ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    mask = np.zeros(len(ids) + (eos is not None), dtype=bool)
    if train_on == "all":
        mask[:] = True
    else:
        a, _ = _first_token_at(enc, len(prompt), len(text), len(ids), None)
        mask[a:] = True
    if eos is not None:
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32), mask


def describe(tokenizer) -> dict[str, Any]:
    """What of a tokenizer changes tokenization (for cache keys)."""
    import hashlib

    backend = tokenizer.backend_tokenizer.to_str()
    template = getattr(tokenizer, "chat_template", None)
    return {
        "tokenizer_sha256": hashlib.sha256(backend.encode()).hexdigest(),
        "chat_template_sha256": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest(),
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "pad_token_id": pad_token_id(tokenizer),
        "template_date": TEMPLATE_DATE.strftime("%Y-%m-%d"),
    }
