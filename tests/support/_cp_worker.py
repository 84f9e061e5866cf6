"""One torchrun worker of tests/e2e/test_context_parallel.py: for each tiny model (Qwen3.5, Llama, Gemma 3, gpt-oss) and
activation checkpointing off and on, the packed block whole on every rank (context_parallel 1) against this rank's
slice of it (context_parallel = world size): logits, summed loss and gradients. Writes the largest differences to
the JSON file named by argv[1] (rank 0); argv[2]: the models, argv[3]: checkpointing modes (off,on), argv[4]: the
context-parallel sizes to check (each divides the world size; comma-separated lists)."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from ftcli.data.collate import block_to_model_inputs, slice_model_inputs
from ftcli.data.packing import make_block
from ftcli.model import kernels
from ftcli.model.kernels.cp import CP_KWARG, CPSlice
from ftcli.train.loss import token_loss_sum

ASSETS = "ftcli/assets"
# 128 tokens; with 2 ranks the boundary (64) cuts segment 0 (0..70); with 4 (32, 64, 96) it also runs through
# rank 1 whole, and the 3rd boundary (96) cuts segment 4 (94..128) 2 tokens after its start (inside the conv halo)
LENGTHS = [70, 3, 1, 20, 34]
SLOW_DECAY = (-4.0, -2.0)  # gated-delta state that lives across the boundary (stock init forgets within tokens)


def tiny_model(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(open(f"{ASSETS}/tiny-{name}.json").read())
    data.pop("architectures", None)
    if name == "gemma3":
        data["sliding_window"] = 16  # windows shorter than the segment that crosses the boundary
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config.use_cache = False
    attn, _ = kernels.enable_packed_kernels(config.model_type, "cpu", context_parallel=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.uniform_(*SLOW_DECAY)
            if hasattr(module, "sinks") and isinstance(module.sinks, torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)
    return model


def the_block(vocab: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, sum(LENGTHS)).astype(np.int32)
    mask = rng.random(sum(LENGTHS)) < 0.8
    return make_block(ids, mask, LENGTHS, sum(LENGTHS), pad_id=0)


def loss_and_logits(model, inputs: dict):
    inputs = dict(inputs)
    labels, trained = inputs.pop("labels"), inputs.pop("trained_positions")
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    head = model.get_output_embeddings().weight
    loss = token_loss_sum(hidden, head, labels, "chunked", 16, trained_positions=trained)
    return loss, (hidden @ head.T).detach()  # the logits (the loss never makes them whole)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main(out_path: str, names: list[str], checkpointing_modes: list[bool], cp_sizes: list[int]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {n: dist.new_subgroups(group_size=n)[0] for n in cp_sizes}  # consecutive ranks, as ftcli's
    report = {}
    for name in names:
        model = tiny_model(name)
        block = the_block(model.config.vocab_size)
        for checkpointing in checkpointing_modes:
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            model.zero_grad(set_to_none=True)
            full_loss, full_logits = loss_and_logits(model, block_to_model_inputs(block))
            full_loss.backward()
            full_loss = full_loss.detach()
            full_grads = grads(model)
            for size, group in groups.items():
                model.zero_grad(set_to_none=True)
                cp_rank = rank % size
                inputs = slice_model_inputs(block, cp_rank, size)
                inputs[CP_KWARG] = CPSlice.of(block.cu_seqlens, cp_rank, size, group)
                loss, logits = loss_and_logits(model, inputs)
                loss.backward()
                diffs = {"loss_value": float(full_loss), "num_grads": len(full_grads)}
                diffs["logits"] = float((gather(logits, size, group) - full_logits).abs().max())
                total = loss.detach().clone()
                dist.all_reduce(total, group=group)
                diffs["loss"] = float((total - full_loss).abs())
                grad_diff, grad_scale = 0.0, 0.0
                for n, g in grads(model).items():
                    dist.all_reduce(g, group=group)
                    grad_diff = max(grad_diff, float((g - full_grads[n]).abs().max()))
                    grad_scale = max(grad_scale, float(full_grads[n].abs().max()))
                diffs.update(grads=grad_diff, grad_scale=grad_scale)
                with torch.no_grad():  # the control: the slice alone (no op looks across the boundary) differs
                    del inputs[CP_KWARG]
                    _, alone = loss_and_logits(model, inputs)
                    diffs["logits_slice_alone"] = float((gather(alone, size, group) - full_logits).abs().max())
                report[f"{name}/cp={size}/ac={'on' if checkpointing else 'off'}"] = diffs
        del model
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def gather(logits: torch.Tensor, size: int, group) -> torch.Tensor:
    pieces = [torch.empty_like(logits) for _ in range(size)]
    dist.all_gather(pieces, logits.contiguous(), group=group)
    return torch.cat(pieces, dim=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), [m == "on" for m in sys.argv[3].split(",")],
         [int(n) for n in sys.argv[4].split(",")])
