"""Recipe -> SFTConfig kwargs and recipe -> PEFT LoraConfig for the LoRA path (exact values). A real SFTConfig and
TRL trainer built from them: tests/e2e/test_lora_trl_build.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _lora_common import tiny_model, tiny_recipe
from ftcli.config.recipe import load_recipe

RUN = Path("/runs/x")


def test_gpt_oss_h100_sft_config_is_the_reference():
    from ftcli.config.recipe import load_recipe
    from ftcli.train.lora.trainer import sft_config_kwargs

    r = load_recipe("gpt-oss-h100")
    kw = sft_config_kwargs(r.training, r.model, r.name, RUN)
    assert kw == {
        "output_dir": "/runs/x/checkpoints",
        "run_name": "gpt-oss-h100",
        "seed": 0,
        "data_seed": 0,
        "num_train_epochs": 1.0,
        "max_steps": -1,
        "per_device_train_batch_size": 1,  # (ref)
        "gradient_accumulation_steps": 1,  # (fix: one packed 4k block per step; the reference took 2 unpacked examples)
        "optim": "adamw_torch_fused",
        "learning_rate": 2e-4,  # (ref)
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "lr_scheduler_type": "cosine_with_min_lr",  # (ref)
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},  # (ref)
        "warmup_steps": 0.03,  # (ref: warmup_ratio 0.03; transformers 5 reads warmup_steps < 1 as a ratio)
        "bf16": True,
        "fp16": False,
        "activation_checkpointing": False,  # (fix; ref: gradient_checkpointing, non-reentrant): 4k fits without
        "activation_checkpointing_kwargs": None,
        "torch_compile": False,
        "ddp_find_unused_parameters": False,  # (ref)
        "average_tokens_across_devices": True,
        "loss_type": "nll",
        "router_aux_loss_coef": 0.0,
        "dataset_kwargs": {"skip_prepare_dataset": True},
        "packing": False,
        "padding_free": False,
        "max_length": None,
        "remove_unused_columns": False,
        "label_names": ["labels"],
        "dataloader_num_workers": 0,
        "logging_steps": 1,  # (ref)
        "logging_first_step": True,
        "disable_tqdm": True,  # (ref: progress bars on) ftcli's own bar and step line, as the full path
        "save_strategy": "steps",
        "save_steps": 500,
        "save_total_limit": 2,
        "report_to": "none",  # (ref: mlflow) ftcli's tracker logs the metrics, as in the full path
    }


@pytest.mark.parametrize(("overrides", "expected"), [
    (["training.schedule.warmup=25"], {"warmup_steps": 25}),
    (["training.schedule.name=constant"], {"lr_scheduler_type": "constant", "lr_scheduler_kwargs": {}}),
    (["training.grad_clip=null"], {"max_grad_norm": 0.0}),
    (["training.activation_checkpointing=selective"],
     {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False, "selective": True}}),
    (["training.checkpoint.enabled=false"], {"save_strategy": "no"}),
    (["training.max_steps=7", "model.dtype=float16"], {"max_steps": 7, "fp16": True, "bf16": False}),
])
def test_sft_config_follows_recipe_knobs(overrides, expected):
    from ftcli.train.lora.trainer import sft_config_kwargs

    r = tiny_recipe(*overrides)
    kw = sft_config_kwargs(r.training, r.model, r.name, RUN)
    assert {k: kw[k] for k in expected} == expected


def _lora_targets(recipe, model):
    from peft import get_peft_model

    from ftcli.train.lora.trainer import lora_config

    peft_model = get_peft_model(model, lora_config(recipe.lora, recipe.model, model))
    return sorted({n.split(".lora_")[0].removeprefix("base_model.model.") for n, _ in peft_model.named_parameters()
                   if "lora_" in n})


def test_all_linear_misses_gpt_oss_experts_target_parameters_adds_them():
    attention_only = _lora_targets(tiny_recipe("lora.target_parameters=[]"), tiny_model())
    assert attention_only == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in
                              ("k_proj", "o_proj", "q_proj", "v_proj")]
    with_experts = _lora_targets(tiny_recipe(), tiny_model())
    experts = [t for t in with_experts if ".mlp." in t]
    # gate_up_proj and down_proj of every layer: PEFT nests one ParamWrapper per targeted parameter
    assert experts == [f"model.layers.{i}.mlp.experts{s}" for i in range(2) for s in ("", ".base_layer")]


def test_target_parameters_with_dropout_is_a_one_line_error():
    from ftcli.config.errors import UserError
    from ftcli.train.lora.trainer import lora_config

    with pytest.raises(UserError, match="lora.dropout=0.05 cannot be used with lora.target_parameters"):
        lora_config(tiny_recipe("lora.dropout=0.05").lora, tiny_recipe().model, tiny_model())
    with pytest.raises(UserError, match="no parameter named 'mlp.experts.nope'"):
        lora_config(tiny_recipe("lora.target_parameters=[mlp.experts.nope]").lora, tiny_recipe().model, tiny_model())


def test_vision_tower_excluded_on_vlm_classes():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from ftcli.config.recipe import resolve_path

    text = json.loads(Path(resolve_path("pkg://assets/tiny-qwen3_5.json")).read_text())
    text.pop("model_type", None)
    config = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                num_heads=2, out_hidden_size=text["hidden_size"]))
    base = ["model.model_type=qwen3_5", "model.model_class=image_text_to_text", "lora.target_parameters=[]",
            "lora.target_modules=all-linear"]
    torch.manual_seed(0)
    excluded = _lora_targets(tiny_recipe(*base), Qwen3_5ForConditionalGeneration(config))
    assert excluded and not any("visual" in t for t in excluded)
    assert all(t.startswith("model.language_model.layers.") for t in excluded)
    included = _lora_targets(tiny_recipe(*base, "lora.exclude_vision=false"), Qwen3_5ForConditionalGeneration(config))
    assert any(t.startswith("model.visual.") for t in included)


@pytest.mark.parametrize("override, line", [
    ("training.precision.master_dtype=bfloat16", "training.precision belongs to training.method=full (this recipe's is "
                                                 "lora): leave it out (switching a recipe's method with --set: also "
                                                 "--set training.precision={})"),
    ("training.activation_checkpointing_keep=2", "training.activation_checkpointing_keep belongs to training.method=full "
                                                 "(this recipe's is lora): leave it out (switching a recipe's method "
                                                 "with --set: also --set training.activation_checkpointing_keep=0)"),
    ("training.fused_ops=[rms_norm]", "training.fused_ops belongs to training.method=full (this recipe's is lora): "
                                      "leave it out (switching a recipe's method with --set: also --set "
                                      "training.fused_ops=[])"),
    ("training.loss.impl=liger", "training.loss: impl=liger belongs to training.method=full; LoRA's loss is the chunked one "
                                 "(ftcli's, as the eval's): leave training.loss.impl out"),
])
def test_a_full_sft_setting_in_a_lora_recipe_is_one_line_naming_its_method(override, line):
    from ftcli.config.errors import UserError

    with pytest.raises(UserError) as e:
        load_recipe("tiny-gpt-oss-cpu", [override])
    assert str(e.value) == f"invalid recipe 'tiny-gpt-oss-cpu': {line}"


def test_training_is_typed_by_method_and_dumps_load_back():
    """`training` is FullTraining or LoraTraining by `method`; each refuses the other's keys except at their defaults,
    which dumps write (recipe.yaml and rendered workloads list every key), so a dump loads back unchanged."""
    from ftcli.config.errors import UserError
    from ftcli.config.recipe import FullTraining, LoraTraining, Recipe, dump_recipe, parse_yaml

    lora, full = load_recipe("tiny-gpt-oss-cpu"), load_recipe("tiny-qwen-cpu")
    assert type(lora.training) is LoraTraining and type(full.training) is FullTraining
    assert not hasattr(lora.training, "precision") and not hasattr(full.training, "sharding")
    dumped = lora.to_dict()["training"]
    assert (dumped["precision"], dumped["activation_checkpointing_keep"], dumped["sharding"]) == (
        {"param_dtype": "bfloat16", "reduce_dtype": "float32", "master_dtype": "float32"}, 0, "auto")
    assert full.to_dict()["training"]["sharding"] == "auto" and "fused_ops" not in dumped
    for recipe in (lora, full):
        assert Recipe.model_validate(parse_yaml(dump_recipe(recipe))) == recipe
    assert type(load_recipe("tiny-qwen-cpu", ["training.method=lora", "training.precision={}"]).training) is LoraTraining
    assert load_recipe("tiny-qwen-cpu", ["training.sharding=auto"]).training == full.training
    with pytest.raises(UserError, match=r"^invalid recipe 'tiny-qwen-cpu': training.sharding belongs to "
                                        r"training.method=lora \(this recipe's is full\): leave it out \(switching a "
                                        r"recipe's method with --set: also --set training.sharding=auto\)$"):
        load_recipe("tiny-qwen-cpu", ["training.sharding=ddp"])
    with pytest.raises(UserError, match=r"unknown key 'training.shardin'; did you mean 'training.sharding'\?$"):
        load_recipe("tiny-gpt-oss-cpu", ["training.shardin=ddp"])
    with pytest.raises(UserError, match=r"unknown key 'training.lr'; did you mean 'training.optimizer.lr'\?$"):
        load_recipe("tiny-gpt-oss-cpu", ["training.lr=1"])
    with pytest.raises(UserError, match=r"training.method: Input should be 'full' or 'lora' \(got 'qlora'\)$"):
        load_recipe("tiny-gpt-oss-cpu", ["training.method=qlora"])
