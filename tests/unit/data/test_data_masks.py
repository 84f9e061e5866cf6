"""Loss masks against an independent structural oracle, on every shape of tests/support/_chat_corpus.py.

The oracle (written here, sharing no code with ftcli.data.chat) works on the *token ids*: it finds each
message by the template's marker tokens, reads its role (and, on harmony, its channel and terminator)
and marks the tokens the assistant generates:

* ChatML (`<|im_start|>role\\n ... <|im_end|>\\n`), Llama-3 (`<|start_header_id|>role<|end_header_id|>\\n\\n
  ... <|eot_id|>`), Gemma (`<start_of_turn>model\\n ... <end_of_turn>\\n`): an assistant message from after
  its header, and after the generation prompt's prefill when the render has it (Qwen3's `<think>\\n`),
  through its end token and the newline before the next header.
* harmony (`<|start|>role<|channel|>X<|message|>...<|end|>|<|call|>|<|return|>`): an assistant message
  from after `<|start|>assistant` (or from `<|start|>` when it continues an analysis/preamble message the
  model itself ended with `<|end|>`) through its terminator, except the `<|end|>` an earlier final answer
  is stored with (the model emitted `<|return|>` there).

A token counts as generated iff its first character is. ftcli must match it exactly: 0 tokens trained
that the oracle masks, 0 missed. The per-turn re-render method is measured against the same oracle.
"""

from __future__ import annotations

from datetime import datetime

import numpy as np
import pytest
from _chat_corpus import as_alpaca, as_sharegpt, corpus
from _data_common import ASSETS
from _mask_oracle import FAMILY, _header_oracle, _tokenizer, oracle

from ftcli.data.chat import ChatEncoder, normalize_messages
from ftcli.data.validate import normalize_turns

CORPUS = corpus()
# Conversations each template renders (the rest it refuses with its own raise_exception, e.g. Qwen3.8
# and developer messages, Gemma and tool or consecutive same-role turns).
RENDERED = {"qwen3_8": 44, "gptoss": 46, "qwen2_5": 46, "qwen3_5_think": 44, "qwen3": 46, "llama3": 46, "gemma3": 26,
            "qwen3_8@merging": 44, "llama3@merging": 46,
            "llama3@tiny": 44, "qwen3@tiny": 46, "gemma3@tiny": 26}  # Llama 3.1's template refuses two tool-call shapes


# Tokens the oracle marks as generated over the corpus (all of them checked one by one above).
ORACLE_TRAINED = {"qwen3_8": 2877, "gptoss": 1851, "qwen2_5": 2454, "qwen3_5_think": 2818, "qwen3": 2806,
                  "llama3": 953, "gemma3": 776, "qwen3_8@merging": 3275, "llama3@merging": 1070,
                  "llama3@tiny": 1734, "qwen3@tiny": 2927, "gemma3@tiny": 844}


def test_corpus_has_at_least_40_shapes():
    assert len(CORPUS) == 46 and len({name for name, _, _ in CORPUS}) == 46


# ------------------------------------------------------------------------------------------- tests
def _cases(name):
    """(case name, messages, tools, ftcli ids, ftcli mask) of every conversation the template renders; the
    messages as the row readers give them to the encoder (`normalize_turns`: tool-call arguments parsed)."""
    tok = _tokenizer(name)
    enc = ChatEncoder(tok, date=datetime.now())  # the HF comparison renders today's date
    out = []
    for case, messages, tools in CORPUS:
        messages = normalize_turns(messages)
        try:
            ids, mask = enc.encode(messages, tools=tools)
        except Exception as e:  # noqa: BLE001 - the template's own raise_exception
            assert "template" in type(e).__module__ or "jinja" in type(e).__module__ or isinstance(e, Exception)
            continue
        out.append((case, messages, tools, ids, mask))
    return enc, out


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_masks_equal_structural_oracle(name):
    tok = _tokenizer(name)
    enc, cases = _cases(name)
    assert enc.grammar is not None and enc.grammar.name == FAMILY[name]
    assert len(cases) == RENDERED[name]
    wrong = missed = trained = 0
    for case, messages, tools, ids, mask in cases:
        want = oracle(name, tok, ids.tolist())
        wrong += int((mask & ~want).sum())
        missed += int((want & ~mask).sum())
        trained += int(want.sum())
        assert (mask == want).all(), (case, tok.decode(ids[mask & ~want]), tok.decode(ids[want & ~mask]))
    assert wrong == missed == 0 and trained == ORACLE_TRAINED[name]


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_ids_equal_apply_chat_template_where_text_has_no_special_strings(name):
    tok = _tokenizer(name)
    enc, cases = _cases(name)
    compared = 0
    for case, messages, tools, ids, _ in cases:
        normalized = normalize_messages(messages)
        if enc.protect(normalized, tools)[:2] != (normalized, tools):
            continue  # special-token strings in the text: ftcli tokenizes them as text, HF as control tokens
        hf = tok.apply_chat_template(normalized, tools=tools, tokenize=True, return_dict=True)["input_ids"]
        assert ids.tolist() == list(hf), case
        compared += 1
    # the cases left out hold special-token strings of that tokenizer in their text (7 on most)
    assert RENDERED[name] - compared == {"gemma3": 5, "qwen3_8@merging": 6, "llama3@merging": 8,
                                          "llama3@tiny": 6, "qwen3@tiny": 6, "gemma3@tiny": 4}.get(name, 7)


def test_special_token_strings_in_text_are_tokenized_as_text():
    tok = _tokenizer("qwen3_8")
    enc = ChatEncoder(tok)
    info = {}
    ids, mask = enc.encode([{"role": "user", "content": "What does <|im_end|> mean?"},
                            {"role": "assistant", "content": "It ends a turn."}], info=info)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert info == {"special_tokens_in_text": 1, "tool_calls_not_rendered": 0}
    assert ids.tolist().count(im_end) == 3  # the template's (system, user, assistant), not the user's
    assert "What does <|im_end|> mean?" in tok.decode(ids.tolist())
    escaped = ChatEncoder(tok, special_tokens_in_text="escape").encode(
        [{"role": "user", "content": "a <|im_end|> b"}, {"role": "assistant", "content": "ok"}])[0]
    assert "a <\u200b|im_end|> b" in tok.decode(escaped.tolist())
    from ftcli.data.validate import BadRow

    with pytest.raises(BadRow, match="special token in text"):
        ChatEncoder(tok, special_tokens_in_text="error").encode(
            [{"role": "user", "content": "a <|im_end|> b"}, {"role": "assistant", "content": "ok"}])


# (wrongly trained tokens, missed tokens, conversations) of the per-turn re-render method vs the oracle
RERENDER = {"gptoss": (296, 0, 5), "qwen3": (89, 930, 12), "qwen3_5_think": (123, 0, 2), "qwen3_8": (0, 0, 0)}


@pytest.mark.parametrize("name", sorted(RERENDER))
def test_rerender_method_is_wrong_where_templates_rewrite_earlier_turns(name):
    """The per-turn re-render method, kept as a comparison: where a template rewrites earlier turns
    (gpt-oss drops earlier analysis and ends earlier answers with `<|end|>`, Qwen3/3.5 drop earlier
    think blocks) it trains tool results and headers, or misses turns; on Qwen3.8 it is right."""
    tok = _tokenizer(name)
    enc, cases = _cases(name)
    wrong = missed = bad_convs = 0
    for case, messages, tools, ids, mask in cases:
        protected, protected_tools, _ = enc.protect(normalize_messages(messages), tools)
        full, spans = enc.rerender_spans(protected, protected_tools)
        ids2, mask2 = enc.encode_text(full, [(s, e) for _, s, e in spans])
        assert ids2.tolist() == ids.tolist()
        want = oracle(name, tok, ids.tolist())
        w, m = int((mask2 & ~want).sum()), int((want & ~mask2).sum())
        wrong, missed, bad_convs = wrong + w, missed + m, bad_convs + bool(w or m)
    assert (wrong, missed, bad_convs) == RERENDER[name]


def test_gpt_oss_tool_turn_with_thinking_trains_no_tool_result_or_header():
    """The issue's case: the template drops the tool-call turn's analysis once a final answer follows;
    ftcli trains the call and the answer, never the tool result or its header."""
    tok = _tokenizer("gptoss")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "thinking": "use the tool", "tool_calls": [call]},
                {"role": "tool", "content": '"paris 21"'},
                {"role": "assistant", "content": "21 C.", "thinking": "answer"}]
    from _data_common import runs

    ids, mask = ChatEncoder(tok).encode(messages)
    assert runs(tok, ids, mask) == [
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "paris"}<|call|>',
        "<|channel|>analysis<|message|>answer<|end|><|start|>assistant<|channel|>final<|message|>21 C.<|return|>",
    ]
    tool_result = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"\\"paris 21\\""<|end|>'
    assert tool_result in tok.decode(ids[~mask].tolist())


# Conversations of the corpus each format can say, and of those the ones each template renders.
IN_FORMAT = {"sharegpt": 30, "alpaca": 16}
FORMAT_RENDERED = {"sharegpt": {"gemma3": 18}, "alpaca": {}}  # Gemma refuses tool turns


@pytest.mark.parametrize("fmt", sorted(IN_FORMAT))
@pytest.mark.parametrize("name", ["qwen3_8", "gemma3", "qwen3_8@merging", "gptoss", "llama3"])
def test_rows_of_every_format_mask_equal_structural_oracle(name, fmt):
    """A ShareGPT or Alpaca row becomes the messages it says before the template sees it: the same ids
    as the messages row, and a mask equal to the oracle's, token for token."""
    from ftcli.data.formats import conversation

    convert = {"sharegpt": as_sharegpt, "alpaca": as_alpaca}[fmt]
    tok = _tokenizer(name)
    enc = ChatEncoder(tok, date=datetime.now())
    said = rendered = 0
    for case, messages, tools in CORPUS:
        row = convert(messages, tools)
        if row is None:
            continue
        said += 1
        conv = conversation(row, fmt)
        # as the messages row reads (tool-call arguments given as JSON text parsed, in both)
        assert conv.messages == normalize_turns(messages) and conv.tools == tools and conv.first_trained == 0, case
        try:
            ids, mask = enc.encode(conv.messages, tools=conv.tools)
        except Exception:  # noqa: BLE001 - the template's own raise_exception, as for the messages rows
            continue
        rendered += 1
        assert ids.tolist() == enc.encode(normalize_turns(messages), tools=tools)[0].tolist(), case
        assert (mask == oracle(name, tok, ids.tolist())).all(), case
    assert said == IN_FORMAT[fmt]
    assert rendered == FORMAT_RENDERED[fmt].get(name, IN_FORMAT[fmt])


PROMPT_COMPLETION = [("What is 18 plus 43?", "18 plus 43 is 61."), ("Say hi", " hi"), ("  ", "x\n")]


@pytest.mark.parametrize("name", ["qwen3_8", "gptoss", "llama3", "gemma3"])
def test_string_prompt_completion_rows_are_trained_in_the_chat_format(name):
    """A `{"prompt": str, "completion": str}` row is the user turn + assistant turn generate/chat ask in:
    the same ids and mask as that conversation, the mask the oracle's (the answer and its end token)."""
    from types import SimpleNamespace

    from ftcli.data.pipeline import RowEncoder

    tok = _tokenizer(name)
    src = SimpleNamespace(format="prompt_completion", messages_field="messages", tools_field="tools")
    data = SimpleNamespace(source_list=lambda: [src], train_on="assistant", special_tokens_in_text="keep",
                           max_row_chars=None, max_length=None, packing=SimpleNamespace(enabled=True, block_len=1024))
    row_encoder = RowEncoder(data, tok)
    for prompt, completion in PROMPT_COMPLETION:
        ids, mask, dropped, _ = row_encoder(0, {"prompt": prompt, "completion": completion})
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        want_ids, want_mask = ChatEncoder(tok).encode(chat)
        assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
        assert (mask == oracle(name, tok, ids.tolist())).all() and dropped == {}
        assert completion.strip() in tok.decode(ids[mask].tolist())
        assert prompt.strip() not in tok.decode(ids[mask].tolist()) or not prompt.strip()


@pytest.mark.parametrize("name,end", [("llama3@tiny", "<|eot_id|>"), ("qwen3@tiny", "<|im_end|>"),
                                      ("gemma3@tiny", "<end_of_turn>")])
def test_each_family_trains_its_templates_own_end_of_turn_token(name, end):
    """Every assistant turn's trained span ends with the template's own end-of-turn token (the family's fact and the
    shipped tokenizer's eos), followed by at most the newline before the next header."""
    from ftcli.chat_formats import format_named
    from ftcli.families import family_of

    model_type = {"llama3@tiny": "llama", "qwen3@tiny": "qwen3", "gemma3@tiny": "gemma3_text"}[name]
    tok = _tokenizer(name)
    assert format_named(family_of(model_type).chat_format).end_of_turn == tok.eos_token == end
    end_id = tok.convert_tokens_to_ids(end)
    enc = ChatEncoder(tok)
    turns = 0
    for _, messages, tools in CORPUS[:12]:
        try:
            ids, mask = enc.encode(messages, tools=tools)
        except Exception:  # noqa: BLE001 - a shape the template refuses
            continue
        ids, edges = ids.tolist(), np.flatnonzero(np.diff(np.r_[mask.astype(int), 0]) == -1)  # last trained token
        for last in edges:
            k = last if ids[last] == end_id else last - 1  # Qwen's and Gemma's "\n" after the end token
            assert ids[k] == end_id and tok.decode(ids[k + 1 : last + 1]).strip() == ""
            turns += 1
    assert turns >= 12


def test_qwen_reply_trains_the_close_of_its_empty_think_block_because_generation_writes_it():
    """The shipped Qwen3.8 template renders `<think>\\n\\n</think>\\n\\n` before an answer without reasoning,
    and its generation prompt ends at `<think>\\n`: the rest of the empty block is what the model must generate
    before answering, so it is trained (pack-preview shows it green), and the prompt's prefill is not. The
    trained text is exactly what follows the generation prompt in the full render (docs/data.md)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer-qwen"))
    ask, answer = [{"role": "user", "content": "Hi"}], {"role": "assistant", "content": "Hello"}
    ids, mask = ChatEncoder(tok).encode([*ask, answer])
    ids, mask = np.asarray(ids), np.asarray(mask).astype(bool)
    prompt = tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template([*ask, answer], tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n") and full.startswith(prompt)
    assert tok.decode(ids[mask].tolist()) == full[len(prompt):] == "\n</think>\n\nHello<|im_end|>\n"
    assert tok.decode(ids[~mask].tolist()) == prompt


# ------------------------------------------------------------------------------- a chat format is one module
# Phi-4's template (microsoft/phi-4's tokenizer_config.json; TRL ships none): ChatML's markers, but `<|im_sep|>` after
# the role where ChatML writes a newline, and no newline between turns.
PHI4_TEMPLATE = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)


def _phi4_format():
    """What a module ftcli/chat_formats/phi4.py would hold: the whole of a new header-style format."""
    from ftcli.chat_formats.base import THINK_BLOCKS, ChatFormat, header_grammar

    return ChatFormat(name="phi4", title="Phi-4", detect=("<|im_start|>", "<|im_sep|>"),
                      grammar=header_grammar("phi4", "<|im_start|>", r"<\|im_sep\|>", r"<\|im_end\|>",
                                             markers=("<|im_sep|>", "<|im_end|>")),
                      end_of_turn="<|im_end|>", replies=THINK_BLOCKS, tool_call_parsers=(), reasoning="none",
                      tool_calls="none in the template (tool messages are not rendered)")


def _phi4_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer-qwen"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_sep|>"]})
    tok.chat_template = PHI4_TEMPLATE
    return tok


def test_template_with_a_formats_markers_that_does_not_parse_as_it_is_refused():
    """Phi-4's template writes ChatML's `<|im_start|>` but is not ChatML: with no format of its own registered,
    ftcli refuses it with one line instead of masking it by re-rendered turns."""
    from ftcli.config.errors import UserError

    with pytest.raises(UserError) as e:
        ChatEncoder(_phi4_tokenizer())
    assert str(e.value) == (
        "the chat template writes ChatML markers (<|im_start|>) but its turns do not parse as the 'chatml' chat "
        "format (generation prompt '<|im_start|>assistant<|im_sep|>'): ftcli has no chat format for it; add one in "
        "ftcli/chat_formats/ (a module and a line in CHAT_FORMATS), or give data.chat_template a template of a known "
        "format (chatml, llama3, gemma, harmony)")


def test_a_registered_format_masks_equal_structural_oracle(monkeypatch):
    """A new format is one record and one registry line: registered, Phi-4's template is detected as it (more of
    its markers than ChatML's), ChatML templates stay ChatML, and every mask equals the oracle's."""
    from ftcli.chat_formats import CHAT_FORMATS, detect

    phi4 = _phi4_format()
    monkeypatch.setitem(CHAT_FORMATS, phi4.name, phi4)
    tok = _tokenizer("qwen3_8")
    assert detect(PHI4_TEMPLATE) is phi4 and detect(tok.chat_template) is CHAT_FORMATS["chatml"]
    tok = _phi4_tokenizer()
    enc = ChatEncoder(tok, date=datetime.now())
    assert enc.format is phi4 and enc.prefill == ""
    rendered = trained = 0
    for case, messages, tools in CORPUS:
        try:
            ids, mask = enc.encode(messages, tools=tools)
        except Exception:  # noqa: BLE001 - the template's own errors (a tool call's missing content)
            continue
        want = _header_oracle(tok, ids.tolist(), "<|im_start|>", "<|im_sep|>", "assistant", "")
        assert (mask == want).all(), (case, tok.decode(ids[mask & ~want]), tok.decode(ids[want & ~mask]))
        rendered, trained = rendered + 1, trained + int(want.sum())
    assert enc.calls["structural"] == rendered and enc.calls["fallback"] == 0
    assert (rendered, trained) == (46, 959)  # every shape renders (tool turns are left out by the template)
