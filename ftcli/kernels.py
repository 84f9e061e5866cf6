"""Packed-sequence kernels: per machine, which implementation keeps the segments of a packed block apart.

A packed block is a batch of one row holding several examples end to end. Every layer must keep them
apart, and each op learns the boundaries from its own piece of metadata:

    tokens        | a0 a1 a2 a3 a4 | b0 b1 | c0 | p0 p1 p2 |     p = padding (its own segment, no loss)
    position_ids  |  0  1  2  3  4 |  0  1 |  0 |  0  1  2 |     restart at 0 in every segment
    cu_seqlens    0                5       7    8          11    int32, S+1 boundaries
    seq_idx       |  0  0  0  0  0 |  1  1 |  2 |  3  3  3 |     int32, segment of every token

    full attention: block-diagonal causal        gated-delta rule: the recurrent state restarts
    mask from cu_seqlens (else position_ids)     at every cu_seqlens boundary
            a a a a a b b c p p p                   S <- 0 | a0 .. a4 | S <- 0 | b0 b1 | S <- 0 | c0 ...
        a0  x
        a1  x x                                  causal conv (width W=4): y[t] sums x[t-j], j < W,
        a4  x x x x x                            only where seq_idx[t-j] == seq_idx[t]
        b0            x                              b1 = w3*b1 + w2*b0   (a3, a4 masked out)
        b1            x x                        A segment shorter than W (c0) sees only itself.
        c0                x
        p0                  x                    gpt-oss also has a sliding window (q - k < W) and a
        p2                  x x x                learned sink per head in the softmax denominator.

Backends, chosen per machine by `select_backends` (a pure decision) and installed by
`enable_packed_kernels`:

    op                 CUDA                                             CPU (exact references)
    attention          flash-attn varlen, else torch varlen_attn;       sdpa per segment;
                       gpt-oss: flex attention + sinks                  gpt-oss: eager + sinks per segment
    gated_delta_rule   fla (its tilelang kernels on Hopper + Triton     transformers' chunked torch rule,
                       3.4-3.7.0, else refused: wrong gradients)        run once per segment
    causal_conv1d      causal-conv1d, else fla's Triton varlen conv     torch conv per seq_idx segment

How they are installed: attention through `transformers.AttentionInterface` / `AttentionMaskInterface`
(no model class is touched). transformers offers no hook for the gated-delta rule and the conv when the
`kernels` package is absent (its `use_kernel_func_from_hub_with_fallback` binds fla / causal-conv1d at
import time, and its torch fallbacks raise on `cu_seqlens`/`seq_idx`), so ftcli replaces the two module
globals `torch_chunk_gated_delta_rule` and `causal_conv1d_fn` of the qwen3_5 modeling module, which
the layer looks up at call time. `disable_packed_kernels` puts the originals back.

Without any packing metadata every op computes exactly what transformers computes for one sequence.
An op that is handed the other op's metadata but not its own refuses (ValueError) instead of mixing
segments: a block with `cu_seq_lens_q` but no `seq_idx` (or the reverse) is a collator bug.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ftcli.errors import UserError

log = logging.getLogger(__name__)

UNAVAILABLE = "unavailable"

# model_type -> family; the family decides which ops a packed block goes through.
MODEL_FAMILIES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "gpt_oss": "gpt_oss"}
_OPS = {"qwen3_5": ("attention", "gated_delta_rule", "causal_conv1d"), "gpt_oss": ("attention",)}
QWEN35_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"

# attention backend -> the attn_implementation name models are given
ATTN_IMPLEMENTATIONS = {
    "flash_attn_varlen": "flash_attention_2",
    "torch_varlen": "ftcli_varlen",
    "sdpa_segments": "ftcli_sdpa_segments",
    "flex_sinks": "ftcli_flex_sinks",
    "eager_segments": "ftcli_eager_segments",
}

# Triton versions whose gated chunk backward is wrong on Hopper (fla #640): [3.4.0, 3.7.1)
_BAD_TRITON_ON_HOPPER = ((3, 4, 0), (3, 7, 1))


@dataclass(frozen=True)
class Backend:
    op: str  # attention | gated_delta_rule | causal_conv1d
    name: str  # e.g. torch_varlen, fla+tilelang, torch_segments, or UNAVAILABLE
    reason: str


@dataclass(frozen=True)
class Machine:
    """What the decision needs to know about the machine; `machine(device)` reads it."""

    device: str  # "cpu", "cuda:0"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    versions: dict[str, str | None] = field(default_factory=dict)  # distribution -> version (None: absent)
    importable: frozenset[str] = frozenset()  # fla, tilelang, flash_attn, causal_conv1d
    torch_varlen: bool = False  # torch.nn.attention.varlen.varlen_attn exists
    flex: bool = False  # torch.nn.attention.flex_attention exists
    nvcc: bool = False  # tilelang JIT-compiles its kernels with nvcc
    fla_tilelang_env: str | None = None  # $FLA_TILELANG ("0" disables fla's tilelang backend)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def hopper_bad_triton(self) -> bool:
        """Hopper GPU with a Triton whose gated chunk backward is wrong (fla #640): fla needs tilelang."""
        triton = _version_tuple(self.versions.get("triton"))
        return (self.capability or (0, 0))[0] == 9 and _BAD_TRITON_ON_HOPPER[0] <= triton < _BAD_TRITON_ON_HOPPER[1]

    @property
    def tilelang_usable(self) -> bool:
        return "tilelang" in self.importable and self.nvcc and self.fla_tilelang_env != "0"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _has_nvcc() -> bool:
    """Mirrors fla's check for a usable nvcc (CUDA_HOME, PATH, /usr/local/cuda)."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return True
    return shutil.which("nvcc") is not None


def machine(device: str | torch.device) -> Machine:
    device = torch.device(device)
    capability = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        capability = tuple(torch.cuda.get_device_capability(device))
    dists = ("torch", "triton", "flash-linear-attention", "fla-core", "tilelang", "causal-conv1d", "flash-attn")
    return Machine(
        device=str(device),
        capability=capability,
        versions={name: _dist_version(name) for name in dists},
        importable=frozenset(m for m in ("fla", "tilelang", "flash_attn", "causal_conv1d") if _has_module(m)),
        torch_varlen=_has_module("torch.nn.attention.varlen"),
        flex=_has_module("torch.nn.attention.flex_attention"),
        nvcc=_has_nvcc(),
        fla_tilelang_env=os.environ.get("FLA_TILELANG"),
    )


def _version_tuple(version: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (version or "0").split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def decide_backends(model_type: str, m: Machine, *, reference: bool = False) -> list[Backend]:
    """The backend of every op a packed block of `model_type` goes through on `m` (pure).

    `reference=True` picks the exact torch references even on CUDA (for checks). An unknown model_type
    gets no backends: packing it is not supported.
    """
    family = MODEL_FAMILIES.get(model_type)
    if family is None:
        return []
    fast = m.device_type == "cuda" and not reference
    v = m.versions
    fla = "fla" in m.importable

    def slow(op: str, name: str, what: str, cuda_why: str) -> Backend:
        why = "reference requested" if reference else cuda_why if fast else m.device_type.upper()
        return Backend(op, name, f"{why}: {what} (exact)")

    if family == "gpt_oss":
        if fast and m.flex:
            attention = Backend("attention", "flex_sinks", "flex attention with a document + sliding-window block "
                                "mask, sinks applied through the log-sum-exp")
        else:
            attention = slow("attention", "eager_segments", "eager attention per segment with sliding window and "
                             "sinks", "torch without flex attention")
        return [attention]

    if fast and "flash_attn" in m.importable:
        attention = Backend("attention", "flash_attn_varlen", f"flash-attn {v.get('flash-attn')}")
    elif fast and m.torch_varlen:
        attention = Backend("attention", "torch_varlen", f"no flash-attn: torch {v.get('torch')} varlen_attn")
    else:
        attention = slow("attention", "sdpa_segments", "sdpa per segment", "no flash-attn and no torch varlen_attn")

    fla_name = f"fla {v.get('flash-linear-attention') or v.get('fla-core')}"
    if not (fast and fla):
        gated_delta = slow("gated_delta_rule", "torch_segments", "chunked torch rule per segment",
                           "no fla (pip install flash-linear-attention), slow")
    elif not m.hopper_bad_triton:
        gated_delta = Backend("gated_delta_rule", "fla", fla_name)
    elif m.tilelang_usable:
        gated_delta = Backend("gated_delta_rule", "fla+tilelang", f"Hopper + Triton {v.get('triton')}: fla's Triton "
                              f"backward is wrong there; its tilelang {v.get('tilelang')} kernels run instead")
    else:
        missing = ("tilelang is not installed" if "tilelang" not in m.importable
                   else "FLA_TILELANG=0 disables tilelang" if m.fla_tilelang_env == "0"
                   else "tilelang has no nvcc to compile with")
        gated_delta = Backend("gated_delta_rule", UNAVAILABLE, f"{fla_name} on Hopper with Triton {v.get('triton')} "
                              f"computes wrong gated-delta gradients and {missing}: install tilelang (with a CUDA "
                              "toolkit's nvcc) or Triton >= 3.7.1")

    if fast and "causal_conv1d" in m.importable:
        conv = Backend("causal_conv1d", "causal_conv1d", f"causal-conv1d {v.get('causal-conv1d')} with seq_idx")
    elif fast and fla:
        conv = Backend("causal_conv1d", "fla_conv_varlen", f"no causal-conv1d: {fla_name} Triton varlen conv")
    else:
        conv = slow("causal_conv1d", "torch_segments", "torch conv per seq_idx segment", "no causal-conv1d and no fla")
    return [attention, gated_delta, conv]


def select_backends(
    model_type: str, device: str | torch.device | Machine, *, reference: bool = False
) -> list[Backend]:
    """The backend of every packed op of `model_type` on `device` (no side effects)."""
    m = device if isinstance(device, Machine) else machine(device)
    return decide_backends(model_type, m, reference=reference)


def check_packing_safe(model_type: str, device: str | torch.device | Machine) -> list[str]:
    """Problems that would make packed training of `model_type` wrong (or impossible) on `device`."""
    if model_type not in MODEL_FAMILIES:
        return [f"packed training is not supported for model_type {model_type!r} (ftcli keeps segments apart "
                f"for {', '.join(sorted(MODEL_FAMILIES))}); set data.packing.enabled: false"]
    problems = [f"{b.op}: {b.reason}" for b in select_backends(model_type, device) if b.name == UNAVAILABLE]
    if MODEL_FAMILIES[model_type] == "qwen3_5":
        module = importlib.import_module(QWEN35_MODULE)
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            if not callable(getattr(module, name, None)):
                problems.append(f"this transformers has no {QWEN35_MODULE}.{name} to route packed blocks "
                                "through; use transformers 5.17-5.24")
    return problems


# --------------------------------------------------------------------------------------------- install
_STOCK: dict[str, object] = {}  # qwen3_5 module globals as transformers defined them
_LOGGED: set[tuple] = set()


def enable_packed_kernels(
    model_type: str, device: str | torch.device, *, reference: bool = False
) -> tuple[str, list[Backend]]:
    """Choose and install the packed kernels for `model_type` on `device`; log the choice once.

    Returns the attn_implementation to give `from_pretrained` / `from_config` /
    `model.set_attn_implementation`, and the backends. Raises UserError when packed training of this
    model cannot be correct here (unknown model_type, fla with wrong gradients).
    """
    problems = check_packing_safe(model_type, device)
    if problems:
        raise UserError(problems[0])
    backends = select_backends(model_type, device, reference=reference)
    attn_implementation = install_backends(model_type, backends)
    key = (model_type, str(device), tuple(backends))
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(
            "packed kernels for %s on %s: %s",
            model_type,
            device,
            "; ".join(f"{b.op}={b.name} ({b.reason})" for b in backends),
        )
    return attn_implementation, backends


def install_backends(model_type: str, backends: list[Backend]) -> str:
    """Install the given backends (process-wide) and return the attn_implementation name to use."""
    from transformers import AttentionInterface, AttentionMaskInterface

    by_op = {b.op: b for b in backends}
    missing = set(_OPS[MODEL_FAMILIES[model_type]]) - set(by_op)
    assert not missing, f"no backend for {missing}"
    for b in backends:
        if b.name == UNAVAILABLE:
            raise UserError(f"{b.op}: {b.reason}")

    attention = by_op["attention"].name
    attn_implementation = ATTN_IMPLEMENTATIONS[attention]
    if attn_implementation.startswith("ftcli_"):
        AttentionInterface.register(attn_implementation, _attention_function(attention))
        AttentionMaskInterface.register(attn_implementation, _mask_function(attention))

    if MODEL_FAMILIES[model_type] == "qwen3_5":
        module = importlib.import_module(QWEN35_MODULE)
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            _STOCK.setdefault(name, getattr(module, name))
        module.torch_chunk_gated_delta_rule = _gated_delta_function(by_op["gated_delta_rule"].name)
        module.causal_conv1d_fn = _conv_function(by_op["causal_conv1d"].name)
    return attn_implementation


def disable_packed_kernels() -> None:
    """Put transformers' own gated-delta rule and conv back (registered attention names stay)."""
    if _STOCK:
        module = importlib.import_module(QWEN35_MODULE)
        for name, fn in _STOCK.items():
            setattr(module, name, fn)


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


def _refuse_half_metadata(op: str, own: object, own_name: str, other: object, other_name: str) -> None:
    if own is None and other is not None:
        raise ValueError(
            f"{op} got {other_name} but no {own_name}: it would mix the segments of this packed block; "
            f"pass both {other_name} and {own_name} (ftcli's collator does)"
        )


# ------------------------------------------------------------------------------------ gated-delta rule
def _gated_delta_function(name: str):
    """A stand-in for transformers' `torch_chunk_gated_delta_rule` (same signature and return)."""
    torch_rule = inspect.unwrap(_STOCK["torch_chunk_gated_delta_rule"])

    def gated_delta_torch_segments(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                   output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                   **kwargs):
        _refuse_half_metadata("gated-delta rule", cu_seqlens, "cu_seq_lens_q", kwargs.get("seq_idx"), "seq_idx")
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

        return chunk_gated_delta_rule(
            query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.long),
        )

    return gated_delta_torch_segments if name == "torch_segments" else gated_delta_fla


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


def _conv_function(name: str):
    """A stand-in for transformers' `causal_conv1d_fn(x[B, D, T], weight[D, W], bias, activation, **kw)`."""

    def conv_torch_segments(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        _refuse_half_metadata("causal conv", seq_idx, "seq_idx", kwargs.get("cu_seq_lens_q"), "cu_seq_lens_q")
        return causal_conv1d_reference(hidden_states, weight, bias, activation, seq_idx)

    def conv_fla_varlen(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        _refuse_half_metadata("causal conv", seq_idx, "seq_idx", kwargs.get("cu_seq_lens_q"), "cu_seq_lens_q")
        from fla.modules.causal_conv1d import causal_conv1d

        cu_seqlens = None if seq_idx is None else _cu_seqlens_from_seq_idx(seq_idx).to(torch.long)
        y, _ = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation, cu_seqlens=cu_seqlens)
        return y.transpose(1, 2)

    def conv_causal_conv1d(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        _refuse_half_metadata("causal conv", seq_idx, "seq_idx", kwargs.get("cu_seq_lens_q"), "cu_seq_lens_q")
        from causal_conv1d import causal_conv1d_fn

        return causal_conv1d_fn(hidden_states, weight, bias, seq_idx=seq_idx, activation=activation)

    return {"torch_segments": conv_torch_segments, "fla_conv_varlen": conv_fla_varlen,
            "causal_conv1d": conv_causal_conv1d}[name]


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


def _attention_function(name: str):
    def sdpa_segments(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        cu = _packed_cu_seqlens(module, query, key, attention_mask, kwargs)
        if cu is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
        q, k, v = (_tokens(x) for x in (query, key, value))
        outs = []
        for s, e in _bounds(cu):
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True,
            )
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs).reshape(query.shape[0], query.shape[2], query.shape[1], -1), None

    def torch_varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from torch.nn.attention.varlen import varlen_attn
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        cu = _packed_cu_seqlens(module, query, key, attention_mask, kwargs)
        if cu is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
        if dropout:
            raise ValueError("torch varlen_attn has no attention dropout; set attention_dropout to 0")
        q, k, v = (_tokens(x) for x in (query, key, value))
        params = inspect.signature(varlen_attn).parameters
        extra = {}
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:  # torch 2.11: no GQA, repeat the kv heads
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        if "window_size" in params:
            extra["window_size"] = (-1, 0)  # causal
        else:
            extra["is_causal"] = True  # torch 2.10
        cu = cu.to(device=q.device, dtype=torch.int32)
        max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
        out = varlen_attn(q, k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, scale=scaling, **extra)
        return out.reshape(query.shape[0], query.shape[2], query.shape[1], -1), None

    def eager_segments(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        cu = _packed_cu_seqlens(module, query, key, attention_mask, kwargs)
        if cu is None:
            return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, **kwargs)
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
        return torch.cat(outs).reshape(query.shape[0], query.shape[2], query.shape[1], -1), None

    def flex_sinks(module, query, key, value, attention_mask, scaling=None, dropout=0.0, s_aux=None, **kwargs):
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        cu = _packed_cu_seqlens(module, query, key, attention_mask, kwargs)
        if cu is None:
            return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, **kwargs)
        if dropout:
            raise ValueError("flex attention has no attention dropout; set attention_dropout to 0")
        q, k, v = (_tokens(x).transpose(0, 1)[None] for x in (query, key, value))  # [1, H, B*T, D]
        block_mask = _document_block_mask(cu, q.shape[2], getattr(module, "sliding_window", None), q.device)
        out, lse = _flex(q, k, v, block_mask, scaling)
        if s_aux is not None:
            # softmax over [scores, sink]: each weight shrinks by Z / (Z + e^sink) = sigmoid(lse - sink)
            out = out.float() * torch.sigmoid(lse - s_aux.float()[None, :, None])[..., None]
        out = out.to(query.dtype)[0].transpose(0, 1)  # [B*T, H, D]
        return out.reshape(query.shape[0], query.shape[2], query.shape[1], -1), None

    return {"sdpa_segments": sdpa_segments, "torch_varlen": torch_varlen, "eager_segments": eager_segments,
            "flex_sinks": flex_sinks}[name]


def _mask_function(name: str):
    """No mask for a packed (or unpadded) training call: the attention function builds the segments
    itself, so no T x T mask is materialized. Padded batches and cached decoding get the stock mask."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    stock = eager_mask if name in ("eager_segments", "flex_sinks") else sdpa_mask

    def mask(*args, **kwargs):
        if kwargs.get("attention_mask") is None and not args and _whole_rows(kwargs):
            return None
        return stock(*args, **kwargs)

    return mask


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


_FLEX: dict[str, object] = {}
_BLOCK_MASKS: dict[tuple, object] = {}


def _flex(q, k, v, block_mask, scale):
    """flex_attention (compiled on CUDA) returning the output and its log-sum-exp [1, H, N] in fp32."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if q.device.type == "cuda":
        fn = _FLEX.get("cuda") or _FLEX.setdefault("cuda", torch.compile(flex_attention))
    else:
        fn = flex_attention
    out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse.float()


def _document_block_mask(cu: torch.Tensor, n: int, window: int | None, device):
    """Causal, same-segment (and within the sliding window) BlockMask; cached per block layout."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (tuple(cu.tolist()), n, window, str(device))
    if key not in _BLOCK_MASKS:
        cu = cu.to(device=device, dtype=torch.long)
        doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu[1:] - cu[:-1])

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
