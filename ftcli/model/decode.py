"""Fast decoding for the hybrid Qwen3.5 model and gpt-oss: static state, one CUDA graph per step.

Why: transformers' `generate` on Qwen3.5 runs the conv-state update through its PyTorch fallback
(causal-conv1d is not installed), re-derives masks and cache bookkeeping on the host every token and
launches ~30 small kernels per layer one by one, so a 64-layer model is bound by launch latency and host
syncs, not by reading its weights (issue 30: 3.7 tokens/s on one H200). Here one decoding step is:

    embed(tok) -> per layer: norm -> token mixer -> norm -> MLP -> final norm -> lm_head -> pick -> tok

on buffers allocated once per (batch, positions) shape, so the whole step is captured in one CUDA graph
and replayed per token (no host work in between but the replay and a non-blocking copy of the new token).

    gated-delta layers  conv state [B, conv_dim, W] (the last W inputs, fla's layout) updated in place by
                        fla's `causal_conv1d_update` (torch on CPU); recurrent state [B, HV, K, V] in
                        float32 stepped by fla's `fused_recurrent_gated_delta_rule` (torch on CPU)
    attention layers    a static KV cache [B, L, kv_heads, head_dim]; the new key/value is written at each
                        row's own position (index_put), attention is masked to each row's length (and
                        gpt-oss's sliding window), with gpt-oss's per-head sinks
    gpt-oss experts     transformers' `grouped_mm_experts_forward` (reads only the routed experts' weights,
                        no host sync: histc offsets)
    prefill             one sequence at a time (no padding at all): fla's chunked gated-delta kernel and
                        fla's varlen-capable causal conv with their final states, SDPA for attention; it
                        writes each row's states into the static buffers

The decoding itself is greedy or sampled (temperature -> top-k -> top-p, as transformers orders them; the
draw is an exponential race, which needs no host sync). Greedy output is transformers' own greedy output
(tests/unit/model/test_decode.py on the tiny models; benchmarks/generate_gpu.py on the 27B width).

One `Decoder` per model per process (`decoder_for` keeps it), so `ftcli chat` pays the graph capture once
per state shape; positions are bucketed to multiples of 1024 so later turns reuse it. A capture is said
on stderr. Set FTCLI_FAST_DECODE=0 to use transformers' generate, 1 to use this path on CPU as well
(default: CUDA only).
"""

from __future__ import annotations

import math
import os
import sys
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ftcli.families import find_family
from ftcli.families.base import HYBRID, SINK_MOE

POSITION_BUCKET = 1024
_DECODERS: "weakref.WeakKeyDictionary[nn.Module, Decoder]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------------------ sampling
@dataclass(frozen=True)
class Pick:
    """How the next token is chosen from the logits (part of a captured graph's key)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def from_generation_config(cls, config) -> "Pick | None":
        """The Pick a transformers GenerationConfig asks for; None when it asks for more than this path does
        (repetition penalties, beams, forced tokens, ...): then transformers' generate runs instead."""
        unsupported = {"num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None,
                       "min_length": 0, "bad_words_ids": None, "forced_bos_token_id": None,
                       "forced_eos_token_id": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                       "sequence_bias": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                       "min_p": None, "encoder_repetition_penalty": 1.0, "num_return_sequences": 1,
                       "penalty_alpha": None, "guidance_scale": None, "watermarking_config": None}
        for name, neutral in unsupported.items():
            value = getattr(config, name, neutral)
            if value not in (neutral, None) and not (name == "min_length" and value == 0):
                return None
        if not getattr(config, "do_sample", False):
            return cls(greedy=True)
        return cls(greedy=False, temperature=float(config.temperature or 1.0), top_k=int(config.top_k or 0),
                   top_p=float(config.top_p if config.top_p is not None else 1.0))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, vocab] -> [B] token ids."""
        if self.greedy:
            return logits.argmax(-1)
        scores = logits.float() / max(self.temperature, 1e-5)
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=False)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            drop = cumulative <= 1 - self.top_p
            drop[..., -1:] = False  # always keep the most likely token
            scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        probs = scores.softmax(-1)
        race = torch.empty_like(probs).exponential_()  # argmax(p / Exp(1)) is a draw from p, no host sync
        return (probs / race).argmax(-1)


# ------------------------------------------------------------------------------------ the kernels
def _fla():
    """fla's decode/prefill kernels, or None (no fla, or no CUDA)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return {"conv": causal_conv1d, "conv_update": causal_conv1d_update, "chunk": chunk_gated_delta_rule,
            "recurrent": fused_recurrent_gated_delta_rule}


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_torch(q, k, v, g, beta, state):
    """The gated delta rule token by token (transformers' reference recurrence, q/k L2-normalised):
    q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV], state [B, HV, K, V] float32 ->
    (out [B, T, HV, V] in v's dtype, new state)."""
    rep, dtype = v.shape[2] // q.shape[2], v.dtype
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).float() for x in (q, k, v, beta, g))
    q, k = _l2norm(q), _l2norm(k)
    q = q / math.sqrt(q.shape[-1])
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (state * k_t[..., None]).sum(-2)) * beta[:, :, t][..., None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, t][..., None]).sum(-2))
    out = torch.stack(outs, dim=2).transpose(1, 2).to(dtype)
    return out, state


def conv_prefill_torch(x, weight, width: int):
    """Causal depthwise conv + SiLU over one sequence: x [1, T, D], weight [D, W] -> (y [1, T, D], the
    last W inputs [1, D, W], zero-padded)."""
    xt = x.transpose(1, 2)
    y = F.conv1d(F.pad(xt, (width - 1, 0)).to(weight.dtype), weight.unsqueeze(1), groups=xt.shape[1])
    state = F.pad(xt, (width, 0))[..., -width:]
    return F.silu(y).transpose(1, 2).to(x.dtype), state


def conv_update_torch(x, state, weight):
    """One token: x [B, D], state [B, D, W] (updated in place) -> SiLU(conv) [B, D]."""
    state.copy_(torch.cat([state[..., 1:], x.unsqueeze(-1).to(state.dtype)], dim=-1))
    return F.silu((state.to(weight.dtype) * weight).sum(-1)).to(x.dtype)


# ------------------------------------------------------------------------------------ the decoder
class Unsupported(Exception):
    """The model is not one this path decodes (its layers do not have the expected parts)."""


@dataclass
class _State:
    batch: int
    positions: int
    tok: torch.Tensor  # [B] the token fed to the next step
    pos: torch.Tensor  # [B] its position (= tokens already in the caches)
    conv: dict  # layer index -> [B, D, W]
    rec: dict  # layer index -> [B, HV, K, V] float32
    keys: dict  # layer index -> [B, L, kv, hd]
    values: dict


class Decoder:
    """Static-state greedy/sampled decoding for one loaded model (see the module doc)."""

    def __init__(self, model: nn.Module, *, use_graphs: bool | None = None, say=None):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.model = model
        config = base.config
        text_config = getattr(config, "text_config", None) or config
        self.model_type = config.model_type
        family = find_family(self.model_type)  # ftcli.families: which decoder (if any) its layers need
        kind = family.decoder if family is not None else None
        if kind is None:
            raise Unsupported(f"model type {self.model_type}")
        self.hybrid, self.sink_moe = kind == HYBRID, kind == SINK_MOE
        inner = base.model
        self.text = getattr(inner, "language_model", inner)
        self.lm_head = base.lm_head
        self.config = text_config
        for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(self.text, part):
                raise Unsupported(f"the text model has no {part}")
        self.layer_types = list(text_config.layer_types)
        self.param = next(model.parameters())
        self.device, self.dtype = self.param.device, self.param.dtype
        self.kernels = _fla() if self.device.type == "cuda" else None
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.say = say or _say
        self._states: dict = {}
        self._graphs: dict = {}
        self._moe = None
        self._check_parts()

    # -------------------------------------------------------------------------------- structure
    def _check_parts(self) -> None:
        for i, layer in enumerate(self.text.layers):
            if self.hybrid and self.layer_types[i] == "linear_attention":
                parts = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                         "out_proj")
                mixer = getattr(layer, "linear_attn", None)
            else:
                parts = ("q_proj", "k_proj", "v_proj", "o_proj")
                mixer = getattr(layer, "self_attn", None)
            if mixer is None or not all(hasattr(mixer, p) for p in parts):
                raise Unsupported(f"layer {i} lacks the parts of a {self.layer_types[i]} layer")
        if self.sink_moe:
            try:
                from transformers.integrations.moe import grouped_mm_experts_forward
            except ImportError:
                grouped_mm_experts_forward = None
            experts = self.text.layers[0].mlp.experts
            if grouped_mm_experts_forward is not None and hasattr(experts, "is_transposed"):
                self._moe = grouped_mm_experts_forward
            elif self.use_graphs:
                self.use_graphs = False  # the eager expert loop syncs with the host: no graph

    def _rope(self, attn):
        return sys.modules[type(attn).__module__].apply_rotary_pos_emb

    def _position_embeddings(self, x, positions):
        """cos/sin for positions [B, T] (Qwen3.5's multimodal rope takes 3 identical rows for text)."""
        ids = positions[None].expand(3, -1, -1) if self.hybrid else positions
        return self.text.rotary_emb(x, ids)

    # -------------------------------------------------------------------------------- state
    def _state(self, batch: int, positions: int) -> _State:
        key = (batch, positions)
        if key not in self._states:
            self._states.clear()  # one shape at a time: the caches of a 27B batch are gigabytes
            self._graphs.clear()
            self._states[key] = self._allocate(batch, positions)
        return self._states[key]

    def _allocate(self, batch: int, positions: int) -> _State:
        dev, dt, cfg = self.device, self.dtype, self.config
        conv, rec, keys, values = {}, {}, {}, {}
        for i, layer in enumerate(self.text.layers):
            if self.hybrid and self.layer_types[i] == "linear_attention":
                m = layer.linear_attn
                conv[i] = torch.zeros(batch, m.conv1d.weight.shape[0], m.conv1d.weight.shape[-1], device=dev, dtype=dt)
                rec[i] = torch.zeros(batch, m.num_v_heads, m.head_k_dim, m.head_v_dim, device=dev, dtype=torch.float32)
            else:
                hd = layer.self_attn.head_dim
                shape = (batch, positions, cfg.num_key_value_heads, hd)
                keys[i] = torch.zeros(shape, device=dev, dtype=dt)
                values[i] = torch.zeros(shape, device=dev, dtype=dt)
        return _State(batch, positions, torch.zeros(batch, dtype=torch.long, device=dev),
                      torch.zeros(batch, dtype=torch.long, device=dev), conv, rec, keys, values)

    # -------------------------------------------------------------------------------- one step
    def _step(self, s: _State, pick: Pick) -> None:
        """Consume s.tok at s.pos, write the states, put the next token in s.tok, advance s.pos."""
        x = self.text.embed_tokens(s.tok[:, None])  # [B, 1, D]
        pe = self._position_embeddings(x, s.pos[:, None])
        rows = torch.arange(s.batch, device=self.device)
        valid = torch.arange(s.positions, device=self.device)[None, :] <= s.pos[:, None]  # [B, L]
        for i, layer in enumerate(self.text.layers):
            h = layer.input_layernorm(x)
            if i in s.conv:
                h = self._gdn_step(layer.linear_attn, h, s.conv[i], s.rec, i)
            else:
                h = self._attn_step(layer.self_attn, h, pe, s, i, rows, valid)
            x = x + h
            x = x + self._mlp(layer, layer.post_attention_layernorm(x))
        logits = self.lm_head(self.text.norm(x))[:, -1]
        s.tok.copy_(pick(logits))
        s.pos.add_(1)

    def _mlp(self, layer, h):
        if self.sink_moe:
            mlp = layer.mlp
            flat = h.reshape(-1, h.shape[-1])
            router = mlp.router
            logits = F.linear(flat, router.weight, router.bias)
            top, index = torch.topk(logits, router.top_k, dim=-1)
            weights = F.softmax(top, dim=1, dtype=top.dtype)
            if self._moe is not None:
                out = self._moe(mlp.experts, flat, index, weights)
            else:
                out = mlp.experts(flat, index, weights)
            return out.reshape(h.shape)
        return layer.mlp(h)

    def _gdn_step(self, m, h, conv_state, rec, i):
        B = h.shape[0]
        qkv = m.in_proj_qkv(h)[:, 0]  # [B, conv_dim]
        z = m.in_proj_z(h)
        b, a = m.in_proj_b(h), m.in_proj_a(h)
        weight = m.conv1d.weight.squeeze(1)
        if self.kernels is not None:
            qkv, _ = self.kernels["conv_update"](qkv, conv_state, weight=weight, bias=m.conv1d.bias,
                                                 activation="silu")
        else:
            qkv = conv_update_torch(qkv, conv_state, weight)
        q, k, v = torch.split(qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q = q.reshape(B, 1, -1, m.head_k_dim)
        k = k.reshape(B, 1, -1, m.head_k_dim)
        v = v.reshape(B, 1, -1, m.head_v_dim)
        beta = b.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        if self.kernels is not None:
            out, new = self.kernels["recurrent"](q, k, v, g=g, beta=beta, initial_state=rec[i],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
        else:
            out, new = gated_delta_torch(q, k, v, g, beta, rec[i])
        rec[i].copy_(new)
        return self._gdn_out(m, out, z, B, 1)

    def _gdn_out(self, m, out, z, B, T):
        out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return m.out_proj(out.reshape(B, T, -1))

    def _qkv(self, attn, h, pe):
        """Projections, norms and rope -> q [B, H, T, hd], k, v [B, kv, T, hd], gate or None."""
        B, T, _ = h.shape
        hd = attn.head_dim
        gate = None
        if self.hybrid:
            q, gate = torch.chunk(attn.q_proj(h).view(B, T, -1, hd * 2), 2, dim=-1)
            gate = gate.reshape(B, T, -1)
            q = attn.q_norm(q).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(h).view(B, T, -1, hd)).transpose(1, 2)
        else:
            q = attn.q_proj(h).view(B, T, -1, hd).transpose(1, 2)
            k = attn.k_proj(h).view(B, T, -1, hd).transpose(1, 2)
        v = attn.v_proj(h).view(B, T, -1, hd).transpose(1, 2)
        cos, sin = pe
        q, k = self._rope(attn)(q, k, cos, sin)
        return q, k, v, gate

    def _attn_out(self, attn, out, gate, B, T):
        out = out.reshape(B, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return attn.o_proj(out)

    def _attn_step(self, attn, h, pe, s: _State, i, rows, valid):
        B = h.shape[0]
        q, k, v, gate = self._qkv(attn, h, pe)
        s.keys[i].index_put_((rows, s.pos), k[:, :, 0])
        s.values[i].index_put_((rows, s.pos), v[:, :, 0])
        kv = s.keys[i].shape[2]
        keys, values = s.keys[i].transpose(1, 2), s.values[i].transpose(1, 2)  # [B, kv, L, hd]
        # the heads sharing a kv head become that head's queries: [B, kv, rep, hd] against [B, kv, L, hd]
        q = q.reshape(B, kv, -1, q.shape[-1])
        mask = valid
        window = getattr(attn, "sliding_window", None)
        if window:
            mask = mask & (torch.arange(s.positions, device=self.device)[None, :] > s.pos[:, None] - window)
        sinks = getattr(attn, "sinks", None)
        if sinks is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :],
                                                 scale=attn.scaling)
        else:
            scores = torch.matmul(q, keys.transpose(-1, -2)).float() * attn.scaling  # [B, kv, rep, L]
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
            out = _softmax_with_sinks(scores, sinks.reshape(1, kv, -1, 1).float(), values)
        return self._attn_out(attn, out.reshape(B, -1, 1, q.shape[-1]).transpose(1, 2), gate, B, 1)

    # -------------------------------------------------------------------------------- prefill
    def _prefill_row(self, s: _State, row: int, ids: list[int]) -> torch.Tensor:
        """Run one prompt (no padding), write its states into row `row`; returns its last logits [vocab]."""
        T = len(ids)
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        x = self.text.embed_tokens(tokens)
        pe = self._position_embeddings(x, torch.arange(T, device=self.device)[None])
        for i, layer in enumerate(self.text.layers):
            h = layer.input_layernorm(x)
            if i in s.conv:
                h = self._gdn_prefill(layer.linear_attn, h, s, i, row)
            else:
                h = self._attn_prefill(layer.self_attn, h, pe, s, i, row)
            x = x + h
            x = x + self._mlp(layer, layer.post_attention_layernorm(x))
        return self.lm_head(self.text.norm(x[:, -1:]))[0, -1]

    def _gdn_prefill(self, m, h, s: _State, i, row):
        T = h.shape[1]
        qkv = m.in_proj_qkv(h)  # [1, T, conv_dim]
        z = m.in_proj_z(h)
        b, a = m.in_proj_b(h), m.in_proj_a(h)
        weight = m.conv1d.weight.squeeze(1)
        width = weight.shape[-1]
        if self.kernels is not None:
            qkv, final = self.kernels["conv"](qkv, weight=weight, bias=m.conv1d.bias, activation="silu",
                                              output_final_state=True)
        else:
            qkv, final = conv_prefill_torch(qkv, weight, width)
        s.conv[i][row].copy_(final[0])
        q, k, v = torch.split(qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q = q.reshape(1, T, -1, m.head_k_dim)
        k = k.reshape(1, T, -1, m.head_k_dim)
        v = v.reshape(1, T, -1, m.head_v_dim)
        beta = b.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        if self.kernels is not None:
            out, final = self.kernels["chunk"](q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
        else:
            zero = torch.zeros_like(s.rec[i][row:row + 1])
            out, final = gated_delta_torch(q, k, v, g, beta, zero)
        s.rec[i][row].copy_(final[0])
        return self._gdn_out(m, out, z, 1, T)

    def _attn_prefill(self, attn, h, pe, s: _State, i, row):
        T = h.shape[1]
        q, k, v, gate = self._qkv(attn, h, pe)
        s.keys[i][row, :T].copy_(k[0].transpose(0, 1))
        s.values[i][row, :T].copy_(v[0].transpose(0, 1))
        sinks = getattr(attn, "sinks", None)
        if sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
        else:
            out = _prefill_attention_with_sinks(q, k, v, sinks, attn.scaling, getattr(attn, "sliding_window", None))
        return self._attn_out(attn, out.transpose(1, 2), gate, 1, T)

    # -------------------------------------------------------------------------------- the loop
    def _graph(self, s: _State, pick: Pick):
        key = (s.batch, s.positions, pick)
        if key in self._graphs:
            return self._graphs[key]
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        saved_tok, saved_pos = s.tok.clone(), s.pos.clone()
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton autotuning and lazy init happen outside the capture
                self._step(s, pick)
                s.tok.copy_(saved_tok)
                s.pos.copy_(saved_pos)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._step(s, pick)
            torch.cuda.synchronize()
        except RuntimeError as e:  # a kernel that cannot be captured: eager steps (correct, slower)
            self.use_graphs = False
            self.say(f"fast decode: no CUDA graph ({str(e).strip().splitlines()[0][:160]}); decoding step by step")
            s.tok.copy_(saved_tok)
            s.pos.copy_(saved_pos)
            return None
        self._graphs[key] = graph
        self.say(f"fast decode: captured a CUDA graph of one {self.model_type} decoding step for batch {s.batch}, "
                 f"{s.positions} positions in {time.perf_counter() - start:.1f} s (once per process and shape)")
        return graph

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids, pick: Pick = Pick(),
                 on_tokens=None) -> list[list[int]]:
        """Each prompt's new token ids, cut after its first stop token. `on_tokens(step_tokens)` is called
        with the list of the batch's tokens at each step, as they arrive."""
        if max_new_tokens < 1 or not prompts:
            return [[] for _ in prompts]
        batch = len(prompts)
        longest = max(len(p) for p in prompts)
        positions = -(-(longest + max_new_tokens) // POSITION_BUCKET) * POSITION_BUCKET
        s = self._state(batch, positions)
        graph = self._graph(s, pick) if self.use_graphs else None
        first = torch.stack([self._prefill_row(s, r, p) for r, p in enumerate(prompts)])
        s.tok.copy_(pick(first))
        s.pos.copy_(torch.tensor([len(p) for p in prompts], device=self.device))
        stops = set(stop_ids or [])
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * batch
        cuda = self.device.type == "cuda"
        host = torch.empty((max_new_tokens, batch), dtype=torch.long, pin_memory=cuda)
        events = [torch.cuda.Event() for _ in range(max_new_tokens)] if cuda else None

        def fetch(t):
            host[t].copy_(s.tok, non_blocking=cuda)
            if cuda:
                events[t].record()

        def take(t) -> bool:
            if cuda:
                events[t].synchronize()
            step = host[t].tolist()
            for r, tid in enumerate(step):
                if not done[r]:
                    out[r].append(tid)
                    done[r] = tid in stops
            if on_tokens is not None:
                on_tokens(step)
            return all(done)

        fetch(0)
        for t in range(1, max_new_tokens):
            if graph is not None:
                graph.replay()
            else:
                self._step(s, pick)
            fetch(t)
            if take(t - 1):  # the host reads step t-1 while step t runs
                return out
        take(max_new_tokens - 1)
        return out


def _softmax_with_sinks(scores, sinks, values):
    """softmax over [scores, sink] without the sink column, times values (gpt-oss's attention sinks)."""
    top = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    weights = (scores - top).exp()
    weights = weights / (weights.sum(-1, keepdim=True) + (sinks - top).exp())
    return torch.matmul(weights.to(values.dtype), values)


def _prefill_attention_with_sinks(q, k, v, sinks, scale, window, block: int = 512):
    """Causal (optionally sliding-window) attention with per-head sinks, in query blocks (bounded memory):
    q [1, H, T, hd], k, v [1, kv, T, hd] -> [1, H, T, hd]."""
    _, H, T, hd = q.shape
    kv = k.shape[1]
    q = q.reshape(1, kv, H // kv, T, hd)
    sinks = sinks.float().reshape(1, kv, H // kv, 1, 1)
    outs = []
    keys_at = torch.arange(T, device=q.device)
    for start in range(0, T, block):
        end = min(T, start + block)
        rows = torch.arange(start, end, device=q.device)[:, None]
        mask = keys_at[None, :end] <= rows
        if window:
            mask = mask & (keys_at[None, :end] > rows - window)
        scores = torch.matmul(q[:, :, :, start:end], k[:, :, None, :end].transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(_softmax_with_sinks(scores, sinks, v[:, :, None, :end]))
    return torch.cat(outs, dim=3).reshape(1, H, T, hd)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ entry points
def enabled(model: nn.Module) -> bool:
    """Whether `generate` should take this path for the model: FTCLI_FAST_DECODE=0 never, =1 always,
    unset on CUDA only; never for a model sharded with FSDP (DTensor parameters)."""
    setting = os.environ.get("FTCLI_FAST_DECODE", "auto").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    param = next(model.parameters(), None)
    if param is None or type(param).__name__ == "DTensor":
        return False
    return setting in ("1", "true", "yes", "on") or param.device.type == "cuda"


def decoder_for(model: nn.Module) -> Decoder | None:
    """The process's Decoder for this model (built on first use), or None where this path does not apply."""
    if not enabled(model):
        return None
    if model not in _DECODERS:
        try:
            _DECODERS[model] = Decoder(model)
        except Unsupported:
            return None
    return _DECODERS[model]


def release(model: nn.Module) -> None:
    """Drop the model's decoder (its static caches and captured graphs), e.g. after samples during training."""
    _DECODERS.pop(model, None)


def generate_ids(model: nn.Module, prompts: list[list[int]], config, *, streamer=None) -> list[list[int]] | None:
    """`_generate_ids` through the fast path: each prompt's new ids cut after its first stop token, or None
    where this path does not apply (the caller runs transformers' generate)."""
    decoder = decoder_for(model)
    pick = Pick.from_generation_config(config) if decoder is not None else None
    if pick is None:
        return None
    stops = config.eos_token_id if isinstance(config.eos_token_id, (list, tuple)) else [config.eos_token_id]
    on_tokens = None
    if streamer is not None:
        streamer.put(torch.tensor([prompts[0]]))
        on_tokens = lambda step: streamer.put(torch.tensor([step[0]]))  # noqa: E731
    out = decoder.generate(prompts, config.max_new_tokens, [t for t in stops if t is not None], pick, on_tokens)
    if streamer is not None:
        streamer.end()
    return out
