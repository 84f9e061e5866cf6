"""Recipes: the built-ins reproduce the two published Databricks examples; mistakes fail loudly and precisely."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ftcli.config.recipe import (
    Recipe,
    RecipeError,
    apply_overrides,
    builtin_recipe_names,
    dump_recipe,
    load_recipe,
    parse_override,
    resolve_path,
)

BUILTINS = ["gemma3-12b-h100", "gpt-oss-120b-1gpu", "gpt-oss-120b-h100", "gpt-oss-20b-dpo-h100", "gpt-oss-h100",
            "llama3-70b-lora-h100",
            "llama3-8b-dpo-h100", "llama3-8b-h100", "qwen-b300", "qwen-b300-dpo", "qwen3-30b-a3b-lora-h100", "tiny-dpo-cpu",
            "tiny-gemma3-cpu", "tiny-gpt-oss-cpu",
            "tiny-llama3-cpu", "tiny-qwen-cpu", "tiny-qwen3-cpu", "tiny-qwen3-moe-cpu"]


def _error(name_or_path, overrides=()) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(name_or_path, list(overrides))
    return str(err.value)


# ------------------------------------------------------------------------------------ built-ins
def test_builtin_recipe_names():
    assert builtin_recipe_names() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_recipe_loads(name):
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe.compute.num_accelerators % recipe.compute.gpus_per_node == 0


@pytest.mark.parametrize("name", ["tiny-qwen-cpu", "tiny-gpt-oss-cpu"])
def test_tiny_recipes_point_at_shipped_assets(name):
    recipe = load_recipe(name)
    assert recipe.model.init == "random"
    for ref in (recipe.model.config, recipe.model.tokenizer, recipe.data.path):
        assert ref.startswith("pkg://")
        assert Path(resolve_path(ref)).exists(), ref


def test_qwen_b300_reproduces_published_qwen_full_sft_example():
    r = load_recipe("qwen-b300")
    assert (r.model.id, r.model.revision) == ("Qwen/Qwen3.8-27B", "1d4bf0f2ff6012fd82039f2fa52739d0dd7c60c0")
    assert (r.model.model_type, r.model.model_class, r.model.dtype) == ("qwen3_5", "image_text_to_text", "bfloat16")
    assert (r.data.path, r.data.revision) == ("HuggingFaceH4/ultrachat_200k", "8049631c405ae6576f93f445c6b8166f76f5505a")
    assert (r.data.split, r.data.streaming, r.data.messages_field, r.data.train_on) == (
        "train_sft", True, "messages", "assistant")
    assert (r.data.packing.enabled, r.data.packing.block_len, r.data.packing.strategy) == (True, 32768, "split")
    t = r.training
    assert (t.method, t.epochs, t.grad_accum, t.per_device_batch) == ("full", 1.0, 1, 1)
    assert (t.optimizer.name, t.optimizer.lr, t.optimizer.betas) == ("adamw", 1e-5, (0.9, 0.95))
    assert (t.optimizer.weight_decay, t.optimizer.fused) == (0.0, True)
    assert (t.schedule.name, t.schedule.warmup) == ("constant", 0.0)
    assert t.grad_clip is None
    assert (t.precision.param_dtype, t.precision.reduce_dtype) == ("bfloat16", "float32")
    assert (t.activation_checkpointing, t.log_every) == ("full", 100)
    c = r.compute
    assert (c.accelerator_type, c.num_accelerators, c.gpus_per_node, c.num_nodes) == ("GPU_8xB300", 8, 8, 1)
    assert (c.experiment_name, c.environment_version) == ("air-b300-qwen3-8-27b-sft", "databricks_ai_v6")
    assert (c.max_retries, c.timeout_minutes) == (0, 240)
    assert c.env_variables == {
        "PYTORCH_ALLOC_CONF": "expandable_segments:True", "HF_HOME": "/tmp/.hf",
        "NCCL_DEBUG": "WARN", "TORCH_CUDA_ARCH_LIST": "10.0",
    }


def test_gpt_oss_h100_reproduces_published_gpt_oss_lora_example():
    r = load_recipe("gpt-oss-h100")
    assert (r.model.id, r.model.model_type, r.model.dtype) == ("openai/gpt-oss-20b", "gpt_oss", "bfloat16")
    assert r.model.quantization == "mxfp4_dequantize"
    assert (r.data.path, r.data.split, r.data.max_length) == ("HuggingFaceH4/Multilingual-Thinking", "train", 2048)
    lora = r.lora
    assert (lora.r, lora.alpha, lora.dropout, lora.bias, lora.target_modules) == (8, 16, 0.05, "none", "all-linear")
    assert lora.target_parameters == []
    t = r.training
    assert (t.method, t.epochs, t.per_device_batch, t.grad_accum, t.log_every) == ("lora", 1.0, 1, 1, 1)
    # the fix: packed 4k blocks without activation checkpointing (the fastest measured setting that fits an
    # 80 GB H100: 63 GiB on one H200) instead of 2 unpacked examples with full checkpointing
    assert (r.data.packing.enabled, r.data.packing.block_len, r.data.packing.strategy) == (True, 4096, "bfd")
    assert (t.optimizer.lr, t.optimizer.betas, t.optimizer.weight_decay) == (2e-4, (0.9, 0.999), 0.0)
    assert (t.schedule.name, t.schedule.warmup, t.schedule.min_lr_ratio) == ("cosine_with_min_lr", 0.03, 0.1)
    assert (t.activation_checkpointing, t.grad_clip) == ("none", 1.0)
    assert r.output.dir == "/Volumes/main/default/checkpoints/gpt-oss-20b-peft"
    c = r.compute
    assert (c.accelerator_type, c.num_accelerators, c.num_nodes) == ("GPU_8xH100", 8, 1)
    assert (c.experiment_name, c.max_retries, c.timeout_minutes) == ("gpt-oss-20b-lora", 0, 120)


# ---------------------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize("override,expected", [
    ("trainig.epochs=1", "unknown key 'trainig'; did you mean 'training'?"),
    ("training.lr=1e-4", "unknown key 'training.lr'; did you mean 'training.optimizer.lr'?"),
    ("training.optimizer.lrr=1e-4", "unknown key 'training.optimizer.lrr'; did you mean 'training.optimizer.lr'?"),
    ("data.packing.block_length=4096", "unknown key 'data.packing.block_length'; did you mean 'data.packing.block_len'?"),
    ("lora.alph=4", "unknown key 'lora.alph'; did you mean 'lora.alpha'?"),
    ("compute.gpus_per_node=8", "unknown key 'compute.gpus_per_node'"),
    ("compute.permissions=[{user_nam: a, level: CAN_VIEW}]",
     "unknown key 'compute.permissions.0.user_nam'; did you mean 'compute.permissions.0.user_name'?"),
    ("level=CAN_VIEW", "unknown key 'level'; did you mean 'compute.permissions.level'?"),
])
def test_unknown_key_names_path_and_suggestion(override, expected):
    msg = _error("qwen-b300", [override])
    assert msg == f"invalid recipe 'qwen-b300': {expected}"


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    data = load_recipe("tiny-qwen-cpu").to_dict()
    data["training"]["lr"] = 0.1
    path.write_text(yaml.safe_dump(data))
    assert _error(str(path)) == (
        f"invalid recipe {path}: unknown key 'training.lr'; did you mean 'training.optimizer.lr'?"
    )


# ----------------------------------------------------------------------------------- type errors
@pytest.mark.parametrize("override,path", [
    ("training.epochs=abc", "training.epochs"),
    ("data.packing.block_len=4", "data.packing.block_len"),
    ("training.optimizer.betas=[0.9]", "training.optimizer.betas"),
    ("model.dtype=float8", "model.dtype"),
    ("lora.dropout=1.5", "lora.dropout"),
    ("name=has space", "name"),
])
def test_type_error_names_path(override, path):
    msg = _error("qwen-b300", [override])
    body = msg.removeprefix("invalid recipe 'qwen-b300': ")
    assert body.startswith(f"{path}:") or f"'{path}." in body, msg  # betas=[0.9]: 'training.optimizer.betas.1'

    assert "\n" not in msg


def test_cross_field_error_names_section():
    msg = _error("qwen-b300", ["compute.num_accelerators=12"])
    assert msg == (
        "invalid recipe 'qwen-b300': compute: num_accelerators=12 is not a multiple of the 8 GPUs per node of GPU_8xB300"
    )
    assert "priority_class needs pool_id" in _error("qwen-b300", ["compute.priority_class=NORMAL"])
    assert _error("qwen-b300", ["compute.secrets.HF_TOKEN=nokey"]) == (
        "invalid recipe 'qwen-b300': compute.secrets.HF_TOKEN: must be 'scope/key' (exactly one '/') (got 'nokey')"
    )
    assert "HF_HOME set both as a secret and as an env variable" in _error("qwen-b300", ["compute.secrets.HF_HOME=s/k"])


def test_multiple_problems_listed_one_per_line():
    msg = _error("qwen-b300", ["training.lr=1", "training.epochs=abc", "model.dtype=fp8"])
    head, *lines = msg.split("\n")
    assert head == "invalid recipe 'qwen-b300': 3 problems"
    assert len(lines) == 3 and all(line.startswith("  - ") for line in lines)
    assert any("training.optimizer.lr" in line for line in lines)


def test_missing_required_key(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\ndata: {path: a.jsonl, source: local}\n")
    assert _error(str(path)) == f"invalid recipe {path}: missing required key 'model'"


# ----------------------------------------------------------------------------------------- --set
@pytest.mark.parametrize("item,keys,value", [
    ("training.optimizer.lr=2.0e-5", ["training", "optimizer", "lr"], 2e-5),
    ("training.grad_accum=4", ["training", "grad_accum"], 4),
    ("training.compile=true", ["training", "compile"], True),
    ("training.compile=false", ["training", "compile"], False),
    ("training.optimizer.betas=[0.9, 0.99]", ["training", "optimizer", "betas"], [0.9, 0.99]),
    ("training.grad_clip=null", ["training", "grad_clip"], None),
    ("description=two words", ["description"], "two words"),
    ("description=", ["description"], ""),
    (" name = x", ["name"], "x"),
    ("model.id=a=b", ["model", "id"], "a=b"),
])
def test_parse_override(item, keys, value):
    assert parse_override(item) == (keys, value)


@pytest.mark.parametrize("item", ["novalue", "=5", "  =5"])
def test_bad_set_syntax(item):
    with pytest.raises(RecipeError, match="expected dotted.key=value"):
        parse_override(item)


def test_set_applies_and_validates():
    r = load_recipe("qwen-b300", [
        "training.optimizer.lr=2e-5", "training.grad_clip=null", "training.optimizer.betas=[0.9, 0.99]",
        "training.compile=true", "data.max_examples=100", "compute.num_accelerators=16",
    ])
    assert r.training.optimizer.lr == 2e-5 and isinstance(r.training.optimizer.lr, float)
    assert r.training.grad_clip is None
    assert r.training.optimizer.betas == (0.9, 0.99)
    assert r.training.compile is True
    assert r.data.max_examples == 100
    assert r.compute.num_nodes == 2


def test_set_into_a_value_is_an_error():
    with pytest.raises(RecipeError, match="'training.optimizer' is a value, not a section"):
        apply_overrides({"training": {"optimizer": 1}}, ["training.optimizer.lr=1"])


def test_set_creates_missing_sections():
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


def test_set_exponent_without_dot_is_a_number():
    assert parse_override("model.config_overrides.rope_theta=1e6") == (["model", "config_overrides", "rope_theta"], 1e6)


# ---------------------------------------------------------------------------------- names, files
def test_unknown_builtin_suggests_closest():
    assert _error("qwen-b30") == "no recipe file or built-in recipe named 'qwen-b30'; did you mean 'qwen-b300'?"


def test_unknown_builtin_lists_builtins():
    assert _error("zzz").endswith("built-in recipes: " + ", ".join(BUILTINS))


def test_missing_recipe_file():
    assert _error("nope/missing.yaml") == "recipe file not found: nope/missing.yaml"


def test_bad_yaml_names_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nmodel: [\n")
    msg = _error(str(path))
    assert msg.startswith(f"invalid recipe {path}: not valid YAML line") and "\n" not in msg


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("- a\n- b\n")
    assert _error(str(path)) == f"invalid recipe {path}: expected a mapping of sections at the top level"


def test_section_that_is_not_a_mapping_is_a_recipe_error(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nmodel: {model_type: gpt_oss, id: a}\ndata: [1, 2]\n")
    assert "data" in _error(str(path))


def test_relative_paths_resolve_against_recipe_folder(tmp_path):
    (tmp_path / "chat.jsonl").write_text("{}\n")
    (tmp_path / "template.jinja").write_text("x")
    path = tmp_path / "r.yaml"
    data = load_recipe("tiny-qwen-cpu").to_dict()
    data["data"]["path"] = "chat.jsonl"
    data["data"]["chat_template"] = "template.jinja"
    path.write_text(yaml.safe_dump(data))
    r = load_recipe(str(path))
    assert r.data.path == str(tmp_path / "chat.jsonl")
    assert r.data.chat_template == str(tmp_path / "template.jinja")
    assert r.model.config == "pkg://assets/tiny-qwen3_5.json"  # pkg:// stays symbolic


def test_relative_eval_and_source_paths_resolve_against_recipe_folder(tmp_path, monkeypatch):
    """eval.path (local unless eval.source says otherwise) and local data.sources / eval.sources entries
    resolve as data.path does, whatever the working directory; hub ids, missing files and absolute paths
    stay as written."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    for name in ("train.jsonl", "held.jsonl", "more.jsonl", "org"):
        (folder / name).write_text("{}\n")
    data = load_recipe("tiny-qwen-cpu").to_dict()
    data["eval"] = {"path": "held.jsonl", "every_steps": 25}
    (folder / "eval.yaml").write_text(yaml.safe_dump(data))
    del data["data"]["path"]  # data.sources replaces the one-source shorthand
    data["data"]["sources"] = [{"source": "local", "path": "train.jsonl"}, {"source": "hub", "path": "org"},
                               {"source": "local", "path": "absent.jsonl"}]
    data["eval"] = {"sources": [{"source": "local", "path": "more.jsonl"}, {"path": "org", "name": "hub"},
                                {"source": "local", "path": str(tmp_path / "abs.jsonl")}]}
    (folder / "sources.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # not the recipe's folder

    assert load_recipe("recipes/eval.yaml").eval.path == str(folder / "held.jsonl")
    hub_eval = load_recipe("recipes/eval.yaml", ["eval.source=hub", "eval.path=org"]).eval
    assert (hub_eval.source, hub_eval.path) == ("hub", "org")
    r = load_recipe("recipes/sources.yaml")
    assert [s.path for s in r.data.sources] == [str(folder / "train.jsonl"), "org", "absent.jsonl"]
    assert [s.path for s in r.eval.sources] == [str(folder / "more.jsonl"), "org", str(tmp_path / "abs.jsonl")]


def test_builtin_recipe_eval_path_stays_as_given(tmp_path, monkeypatch):
    (tmp_path / "held.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    assert load_recipe("tiny-qwen-cpu", ["eval.holdout=null", "eval.path=held.jsonl"]).eval.path == "held.jsonl"


# ---------------------------------------------------------------------------- model.config_overrides
@pytest.mark.parametrize("override,problem", [
    ("num_hidden_layers=-1", "num_hidden_layers must be at least 1 (got -1)"),
    ("num_hidden_layers=0", "num_hidden_layers must be at least 1 (got 0)"),
    ("hidden_size=-4", "hidden_size must be at least 1 (got -4)"),
    ("vocab_size=0", "vocab_size must be at least 1 (got 0)"),
    ("head_dim=0", "head_dim must be at least 1 (got 0)"),
    ("num_key_value_heads=true", "num_key_value_heads must be a whole number, not true/false"),
    ("max_position_embeddings=0", "max_position_embeddings must be at least 1 (got 0)"),
    ("mtp_num_hidden_layers=-1", "mtp_num_hidden_layers must not be negative (got -1)"),
    ("text_config={num_attention_heads: 0}", "text_config.num_attention_heads must be at least 1 (got 0)"),
    ("{intermediate_size: -1, linear_conv_kernel_dim: 0}",
     "intermediate_size must be at least 1 (got -1); linear_conv_kernel_dim must be at least 1 (got 0)"),
])
def test_impossible_config_override_sizes_are_one_line(override, problem):
    key = "model.config_overrides" + ("=" if override.startswith("{") else ".")
    assert _error("tiny-qwen-cpu", [key + override]) == (
        f"invalid recipe 'tiny-qwen-cpu': model.config_overrides: {problem}"
    )


def test_impossible_config_override_in_a_file_names_the_file(tmp_path):
    data = load_recipe("tiny-gpt-oss-cpu").to_dict()
    data["model"]["config_overrides"] = {"num_hidden_layers": 0}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    assert _error(str(path)) == (
        f"invalid recipe {path}: model.config_overrides: num_hidden_layers must be at least 1 (got 0)"
    )


def test_possible_config_overrides_pass():
    """Zero where it means none, flags, ids and sizes of at least 1 are not sizes to refuse."""
    overrides = {"num_hidden_layers": 1, "mtp_num_hidden_layers": 0, "num_experts": 0, "tie_word_embeddings": True,
                 "pad_token_id": -1, "head_dim": None, "text_config": {"hidden_size": 8}}
    sets = [f"model.config_overrides={overrides}".replace("True", "true").replace("None", "null")]
    assert load_recipe("tiny-qwen-cpu", sets).model.config_overrides == overrides


@pytest.mark.parametrize("name", BUILTINS)
def test_dump_loads_back_to_equal_recipe(name, tmp_path):
    recipe = load_recipe(name, ["training.optimizer.lr=3.0e-5"])
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_recipe(recipe))
    assert load_recipe(str(path)) == recipe
    assert Recipe.model_validate(recipe.to_dict()) == recipe


def test_output_dir_substitutes_name():
    assert str(load_recipe("tiny-qwen-cpu").output_dir) == "runs/tiny-qwen-cpu"


def test_packing_needs_packed_kernels():
    with pytest.raises(RecipeError) as e:
        load_recipe("tiny-gpt-oss-cpu", ["model.attn_implementation=eager"])
    assert str(e.value).endswith(
        "model.attn_implementation=eager cannot keep packed documents apart; use model.attn_implementation=auto "
        "(or, for LoRA, data.packing.enabled=false)")
    assert load_recipe("tiny-gpt-oss-cpu", ["model.attn_implementation=eager", "data.packing.enabled=false"])


def test_activation_checkpointing_keep_needs_full():
    assert load_recipe("tiny-qwen-cpu", ["training.activation_checkpointing=full",
                                         "training.activation_checkpointing_keep=2"]).training.activation_checkpointing_keep == 2
    with pytest.raises(RecipeError, match="training: activation_checkpointing_keep applies to activation_checkpointing=full only"):
        load_recipe("tiny-qwen-cpu", ["training.activation_checkpointing_keep=2"])  # the tiny recipe checkpoints none
