"""The published qwen-b300 training loop (its train.py), copied as it runs, at N decoder layers.

What the published train.py does per rank, and what this copy does on one GPU:

    published                                        here (only what this machine forces)
    from_pretrained(Qwen/Qwen3.8-27B), VLM class     random init (seed 0) from the 27B-width text config
                                                     (benchmarks/qwen27b-4layer.json) with N layers in the
                                                     [linear x3, full] pattern, Qwen3_5ForCausalLM (the
                                                     vision tower is never called on text data)
    attn_implementation="flash_attention_2"          torch varlen_attn (ftcli.model.kernels' torch_varlen backend)
    causal-conv1d's causal_conv1d_fn(seq_idx=...)    fla's Triton varlen conv (ftcli.model.kernels' fla_conv_varlen)
    fla chunk_gated_delta_rule (bound by transformers) the same: transformers' own fla binding is kept
    ultrachat_200k, streamed, packed to 32k          ftcli's synthetic packed blocks of the benchmark recipe
                                                     (same blocks, same order as `ftcli train` gets)
    torchrun, 8 ranks                                one process, world size 1 (same FSDP2 code path)

and everything else as published: bf16 weights (so bf16 master weights and AdamW states),
`gradient_checkpointing_enable(use_reentrant=False)`, `use_cache=False`, `fully_shard` on every decoder
layer then the root with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, fused AdamW (lr 1e-5,
betas 0.9/0.95, no weight decay), no clipping, the model's own loss (`labels=` -> full bf16 logits, upcast to
fp32), the per-step all-reduce(MAX) of the "ran out" flag, loss read only every 100 steps.
Model call: model(input_ids, labels, position_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
seq_idx), one block per step.

Timing: --warmup steps, then --steps steps between two device synchronizations (the loop itself syncs only
on the flag). Prints one `ROW {json}` line per depth (benchmarks/depth_gpu.py reads them) and a table.

H200:  source .gpu/activate.sh && python benchmarks/reference_loop_gpu.py --layers 4 8 --block-len 32768
CPU logic check (tiny config, 512-token blocks, gloo, fp32): python benchmarks/reference_loop_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
from train_full_gpu import RECIPE, TINY  # noqa: E402  (the benchmark recipe and its CPU overrides)

from ftcli.model import kernels  # noqa: E402

WIDE_CONFIG = ROOT / "benchmarks" / "qwen27b-4layer.json"
IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------ shapes
def depth_config(n_layers: int, tiny: bool) -> dict:
    """The benchmark config (27B width, or ftcli's tiny one) with n_layers in the [lin, lin, lin, full] pattern."""
    if tiny:
        from ftcli.config.recipe import resolve_path

        base = json.loads(Path(resolve_path("pkg://assets/tiny-qwen3_5.json")).read_text())
    else:
        base = json.loads(WIDE_CONFIG.read_text())
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    return base | {"num_hidden_layers": n_layers, "layer_types": [pattern[i % 4] for i in range(n_layers)]}


def write_depth_config(n_layers: int, tiny: bool, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"qwen{'tiny' if tiny else '27b'}-{n_layers}layer.json"
    path.write_text(json.dumps(depth_config(n_layers, tiny), indent=1))
    return path


def data_overrides(block_len: int, tiny: bool) -> list[str]:
    """The data settings `ftcli train` gets in benchmarks/depth_gpu.py (so both loops see the same blocks)."""
    return [s for s in (TINY if tiny else []) if s.startswith("data.")] + [f"data.packing.block_len={block_len}"]


def bench_blocks(block_len: int, tiny: bool, count: int) -> list:
    """The first `count` blocks `ftcli train` trains on (rank 0 of 1, the recipe's seed), from ftcli's cache."""
    from ftcli import data
    from ftcli.config.recipe import load_recipe

    recipe = load_recipe(RECIPE, data_overrides(block_len, tiny))
    tokenizer = data.load_tokenizer(recipe.model, recipe.data)
    stream = data.BlockStream(data.prepare_blocks(recipe, tokenizer), 0, 1, epochs=recipe.training.epochs,
                              seed=recipe.training.seed)
    blocks = []
    for block in stream:
        blocks.append(block)
        if len(blocks) == count:
            return blocks
    raise SystemExit(f"the benchmark data has only {len(blocks)} blocks of {block_len}; {count} needed")


# ------------------------------------------------------------------------------------------- FLOPs
def step_flops(cfg: dict, blocks: list) -> dict:
    """Model FLOPs of one training step (forward + backward = 3 x forward), per block, averaged over `blocks`.

    Every matmul is counted: the decoder's nn.Linear weights on every token, the LM head on the trained
    tokens only (what a fused/chunked loss computes; the full-logit loss does it on all tokens), causal
    attention within each segment (QK^T and PV: 4 * heads * head_dim * L(L+1)/2 per segment), the gated-delta
    rule in its recurrent form (S^T k, the rank-1 update, S^T q: 6 * dk * dv per token per value head), and
    the depthwise conv (2 * width * channels per token). Recomputation (activation checkpointing) is not
    model work and is not counted. Returns the parts and the total.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = dict(cfg)
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    linear = sum(m.in_features * m.out_features for m in layers.modules() if isinstance(m, torch.nn.Linear))
    full = sum(t == "full_attention" for t in config.layer_types)
    lin = len(config.layer_types) - full
    tokens = sum(len(b.input_ids) for b in blocks) / len(blocks)
    trained = sum(b.num_trained_tokens for b in blocks) / len(blocks)
    pairs = sum(sum(int(L) * (int(L) + 1) // 2 for L in (b.cu_seqlens[1:] - b.cu_seqlens[:-1])) for b in blocks)
    pairs /= len(blocks)
    dk, dv, nv = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_num_value_heads
    conv_ch = 2 * config.linear_num_key_heads * dk + nv * dv
    fwd = {
        "linear": 2 * linear * tokens,
        "lm_head": 2 * config.hidden_size * config.vocab_size * trained,
        "attention": full * 4 * config.num_attention_heads * config.head_dim * pairs,
        "gated_delta": lin * 6 * dk * dv * nv * tokens,
        "conv": lin * 2 * config.linear_conv_kernel_dim * conv_ch * tokens,
    }
    out = {k: 3 * v for k, v in fwd.items()}
    out["total"] = sum(out.values())
    out["tokens"], out["trained_tokens"] = tokens, trained
    return out


# ------------------------------------------------------------------------------------------- model
def install_reference_kernels(device: torch.device) -> str:
    """The substitutions (module doc), through ftcli.model.kernels' public functions; returns attn_implementation.
    On CPU: ftcli's exact per-segment references for all three ops (logic check only)."""
    if device.type != "cuda":
        attn, _ = kernels.enable_packed_kernels("qwen3_5_text", device)
        return attn
    module = importlib.import_module(kernels.QWEN35_MODULE)
    stock_rule = module.torch_chunk_gated_delta_rule  # transformers' binding: fla's chunk_gated_delta_rule here
    backends = kernels.decide_backends("qwen3_5_text", device)
    attn = kernels.install_backends("qwen3_5_text", backends)
    try:  # keep transformers' own fla binding, as the published loop runs it, if it takes packed input here
        T, cu = 96, torch.tensor([0, 40, 96], dtype=torch.int32, device=device)  # the model's head shapes
        q, k = (torch.randn(1, T, 16, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(1, T, 48, 128, device=device, dtype=torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(1, T, 48, device=device))
        beta = torch.rand(1, T, 48, device=device, dtype=torch.bfloat16)
        stock_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        module.torch_chunk_gated_delta_rule = stock_rule
        rule = "transformers' fla binding"
    except Exception as e:  # noqa: BLE001 - say so and keep ftcli's fla wrapper
        rule = f"ftcli's fla wrapper (transformers' binding failed: {type(e).__name__}: {str(e)[:120]})"
    print("reference kernels: " + "; ".join(f"{b.op}={b.name}" for b in backends if b.op != "gated_delta_rule")
          + f"; gated_delta_rule={rule}", flush=True)
    return attn


def build_reference_model(cfg: dict, device: torch.device, dtype: torch.dtype, attn: str, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = dict(cfg)
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def to_model_inputs(block, device: torch.device) -> dict:
    """The published collator's tensors for one block (batch of 1)."""
    def row(a, dtype):
        return torch.as_tensor(a, dtype=dtype).unsqueeze(0).to(device)

    cu = torch.as_tensor(block.cu_seqlens, dtype=torch.int32).to(device)
    return {"input_ids": row(block.input_ids, torch.long), "labels": row(block.labels, torch.long),
            "position_ids": row(block.position_ids, torch.long), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": int(block.max_seqlen), "max_length_k": int(block.max_seqlen),
            "seq_idx": row(block.seq_idx, torch.int32)}


def run_depth(n_layers: int, blocks: list, warmup: int, steps: int, device, dtype, attn, mesh, tiny: bool) -> dict:
    import torch.distributed as dist

    cfg = depth_config(n_layers, tiny)
    model = build_reference_model(cfg, device, dtype, attn, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=device.type == "cuda" or None)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, start = [], time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            common.sync(device)
            start = time.perf_counter()
        ran_out = torch.zeros(1, dtype=torch.int32, device=device)  # a rank whose shard ended sets 1
        dist.all_reduce(ran_out, op=dist.ReduceOp.MAX)
        if ran_out.item():
            break
        loss = model(**to_model_inputs(blocks[step], device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    common.sync(device)
    seconds = (time.perf_counter() - start) / steps
    flops = step_flops(cfg, blocks[warmup:warmup + steps])
    row = {"loop": "reference", "layers": n_layers, "block": len(blocks[0].input_ids), "s_per_step": seconds,
           "tokens_per_s": flops["tokens"] / seconds, "losses": [round(float(x), 4) for x in losses],
           "flops": flops}
    if device.type == "cuda":
        row["peak_mem_gib"] = common.peak_gib(device)
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    del model, optimizer, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def init_world(device: torch.device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return init_device_mesh(device.type, (1,))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="depths (default 4 8; tiny 4 8)")
    parser.add_argument("--block-len", type=int, default=None, help="default 32768 (tiny 512)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile, autotune)")
    parser.add_argument("--tiny", action="store_true", help="CPU logic check: tiny config, fp32, gloo")
    parser.add_argument("--json-out", type=Path, default=None, help="also append the rows here (JSON lines)")
    args = parser.parse_args()

    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    block_len = args.block_len or (512 if args.tiny else 32768)
    mesh = init_world(device)
    attn = install_reference_kernels(device)
    blocks = bench_blocks(block_len, args.tiny, args.warmup + args.steps)
    rows = []
    for n in args.layers or [4, 8]:
        row = run_depth(n, blocks, args.warmup, args.steps, device, dtype, attn, mesh, args.tiny)
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"\npublished loop, block {block_len}, {device}, mean over {args.steps} steps after "
          f"{args.warmup}\n")
    print(common.table(["layers", "s/step", "tokens/s", "peak GiB (reserved)", "losses"],
                       [[r["layers"], f"{r['s_per_step']:.3f}", f"{r['tokens_per_s']:,.0f}",
                         f"{r['peak_mem_gib']:.1f} ({r['peak_reserved_gib']:.1f})" if "peak_mem_gib" in r else "-",
                         r["losses"]] for r in rows]))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
