"""Chat rendering and loss masks: which tokens of a conversation the model is trained on.

What is trained (train_on=assistant) is what the reference defines: for assistant turn i, the text that
`render(messages[:i+1])` adds after `render(messages[:i], add_generation_prompt=True)`, i.e. exactly what
the model must generate after the generation prompt, its end-of-turn token included:

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n<think>\\n | \\n</think>\\n\\nHello!<|im_end|>\\n |
    '--------- render(messages[:1], add_generation_prompt=True) ----' '-------- trained ---------'

Two ways to compute it, proven equal by tests/test_data_chat.py on the real templates TRL ships:

* `reference_encode`, the reference method: re-render and re-tokenize the conversation twice per
  assistant turn and take token-count differences. O(turns x length); kept as the oracle and the
  benchmark baseline.
* `ChatEncoder` (what ftcli uses): the turn boundaries of a conversation depend only on its *shape*
  (roles, which fields are set), not on its text, for every template that treats text as opaque. So
  render the shape once with sentinel strings in place of the text, run the reference's per-turn
  renders on that skeleton (character offsets, no tokenizer), and cache the result per shape. A
  conversation is then: fill its text into the cached skeleton, check the filled string equals one real
  render (so a template that trims, splits or escapes text cannot fool it: such a conversation takes the
  same per-turn renders on its real text instead), tokenize once, and turn character spans into token
  spans with the fast tokenizer's offsets (a token is trained iff it *starts* inside the span: this
  reproduces the reference's token counts where BPE merges across a boundary, e.g. `<think>\\n|\\n`).
  For byte-level BPE tokenizers the one tokenization is itself done the tokenizer's own way: cut at
  added tokens (`<|im_end|>`), encode the pieces in one batch without offsets, and ask for offsets only
  in the pieces a span edge falls in.

Template quirks, and what ftcli does:

* Prefix property failures. Several real templates render a turn differently once a later turn exists
  (Qwen3/3.5/3.6 drop the empty think block of earlier turns, gpt-oss ends the last final message with
  `<|return|>` but earlier ones with `<|end|>` and drops earlier reasoning, phi3, deepseek, nemotron add a
  prefill to the generation prompt). There the reference's token counts land on the wrong tokens. ftcli
  measures both edges in the full render instead: the turn starts where the generation-prompt render and
  the full render stop agreeing, and ends where the turn's own closing text (what follows its last text
  field when it is the final turn) stops agreeing with the full render, both counted in whole tokens
  (`<|end|>` vs `<|return|>` agree on nothing). Net effect: on gpt-oss, earlier turns train
  `<|channel|>final<|message|>text` (at inference a final answer ends with `<|return|>`; `<|end|>` is how
  the template stores it in history) and the last turn trains through `<|return|>`; on Qwen3.5, earlier
  turns train `text<|im_end|>\\n`.
* Token-level prefix failures. Where a vocabulary tokenizes the generation prompt alone differently from
  the same characters inside the conversation (Llama-3's header ends in "\\n\\n": one token alone, two
  before text in a whitespace-merging BPE), the reference's count trains a prompt token; ftcli follows
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
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

import numpy as np

from ftcli.errors import UserError

TEMPLATE_DATE = datetime(2025, 1, 1)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


# ----------------------------------------------------------------------------------------- tokenizer
def load_tokenizer(recipe):
    """The recipe's tokenizer: `model.tokenizer`, else `model.id` at `model.revision`; `data.chat_template`
    (a Jinja file) replaces its chat template. Paths may be `pkg://`."""
    from transformers import AutoTokenizer

    from ftcli.recipe import resolve_path

    model = recipe.model
    name = resolve_path(model.tokenizer or model.id)
    revision = None if model.tokenizer else model.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=revision, trust_remote_code=model.trust_remote_code
        )
    except Exception as e:  # noqa: BLE001 - hub/IO errors of every kind become one line
        raise UserError(f"cannot load tokenizer {name!r}: {_first_line(e)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"tokenizer {name!r} is not a fast tokenizer; ftcli needs character offsets to mask turns")
    if recipe.data.chat_template:
        path = resolve_path(recipe.data.chat_template)
        try:
            with open(path, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        except OSError as e:
            raise UserError(f"data.chat_template: cannot read {path}: {e.strerror}") from None
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
def compile_template(template: str, date: datetime = TEMPLATE_DATE):
    """Compile a chat template in transformers' sandbox (same filters, globals and `{% generation %}`
    support as `apply_chat_template`), with `strftime_now` pinned to `date`."""
    from transformers.utils import chat_template_utils as ctu

    compile_fn = getattr(ctu, "_cached_compile_jinja_template", None) or ctu._compile_jinja_template.__wrapped__
    compiled = compile_fn(template)  # a fresh environment: pinning the date leaves transformers' alone
    compiled.environment.globals["strftime_now"] = lambda fmt: date.strftime(fmt)
    return compiled


def normalize_messages(messages: list[dict]) -> list[dict]:
    """What `apply_chat_template` does to messages before rendering: drop None values, alias reasoning."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
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

    def __init__(self, tokenizer, chat_template: str | None = None, date: datetime = TEMPLATE_DATE):
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()))
        if not template:
            raise UserError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "set data.chat_template to a Jinja file"
            )
        self.tokenizer = tokenizer
        self.template = template
        self.date = date
        self._compiled = compile_template(template, date)
        self._kwargs = dict(tokenizer.special_tokens_map)
        self._backend = tokenizer.backend_tokenizer
        self._split, self._added = _piecewise_split(tokenizer)
        self._skeletons: dict[tuple, _Skeleton] = {}
        self.calls = {"encode": 0, "skeleton": 0, "fallback": 0}

    # -- rendering
    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._compiled.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **self._kwargs
        )

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
        self, messages: list[dict], full: str, anchor: Callable[[int, str, str, int], tuple[int, int] | None]
    ) -> list[tuple[int, int, int]]:
        """(message index, start, end) in `full` for every assistant turn: the reference's per-turn renders,
        on characters, with the prefix-failure rules of the module docstring."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            start = len(prompt) if full.startswith(prompt) else self._agree(prompt, full)
            turn = self.render(messages[: i + 1])
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
        except Exception:  # noqa: BLE001 - the real conversation will raise the same error with its text
            return _Skeleton(literals, order, None)
        spans = []
        for i, s, e in raw:
            ls, le = locate(s), locate(e)
            if ls is None or le is None:
                return _Skeleton(literals, order, None)
            spans.append((i, ls, le))
        return _Skeleton(literals, order, spans)

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int, int]]]:
        """The rendered conversation and (message index, start char, end char) of every assistant turn."""
        messages = normalize_messages(messages)
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

    def rerender_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int, int]]]:
        """The same spans from the per-turn renders of the real text (no skeleton): the slow path, and
        what `spans` is proven equal to."""
        messages = normalize_messages(messages)
        full = self.render(messages)
        return full, self._turn_spans(messages, full, self._text_anchor(messages))

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
        self, messages: list[dict], train_on: str = "assistant", first_message: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """input_ids (int32) and loss mask (bool) of one conversation.

        train_on: assistant = every assistant turn, last = the last one, all = every token. Turns before
        message `first_message` are never trained (prompt/completion rows: the prompt's turns)."""
        self.calls["encode"] += 1
        if train_on == "all":
            text = self.render(normalize_messages(messages))
            enc = self._backend.encode(text, add_special_tokens=False)
            ids = np.asarray(enc.ids, dtype=np.int32)
            return ids, np.ones(len(ids), dtype=bool)
        text, spans = self.spans(messages)
        spans = [s for s in spans if s[0] >= first_message]
        if train_on == "last":
            spans = spans[-1:]
        return self.encode_text(text, [(s, e) for _, s, e in spans])

    def encode_text(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize `text` once; a token is trained iff its first character lies in one of `spans`."""
        if self._split is not None:
            return self._encode_pieces(text, spans)
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
        pieces a span edge falls in. Exact for the tokenizers `_piecewise_split` accepts."""
        pieces = self._split.split(text)  # plain, added, plain, added, ..., plain
        plain = pieces[0::2]
        encs = self._backend.encode_batch_fast(plain, add_special_tokens=False)
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
            offsets = self._backend.encode(pieces[k], add_special_tokens=False).offsets
            local = c - char_starts[k]
            return tok_starts[k] + sum(1 for o in offsets if o[0] < local)

        for s, e in spans:
            if e > s:
                mask[token_at(s) : token_at(e)] = True
        return np.asarray(ids, dtype=np.int32), mask


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


# ---------------------------------------------------------------------------------- the reference
def reference_encode(
    tokenizer, messages: list[dict], train_on: str = "assistant", chat_template: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The reference method, verbatim: for each assistant turn i, tokenize messages[:i] with the generation
    prompt and messages[:i+1]; the tokens between the two lengths are that turn's response tokens.
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
