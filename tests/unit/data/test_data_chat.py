"""Chat tokenization + loss masks on the real templates TRL ships (trl/chat_templates/*.jinja).

Three methods, one answer:
* the published qwen-b300 loop's method (re-render + re-tokenize per assistant turn, `reference_encode`),
* ftcli's method (`ChatEncoder`: one render parsed by the template's markers, or for templates of no
  known marker family a cached skeleton per conversation shape; one tokenization),
* the `{% generation %}` oracle of the `*_training.jinja` twins (`return_assistant_tokens_mask=True`),
  which by design also marks the part of the generation prompt inside its block (`<think>\\n` on Qwen).
"""

from __future__ import annotations

from datetime import datetime

import numpy as np
import pytest
from _data_common import conversations, merging_tokenizer, runs, template, tokenizer

from ftcli.data.chat import ChatEncoder, encode_prompt_completion_text, normalize_messages, reference_encode

CONVS = conversations(40, seed=1)

# Templates whose renders are prefix-preserving (messages[:i] + generation prompt, and messages[:i+1],
# are prefixes of the full render): there the published loop's method is well-defined and ftcli must equal it.
PREFIX_PRESERVING = [
    "qwen3_8", "qwen3_8_training", "qwen3_5_think_training", "qwen3_6_training", "qwen3_training",
    "qwen2_5", "qwen2_5_training", "qwen3_instruct_2507", "llama3", "llama3_training", "gemma3",
    "gemma3_training", "lfm2", "cohere2",
]


def _prefix_preserving(enc: ChatEncoder, messages: list[dict]) -> bool:
    m = normalize_messages(messages)
    full = enc.render(m)
    return all(
        full.startswith(enc.render(m[:i], add_generation_prompt=True)) and full.startswith(enc.render(m[: i + 1]))
        for i, x in enumerate(m)
        if x["role"] == "assistant"
    )


def test_shipped_qwen_template_is_trl_qwen3_8():
    assert tokenizer("qwen").chat_template == template("qwen3_8")
    assert tokenizer("gpt-oss").chat_template == template("gptoss")


@pytest.mark.parametrize("name", PREFIX_PRESERVING)
def test_fast_masks_equal_reference_method(name):
    tok = tokenizer("qwen")
    enc = ChatEncoder(tok, template(name))
    for messages in CONVS:
        assert _prefix_preserving(enc, messages)
        ids, mask = enc.encode(messages)
        ref_ids, ref_mask = reference_encode(tok, messages, chat_template=template(name))
        assert ids.tolist() == ref_ids.tolist()
        assert mask.tolist() == ref_mask.tolist()
    if enc.grammar is None:
        assert enc.calls["skeleton"] > 0  # the skeleton path did the work ...
        assert len(enc._skeletons) < len(CONVS)  # ... from shapes rendered once and reused
    else:
        assert enc.calls["structural"] == len(CONVS)  # one render per conversation, parsed by its markers


@pytest.mark.parametrize("name", ["qwen3_8", "llama3", "qwen2_5", "gemma3", "qwen3_5_think", "gptoss", "phi3"])
def test_skeleton_spans_equal_per_turn_rerender(name):
    """The skeleton shortcut returns exactly the spans of re-rendering every turn on the real text, on
    prefix-preserving and prefix-breaking templates alike."""
    tok = tokenizer("gpt-oss" if name == "gptoss" else "qwen")
    enc = ChatEncoder(tok, template(name))
    for messages in CONVS:
        assert enc.skeleton_spans(messages) == enc.rerender_spans(messages)


@pytest.mark.parametrize(
    "name",
    ["qwen3_8", "qwen3_8_training", "qwen3_5_think_training", "qwen2_5", "gemma3", "lfm2", "qwen3_instruct_2507"],
)
def test_fast_masks_equal_reference_method_with_merging_vocab(name):
    """A vocabulary that merges whitespace makes tokens straddle template boundaries (`<think>\n|\n`):
    ftcli's "a token is trained iff it starts in the span" reproduces the published loop's token counts."""
    tok = merging_tokenizer()
    enc = ChatEncoder(tok, template(name))
    for messages in CONVS:
        ids, mask = enc.encode(messages)
        ref_ids, ref_mask = reference_encode(tok, messages, chat_template=template(name))
        assert ids.tolist() == ref_ids.tolist()
        assert mask.tolist() == ref_mask.tolist()


def test_reference_trains_a_prompt_token_where_bpe_splits_the_prompt_end():
    """Llama-3's generation prompt ends in "\n\n": alone it is one token, before text two. The published
    loop's token count then lands on the second "\n" and trains it; ftcli starts at the response's first token."""
    tok = merging_tokenizer()
    enc = ChatEncoder(tok, template("llama3"))
    for messages in CONVS:
        ids, mask = enc.encode(messages)
        ref_ids, ref_mask = reference_encode(tok, messages, chat_template=template("llama3"))
        assert not (mask & ~ref_mask).any()
        turns = sum(m["role"] == "assistant" for m in messages)
        assert runs(tok, ids, ref_mask & ~mask) == ["\n"] * turns
        assert (ref_mask & ~mask).sum() == turns


# Oracle: the *_training twins' generation blocks. What the oracle trains and ftcli does not is exactly
# the part of the generation prompt inside the block (the prompt supplies it at inference), plus, on
# gpt-oss, the `<|end|>` closing earlier final answers (the model emits `<|return|>` there).
ORACLE_EXTRA = {
    "qwen3_8_training": {"<think>\n"},
    "qwen3_5_think_training": {"<think>\n"},
    "qwen3_6_training": {"<think>\n"},
    "qwen2_5_training": {"\n"},
    "gptoss_training": {"<|start|>assistant", "<|end|>"},
    "llama3_training": set(),
    "gemma3_training": set(),
    "lfm2_training": set(),
    "qwen3_training": set(),
    "qwen3_instruct_2507_training": set(),
    "cohere2_training": set(),
    "glm4moe_training": set(),
}


@pytest.mark.parametrize("name", sorted(ORACLE_EXTRA))
def test_masks_equal_generation_marker_oracle(name):
    tok = tokenizer("gpt-oss" if name.startswith("gptoss") else "qwen")
    enc = ChatEncoder(tok, template(name), date=datetime.now())  # the oracle renders today's date
    extra = set()
    for messages in CONVS:
        ids, mask = enc.encode(messages)
        oracle = tok.apply_chat_template(
            messages, chat_template=template(name), return_assistant_tokens_mask=True, return_dict=True
        )
        assert ids.tolist() == list(oracle["input_ids"])
        oracle_mask = np.asarray(oracle["assistant_masks"], dtype=bool)
        assert not (mask & ~oracle_mask).any()  # ftcli never trains a token outside a generation block
        extra |= set(runs(tok, ids, oracle_mask & ~mask))
    assert extra == ORACLE_EXTRA[name]


def test_gpt_oss_turns_train_what_the_model_generates():
    """gpt-oss renders earlier final answers with `<|end|>` and drops their reasoning, the last one with
    `<|return|>`: prefix-breaking. ftcli trains the common part; the published loop's method lands on wrong tokens."""
    tok = tokenizer("gpt-oss")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 7 plus 6?"},
        {"role": "assistant", "content": "13", "thinking": "add them"},
        {"role": "user", "content": "Count from 1 to 3."},
        {"role": "assistant", "content": "1 2 3", "thinking": "easy"},
    ]
    ids, mask = ChatEncoder(tok).encode(messages)
    assert runs(tok, ids, mask) == [
        "<|channel|>final<|message|>13",
        "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>1 2 3<|return|>",
    ]
    ref_ids, ref_mask = reference_encode(tok, messages)
    assert "<|start|>user<|message|>Count from 1 to 3." in runs(tok, ref_ids, ref_mask)[0]  # leaks into the user turn


def test_qwen3_5_earlier_turns_train_text_and_end_token():
    """Qwen3.5 drops the think block of turns before the last user message (prefix-breaking)."""
    tok = tokenizer("qwen")
    messages = [
        {"role": "user", "content": "What is 7 plus 6?"},
        {"role": "assistant", "content": "13"},
        {"role": "user", "content": "Count from 1 to 3."},
        {"role": "assistant", "content": "1 2 3"},
    ]
    ids, mask = ChatEncoder(tok, template("qwen3_5_think")).encode(messages)
    assert runs(tok, ids, mask) == ["13<|im_end|>\n", "\n</think>\n\n1 2 3<|im_end|>\n"]


def test_qwen3_8_trains_after_the_prefilled_think_tag():
    tok = tokenizer("qwen")
    messages = [{"role": "system", "content": "Hi."}, {"role": "user", "content": "2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "2+2"}]
    ids, mask = ChatEncoder(tok).encode(messages)
    assert runs(tok, ids, mask) == ["2+2\n</think>\n\n4<|im_end|>\n"]


def test_train_on_last_and_all():
    tok = tokenizer("qwen")
    enc = ChatEncoder(tok)
    messages = CONVS[3]
    ids, every = enc.encode(messages, "assistant")
    _, last = enc.encode(messages, "last")
    _, everything = enc.encode(messages, "all")
    assert len(runs(tok, ids, every)) == sum(m["role"] == "assistant" for m in messages)
    assert runs(tok, ids, last) == runs(tok, ids, every)[-1:]
    assert everything.all()
    ref_ids, ref_last = reference_encode(tok, messages, train_on="last")
    assert ref_last.tolist() == last.tolist()


def test_prompt_tokens_masked_in_prompt_completion_rows():
    tok = tokenizer("qwen")
    ids, mask = encode_prompt_completion_text(tok, "What is 7 plus 6?", " 13.", "assistant")
    assert ids[-1] == tok.eos_token_id and mask[-1]
    assert tok.decode(ids[mask].tolist()) == " 13.<|im_end|>"
    assert tok.decode(ids[~mask].tolist()) == "What is 7 plus 6?"
    # conversational prompt/completion: only the completion's assistant turn is trained
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    ids, mask = ChatEncoder(tok).encode(prompt + completion, "assistant", first_message=len(prompt))
    assert runs(tok, ids, mask) == ["\n</think>\n\n4<|im_end|>\n"]


def test_template_date_is_pinned():
    tok = tokenizer("gpt-oss")
    text = ChatEncoder(tok).render([{"role": "user", "content": "hi"}])
    assert "Current date: 2025-01-01" in text


@pytest.mark.parametrize("which", ["qwen", "merging"])
def test_piecewise_tokenization_equals_whole_text_tokenization(which):
    """ftcli tokenizes the pieces between added tokens separately (the tokenizer's own first step):
    identical ids, with an NFC normalizer and combining characters right at the cuts."""
    tok = tokenizer("qwen") if which == "qwen" else merging_tokenizer()
    enc = ChatEncoder(tok, template("qwen3_8"))
    assert enc._split is not None
    texts = [
        "<|im_start|>user\ne\u0301te\u0301<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\u0301ok<|im_end|>",
        "no added tokens at all  \n\n  ",
        "<|im_end|><|im_end|>x<think>",
        *(enc.render(m) for m in CONVS[:10]),
    ]
    for text in texts:
        ids, mask = enc.encode_text(text, [(3, len(text) - 2)])
        whole = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        assert ids.tolist() == whole.ids
        assert mask.tolist() == [3 <= s < len(text) - 2 for s, _ in whole.offsets]
