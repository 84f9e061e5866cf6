"""ftcli.model.decode on the tiny models (CPU, float32, eager steps): greedy output equals transformers'
own greedy `generate`, batched rows equal single ones, state reuse across calls, sampling's filters, and
the `_generate_ids` hook."""

from __future__ import annotations

import pytest
import torch

from ftcli import inference as generate
from ftcli.model import decode

CONFIGS = {"qwen": ("tiny-qwen3_5.json", "qwen3_5_text"), "gpt-oss": ("tiny-gpt-oss.json", "gpt_oss")}
PROMPTS = [[5, 17, 300, 42, 9, 81, 77], [3, 900, 12], list(range(100, 140))]  # lengths 7, 3, 40 (past gpt-oss's window 16)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request):
    from ftcli.config.recipe import ModelConfig
    from ftcli.model.build import load_model

    config, model_type = CONFIGS[request.param]
    torch.manual_seed(0)
    model = load_model(ModelConfig(init="random", config=f"pkg://assets/{config}", tokenizer="unused",
                                   model_type=model_type, dtype="float32"))
    with torch.no_grad():  # larger weights than the init's 0.02: decisive logits, so greedy ids test the math
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.eval()
    model.config.use_cache = True
    return request.param, model


def _transformers_greedy(model, prompt, new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_generate_row_by_row_and_batched(tiny):
    _, model = tiny
    expected = [_transformers_greedy(model, p, 8) for p in PROMPTS]
    decoder = decode.Decoder(model, use_graphs=False)
    assert decoder.generate(PROMPTS, 8, stop_ids=[]) == expected
    assert decoder.generate([PROMPTS[1]], 8, stop_ids=[])[0] == expected[1]  # a new state shape, same ids
    assert decoder.generate(PROMPTS, 8, stop_ids=[]) == expected  # the reused state is fully overwritten


def test_rows_stop_after_their_first_stop_token(tiny):
    _, model = tiny
    decoder = decode.Decoder(model, use_graphs=False)
    full = decoder.generate(PROMPTS, 6, stop_ids=[])
    stop = full[0][3]
    cut = decoder.generate(PROMPTS, 6, stop_ids=[stop])
    for row, ids in zip(full, cut):
        end = row.index(stop) + 1 if stop in row else len(row)
        assert ids == row[:end]


def test_generate_ids_hook_takes_the_fast_path_and_matches(tiny, monkeypatch):
    _, model = tiny
    config = generate.Sampling(max_new_tokens=9, greedy=True).generation_config(model, [], 0)
    monkeypatch.setenv("FTCLI_FAST_DECODE", "0")
    slow = generate._generate_ids(model, PROMPTS[:2], config, 0)
    monkeypatch.setenv("FTCLI_FAST_DECODE", "1")
    calls = []
    real = decode.Decoder.generate
    monkeypatch.setattr(decode.Decoder, "generate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert generate._generate_ids(model, PROMPTS[:2], config, 0) == slow
    assert calls == [1]
    assert decode.decoder_for(model) is decode.decoder_for(model)  # one decoder per model per process


def test_pick_filters_follow_transformers_warpers():
    from transformers import GenerationConfig
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    pick = decode.Pick(greedy=False, temperature=0.7, top_k=10, top_p=0.8)
    ref = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(10)(None, TemperatureLogitsWarper(0.7)(None, logits)))
    allowed = torch.isfinite(ref)
    draws = torch.stack([pick(logits) for _ in range(400)])  # [400, 4]
    assert all(allowed[r, draws[:, r]].all() for r in range(4))
    freq = torch.stack([torch.bincount(draws[:, r], minlength=50).float() / 400 for r in range(4)])
    assert (freq - ref.softmax(-1)).abs().max() < 0.1
    assert decode.Pick.from_generation_config(GenerationConfig(do_sample=False)) == decode.Pick()
    assert decode.Pick.from_generation_config(GenerationConfig(repetition_penalty=1.3)) is None


def test_gated_delta_reference_matches_transformers_chunked_rule():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    torch.manual_seed(0)
    q, k = torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)
    v = torch.randn(1, 9, 4, 8)
    g, beta = -torch.rand(1, 9, 4), torch.rand(1, 9, 4)
    ref, ref_state = m.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    out, state = decode.gated_delta_torch(q, k, v, g, beta, torch.zeros(1, 4, 8, 8))
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(state, ref_state, atol=1e-5)


def test_streamed_reply_through_the_fast_path_equals_transformers(tiny, monkeypatch):
    """stream_reply (what `generate --prompt` and `chat` run) streams the same completion either way."""
    name, model = tiny
    from ftcli.config.recipe import resolve_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_path(f"pkg://assets/tokenizer-{name}"))
    loaded = generate.LoadedModel(model=model, tokenizer=tok, stop_ids=generate.stop_token_ids(tok, model),
                                  source=generate.ModelSource(model="tiny"))
    messages = generate.conversation("What is 2 plus 4?")
    sampling = generate.Sampling(max_new_tokens=10, greedy=True)
    replies = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("FTCLI_FAST_DECODE", setting)
        shown = []
        completion, stats = generate.stream_reply(loaded, messages, sampling, write=shown.append)
        replies[setting] = (completion.token_ids, "".join(shown), stats.new_tokens, stats.first_token_s is not None)
    assert replies["1"] == replies["0"]
    assert replies["1"][0] and replies["1"][1] and replies["1"][3]  # tokens, streamed text, a first-token time
    decode.release(model)
    assert model not in decode._DECODERS
