"""One torchrun worker of tests/e2e/test_context_parallel.py: for each tiny model (Qwen3.5, Llama, Gemma 3, gpt-oss) and
activation checkpointing off and on, the packed block whole on every rank (context_parallel 1) against this rank's
slice of it (context_parallel = world size): logits, summed loss and gradients. Writes the largest differences to
the JSON file named by argv[1] (rank 0); argv[2]: the models, argv[3]: checkpointing modes (off,on), argv[4]: the
context-parallel sizes to check (each divides the world size; comma-separated lists; "4b" is CP=4 balanced). The
model name `dpo` checks the preference loss instead (`preference_check`): tiny Qwen3.5 with a frozen reference copy,
DPO on pairs whose sides cross the slice boundaries."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from ftcli.data.collate import block_to_model_inputs
from ftcli.data.packing import make_block
from ftcli.model import kernels
from ftcli.model.kernels.cp import CP_KWARG, slice_of_block
from ftcli.train.loss import token_loss_sum

ASSETS = "ftcli/assets"
# 128 tokens; with 2 ranks the boundary (64) cuts segment 0 (0..70); with 4 (32, 64, 96) it also runs through
# rank 1 whole, and the 3rd boundary (96) cuts segment 4 (94..128) 2 tokens after its start (inside the conv halo)
LENGTHS = [70, 3, 1, 20, 34]
# preference pairs (chosen, rejected) = segments (0, 1) and (2, 3): with 2 ranks segment 1 crosses 64, with 4 segment
# 0 crosses 32, segment 1 64 and segment 2 96
PAIR_LENGTHS = [50, 30, 20, 28]
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


def grad_difference(model, full_grads: dict, group) -> dict[str, float]:
    """The largest |gradient summed over the CP group - the whole block's|, and the largest whole-block entry."""
    grad_diff, grad_scale = 0.0, 0.0
    for n, g in grads(model).items():
        dist.all_reduce(g, group=group)
        grad_diff = max(grad_diff, float((g - full_grads[n]).abs().max()))
        grad_scale = max(grad_scale, float(full_grads[n].abs().max()))
    return {"grads": grad_diff, "grad_scale": grad_scale}


def main(out_path: str, names: list[str], checkpointing_modes: list[bool], cp_sizes: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # "4": CP=4 contiguous, "4b": balanced (two chunks per rank, training.context_parallel_balance)
    layouts = [(int(n.rstrip("b")), n.endswith("b")) for n in cp_sizes]
    groups = {n: dist.new_subgroups(group_size=n)[0] for n in sorted({n for n, _ in layouts})}  # consecutive ranks
    report = {}
    for name in names:
        if name == "dpo":
            report.update(preference_check(groups, layouts))
            continue
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
            for size, balanced in layouts:
                group = groups[size]
                model.zero_grad(set_to_none=True)
                inputs = slice_of_block(block, rank % size, size, group, balanced=balanced)
                order = inputs[CP_KWARG].block_order()
                loss, logits = loss_and_logits(model, inputs)
                loss.backward()
                diffs = {"loss_value": float(full_loss), "num_grads": len(full_grads)}
                diffs["logits"] = float((gather(logits, size, group, order) - full_logits).abs().max())
                total = loss.detach().clone()
                dist.all_reduce(total, group=group)
                diffs["loss"] = float((total - full_loss).abs())
                diffs.update(grad_difference(model, full_grads, group))
                with torch.no_grad():  # the control: the slice alone (no op looks across the boundary) differs
                    del inputs[CP_KWARG]
                    _, alone = loss_and_logits(model, inputs)
                    diffs["logits_slice_alone"] = float((gather(alone, size, group, order) - full_logits).abs().max())
                report[f"{name}/cp={size}{'b' if balanced else ''}/ac={'on' if checkpointing else 'off'}"] = diffs
        del model
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def preference_check(groups: dict, layouts: list[tuple[int, bool]]) -> dict:
    """DPO through `attach_preference_loss` with a frozen reference (a perturbed copy, as method full's frozen model):
    the whole block against CP=N slices. The loss (the group's returns added up), the policy's per-segment log-prob
    sums and token counts (added up over the group), the SimPO loss of those sums and counts, and the gradients."""
    import copy

    from ftcli.train.preference import PreferenceConfig, attach_preference_loss, over_slices, pair_losses, SideLogps

    model = tiny_model("qwen3_5")
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    attach_preference_loss(model, PreferenceConfig(loss="sigmoid", beta=0.5), 16, reference)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, model.config.vocab_size, sum(PAIR_LENGTHS)).astype(np.int32)
    mask = rng.random(sum(PAIR_LENGTHS)) < 0.8
    block = make_block(ids, mask, PAIR_LENGTHS, sum(PAIR_LENGTHS), pad_id=0, roles=np.array([0, 1, 0, 1]))
    simpo = PreferenceConfig(loss="simpo", beta=2.0, simpo_gamma=0.5)
    model.train()
    whole_inputs = block_to_model_inputs(block)
    full_loss = model.loss_sum(**whole_inputs)
    full_loss.backward()
    full_loss = full_loss.detach()
    full_grads = grads(model)
    with torch.no_grad():
        full_sums, full_counts = model.sequence_logps(**whole_inputs)
    full_simpo = pair_losses(simpo, SideLogps.of_block(full_sums, full_counts, whole_inputs["pairs"]))[0]
    report = {}
    for size, balanced in layouts:
        group = groups[size]
        model.zero_grad(set_to_none=True)
        model.preference_sums.take()
        inputs = slice_of_block(block, dist.get_rank() % size, size, group, balanced=balanced)
        loss = model.loss_sum(**inputs)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        counted = torch.tensor([float(model.preference_sums.take().pairs)])
        dist.all_reduce(counted, group=group)
        with torch.no_grad():
            sums, counts = over_slices(model.sequence_logps(**inputs), inputs[CP_KWARG])
        cp_simpo = pair_losses(simpo, SideLogps.of_block(sums, counts, inputs["pairs"]))[0]
        d = {"loss_value": float(full_loss), "loss": float((total - full_loss).abs()),
             "logps": float((sums - full_sums).abs().max()), "logps_scale": float(full_sums.abs().max()),
             "counts": float((counts - full_counts).abs().max()), "pairs_counted": float(counted),
             "simpo": float((cp_simpo - full_simpo).abs().max()), "num_grads": len(full_grads)}
        d.update(grad_difference(model, full_grads, group))
        report[f"dpo/qwen3_5/cp={size}{'b' if balanced else ''}"] = d
    return report


def gather(logits: torch.Tensor, size: int, group, order=None) -> torch.Tensor:
    """Every rank's logits in block order (`order`: CPSlice.block_order, the balanced layout's)."""
    pieces = [torch.empty_like(logits) for _ in range(size)]
    dist.all_gather(pieces, logits.contiguous(), group=group)
    out = torch.cat(pieces, dim=1)
    return out if order is None else out.index_select(1, order)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), [m == "on" for m in sys.argv[3].split(",")], sys.argv[4].split(","))
