"""The memory model and `ftcli plan` with a kept-MXFP4 base (model.quantization=mxfp4)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ftcli.config.recipe import load_recipe
from ftcli.estimate import memory, plan
from ftcli.estimate.fit import resolved_sharding
from ftcli.estimate.shape import model_shape

EXPERTS_120B = 36 * 128 * (2880 * 5760 + 2880 * 2880)  # gate_up [E, 2880, 5760] + down [E, 2880, 2880] per layer


def _card(p, accelerator):
    return next(c for c in p.cards if c.accelerator == accelerator)


def test_kept_base_holds_expert_weights_at_4_25_bits():
    """Only the expert weights change: bf16 (2 bytes) -> 4.25/8 bytes per parameter; the rest of the base and the
    adapter's state as with a bf16 base; `other` is one chunk of dequantized experts (16 of the 120b's gate_up
    experts in DEQUANT_CHUNK_BYTES, the same constant as the code's)."""
    from ftcli.model import mxfp4_lora

    assert memory.DEQUANT_CHUNK_BYTES == mxfp4_lora.DEQUANT_CHUNK_BYTES
    shape = model_shape(load_recipe("gpt-oss-120b-1gpu").model)
    assert memory.expert_weight_params(shape) == EXPERTS_120B
    s = memory.Setting(method="lora", tokens=4096, world=1, compute_bytes=2, checkpointing="full", loss="trl",
                       adapter_params=536_809_472, sharding="ddp")
    bf16, kept = memory.estimate(shape, s), memory.estimate(shape, replace(s, expert_quant="mxfp4"))
    assert bf16.params - kept.params == pytest.approx(EXPERTS_120B * (2 - 4.25 / 8) / memory.GiB)
    assert (kept.grads, kept.optimizer, kept.activations) == (bf16.grads, bf16.optimizer, bf16.activations)
    assert kept.other == pytest.approx(16 * 2880 * 5760 * 2 / memory.GiB)
    assert round(kept.params - 4 * 536_809_472 / memory.GiB, 1) == 60.8  # the kept base: 218 GiB in bf16


def test_120b_1gpu_recipe_fits_one_h200_and_h100_with_a_smaller_rank():
    r = load_recipe("gpt-oss-120b-1gpu")
    assert (r.model.quantization, r.training.sharding, r.compute.accelerator_type) == ("mxfp4", "ddp", "GPU_1xH200")
    p = plan.make_plan(r)
    h200, h100 = _card(p, "GPU_1xH200"), _card(p, "GPU_1xH100")
    assert h200.fits and round(h200.estimate.total, 1) == 71.1
    assert plan.fit_check(r).reason == "fits GPU_1xH200: 71.1 of 120.8 GiB usable per GPU"
    assert not h100.fits and [s.overrides for s in h100.suggestions] == [("lora.r=4",)]
    assert round(h100.suggestions[0].total_gib, 1) == 67.1


def test_plan_suggests_the_kept_base_for_one_gpu():
    """The 8-GPU bf16 recipe asked about one GPU: keeping the experts in MXFP4 (with DDP) is the first suggestion."""
    one = load_recipe("gpt-oss-120b-h100", ["compute.accelerator_type=GPU_1xH200", "compute.num_accelerators=1"])
    h200 = _card(plan.make_plan(one), "GPU_1xH200")
    assert not h200.fits
    assert h200.suggestions[0].overrides == ("model.quantization=mxfp4", "training.sharding=ddp")
    h100 = _card(plan.make_plan(one), "GPU_1xH100")
    assert h100.suggestions[0].overrides == ("model.quantization=mxfp4", "training.sharding=ddp", "lora.r=4")
    assert resolved_sharding(load_recipe("gpt-oss-120b-1gpu", ["training.sharding=auto"]))[0] == "ddp"


def test_peft_folded_expert_lora_keeps_every_stored_layers_folded_weights():
    """lora.experts=peft (PEFT's ParamWrapper) on gpt-oss-20b without checkpointing: each of the 24 layers keeps its
    folded W + s·A·B for backward, 24 layers' expert weights in bf16 more than the grouped expert LoRA (an H200, 4k
    block: 103.1 vs 67.2 GiB measured; the model: 100.0 vs 64.4); with full checkpointing the two are equal."""
    from ftcli.estimate.fit import memory_on

    experts = ["lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]", "lora.dropout=0"]
    one_h200 = ["compute.accelerator_type=GPU_1xH200", "compute.num_accelerators=1"]
    totals = {}
    for how in ("peft", "grouped"):
        for ac in ("none", "full"):
            recipe = load_recipe("gpt-oss-h100", [*experts, *one_h200, f"lora.experts={how}",
                                                  f"training.activation_checkpointing={ac}"])
            totals[how, ac] = memory_on(recipe, 1).total
    per_layer = 32 * (2880 * 5760 + 2880 * 2880) * 2 / memory.GiB
    assert totals["peft", "none"] - totals["grouped", "none"] == pytest.approx(24 * per_layer)
    assert totals["peft", "full"] == totals["grouped", "full"]
    assert (round(totals["peft", "none"], 1), round(totals["grouped", "none"], 1)) == (100.0, 64.4)


@pytest.mark.parametrize("name, layers, per_layer_params, gib", [
    ("gpt-oss-120b-h100", 36, 128 * (2880 * 5760 + 2880 * 2880), (44.1, 78.5, 292.1)),
    ("qwen3-30b-a3b-lora-h100", 48, 128 * (1536 * 2048 + 2048 * 768), (12.7, 45.5, 99.5)),
])
def test_grouped_expert_lora_is_the_default_over_an_fsdp_base_too(name, layers, per_layer_params, gib):
    """The FSDP recipes train their experts through the grouped expert LoRA (`grouped_expert_lora`, for trainer,
    plan and doctor alike): as shipped (full checkpointing) the plan is what it was with PEFT's fold (44.1 and 12.7
    GiB per GPU of 8); without checkpointing lora.experts=peft keeps every layer's folded expert weights in bf16
    (gpt-oss-120b 292.1 vs 78.5 GiB, Qwen3-30B-A3B 99.5 vs 45.5) and grouped does not."""
    from ftcli.estimate.fit import grouped_expert_lora, memory_on, merged_experts

    recipe = load_recipe(name)
    assert (recipe.training.sharding == "fsdp" and grouped_expert_lora(recipe.model, recipe.training, recipe.lora)
            and not merged_experts(recipe.model, recipe.training, recipe.lora))
    totals = {}
    for how in ("grouped", "peft"):
        for ac in ("full", "none"):
            sets = [f"lora.experts={how}", f"training.activation_checkpointing={ac}"]
            totals[how, ac] = memory_on(load_recipe(name, sets), 8).total
    assert totals["grouped", "full"] == totals["peft", "full"] == memory_on(recipe, 8).total
    folded = layers * per_layer_params * 2 / memory.GiB  # every layer's expert weights in bf16
    assert totals["peft", "none"] - totals["grouped", "none"] == pytest.approx(folded)
    assert tuple(round(totals[k], 1) for k in (("grouped", "full"), ("grouped", "none"), ("peft", "none"))) == gib
