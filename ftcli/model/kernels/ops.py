"""The nine packed kernels: stand-ins for transformers' attention, gated-delta rule and causal conv that
keep the segments of a packed block apart. `KERNELS[op][backend]` is the function `install` puts in
place; `MASKS[backend]` is the mask function registered beside an attention backend.

Every kernel has the signature of what it replaces, and without packing metadata it computes exactly
what transformers computes for one sequence.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
import torch.nn.functional as F

from ftcli.data.collate import FLA_CHUNK
from ftcli.model.kernels.choose import QWEN35_MODULE, SINKS_MODULE

# The Qwen3.5 modeling module's own functions, as transformers defined them: saved by `install` before it
# replaces them, read by the torch gated-delta kernel and by `disable_packed_kernels`.
TRANSFORMERS_ORIGINALS: dict[str, object] = {}


def transformers_original(name: str):
    """transformers' own `name` from the Qwen3.5 modeling module (saved the first time it is asked for)."""
    if name not in TRANSFORMERS_ORIGINALS:
        TRANSFORMERS_ORIGINALS[name] = getattr(importlib.import_module(QWEN35_MODULE), name)
    return TRANSFORMERS_ORIGINALS[name]


# -------------------------------------------------------------------------------------------- helpers
def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(s, e) for s, e in zip(cu[:-1], cu[1:]) if e > s]


def _cu_seqlens_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """[1, T] segment index per token -> int32 boundaries [S+1]."""
    if seq_idx.shape[0] != 1:
        raise ValueError(f"packed blocks have batch size 1; got seq_idx of shape {tuple(seq_idx.shape)}")
    s = seq_idx[0]
    starts = torch.nonzero(s[1:] != s[:-1]).flatten() + 1
    edges = [starts.new_zeros(1), starts, starts.new_full((1,), s.numel())]
    return torch.cat(edges).to(torch.int32)


def _cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[1, T] positions that restart per segment -> int32 boundaries [S+1] (a segment starts where the
    position does not follow its predecessor)."""
    p = position_ids[0]
    starts = torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1
    edges = [starts.new_zeros(1), starts, starts.new_full((1,), p.numel())]
    return torch.cat(edges).to(torch.int32)


def _fla_varlen(kwargs: dict, cu_seqlens, chunk_size: int = FLA_CHUNK) -> dict:
    """fla's varlen arguments: the block's own `fla_cu_seqlens` / `fla_chunk_indices` when the model call
    carries them (ftcli.data.collate builds them once per block; the same tensors reach every layer, so
    nothing here reads the device), else int64 boundaries from `cu_seqlens()` (fla then derives the chunk
    indices itself, one host sync per call)."""
    given = kwargs.get("fla_cu_seqlens")
    if given is None:
        return {"cu_seqlens": cu_seqlens().to(torch.long)}
    chunks = kwargs.get("fla_chunk_indices") if chunk_size == FLA_CHUNK else None
    return {"cu_seqlens": given, **({"chunk_indices": chunks} if chunks is not None else {})}


def _refuse_half_metadata(op: str, own: object, own_name: str, other: object, other_name: str) -> None:
    if own is None and other is not None:
        raise ValueError(
            f"{op} got {other_name} but no {own_name}: it would mix the segments of this packed block; "
            f"pass both {other_name} and {own_name} (ftcli's collator does)"
        )


# ------------------------------------------------------------------------------------ gated-delta rule
# Stand-ins for transformers' `torch_chunk_gated_delta_rule` (same signature and return).
def gated_delta_torch_segments(query, key, value, g, beta, chunk_size=64, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    _refuse_half_metadata("gated-delta rule", cu_seqlens, "cu_seq_lens_q", kwargs.get("seq_idx"), "seq_idx")
    torch_rule = inspect.unwrap(transformers_original("torch_chunk_gated_delta_rule"))
    args = dict(chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                output_final_state=output_final_state)
    if cu_seqlens is None:
        return torch_rule(query, key, value, g=g, beta=beta, initial_state=initial_state, **args)
    if query.shape[0] != 1 or initial_state is not None:
        raise ValueError("packed blocks have batch size 1 and no recurrent cache")
    outs, finals = [], []
    for s, e in _bounds(cu_seqlens):
        o, final = torch_rule(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **args)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, dim=1), (torch.cat(finals) if output_final_state else None)


def gated_delta_fla(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    _refuse_half_metadata("gated-delta rule", cu_seqlens, "cu_seq_lens_q", kwargs.get("seq_idx"), "seq_idx")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    varlen = {} if cu_seqlens is None else _fla_varlen(kwargs, lambda: cu_seqlens, chunk_size)
    return chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **varlen,
    )


# ---------------------------------------------------------------------------------------- causal conv
def causal_conv1d_reference(x, weight, bias=None, activation=None, seq_idx=None):
    """transformers' torch conv (depthwise, causal, x [B, D, T], weight [D, W]) run once per segment of
    seq_idx [1, T], so no output reaches back across a boundary; without seq_idx, one run over all of x."""
    from transformers.activations import ACT2FN

    def conv(xs):
        out = F.conv1d(xs.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
        return out[..., : xs.shape[-1]]

    if seq_idx is None:
        out = conv(x)
    else:
        out = torch.cat([conv(x[..., s:e]) for s, e in _bounds(_cu_seqlens_from_seq_idx(seq_idx))], dim=-1)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


# Stand-ins for transformers' `causal_conv1d_fn(x[B, D, T], weight[D, W], bias, activation, **kw)`.
def conv_torch_segments(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    _refuse_half_metadata("causal conv", seq_idx, "seq_idx", kwargs.get("cu_seq_lens_q"), "cu_seq_lens_q")
    return causal_conv1d_reference(hidden_states, weight, bias, activation, seq_idx)


def conv_fla_varlen(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    _refuse_half_metadata("causal conv", seq_idx, "seq_idx", kwargs.get("cu_seq_lens_q"), "cu_seq_lens_q")
    from fla.modules.causal_conv1d import causal_conv1d

    varlen = {} if seq_idx is None else _fla_varlen(kwargs, lambda: _cu_seqlens_from_seq_idx(seq_idx))
    y, _ = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation, **varlen)
    return y.transpose(1, 2)


def conv_causal_conv1d(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    _refuse_half_metadata("causal conv", seq_idx, "seq_idx", kwargs.get("cu_seq_lens_q"), "cu_seq_lens_q")
    from causal_conv1d import causal_conv1d_fn

    return causal_conv1d_fn(hidden_states, weight, bias, seq_idx=seq_idx, activation=activation)


# ------------------------------------------------------------------------------------------- attention
def _packed_cu_seqlens(module, query, key, attention_mask, kwargs) -> torch.Tensor | None:
    """Segment boundaries over the B*T flattened tokens, or None when the call is not a causal
    self-attention over whole rows (a padded batch, a cached decode step, the vision tower): those go to
    the stock implementation with the mask transformers built."""
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        return None
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return None
    batch, seq_len = query.shape[0], query.shape[2]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None and batch == 1 and kwargs.get("position_ids") is not None:
        cu = _cu_seqlens_from_position_ids(kwargs["position_ids"].reshape(1, -1))
    if cu is None:  # whole rows
        cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=query.device)
    elif batch != 1:
        raise ValueError(f"packed blocks have batch size 1; got cu_seq_lens_q with a batch of {batch}")
    return cu


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B*T, H, D]."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _rows(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """[B*T, H, D] -> [B, T, H, D], the layout attention functions return."""
    return out.reshape(query.shape[0], query.shape[2], query.shape[1], -1)


# Attention functions for `transformers.AttentionInterface`: (module, q, k, v [B, H, T, D], mask, ...)
# -> ([B, T, H, D], None).
def _stock_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _stock_eager():
    return importlib.import_module(SINKS_MODULE).eager_attention_forward  # gpt-oss's: it applies the sinks


def _segments_else(stock):
    """Make `kernel(module, q, k, v, cu, scaling, dropout, **kwargs)` an attention function: a call over
    packed segments (`_packed_cu_seqlens`) runs the kernel with their boundaries `cu`; any other call
    goes unchanged to transformers' own implementation, `stock()`."""

    def decorate(kernel):
        @functools.wraps(kernel)
        def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            cu = _packed_cu_seqlens(module, query, key, attention_mask, kwargs)
            if cu is None:
                return stock()(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                               **kwargs)
            return kernel(module, query, key, value, cu, scaling=scaling, dropout=dropout, **kwargs)

        del attention.__wrapped__  # its signature is the attention function's, not the kernel's
        return attention

    return decorate


def _dense_window(kwargs) -> int | None:
    """The sliding window a dense layer asks for (Gemma 3's local layers: keys with q - k < window), or None;
    refuses the attention soft-capping no sdpa / varlen kernel computes."""
    if kwargs.get("softcap") is not None:
        raise ValueError("packed attention has no logit soft-capping; set attn_logit_softcapping to null "
                         "(Gemma 3 has none) or data.packing.enabled: false")
    return kwargs.get("sliding_window") or None


# The per-segment references loop over the segment bounds (data-dependent lengths): never traced by torch.compile
# (one graph per segment length, and inductor's dynamic-shape lowering of them failed on CPU), so a compiled layer
# calls them as they are (`training.compile`: one graph break).
@_segments_else(_stock_sdpa)
@torch.compiler.disable
def sdpa_segments(module, query, key, value, cu, scaling=None, dropout=0.0, **kwargs):
    return _sdpa_per_segment(query, key, value, cu, scaling, dropout, **kwargs)


def _sdpa_per_segment(query, key, value, cu, scaling=None, dropout=0.0, **kwargs):
    window = _dense_window(kwargs)
    q, k, v = (_tokens(x) for x in (query, key, value))
    outs = []
    for s, e in _bounds(cu):
        mask = None
        if window and e - s > window:  # causal and inside the window, per segment
            i = torch.arange(e - s, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
            attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=True,
        )
        outs.append(o[0].transpose(0, 1))
    return _rows(torch.cat(outs), query), None


@_segments_else(_stock_sdpa)
def torch_varlen(module, query, key, value, cu, scaling=None, dropout=0.0, **kwargs):
    from torch.nn.attention.varlen import varlen_attn

    if query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):  # its flash kernel: half precision
        return _sdpa_per_segment(query, key, value, cu, scaling, dropout, **kwargs)  # only (a float32 model: exact)
    if dropout:
        raise ValueError("torch varlen_attn has no attention dropout; set attention_dropout to 0")
    q, k, v = (_tokens(x) for x in (query, key, value))
    params = inspect.signature(varlen_attn).parameters
    extra = {}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:  # torch 2.11: no GQA, repeat the kv heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    window = _dense_window(kwargs)
    if "window_size" in params:
        extra["window_size"] = (window - 1 if window else -1, 0)  # causal (within the sliding window)
    elif window:
        raise ValueError(f"torch {torch.__version__} varlen_attn has no window_size for sliding-window layers; "
                         "use torch >= 2.11 or install flash-attn")
    else:
        extra["is_causal"] = True  # torch 2.10
    cu = cu.to(device=q.device, dtype=torch.int32)
    max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
    out = varlen_attn(q, k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, scale=scaling, **extra)
    return _rows(out, query), None


@_segments_else(_stock_eager)
@torch.compiler.disable
def eager_segments(module, query, key, value, cu, scaling=None, dropout=0.0, **kwargs):
    eager_attention_forward = _stock_eager()
    window = getattr(module, "sliding_window", None)
    q, k, v = (_tokens(x) for x in (query, key, value))
    outs = []
    for s, e in _bounds(cu):
        n = e - s
        i = torch.arange(n, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if window:
            allowed &= i[:, None] - i[None, :] < window
        mask = torch.zeros(n, n, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
        o, _ = eager_attention_forward(
            module, *(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), mask[None, None],
            scaling=scaling, dropout=dropout,
        )
        outs.append(o[0])
    return _rows(torch.cat(outs), query), None


@_segments_else(_stock_eager)
def flex_sinks(module, query, key, value, cu, scaling=None, dropout=0.0, s_aux=None, **kwargs):
    if dropout:
        raise ValueError("flex attention has no attention dropout; set attention_dropout to 0")
    q, k, v = (_tokens(x).transpose(0, 1)[None] for x in (query, key, value))  # [1, H, B*T, D]
    window = getattr(module, "sliding_window", None)
    block_mask = (kwargs.get(BLOCK_MASKS_KWARG) or {}).get(window)  # built before the layers (block_masks_hook)
    if block_mask is None:
        block_mask = _document_block_mask(cu, q.shape[2], window, q.device)
    out, lse = _flex(q, k, v, block_mask, scaling)
    if s_aux is not None:
        # softmax over [scores, sink]: each weight shrinks by Z / (Z + e^sink) = sigmoid(lse - sink)
        out = out.float() * torch.sigmoid(lse - s_aux.float()[None, :, None])[..., None]
    return _rows(out.to(query.dtype)[0].transpose(0, 1), query), None


_FLEX: dict[str, object] = {}
_BLOCK_MASKS: dict[tuple, object] = {}
_LAST_CU: list[tuple[torch.Tensor, tuple[int, ...]]] = []  # (cu tensor, its values): the last block's boundaries


def _flex(q, k, v, block_mask, scale):
    """flex_attention (compiled on CUDA, alone or with the layer that calls it) returning the output and its
    log-sum-exp [1, H, N] in fp32."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if q.device.type == "cuda" and not torch.compiler.is_compiling():  # inside a compiled layer: traced with it
        fn = _FLEX.get("cuda") or _FLEX.setdefault("cuda", torch.compile(flex_attention))
    else:
        fn = flex_attention
    out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse.float()


def _document_block_mask(cu: torch.Tensor, n: int, window: int | None, device):
    """Causal, same-segment (and within the sliding window) BlockMask; cached per block layout."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (_boundaries(cu), n, window, str(device))
    if key not in _BLOCK_MASKS:
        bounds = torch.tensor(key[0], dtype=torch.long)  # the segment of every token, made on the host, then copied
        doc = torch.repeat_interleave(torch.arange(bounds.numel() - 1), bounds[1:] - bounds[:-1]).to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            keep = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
            if window:
                keep = keep & (q_idx - kv_idx < window)
            return keep

        if len(_BLOCK_MASKS) >= 8:
            _BLOCK_MASKS.clear()
        _BLOCK_MASKS[key] = create_block_mask(mask_mod, None, None, n, n, device=device,
                                              _compile=torch.device(device).type == "cuda")
    return _BLOCK_MASKS[key]


def _boundaries(cu: torch.Tensor) -> tuple[int, ...]:
    """cu's values. Reading a CUDA tensor waits for the device; every layer of a forward (and its recompute, and
    the reference's forward over the same inputs) gets the same cu tensor object, so it is read once per block."""
    if _LAST_CU and _LAST_CU[0][0] is cu:
        return _LAST_CU[0][1]
    values = tuple(cu.tolist())
    _LAST_CU[:] = [(cu, values)]
    return values


# The block masks of one packed call, built before the decoder layers (`block_masks_ahead`) and handed to every
# layer's attention in its kwargs under this name: a compiled layer then reads no tensor's values (cu.tolist() is
# a graph break), so flex attention compiles inside the layer's graph.
BLOCK_MASKS_KWARG = "ftcli_block_masks"


def block_masks_hook(windows):
    """A forward pre-hook (`with_kwargs=True`) for a model over packed blocks: for a packed call (`cu_seq_lens_q`
    given) the block mask of every attention window in `windows` (None: full causal) under `BLOCK_MASKS_KWARG`;
    any other call (eval without packing metadata, decoding) is left as it is."""
    windows = tuple(windows)

    def hook(module, args, kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if cu is None or tokens is None or BLOCK_MASKS_KWARG in kwargs:
            return None
        n = tokens.shape[0] * tokens.shape[1]
        return args, {**kwargs, BLOCK_MASKS_KWARG: {w: _document_block_mask(cu, n, w, tokens.device) for w in windows}}

    return hook


# ------------------------------------------------------------------------------------------------ masks
# No mask for a packed (or unpadded) training call: the attention function builds the segments itself,
# so no T x T mask is materialized. Padded batches and cached decoding get the stock mask.
def _whole_rows(kwargs) -> bool:
    """Whether a mask request covers whole sequences (queries = keys, nothing cached). transformers
    5.2x passes q_length/q_offset; earlier 5.x passed cache_position."""
    if "q_length" in kwargs:
        q_length, q_offset = kwargs["q_length"], kwargs.get("q_offset", 0)
    elif isinstance(kwargs.get("cache_position"), torch.Tensor):
        position = kwargs["cache_position"]
        q_length, q_offset = position.shape[0], int(position[0]) if position.numel() else 0
    else:
        return False
    if isinstance(q_offset, torch.Tensor) or isinstance(kwargs.get("kv_offset", 0), torch.Tensor):
        return False
    return q_offset == 0 and kwargs.get("kv_offset", 0) == 0 and q_length == kwargs.get("kv_length")


def _packed_call(args, kwargs) -> bool:
    return kwargs.get("attention_mask") is None and not args and _whole_rows(kwargs)


def sdpa_mask_unless_packed(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    return None if _packed_call(args, kwargs) else sdpa_mask(*args, **kwargs)


def eager_mask_unless_packed(*args, **kwargs):
    from transformers.masking_utils import eager_mask

    return None if _packed_call(args, kwargs) else eager_mask(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ table
# op -> backend name (as `decide_backends` names it) -> kernel. flash_attn_varlen is not here: it is
# transformers' own "flash_attention_2".
KERNELS = {
    "attention": {
        "sdpa_segments": sdpa_segments,
        "torch_varlen": torch_varlen,
        "eager_segments": eager_segments,
        "flex_sinks": flex_sinks,
    },
    "gated_delta_rule": {
        "torch_segments": gated_delta_torch_segments,
        "fla": gated_delta_fla,
        "fla+tilelang": gated_delta_fla,  # fla picks its tilelang kernels itself
    },
    "causal_conv1d": {
        "torch_segments": conv_torch_segments,
        "fla_conv_varlen": conv_fla_varlen,
        "causal_conv1d": conv_causal_conv1d,
    },
}
MASKS = {
    "sdpa_segments": sdpa_mask_unless_packed,
    "torch_varlen": sdpa_mask_unless_packed,
    "eager_segments": eager_mask_unless_packed,
    "flex_sinks": eager_mask_unless_packed,
}
