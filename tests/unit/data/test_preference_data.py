"""Preference rows -> pairs -> packed blocks: the forms users bring, SFT's masks on each side, counted skips.

Each side of a pair is the conversation prompt + completion rendered by the SFT path, so its mask is checked
against the structural mask oracle of tests/unit/data/test_data_masks.py: the oracle's trained tokens from the completion on,
none of the prompt's (a multi-turn prompt's earlier assistant turns are context, not trained).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from _mask_oracle import _tokenizer, oracle

from ftcli.config.errors import UserError
from ftcli.data.chat import ChatEncoder
from ftcli.data.packing import pack_pairs
from ftcli.data.preference import EMPTY, IDENTICAL, NO_PROMPT, PairEncoder, detect, fit_pair, hh_messages, pair
from ftcli.data.validate import BadRow

NAMES = ["qwen3_8", "gptoss", "llama3", "gemma3@tiny", "qwen3@tiny"]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
SYSTEM = {"role": "system", "content": "Answer briefly."}
USER = {"role": "user", "content": "What is 7 plus 6?"}


def ask(text):
    return {"role": "user", "content": text}


def say(text):
    return {"role": "assistant", "content": text}


CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 7}}}]}
RESULT = {"role": "tool", "content": "13"}

# (case, row, prompt messages, chosen completion, rejected completion) for every form
FORMS = [
    ("conversational", {"prompt": [USER], "chosen": [say("13.")], "rejected": [say("15.")]},
     [USER], [say("13.")], [say("15.")]),
    ("standard strings", {"prompt": "What is 7 plus 6?", "chosen": "13.", "rejected": "15."},
     [USER], [say("13.")], [say("15.")]),
    ("multi-turn prompt", {"prompt": [SYSTEM, ask("Hi"), say("Hello."), USER], "chosen": "13.", "rejected": "15."},
     [SYSTEM, ask("Hi"), say("Hello."), USER], [say("13.")], [say("15.")]),
    ("implicit (UltraFeedback)", {"prompt": "What is 7 plus 6?", "chosen": [USER, say("13.")],
                                  "rejected": [USER, say("15.")], "score_chosen": 9.0, "score_rejected": 2.0},
     [USER], [say("13.")], [say("15.")]),
    ("implicit multi-turn", {"chosen": [SYSTEM, ask("Hi"), say("Hello."), USER, say("13.")],
                             "rejected": [SYSTEM, ask("Hi"), say("Hello."), USER, say("15.")]},
     [SYSTEM, ask("Hi"), say("Hello."), USER], [say("13.")], [say("15.")]),
    ("hh-rlhf", {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: What is 7 plus 6?\n\nAssistant: 13.",
                 "rejected": "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: What is 7 plus 6?\n\nAssistant: 15."},
     [ask("Hi"), say("Hello."), USER], [say("13.")], [say("15.")]),
    ("tool turns", {"prompt": [USER], "chosen": [CALL, RESULT, say("13.")], "rejected": [say("15.")], "tools": TOOLS},
     [USER], [CALL, RESULT, say("13.")], [say("15.")]),
]


def _data(**kw):
    return SimpleNamespace(train_on="assistant", special_tokens_in_text="keep", source_list=lambda: [], **kw)


@pytest.mark.parametrize("case", [c[0] for c in FORMS])
def test_each_form_becomes_its_prompt_and_completions(case):
    _, row, prompt, chosen, rejected = next(f for f in FORMS if f[0] == case)
    p = pair(row)
    assert (p.prompt, p.chosen, p.rejected) == (prompt, chosen, rejected) or (
        p.prompt == row["prompt"] and case == "standard strings")


@pytest.mark.parametrize("name", NAMES)
def test_each_side_trains_only_its_completion_as_the_mask_oracle_says(name):
    tok = _tokenizer(name)
    enc = PairEncoder(_data(), tok, [SimpleNamespace(format="auto", tools_field="tools")])
    chat = ChatEncoder(tok)
    checked = 0
    for case, row, prompt, chosen, rejected in FORMS:
        (got,) = enc(0, row)
        if isinstance(got, BadRow):  # Gemma's template refuses tool turns: a counted skip, never a wrong mask
            assert got.reason == "template error" and name.startswith("gemma") and case == "tool turns", (case, got)
            continue
        for ids, mask, completion in ((got.chosen_ids, got.chosen_mask, chosen),
                                      (got.rejected_ids, got.rejected_mask, rejected)):
            want_ids, want_mask = chat.encode(prompt + completion, first_message=len(prompt),
                                              tools=row.get("tools"))
            assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist(), case
            first = int(np.flatnonzero(mask)[0])
            marked = oracle(name, tok, ids.tolist())
            assert not (mask & ~marked).any(), case  # nothing trained the oracle does not mark
            assert (marked[first:] == mask[first:]).all(), case  # everything the oracle marks in the completion
            assert "7 plus 6" not in tok.decode(ids[mask].tolist())  # no prompt token trained
            assert ("13" in tok.decode(ids[mask].tolist())) == (completion is chosen) or case == "tool turns"
            if case == "tool turns" and completion is chosen:
                tool_result = tok.decode(ids[~mask].tolist())
                assert "13" in tool_result  # the tool's result is context, not trained
            checked += 1
    assert checked == 2 * (len(FORMS) - name.startswith("gemma"))


BAD = [
    ({"prompt": [USER], "chosen": [say("13.")], "rejected": [say("13.")]}, IDENTICAL),
    ({"prompt": "Q", "chosen": "same", "rejected": "same"}, IDENTICAL),
    ({"chosen": [USER, say("13.")], "rejected": [USER, say("13.")]}, IDENTICAL),
    ({"prompt": [USER], "chosen": [say("13.")], "rejected": [say("  ")]}, EMPTY),
    ({"prompt": "Q", "chosen": "", "rejected": "x"}, EMPTY),
    ({"prompt": [USER], "chosen": [], "rejected": [say("x")]}, EMPTY),
    ({"chosen": [say("a")], "rejected": [say("b")]}, NO_PROMPT),
    ({"prompt": [USER], "chosen": [say("13.")]}, "rejected missing"),
    ({"prompt": [{"role": "wizard", "content": "x"}], "chosen": "a", "rejected": "b"}, "unknown role"),
    ({"chosen": "no turns here", "rejected": "x"}, "not a preference pair"),
]


@pytest.mark.parametrize("row,reason", BAD)
def test_bad_pairs_are_skipped_with_their_reason(row, reason):
    enc = PairEncoder(_data(), _tokenizer("qwen3_8"), [SimpleNamespace(format="auto", tools_field="tools")])
    (result,) = enc(0, row)
    assert isinstance(result, BadRow) and result.reason == reason, result


def test_a_prompt_the_template_refuses_is_a_counted_template_error():
    """Gemma's template raises on two user turns in a row: the pair is skipped, counted as a template error."""
    enc = PairEncoder(_data(), _tokenizer("gemma3@tiny"), [SimpleNamespace(format="auto", tools_field="tools")])
    (result,) = enc(0, {"prompt": [USER, ask("again")], "chosen": "a", "rejected": "b"})
    assert isinstance(result, BadRow) and result.reason == "template error"


def test_hh_transcript_parsed_into_turns():
    assert hh_messages("\n\nHuman: a b\n\nAssistant: c\n\nHuman: d\n\nAssistant:") == [
        ask("a b"), say("c"), ask("d"), say("")]


def test_detect_names_the_form_of_most_rows():
    rows = [FORMS[0][1]] * 3 + [FORMS[5][1]] * 2 + [{"messages": []}]
    assert detect(rows) == ("explicit", "auto: 3 of the first 6 rows are explicit preference pairs")
    assert detect([{"messages": []}])[0] is None


def test_fit_pair_keeps_a_short_side_whole():
    assert fit_pair(10, 20, 100) == (10, 20)
    assert fit_pair(10, 200, 100) == (10, 90)
    assert fit_pair(300, 30, 100) == (70, 30)
    assert fit_pair(300, 200, 100) == (50, 50)


# --------------------------------------------------------------------------------------- packing
def _pairs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, (a, b) in enumerate(lengths):
        out.append((i, rng.integers(5, 99, a).astype(np.int32), np.r_[False, np.ones(a - 1, bool)],
                    rng.integers(5, 99, b).astype(np.int32), np.r_[False, np.ones(b - 1, bool)]))
    return out


def test_pairs_are_never_split_and_sides_stay_adjacent():
    pairs = _pairs([(5, 9), (30, 2), (12, 12), (3, 4), (20, 25), (8, 1)])
    blocks = list(pack_pairs(pairs, 48, 64))
    seen = []
    for ids, mask, segs, roles in blocks:
        assert sum(segs) == len(ids) <= 48 and roles == [0, 1] * (len(segs) // 2)
        pos = 0
        for c, r in zip(segs[0::2], segs[1::2]):
            k = next(k for k, p in enumerate(pairs) if len(p[1]) == c and len(p[3]) == r
                     and (ids[pos:pos + c] == p[1]).all())
            assert (ids[pos + c:pos + c + r] == pairs[k][3]).all()
            seen.append(k)
            pos += c + r
    assert sorted(seen) == list(range(len(pairs)))
    assert [segs for _, _, segs, _ in pack_pairs(pairs[:2], None, 64)] == [[5, 9], [30, 2]]  # packing off


def _recipe(tmp_path, rows, **over):
    from ftcli.config.recipe import load_recipe

    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"data.path={path}", "data.format=auto", "data.packing.strategy=bfd", f"data.cache_dir={tmp_path}/cache",
            "data.packing.block_len=64", *[f"{k}={v}" for k, v in over.items()]]
    return load_recipe("tiny-qwen3-cpu", sets)


def test_prepare_packs_pairs_and_counts_every_row(tmp_path):
    from ftcli.data import pipeline
    from ftcli.data.chat import load_tokenizer
    from ftcli.data.spec import DataSpec

    long = "1 2 3 4 5 6 7 8 9 " * 8
    rows = [FORMS[0][1], FORMS[1][1], FORMS[3][1], BAD[0][0], BAD[3][0],
            {"prompt": [USER], "chosen": [say(long)], "rejected": [say(long + "x")]}]
    recipe = _recipe(tmp_path, rows, **{"data.packing.overlong": "drop"})
    tok = load_tokenizer(recipe.model, recipe.data)
    ds = pipeline.prepare_blocks(DataSpec(recipe.name, recipe.data, pairs=True), tok)
    st = ds.stats
    assert st.examples_read == 6 and st.pairs == 3 and ds.paired
    assert st.skipped == {IDENTICAL: 1, EMPTY: 1, "longer than block": 1}
    assert st.trained_lost_overlong > 100
    blocks = [ds[i] for i in range(len(ds))]
    assert sum(len(b.pairs) for b in blocks) == 3
    for b in blocks:
        for c, r in b.pairs:  # each side starts a segment at position 0 and trains only its completion
            for s in (c, r):
                a, e = b.cu_seqlens[s], b.cu_seqlens[s + 1]
                assert b.position_ids[a] == 0 and (b.seq_idx[a:e] == s).all()
                assert tok.decode(b.labels[a:e][b.labels[a:e] != -100]).strip().endswith("<|im_end|>")
    truncated = pipeline.prepare_blocks(DataSpec(recipe.name, _recipe(
        tmp_path, rows, **{"data.packing.overlong": "truncate"}).data, pairs=True), tok).stats
    assert truncated.pairs == 4 and truncated.truncated == 1 and truncated.trained_lost_truncation > 0


def test_no_usable_pair_stops_in_one_line(tmp_path):
    from ftcli.data import pipeline
    from ftcli.data.chat import load_tokenizer
    from ftcli.data.spec import DataSpec

    recipe = _recipe(tmp_path, [BAD[0][0], BAD[3][0]])
    with pytest.raises(UserError) as e:
        pipeline.prepare(DataSpec(recipe.name, recipe.data, pairs=True), load_tokenizer(recipe.model, recipe.data))
    assert str(e.value) == (f"no usable preference pair in the data (2 rows read; 1 {IDENTICAL}; 1 {EMPTY})")
    sft_rows = _recipe(tmp_path, [{"messages": [USER, say("13.")]}])
    with pytest.raises(UserError, match="needs .prompt, chosen, rejected. rows"):
        pipeline.prepare(DataSpec(recipe.name, sft_rows.data, pairs=True), load_tokenizer(recipe.model, recipe.data))


def test_pack_preview_names_each_segments_pair_and_side(tmp_path):
    from typer.testing import CliRunner

    from ftcli.cli import app

    res = CliRunner().invoke(app, ["pack-preview", "-r", "tiny-dpo-cpu", "--set", f"data.cache_dir={tmp_path}",
                                   "--set", "eval=null", "--set", "data.max_examples=40"])
    assert res.exit_code == 0, res.output
    for side in ("0 (pair 0 chosen)", "1 (pair 0 rejected)", "⟦segment 1 (pair 0 rejected)⟧"):
        assert side in res.output
    assert "preference (auto: " in res.output  # the summary names the form the rows were detected in
