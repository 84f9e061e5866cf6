"""Model construction for the FSDP2 trainer (ftcli.train.full): the recipe's model, built on the meta device,
made into the model that trains, then only this rank's shard materialized.

    build_model(model, training, world, attn)   (the recipe's model and training sections)
        meta build                       ftcli.model.build.build_empty_model (real buffers: rotary inv_freq)
        the training features            ftcli.features: each active feature's `convert` on the meta model
                                         (module swaps of linears, norms, MLPs that keep every parameter's
                                         name, so sharding and checkpoints are unchanged)
        shard_model
            activation checkpointing     per decoder layer (below)
            per-layer features           each active feature's `per_layer` (compile: whole layers or regions)
            fully_shard                  each decoder layer, the vision tower (VLM classes), the input
                                         embeddings and an untied LM head (below), then the root
        materialize                      this rank's shard only (`to_empty`), buffers copied back
        weights                          random init (below) or pretrained weights broadcast from rank 0

Random init (`model.init: random`) must not depend on the world size: a 1-rank and a 2-rank run start
from the same weights, and a 27B model never exists whole on one device, nor on rank 0 to broadcast.
So the weights are generated group by group (one decoder layer, then everything else): every rank
materializes the group in full on its own device, seeds the RNG from (training.seed, group name), runs
the model's own Hugging Face init on it, keeps its shard and frees the rest. Same seed, same group,
same values, whatever the sharding; the peak extra memory is the largest group (for the 27B shape,
embeddings + LM head + vision tower, ~3B values). Pretrained weights are read by rank 0 and
broadcast shard by shard (`set_model_state_dict(broadcast_from_rank0=True)`).

Activation checkpointing: `full` recomputes every decoder layer in backward (as the published qwen-b300 example), except
the last `activation_checkpointing_keep` layers, which keep their activations (memory traded for speed
where the card has room); `selective` recomputes every other layer, keeping about half the activations for about half the
recompute (a layer-level choice works the same for the linear-attention and full-attention layers
of a hybrid model, unlike an op-level policy).

The input embeddings and an untied LM head are FSDP units of their own, not parameters of the root: FSDP2 never
reshards the root after forward, so as part of it their bf16 copies (2 x vocab x hidden) stayed gathered through
the whole backward, the LM head's bf16 gradient from the first op of backward to the last, and both were reduced
together at the very end into one float32 reduce-scatter buffer of both, held beside every gradient (at the
Llama-3.1-8B width: 4.2 GB over TRL's peak, BENCHMARKS.md). As units, the LM head is gathered around the loss
(`ftcli.train.loss.attach_loss` calls it through an FSDP forward method) and reduced at the start of backward, the
embeddings are gathered around their lookup and reduced alone at the end. Tied embeddings (one parameter) stay
in the root.

The last decoder layer and the LM head unit stay gathered after forward (`reshard_after_forward=False`, as
torchtitan does for its last units): backward starts with them, so resharding them would only all-gather them again
at once (at world size 1 a cast-copy of each, exposed at the start of backward). Their bf16 copies are then held
through the loss's forward, below the peak at the end of backward. An eval's no-grad forward leaves them gathered
until the next backward (no optimizer step comes between; a state dict reshards first).

`world` is the trainer's ftcli.train.distributed.World (its mesh, device and rank 0 flag).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from ftcli import features
from ftcli.model.build import DTYPES, build_empty_model, decoder_layers, load_model, vision_tower


def set_activation_checkpointing(model: nn.Module, tcfg) -> list[bool]:
    """Which decoder layers recompute their activations in backward (the module doc); returns the flags."""
    layers = decoder_layers(model)
    if tcfg.activation_checkpointing == "none":
        flags = [False] * len(layers)
    elif tcfg.activation_checkpointing == "full":  # the last `keep` layers keep their activations
        flags = [i < len(layers) - tcfg.activation_checkpointing_keep for i in range(len(layers))]
    else:  # selective
        flags = [i % 2 == 0 for i in range(len(layers))]
    if any(flags):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer, flag in zip(layers, flags):
        layer.gradient_checkpointing = flag
    return flags


SEPARATE_EMBEDDING_UNITS = True  # the module doc; benchmarks/families_throughput_gpu.py measures both
KEEP_LAST_UNITS_GATHERED = True  # the module doc; benchmarks/families_throughput_gpu.py measures both


def embedding_units(model: nn.Module) -> list[nn.Module]:
    """The input embeddings and the LM head, when they are two parameters (the module doc); else none."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not SEPARATE_EMBEDDING_UNITS or embed is None or head is None or head.weight is embed.weight:
        return []
    return [embed, head]


def shard_model(model: nn.Module, training, world) -> nn.Module:
    """Activation checkpointing and compile per layer, then `fully_shard` per decoder layer, the vision
    tower (VLM classes; frozen and never called on text data, so never all-gathered), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tcfg = training
    layers = decoder_layers(model)
    set_activation_checkpointing(model, tcfg)
    per_layer = [f.per_layer for f in features.active(training) if f.per_layer is not None]  # compile
    for layer in layers:  # in place: parameter names (and so checkpoints) stay the same
        for apply in per_layer:
            apply(layer, training)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[tcfg.precision.param_dtype], reduce_dtype=DTYPES[tcfg.precision.reduce_dtype]
    )
    last_units = {id(layers[-1]), id(model.get_output_embeddings())} if KEEP_LAST_UNITS_GATHERED else set()
    for layer in layers:
        fully_shard(layer, mesh=world.mesh, mp_policy=mp_policy, reshard_after_forward=id(layer) not in last_units)
    visual = vision_tower(model)
    if visual is not None:
        visual.requires_grad_(False)
        fully_shard(visual, mesh=world.mesh, mp_policy=mp_policy)
    for unit in embedding_units(model):
        fully_shard(unit, mesh=world.mesh, mp_policy=mp_policy, reshard_after_forward=id(unit) not in last_units)
    fully_shard(model, mesh=world.mesh, mp_policy=mp_policy)
    return model


def _group_seed(seed: int, group: str) -> int:
    return zlib.crc32(f"{seed}/{group}".encode()) & 0x7FFFFFFF


@torch.no_grad()
def init_random_weights(model: nn.Module, template: nn.Module, seed: int, device: torch.device) -> None:
    """Fill the sharded `model` with a random init that does not depend on the sharding (module doc).
    `template` is an unsharded meta copy of the same model; one group at a time is made real in it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    names = {id(m): n for n, m in template.named_modules()}
    layers_prefix = names[id(decoder_layers(template))] + "."
    groups = [f"{layers_prefix}{i}." for i in range(len(decoder_layers(template)))] + ["<rest>"]
    sharded = dict(model.named_parameters())
    for group in groups:
        def in_group(name: str, group=group) -> bool:
            return name.startswith(group) if group != "<rest>" else not name.startswith(layers_prefix)

        members = [m for n, m in template.named_modules() if in_group(n + ".")]
        for m in members:
            m.to_empty(device=device, recurse=False)
        for m in template.modules():  # HF skips modules it has initialized once
            m.__dict__.pop("_is_hf_initialized", None)
        torch.manual_seed(_group_seed(seed, group))
        template.initialize_weights()  # the model's own init; meta tensors of other groups are no-ops
        for name, full in template.named_parameters():
            if in_group(name):
                target = sharded[name]
                if isinstance(target, DTensor):
                    full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target.copy_(full)
        for m in members:
            m.to_empty(device="meta", recurse=False)


def load_pretrained_weights(model: nn.Module, cfg, dtype: torch.dtype, world) -> None:
    """Rank 0 reads the checkpoint (CPU); every rank receives its shards by broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = load_model(cfg, dtype=dtype).state_dict() if world.is_main else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def build_model(cfg, tcfg, world, attn_implementation: str | None) -> nn.Module:
    """Meta build -> shard -> materialize this rank's shard -> weights, from the model section `cfg` and the training
    section `tcfg`. Returns the FSDP2 model."""
    master_dtype = DTYPES[tcfg.precision.master_dtype]
    model = build_empty_model(cfg, master_dtype, attn_implementation)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    features.preflight(tcfg, world.device)  # a missing package fails now, not after the first forward
    for feature in features.active(tcfg):  # module swaps that keep the parameter names
        if feature.convert is not None:
            feature.convert(model, tcfg, world.device)
    shard_model(model, tcfg, world)
    model.to_empty(device=world.device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    if cfg.init == "random":
        init_random_weights(model, build_empty_model(cfg, master_dtype), tcfg.seed, world.device)
    else:
        load_pretrained_weights(model, cfg, master_dtype, world)
    model.train()
    return model
