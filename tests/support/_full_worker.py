"""torchrun entry for the multi-process tests of the FSDP2 trainer (tests/e2e/test_train_full.py).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/support/_full_worker.py grads OUT
        builds the tiny model through train_full (FSDP2, 2 ranks), runs forward_backward on this rank's
        two of four hand-made packed blocks with very different trained-token counts (chunked loss). Rank
        0 then builds the same model unsharded in one process (same init code) and computes the same
        step as 1 x 4 micro-batches and as ONE micro-batch of the four blocks concatenated (full loss).
        Saves initial weights, gradients and losses to OUT/grads.pt.

    ... tests/support/_full_worker.py train OUT RECIPE_YAML [--nan-steps 2,5,6,7] [--truncate-rank1 K] [--mask-from J]
                                       [--block-delay-ms MS]
        runs train_full.train on the recipe (its output.dir is the run dir) through its seams: --nan-steps
        passes a loss_fn that poisons the summed loss on rank 0 at those steps, --truncate-rank1 a blocks
        stream that ends rank 1's blocks K early (streams of unequal length), --mask-from one that replaces
        every rank's blocks from index J on by all-masked padding blocks. Each rank writes
        OUT/rank{r}.json: the TrainResult, or the error that stopped it, and what its stream yielded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch


def hand_made_blocks(block_len: int = 64):
    """Four packed blocks; trained tokens 1.5 orders of magnitude apart (and one block with none)."""
    from ftcli.data import make_block

    rng = np.random.default_rng(0)
    specs = [  # (segment lengths, trained fraction per segment)
        ([30, 34], 0.9),
        ([20, 20, 10], 0.08),
        ([64], 0.5),
        ([40, 10], 0.0),
    ]
    blocks = []
    for i, (segs, frac) in enumerate(specs):
        ids = rng.integers(5, 1000, size=sum(segs)).astype(np.int32)
        mask = np.zeros(sum(segs), dtype=bool)
        start = 0
        for n in segs:
            first = start + n - int(round(n * frac))
            mask[first : start + n] = True
            start += n
        blocks.append(make_block(ids, mask, segs, block_len, pad_id=0, index=i))
    return blocks


def concat_blocks(blocks):
    """The four blocks as one packed block (the first label of each later block masked: in separate
    blocks label[0] is never a target, here it would be predicted across the boundary)."""
    from ftcli.data import Block

    labels = []
    for k, b in enumerate(blocks):
        lab = b.labels.copy()
        if k:
            lab[0] = -100
        labels.append(lab)
    offsets = np.cumsum([0] + [len(b.input_ids) for b in blocks])
    seg_offsets = np.cumsum([0] + [len(b.cu_seqlens) - 1 for b in blocks])
    cat_labels = np.concatenate(labels)
    return Block(
        input_ids=np.concatenate([b.input_ids for b in blocks]),
        labels=cat_labels,
        position_ids=np.concatenate([b.position_ids for b in blocks]),
        seq_idx=np.concatenate([b.seq_idx + s for b, s in zip(blocks, seg_offsets)]),
        cu_seqlens=np.concatenate([[0]] + [b.cu_seqlens[1:] + o for b, o in zip(blocks, offsets)]).astype(np.int32),
        max_seqlen=max(b.max_seqlen for b in blocks),
        num_trained_tokens=int((cat_labels[1:] != -100).sum()),
    )


def grads(out: Path) -> None:
    from ftcli import data
    from ftcli.model import kernels
    from ftcli.model.build import DTYPES
    from ftcli.config.recipe import load_recipe
    from ftcli.train.distributed import init_distributed
    from ftcli.train.loss import attach_loss, count_trained_tokens
    from ftcli.model.build import build_empty_model
    from ftcli.model.parallelize import build_model, init_random_weights
    from ftcli.train.full import forward_backward

    recipe = load_recipe("tiny-qwen-cpu", ["training.activation_checkpointing=selective"])
    world = init_distributed()
    attn, _ = kernels.enable_packed_kernels(recipe.model.model_type, world.device)
    model = build_model(recipe.model, recipe.training, world, attn)
    attach_loss(model, "chunked", 37)  # an odd chunk size: chunks cross segment and block boundaries
    init = {n: p.full_tensor().clone() for n, p in model.named_parameters()}

    blocks = hand_made_blocks()
    per_rank = len(blocks) // world.world_size
    mine = blocks[world.rank * per_rank : (world.rank + 1) * per_rank]
    global_tokens = sum(count_trained_tokens(b.labels) for b in blocks)  # what the all-reduce gives
    summed = forward_backward(model, [data.block_to_model_inputs(b) for b in mine], global_tokens, world.world_size)
    total = torch.tensor([summed], dtype=torch.float64)
    torch.distributed.all_reduce(total)
    grads_ = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    result = {"init": init, f"grads_{world.world_size}x{per_rank}": grads_,
              "loss_sharded": total.item() / global_tokens, "trained": [count_trained_tokens(b.labels) for b in blocks]}

    if world.rank == 0:  # the same step in one process without FSDP: 1 x 4 micro-batches, then 1 x 1 (concat)
        dtype = DTYPES[recipe.training.precision.master_dtype]
        plain = build_empty_model(recipe.model, dtype, attn)
        buffers = {n: b.clone() for n, b in plain.named_buffers()}
        plain.to_empty(device="cpu")
        with torch.no_grad():
            for n, b in plain.named_buffers():
                b.copy_(buffers[n])
        init_random_weights(plain, build_empty_model(recipe.model, dtype), recipe.training.seed, torch.device("cpu"))
        attach_loss(plain, "full", 0)
        result["init_unsharded"] = {n: p.detach().clone() for n, p in plain.named_parameters()}
        summed = forward_backward(plain, [data.block_to_model_inputs(b) for b in blocks], global_tokens, 1)
        result["grads_1x4"] = {n: p.grad.clone() for n, p in plain.named_parameters()}
        result["loss_1x4"] = summed / global_tokens
        plain.zero_grad(set_to_none=True)
        one = concat_blocks(blocks)
        assert count_trained_tokens(one.labels) == global_tokens
        summed = forward_backward(plain, [data.block_to_model_inputs(one)], global_tokens, 1)
        result["grads_one_batch"] = {n: p.grad.clone() for n, p in plain.named_parameters()}
        result["loss_one_batch"] = summed / global_tokens
        torch.save(result, out / "grads.pt")
    torch.distributed.barrier()  # rank 1 waits for rank 0's unsharded work before the group goes away
    torch.distributed.destroy_process_group()


def train(out: Path, recipe_path: str, nan_steps: set[int], truncate_rank1: int, mask_from: int | None,
          block_delay_ms: float = 0.0) -> None:
    """train_full.train with faults injected through its seams (`loss_fn`, `blocks`), no global patched."""
    from ftcli import data
    from ftcli.train import full as train_full
    from ftcli.config.errors import UserError
    from ftcli.train.loss import token_loss_sum
    from ftcli.config.recipe import load_recipe

    rank = int(os.environ["RANK"])
    recipe = load_recipe(recipe_path)
    yielded = {"trained": 0, "blocks": 0}
    calls = {"n": 0}

    def poisoned_loss(*args, **kwargs):  # grad_accum 1: call n is step n
        calls["n"] += 1
        value = token_loss_sum(*args, **kwargs)
        return value * float("nan") if rank == 0 and calls["n"] in nan_steps else value

    def counted_blocks(stream):
        limit = len(stream) - truncate_rank1 if rank == 1 else None
        for i, block in enumerate(stream):
            if limit is not None and i >= limit:
                return
            if mask_from is not None and i >= mask_from:
                block = data.padding_block(len(block.input_ids), 0)
            yielded["trained"] += block.num_trained_tokens
            yielded["blocks"] += 1
            time.sleep(block_delay_ms / 1000)  # reading a block takes time: a time-based save is then due
            yield block

    try:
        result = asdict(train_full.train(recipe, recipe.output_dir, None, loss_fn=poisoned_loss, blocks=counted_blocks))
    except UserError as e:
        result = {"error": str(e)}
    result["yielded"] = yielded
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["grads", "train"])
    parser.add_argument("out", type=Path)
    parser.add_argument("recipe", nargs="?")
    parser.add_argument("--nan-steps", default="")
    parser.add_argument("--truncate-rank1", type=int, default=0)
    parser.add_argument("--mask-from", type=int, default=None)
    parser.add_argument("--block-delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if args.mode == "grads":
        grads(args.out)
    else:
        steps = {int(s) for s in args.nan_steps.split(",") if s}
        train(args.out, args.recipe, steps, args.truncate_rank1, args.mask_from, args.block_delay_ms)
    from ftcli.train.distributed import exit_worker

    exit_worker(0)  # the files are written: skip the interpreter's teardown (gloo can abort there, see exit_worker)
