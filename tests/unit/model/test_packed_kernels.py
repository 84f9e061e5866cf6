"""A packed block gives every example exactly what it would get alone (CPU, fp32, tiny random models).

The block used throughout (last segment = padding, no loss):

    segment   0 (70 tokens)          1 (3)   2 (1)   3 (20)   4 (5, padding)
    why       > gated-delta chunk    < conv  single  ...      padding
              of 64                  width 4 token

"Separate" runs are stock transformers (sdpa / eager attention, its own torch gated-delta rule and conv)
on one example at a time, with ftcli's kernels uninstalled.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from ftcli import hardware
from ftcli.model import kernels
from ftcli.config.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore")

LENGTHS = [70, 3, 1, 20, 5]
VOCAB = 97
LOGITS_ATOL = 1e-5
GRAD_RTOL = 1e-4
LEAK = 1e-2  # a leak moves logits by far more than this; exact runs by far less


@pytest.fixture(autouse=True)
def _uninstall_after_each_test():
    yield
    kernels.disable_packed_kernels()


# ------------------------------------------------------------------------------------------ fixtures
def _text_config(**overrides) -> dict:
    config = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, initializer_range=0.1,
    )
    return {**config, **overrides}


def _slow_decay(model):
    """Gated-delta state that lives across the whole 70-token segment (stock init forgets within a few
    tokens), so a state carried over a boundary shows in the logits."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.uniform_(-4.0, -2.0)
    return model


def qwen35_text(layer_types=("linear_attention", "full_attention")):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = _text_config(layer_types=list(layer_types), num_hidden_layers=len(layer_types))
    return _slow_decay(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)))


def qwen35_vlm():
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, patch_size=4)
    config = Qwen3_5Config(text_config=_text_config(), vision_config=vision, initializer_range=0.1)
    model = AutoModelForImageTextToText.from_config(config)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    return _slow_decay(model)


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # sinks big enough to matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def block(lengths=LENGTHS, seed=0) -> dict:
    """The packed-block call contract: position_ids restart per segment, int32 cu_seqlens and seq_idx."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    return dict(
        input_ids=torch.randint(0, VOCAB, (1, int(lens.sum())), generator=g),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
        seq_idx=torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lens)[None],
    )


def bounds(blk) -> list[tuple[int, int]]:
    cu = blk["cu_seq_lens_q"].tolist()
    return list(zip(cu[:-1], cu[1:]))


def segment_loss(logits, input_ids) -> torch.Tensor:
    """Sum-reduced next-token loss inside one segment."""
    return F.cross_entropy(logits[0, :-1], input_ids[0, 1:], reduction="sum")


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_packed(model, model_type, blk, backward=True, backends=None):
    if backends is None:
        attn, _ = kernels.enable_packed_kernels(model_type, "cpu")
    else:
        attn = kernels.install_backends(model_type, backends)
    model.set_attn_implementation(attn)
    model.zero_grad()
    logits = model(**blk, use_cache=False).logits
    if backward:
        ids = blk["input_ids"]
        loss = sum(segment_loss(logits[:, s:e], ids[:, s:e]) for s, e in bounds(blk)[:-1])  # last = padding
        loss.backward()
    return logits.detach(), grads(model)


def run_separate(model, stock_attn, blk, backward=True):
    kernels.disable_packed_kernels()
    model.set_attn_implementation(stock_attn)
    model.zero_grad()
    ids, pieces = blk["input_ids"], []
    for i, (s, e) in enumerate(bounds(blk)):
        logits = model(ids[:, s:e], use_cache=False).logits
        if backward and i < len(bounds(blk)) - 1:
            segment_loss(logits, ids[:, s:e]).backward()
        pieces.append(logits.detach())
    return torch.cat(pieces, dim=1), grads(model)


def assert_same(packed, separate):
    (logits_p, grads_p), (logits_s, grads_s) = packed, separate
    assert logits_s.abs().max() > 1.0  # logits of a size where a leak would show
    assert (logits_p - logits_s).abs().max().item() <= LOGITS_ATOL
    assert grads_p.keys() == grads_s.keys() and len(grads_s) > 10
    for name, g in grads_s.items():
        rel = ((grads_p[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel <= GRAD_RTOL, f"{name}: relative gradient error {rel:.2e}"


def max_diff_after_first_segment(logits, reference, blk) -> tuple[float, float]:
    first = bounds(blk)[0][1]
    return (
        (logits[:, :first] - reference[:, :first]).abs().max().item(),
        (logits[:, first:] - reference[:, first:]).abs().max().item(),
    )


# ------------------------------------------------------------------------------------------ invariants
def test_packed_logits_equal_separate_qwen35_text():
    model, blk = qwen35_text(), block()
    assert_same(run_packed(model, "qwen3_5_text", blk), run_separate(model, "sdpa", blk))


def test_packed_logits_equal_separate_qwen35_vlm():
    model, blk = qwen35_vlm(), block()
    assert_same(run_packed(model, "qwen3_5", blk), run_separate(model, "sdpa", blk))


def test_packed_logits_equal_separate_gpt_oss():
    model, blk = gpt_oss(), block()
    assert 8 < max(LENGTHS)  # the sliding window (8) is shorter than a segment, so it matters
    assert_same(run_packed(model, "gpt_oss", blk), run_separate(model, "eager", blk))


def test_gpt_oss_segments_from_position_ids_when_cu_seqlens_absent():
    """TRL-style calls with position_ids only: attention derives the segments from the restarts."""
    model, blk = gpt_oss(), block()
    separate, _ = run_separate(model, "eager", blk, backward=False)
    position_only = {k: blk[k] for k in ("input_ids", "position_ids")}
    packed, _ = run_packed(model, "gpt_oss", position_only, backward=False)
    assert (packed - separate).abs().max().item() <= LOGITS_ATOL


def test_packed_call_builds_no_attention_mask():
    """The segments come from cu_seqlens inside the attention call: no T x T mask is materialized for a
    packed block (at 32k tokens that mask alone is 1 GiB), while a padded batch still gets its mask."""
    from transformers.masking_utils import create_causal_mask

    model, blk = qwen35_text(), block()
    attn, _ = kernels.enable_packed_kernels("qwen3_5_text", "cpu")
    model.set_attn_implementation(attn)
    embeds = torch.zeros(1, blk["input_ids"].shape[1], 8)
    assert create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=blk["position_ids"]) is None
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[1, :2] = 0
    padded = create_causal_mask(config=model.config, inputs_embeds=torch.zeros(2, 6, 8), attention_mask=padding,
                                cache=None, position_ids=None)
    assert padded.shape == (2, 1, 6, 6) and not padded[1, 0, :, :2].any()


@pytest.mark.parametrize(
    "build,model_type,stock", [(qwen35_text, "qwen3_5_text", "sdpa"), (gpt_oss, "gpt_oss", "eager")]
)
def test_padded_batch_same_with_packed_kernels(build, model_type, stock):
    """Unpacked use (a right-padded batch, e.g. evaluation) gives what stock transformers gives."""
    model = build()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    with torch.no_grad():
        model.set_attn_implementation(stock)
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation(kernels.enable_packed_kernels(model_type, "cpu")[0])
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert (got - expected)[mask.bool()].abs().max().item() <= LOGITS_ATOL


# ------------------------------------------------------------------------------------------ leaks
def test_leak_caught_when_seq_idx_marks_no_boundaries():
    """The conv is the only op reading seq_idx: one segment in seq_idx moves every later segment."""
    model, blk = qwen35_text(), block()
    separate, _ = run_separate(model, "sdpa", blk, backward=False)
    leaky, _ = run_packed(model, "qwen3_5_text", {**blk, "seq_idx": torch.zeros_like(blk["seq_idx"])}, backward=False)
    first, rest = max_diff_after_first_segment(leaky, separate, blk)
    assert first <= LOGITS_ATOL and rest > LEAK


@pytest.mark.parametrize("layer", ["linear_attention", "full_attention"])
def test_leak_caught_when_cu_seqlens_marks_no_boundaries(layer):
    """Attention and the gated-delta rule read cu_seqlens: with one segment there, each op on its own
    (a model of only that layer kind) moves every later segment."""
    model, blk = qwen35_text(layer_types=(layer, layer)), block()
    separate, _ = run_separate(model, "sdpa", blk, backward=False)
    whole = torch.tensor([0, blk["input_ids"].shape[1]], dtype=torch.int32)
    leaky, _ = run_packed(model, "qwen3_5_text", {**blk, "cu_seq_lens_q": whole, "cu_seq_lens_k": whole},
                          backward=False)
    first, rest = max_diff_after_first_segment(leaky, separate, blk)
    assert first <= LOGITS_ATOL and rest > LEAK


def test_leak_caught_when_gpt_oss_cu_seqlens_marks_no_boundaries():
    model, blk = gpt_oss(), block()
    separate, _ = run_separate(model, "eager", blk, backward=False)
    whole = torch.tensor([0, blk["input_ids"].shape[1]], dtype=torch.int32)
    leaky, _ = run_packed(model, "gpt_oss", {**blk, "cu_seq_lens_q": whole, "cu_seq_lens_k": whole}, backward=False)
    first, rest = max_diff_after_first_segment(leaky, separate, blk)
    assert first <= LOGITS_ATOL and rest > LEAK


def test_dropping_seq_idx_or_cu_seqlens_is_refused():
    model, blk = qwen35_text(), block()
    for dropped in (["seq_idx"], ["cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"]):
        with pytest.raises(ValueError, match="would mix the segments"):
            run_packed(model, "qwen3_5_text", {k: v for k, v in blk.items() if k not in dropped}, backward=False)


def test_leak_caught_with_stock_qwen35_fallbacks():
    """transformers' own torch fallbacks refuse the metadata, and with position_ids alone they leak."""
    model, blk = qwen35_text(), block()
    separate, _ = run_separate(model, "sdpa", blk, backward=False)
    with pytest.raises(ValueError, match="packed sequences"):
        model(**blk, use_cache=False)
    with torch.no_grad():
        stock = model(input_ids=blk["input_ids"], position_ids=blk["position_ids"], use_cache=False).logits
    first, rest = max_diff_after_first_segment(stock, separate, blk)
    assert first <= LOGITS_ATOL and rest > LEAK


def test_leak_caught_with_stock_gpt_oss_eager():
    """gpt-oss builds its masks without position_ids: stock eager attends across segments."""
    model, blk = gpt_oss(), block()
    separate, _ = run_separate(model, "eager", blk, backward=False)
    with torch.no_grad():
        stock = model(**blk, use_cache=False).logits
    first, rest = max_diff_after_first_segment(stock, separate, blk)
    assert first <= LOGITS_ATOL and rest > LEAK


# ------------------------------------------------------------------------------ CUDA wrappers, faked
def _fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's varlen_attn contract (no enable_gqa), computed per segment with sdpa."""
    assert query.dim() == 3 and key.shape[1] == query.shape[1], "[T, H, D] with kv heads repeated"
    assert cu_seq_q.dtype == torch.int32 and window_size == (-1, 0)
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    cu = cu_seq_q.tolist()
    outs = [F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (query, key, value)),
                                           is_causal=True, scale=scale).transpose(0, 1)
            for s, e in zip(cu[:-1], cu[1:])]
    return torch.cat(outs)


def _fake_fla(monkeypatch, calls: list | None = None):
    """fla's varlen entry points (batch 1, long cu_seqlens, [B, T, D] conv layout) over exact references;
    each call's (kernel, cu_seqlens, chunk_indices) is appended to `calls`."""
    kernels.disable_packed_kernels()
    from transformers.models.qwen3_5 import modeling_qwen3_5

    torch_rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    calls = [] if calls is None else calls

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_indices=None):
        assert cu_seqlens.dtype == torch.long and q.shape[0] == 1
        calls.append(("gated_delta_rule", cu_seqlens, chunk_indices))
        cu = cu_seqlens.tolist()
        outs = [torch_rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0] for s, e in zip(cu[:-1], cu[1:])]
        return torch.cat(outs, dim=1), None

    def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, chunk_indices=None):
        assert x.shape[-1] == weight.shape[0] and cu_seqlens.dtype == torch.long, "x is [B, T, D]"
        calls.append(("causal_conv1d", cu_seqlens, chunk_indices))
        cu, x = cu_seqlens.tolist(), x.transpose(1, 2)
        y = torch.cat([kernels.causal_conv1d_reference(x[..., s:e], weight, bias, activation)
                       for s, e in zip(cu[:-1], cu[1:])], dim=-1)
        return y.transpose(1, 2), None

    fakes = {
        "fla": {}, "fla.ops": {}, "fla.modules": {},
        "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": chunk_gated_delta_rule},
        "fla.modules.causal_conv1d": {"causal_conv1d": causal_conv1d},
    }
    for name, attrs in fakes.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)


def test_cuda_wrappers_keep_segments_apart_qwen35(monkeypatch):
    """The varlen_attn / fla wrappers hand the kernels the right layouts (kernels faked by references)."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", _fake_varlen_attn)
    _fake_fla(monkeypatch)
    fast = [kernels.Backend("attention", "torch_varlen", "faked"),
            kernels.Backend("gated_delta_rule", "fla", "faked"),
            kernels.Backend("causal_conv1d", "fla_conv_varlen", "faked")]
    model, blk = qwen35_text(), block()
    assert_same(run_packed(model, "qwen3_5_text", blk, backends=fast), run_separate(model, "sdpa", blk))


def _collated_block(lengths=LENGTHS, seed=0) -> dict:
    """`block()` as ftcli's collator hands it to the model (ftcli.data.block_to_model_inputs)."""
    import numpy as np

    from ftcli.data import block_to_model_inputs, make_block

    ids = block(lengths, seed)["input_ids"][0].numpy()
    trained = np.ones(len(ids), dtype=bool)
    trained[-lengths[-1]:] = False  # the last segment is padding
    return block_to_model_inputs(make_block(ids, trained, list(lengths), len(ids), pad_id=0))


def test_block_tensors_are_built_once_and_reach_every_layer(monkeypatch):
    """fla's int64 boundaries and chunk indices come from the collator, once per block: every gated-delta
    and conv call of every layer, forward and activation-checkpointing recompute alike, gets the same
    tensor objects, no kernel searches the device for boundaries (`nonzero`), and the logits and
    gradients stay those of separate runs."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", _fake_varlen_attn)
    calls = []
    _fake_fla(monkeypatch, calls)
    fast = [kernels.Backend("attention", "torch_varlen", "faked"),
            kernels.Backend("gated_delta_rule", "fla", "faked"),
            kernels.Backend("causal_conv1d", "fla_conv_varlen", "faked")]
    layer_types = ("linear_attention", "linear_attention", "full_attention")
    model, blk = qwen35_text(layer_types), _collated_block()
    assert blk["fla_cu_seqlens"].tolist() == [0, 70, 73, 74, 94, 99] and blk["fla_cu_seqlens"].dtype == torch.long
    # 64-token chunks: segment 0 (70 tokens) has two, every other segment one
    assert blk["fla_chunk_indices"].tolist() == [[0, 0], [0, 1], [1, 0], [2, 0], [3, 0], [4, 0]]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model_inputs = {k: v for k, v in blk.items() if k not in ("labels", "trained_positions")}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        packed = run_packed(model, "qwen3_5_text", model_inputs, backends=fast)
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::nonzero") == 0
    # 2 gated-delta layers x (forward + recompute in backward), for each of the two kernels
    assert sorted(name for name, _, _ in calls) == ["causal_conv1d"] * 4 + ["gated_delta_rule"] * 4
    assert all(cu is blk["fla_cu_seqlens"] and chunks is blk["fla_chunk_indices"] for _, cu, chunks in calls)
    model.gradient_checkpointing_disable()
    assert_same(packed, run_separate(model, "sdpa", block(), backward=True))


def test_fla_kernels_without_block_tensors_derive_them():
    """A call without the collator's tensors (another caller's model call) still gets int64 boundaries
    from its own metadata, and no chunk indices (fla builds them)."""
    from ftcli.model.kernels import ops

    blk = block()
    got = ops._fla_varlen({}, lambda: ops._cu_seqlens_from_seq_idx(blk["seq_idx"]))
    assert set(got) == {"cu_seqlens"} and got["cu_seqlens"].dtype == torch.long
    assert got["cu_seqlens"].tolist() == [0, 70, 73, 74, 94, 99]
    given = _collated_block()
    other_chunk = ops._fla_varlen(given, lambda: None, chunk_size=32)
    assert other_chunk == {"cu_seqlens": given["fla_cu_seqlens"]}  # indices are for 64-token chunks only


@pytest.mark.parametrize("impl", ["chunked", "full"])
def test_loss_with_collated_trained_positions_equals_device_search(impl):
    """token_loss_sum over the collator's trained_positions: the same sum and gradients as finding the
    trained targets on the device, without `nonzero` (a host sync) on the way."""
    from ftcli.train.loss import token_loss_sum

    blk = _collated_block()
    labels, trained = blk["labels"], blk["trained_positions"]
    assert trained.tolist() == [t for t in range(98) if labels[0, t + 1] != -100] and len(trained) == 90
    torch.manual_seed(0)
    hidden, weight = torch.randn(1, 99, 16, requires_grad=True), torch.randn(VOCAB, 16, requires_grad=True)
    searched = token_loss_sum(hidden, weight, labels, impl, 32)
    searched_grads = torch.autograd.grad(searched, (hidden, weight))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        given = token_loss_sum(hidden, weight, labels, impl, 32, trained_positions=trained)
    given_grads = torch.autograd.grad(given, (hidden, weight))
    assert impl == "full" or sum(e.count for e in prof.key_averages() if e.key == "aten::nonzero") == 0
    assert abs(given.item() - searched.item()) <= 1e-4 * abs(searched.item())
    for a, b in zip(given_grads, searched_grads):
        assert (a - b).abs().max().item() <= 1e-5


def test_flex_sinks_forward_equals_separate_gpt_oss(monkeypatch):
    """The CUDA gpt-oss path (document + window BlockMask, sinks through the LSE), forward on CPU. The block's
    boundaries are read off the tensor once for all layers (on CUDA each read waits for the device)."""
    from ftcli.model.kernels import ops

    model, blk = gpt_oss(), block()
    separate, _ = run_separate(model, "eager", blk, backward=False)
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(tuple(t.shape)) or tolist(t))
    monkeypatch.setattr(ops, "_BLOCK_MASKS", {})
    with torch.no_grad():
        packed, _ = run_packed(model, "gpt_oss", blk, backward=False,
                               backends=[kernels.Backend("attention", "flex_sinks", "forward check on CPU")])
    assert (packed - separate).abs().max().item() <= LOGITS_ATOL
    cu_shape = tuple(blk["cu_seq_lens_q"].shape)
    assert model.config.num_hidden_layers >= 2 and reads.count(cu_shape) == 1, reads


# ------------------------------------------------------------------------------------------ decisions
def test_cpu_gets_exact_per_segment_references():
    names = lambda model_type: [(b.op, b.name) for b in kernels.decide_backends(model_type, "cpu")]  # noqa: E731
    expected = [("attention", "sdpa_segments"), ("gated_delta_rule", "torch_segments"),
                ("causal_conv1d", "torch_segments")]
    assert names("qwen3_5") == names("qwen3_5_text") == expected
    assert names("gpt_oss") == [("attention", "eager_segments")]
    assert names("llama") == names("qwen3") == names("qwen3_moe") == names("gemma3_text") == [("attention", "sdpa_segments")]
    assert names("mistral") == []
    assert kernels.check_packing_safe("qwen3_5", "cpu") == []
    assert kernels.check_packing_safe("mistral", "cpu")[0].startswith("packed training is not supported")


def _gpu(capability, triton, *, tilelang=False, flash_attn=False, causal_conv1d=False) -> kernels.Machine:
    importable = {"fla"} | ({"tilelang"} if tilelang else set()) | ({"flash_attn"} if flash_attn else set())
    importable |= {"causal_conv1d"} if causal_conv1d else set()
    return kernels.Machine(
        device="cuda:0", capability=capability, importable=frozenset(importable), torch_varlen=True, flex=True,
        nvcc=True, versions={"torch": "2.11.0", "triton": triton, "flash-linear-attention": "0.6.0",
                             "tilelang": "0.1.15" if tilelang else None},
    )


def test_hopper_with_bad_triton_needs_tilelang():
    decide = lambda m: {b.op: b for b in kernels.decide_backends("qwen3_5", m)}  # noqa: E731
    refused = decide(_gpu((9, 0), "3.6.0"))["gated_delta_rule"]
    assert refused.name == kernels.UNAVAILABLE and "tilelang" in refused.reason and "3.7.1" in refused.reason
    assert decide(_gpu((9, 0), "3.6.0", tilelang=True))["gated_delta_rule"].name == "fla+tilelang"
    assert decide(_gpu((9, 0), "3.3.1"))["gated_delta_rule"].name == "fla"
    assert decide(_gpu((9, 0), "3.7.1"))["gated_delta_rule"].name == "fla"
    assert decide(_gpu((10, 0), "3.6.0"))["gated_delta_rule"].name == "fla"
    with pytest.raises(UserError, match="wrong gated-delta gradients"):
        kernels.install_backends("qwen3_5", list(decide(_gpu((9, 0), "3.6.0")).values()))


def test_cuda_prefers_flash_attn_then_torch_varlen_and_fla():
    h200 = {b.op: b.name for b in kernels.decide_backends("qwen3_5", _gpu((9, 0), "3.6.0", tilelang=True))}
    assert h200 == {"attention": "torch_varlen", "gated_delta_rule": "fla+tilelang",
                    "causal_conv1d": "fla_conv_varlen"}
    full = _gpu((10, 0), "3.6.0", flash_attn=True, causal_conv1d=True)
    assert [b.name for b in kernels.decide_backends("qwen3_5", full)] == ["flash_attn_varlen", "fla", "causal_conv1d"]
    assert [b.name for b in kernels.decide_backends("gpt_oss", full)] == ["flex_sinks"]
    reference = kernels.decide_backends("qwen3_5", full, reference=True)
    assert [b.name for b in reference] == ["sdpa_segments", "torch_segments", "torch_segments"]


def test_every_decidable_backend_has_a_kernel():
    """What `decide_backends` can pick on any machine is in the table `install` and doctor read (or is
    transformers' own flash_attention_2), and the table holds nothing that cannot be picked."""
    machines = [hardware.read("cpu"), _gpu((9, 0), "3.6.0", tilelang=True), _gpu((9, 0), "3.3.1"),
                _gpu((10, 0), "3.6.0", flash_attn=True, causal_conv1d=True),
                kernels.Machine(device="cuda:0", capability=(9, 0)), kernels.Machine(device="cuda:0", flex=True)]
    chosen = {(b.op, b.name) for model_type in kernels.MODEL_FAMILIES for m in machines
              for reference in (False, True) for b in kernels.decide_backends(model_type, m, reference=reference)}
    table = {(op, name) for op, by_name in kernels.KERNELS.items() for name in by_name}
    assert chosen - table == {("attention", "flash_attn_varlen")}
    assert table - chosen == set()
    assert {op for op, _ in chosen} == set(kernels.KERNELS) == {op for ops in kernels.FAMILY_OPS.values() for op in ops}
    assert len({fn for by_name in kernels.KERNELS.values() for fn in by_name.values()}) == 9


# ---------------------------------------------------------------- dense families (Llama 3, Qwen3, Qwen3-MoE, Gemma 3)
def _dense(model_type: str):
    """A tiny random model of each dense family, at the widths the other fixtures use."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, initializer_range=0.1)
    extra = {
        "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}),
        "qwen3": {},
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        # the sliding window (8) is shorter than a segment (70): packed blocks must keep it per segment
        "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                            query_pre_attn_scalar=16),
    }[model_type]
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **common, **extra))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "gemma3_text"])
def test_packed_logits_equal_separate_dense_families(model_type):
    model, blk = _dense(model_type), block()
    assert_same(run_packed(model, model_type, blk), run_separate(model, "sdpa", blk))


def test_gemma3_sliding_window_is_kept_per_segment():
    """The same block with the window dropped from the packed path differs past the window: the check above
    would see a kernel that ignored it."""
    model, blk = _dense("gemma3_text"), block()
    separate, _ = run_separate(model, "sdpa", blk, backward=False)
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        packed, _ = run_packed(model, "gemma3_text", blk, backward=False)
    first = bounds(blk)[0][1]
    assert (packed[:, 8:first] - separate[:, 8:first]).abs().max().item() > LEAK
    assert (packed[:, :8] - separate[:, :8]).abs().max().item() <= LOGITS_ATOL  # inside the window: the same


def test_torch_varlen_keeps_the_sliding_window(monkeypatch):
    """The CUDA torch varlen path hands varlen_attn the window as (window - 1, 0)."""
    import torch.nn.attention.varlen as varlen

    seen = []

    def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        seen.append(window_size)
        cu = cu_seq_q.tolist()
        outs = []
        for s, e in zip(cu[:-1], cu[1:]):
            i = torch.arange(e - s)
            left = window_size[0] if window_size[0] >= 0 else e - s
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= left)
            outs.append(F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (query, key, value)),
                                                       attn_mask=mask, scale=scale).transpose(0, 1))
        return torch.cat(outs)

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    model, blk = _dense("gemma3_text"), block()
    separate, _ = run_separate(model, "sdpa", blk, backward=False)
    with torch.no_grad():
        packed, _ = run_packed(model, "gemma3_text", blk, backward=False,
                               backends=[kernels.Backend("attention", "torch_varlen", "faked on CPU")])
    assert set(seen) == {(7, 0), (-1, 0)}  # the sliding layer and the global one
    assert (packed - separate).abs().max().item() <= LOGITS_ATOL
