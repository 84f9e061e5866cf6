"""The training-feature registry (ftcli.features): each record's facts, asked the way its consumers ask them,
on faked machines and recipes (no GPU, nothing imported that a feature needs)."""

from __future__ import annotations

import pytest

from ftcli import features
from ftcli.config.errors import UserError
from ftcli.config.recipe import Recipe, load_recipe
from ftcli.hardware import Machine


def test_every_record_is_its_modules_and_names_a_real_recipe_key():
    import importlib
    import typing

    from pydantic import BaseModel

    from ftcli.config.recipe import LoraTraining

    assert list(features.FEATURES) == ["float8", "compile", "loss", "fused_ops"]
    for name, f in features.FEATURES.items():
        assert importlib.import_module(f"ftcli.features.{name}").FEATURE is f
        section, *path = f.setting.split(".")
        model = Recipe
        for key in [section, *path]:  # every step of the dotted key is a schema field (training: full SFT's)
            field = model.model_fields[key]
            members = [typing.get_args(m)[0] if typing.get_origin(m) is typing.Annotated else m
                       for m in (typing.get_args(field.annotation) or (field.annotation,))]
            model = next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)
                          and m is not LoraTraining), None)
    assert len({f.label for f in features.FEATURES.values()}) == len(features.FEATURES)


def test_checks_on_faked_machines():
    """float8 needs capability >= 8.9 and torchao; fused ops each op's package (fla's kernels also count from
    fla-core); torch-free: a Machine of plain data."""
    fp8, fused = features.FEATURES["float8"], features.FEATURES["fused_ops"]
    training = load_recipe("qwen-b300", ["training.fused_ops=[rms_norm,gated_norm]"]).training
    ada = Machine(device="cuda:0", capability=(8, 9), versions={"torchao": "0.18.0"})
    assert fp8.check(training, ada) == features.Found((), ("fp8: torchao 0.18.0 on capability 8.9",))
    ampere = Machine(device="cuda:0", capability=(8, 6), versions={})
    assert fp8.check(training, ampere).problems == (
        "training.precision.fp8 needs compute capability >= 8.9, this GPU is 8.6: set training.precision.fp8=false",
        "training.precision.fp8 needs torchao: pip install torchao")
    core_only = Machine(device="cuda:0", versions={"liger-kernel": "0.8.5", "fla-core": "0.6.0"})
    assert fused.check(training, core_only) == features.Found((), ("liger-kernel 0.8.5", "flash-linear-attention 0.6.0"))
    assert fused.check(training, Machine(device="cuda:0")).problems == (
        "training.fused_ops needs liger-kernel: pip install liger-kernel",
        "training.fused_ops needs flash-linear-attention: pip install flash-linear-attention")
    assert [f.name for f in features.checked()] == ["float8", "fused_ops"]  # compile and the loss: nothing to check


def test_requirements_one_line_per_package_in_the_workload():
    """Two features on one package share its line (both uses, in registry order); pins come sorted."""
    both = load_recipe("qwen-b300", ["training.fused_ops=[swiglu]"])
    assert features.requirements(both.training) == [
        ("liger-kernel==0.8.5", "pure Python + Triton fused linear cross-entropy (loss.impl=liger) and fused "
                                "RMSNorm / SwiGLU (training.fused_ops)"),
        ("torchao==0.18.0", "float8 training (training.precision.fp8), its Python part; the float8 GEMMs are "
                            "torch's own")]
    gated_only = load_recipe("qwen-b300", ["training.fused_ops=[gated_norm]", "training.loss.impl=chunked",
                                           "training.precision.fp8=false"])
    assert features.requirements(gated_only.training) == []  # fla is the Qwen3.5 family's own pin
    from ftcli.launchers.databricks import render_command

    assert "torchao==0.18.0" in render_command(both) and "torchao" not in render_command(gated_only)


def test_rules_run_in_the_features_loader_and_name_every_problem():
    overrides = ["training.precision.fp8=true", "data.packing.block_len=1000", "model.model_type=gpt_oss",
                 "training.fused_ops=[rms_norm]"]
    assert load_recipe("tiny-qwen-cpu", overrides).training.precision.fp8  # the schema alone accepts it
    with pytest.raises(UserError) as err:
        features.load_recipe("tiny-qwen-cpu", overrides)
    assert str(err.value) == (
        "invalid recipe 'tiny-qwen-cpu': 2 problems\n"
        "  - training.precision.fp8 needs packed blocks whose tokens per micro-batch (block_len x per_device_batch "
        "= 1000) are a multiple of 16\n"
        "  - training.fused_ops covers the modules of model_type qwen3_5, qwen3_5_text, llama, qwen3, gemma3_text, "
        "gemma3; this recipe's model_type is gpt_oss: set training.fused_ops=[]")
    with pytest.raises(UserError, match=r"training.precision belongs to training.method=full"):
        features.load_recipe("tiny-gpt-oss-cpu", ["training.precision.fp8=true"])  # LoRA: no feature to turn on


def test_lora_sets_no_feature_and_the_full_path_names_each():
    """A LoRA recipe cannot turn a feature on (its typed training section refuses the keys); a full one lists
    them in the registry's order."""
    lora = load_recipe("tiny-gpt-oss-cpu")
    assert features.active(lora.training) == []
    with pytest.raises(UserError, match=r"training.fused_ops belongs to training.method=full"):
        load_recipe("tiny-gpt-oss-cpu", ["training.fused_ops=[rms_norm]"])
    full = load_recipe("qwen-b300", ["training.fused_ops=[swiglu,rms_norm]"])
    assert [f.name for f in features.active(full.training)] == ["float8", "compile", "loss", "fused_ops"]
    assert features.speed_keys(full.training) == ("fp8", "compile=regions", "fused=rms_norm+swiglu")
    assert features.speed_keys(load_recipe("gpt-oss-h100").training) == ("compile=layers",)  # LoRA: compile alone applies
    assert features.speed_keys(lora.training) == ()


def test_a_compiled_lora_recipe_plans_with_the_compiled_step_time():
    from ftcli.estimate import fit, memory, steptime

    for sets, seconds in (([], 0.226), (["training.compile=false"], 0.374)):
        recipe = load_recipe("gpt-oss-h100", sets)
        shape = memory.shipped_shape(recipe.model.id)
        st = steptime.step_time(recipe.training, shape, fit.setting_of(recipe, shape), "H200")
        assert st.s_per_step == pytest.approx(seconds), st.source
