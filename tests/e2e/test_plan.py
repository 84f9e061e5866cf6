"""`ftcli plan`: per-card memory, fit and the settings that would fit, step times from the measured data,
token counts (pack cache, synthetic, sampled), the JSON output, and render-workload's fit check."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest

from ftcli.estimate import memory

from ftcli.commands import plan as plan_command
from ftcli.estimate import datasize, plan, steptime
from ftcli.estimate.fit import CARDS, resolved_sharding, setting_of
from ftcli.estimate.shape import adapter_params, model_shape
from ftcli.config.errors import UserError
from ftcli.config.recipe import load_recipe, resolve_path


# gpt-oss-h100 without its compiled layers: the eager step-time rows these tables pin (the compiled row: test_features)
EAGER = ["training.compile=false"]


@pytest.fixture(autouse=True)
def _no_pack_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FTCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "300")


def cards(p: plan.Plan) -> dict[str, plan.CardPlan]:
    return {c.accelerator: c for c in p.cards}


def test_qwen_b300_plan_on_every_card():
    p = plan.make_plan(load_recipe("qwen-b300"))
    c = cards(p)
    assert list(c) == ["GPU_8xB300", "GPU_8xH100", "GPU_8xH200", "GPU_1xA10"]
    assert c["GPU_8xB300"].own and c["GPU_8xB300"].fits and c["GPU_8xB300"].keep_layers == 17
    assert round(c["GPU_8xB300"].estimate.total, 1) == 211.4  # the recipe keeps 14 layers' activations
    keep0 = "training.activation_checkpointing_keep=0"
    assert not c["GPU_8xH200"].fits and [s.overrides for s in c["GPU_8xH200"].suggestions][:2] == [
        ("training.activation_checkpointing_keep=4",), (keep0, "data.packing.block_len=16384")]
    assert not c["GPU_8xH100"].fits
    assert [s.overrides for s in c["GPU_8xH100"].suggestions] == [
        (keep0, "data.packing.block_len=16384"), (keep0, "training.precision.master_dtype=bfloat16"),
        (keep0, "compute.num_accelerators=16")]
    assert [round(s.total_gib, 1) for s in c["GPU_8xH100"].suggestions] == [65.8, 61.2, 56.4]
    assert not c["GPU_1xA10"].fits and c["GPU_1xA10"].gpus == 8 and not c["GPU_1xA10"].suggestions
    assert "no setting tried fits 20.6 GiB" in c["GPU_1xA10"].why


TINY_CHAT = "{source: local, path: pkg://assets/tiny_chat.jsonl}"
NO_SHORTHAND = ["data.path=null", "data.revision=null", "data.split=train", "data.streaming=false"]


def test_plan_sizes_the_mix_not_the_one_source_keys():
    """qwen-b300 with `--set data.sources=...` once sized the recipe's ultrachat path (260,833,280 published
    tokens) instead of the mix: both forms at once are now one line, and the mix is what plan sizes, source by
    source under its weight."""
    with pytest.raises(UserError, match=r"^invalid recipe 'qwen-b300': data: data.sources and data.path, data.revision, "
                                        r"data.split, data.streaming are both set; .*: keep one form \(--set data.path=null "
                                        r"--set data.revision=null --set data.split=train --set data.streaming=false drops"):
        load_recipe("qwen-b300", [f"data.sources=[{TINY_CHAT}]"])
    one = plan.make_plan(load_recipe("qwen-b300", [*NO_SHORTHAND, f"data.sources=[{TINY_CHAT}]"])).data
    shorthand = plan.make_plan(load_recipe("qwen-b300", [*NO_SHORTHAND, "data.source=local",
                                                         "data.path=pkg://assets/tiny_chat.jsonl"])).data
    assert one == shorthand and one.source.startswith("estimate: first 300 of 3000 rows")
    assert one.tokens != 995 * 8 * 32768 and one.blocks == -(-one.tokens // 32768)
    twice = TINY_CHAT.replace("}", ", weight: 2}")
    mix = plan.make_plan(load_recipe("qwen-b300", [*NO_SHORTHAND, f"data.sources=[{twice}, {{name: b, "
                                                                  f"{TINY_CHAT[1:]}]"])).data
    assert mix.tokens == 3 * one.tokens and mix.blocks == -(-mix.tokens // 32768)
    assert mix.source.startswith("mix of 2 sources, x weight (pkg://assets/tiny_chat.jsonl: estimate: first 300")


def test_qwen_b300_time_from_the_published_token_count():
    p = plan.make_plan(load_recipe("qwen-b300"))
    assert p.data.tokens == 995 * 8 * 32768 and p.data.blocks == 7960 and p.steps == 995
    assert p.setting.speed == ("fp8", "compile=regions")
    h200 = cards(p)["GPU_8xH200"]
    # the H200 rows of qwen-b300's settings, fp8 + compile=regions (measured.json, 15:39-15:51 UTC): keep 2 at 4
    # and 8 layers, keep 4 of 4
    recomputed = (1.388 - 0.875) / (8 - 4)
    kept = recomputed - (0.875 - 0.812) / (4 - 2)  # a kept layer skips its recompute
    fixed = 0.875 - 2 * recomputed - 2 * kept
    expected = fixed + recomputed * (64 - 14) + kept * 14
    assert h200.step.s_per_step == pytest.approx(expected) and not h200.step.measured
    assert round(expected, 2) == 8.19 and (round(fixed, 3), round(recomputed, 4), round(kept, 4)) == (
        0.425, 0.1282, 0.0968)
    assert ("4 and 8 -> 64 layers by the per-layer fit, 14 of them kept (0.425 s + 0.1282 s x 50 recomputed + "
            "0.0968 s x 14 kept layers; kept layers counted: ") in h200.step.source
    assert "2026-12-01 15:39-15:51 UTC" in h200.step.source and "not counted" not in h200.step.source
    assert h200.wall_hours == pytest.approx(995 * expected / 3600)
    assert h200.gpu_hours == pytest.approx(8 * h200.wall_hours)
    b300 = cards(p)["GPU_8xB300"]
    assert b300.step.s_per_step == pytest.approx(expected * 989 / 2250)
    assert "x peak bf16 FLOP/s H200/B300" in b300.step.source


def test_qwen_b300_in_bf16_takes_the_bf16_rows():
    """fp8 and compile off: the rows without speed settings, the image-kernel H200 sitting (13:48-13:52)."""
    p = plan.make_plan(load_recipe("qwen-b300", ["training.precision.fp8=false", "training.compile=false"]))
    assert p.setting.speed == ()
    h200 = cards(p)["GPU_8xH200"]
    recomputed = (1.989 - 1.165) / (8 - 4)
    kept = recomputed - (1.165 - 1.078) / (4 - 2)
    fixed = 1.165 - 2 * recomputed - 2 * kept
    assert h200.step.s_per_step == pytest.approx(fixed + recomputed * 50 + kept * 14)
    assert round(h200.step.s_per_step, 2) == 13.00 and "13:48-13:52 UTC" in h200.step.source
    fused = cards(plan.make_plan(load_recipe("qwen-b300", [
        "training.precision.fp8=false", "training.compile=false",
        "training.fused_ops=[swiglu,rms_norm,gated_norm]"])))["GPU_8xH200"]
    recomputed = (1.760 - 1.051) / 4
    kept = recomputed - (1.051 - 0.983) / 2
    assert fused.step.s_per_step == pytest.approx(1.051 - 2 * recomputed - 2 * kept + recomputed * 50 + kept * 14)


def test_a_speed_setting_without_rows_falls_back_to_rows_without_speed_settings():
    """fused rms_norm alone, or fp8 with eager casts (compile off, measured slower than bf16), was never timed:
    plan takes the rows without speed settings (the bf16 image-kernel sitting, 13.00 s) and says so, never
    another speed setting's rows (fp8 + regions, 8.19 s)."""
    for overrides, recipe_text in ((["training.fused_ops=[rms_norm]"], "fp8 compile=regions fused=rms_norm"),
                                   (["training.compile=false"], "fp8")):
        h200 = cards(plan.make_plan(load_recipe("qwen-b300", overrides)))["GPU_8xH200"]
        assert not h200.step.measured and round(h200.step.s_per_step, 2) == 13.00
        assert (f"measured with master fp32, loss liger (recipe: master fp32, loss liger, {recipe_text})"
                in h200.step.source) and "13:48-13:52 UTC" in h200.step.source
    regions = cards(plan.make_plan(load_recipe("qwen-b300", ["training.precision.fp8=false"])))["GPU_8xH200"]
    recomputed = (1.814 - 1.071) / 4  # its own rows: compile=regions in bf16
    kept = recomputed - (1.071 - 0.985) / 2
    assert regions.step.s_per_step == pytest.approx(1.071 - 2 * recomputed - 2 * kept + 50 * recomputed + 14 * kept)
    assert round(regions.step.s_per_step, 2) == 11.70


def test_gpt_oss_lora_plan():
    p = plan.make_plan(load_recipe("gpt-oss-h100", EAGER))
    c = cards(p)
    assert p.setting.adapter_params == 3_981_312  # r 8 on q/k/v/o of 24 layers
    assert round(c["GPU_8xH100"].estimate.total, 1) == 63.1 and c["GPU_8xH100"].fits
    assert c["GPU_8xH200"].step.measured and c["GPU_8xH200"].step.s_per_step == 0.374
    assert c["GPU_8xH100"].step.s_per_step == 0.374 and not c["GPU_8xH100"].step.measured  # same peak FLOP/s
    assert p.setting.sharding == "ddp" and c["GPU_8xH100"].sharding == "ddp"  # auto: a whole base fits an H100
    assert c["GPU_1xA10"].sharding == "fsdp" and not c["GPU_1xA10"].fits  # auto: 39 GiB of base do not fit an A10
    assert [s.overrides for s in c["GPU_1xA10"].suggestions][0] == ("training.activation_checkpointing=full",)
    assert p.data.tokens is None and "pack-preview --recipe gpt-oss-h100" in p.data.source
    assert c["GPU_8xH100"].wall_hours is None
    ddp = cards(plan.make_plan(load_recipe("gpt-oss-h100", ["training.sharding=ddp"])))["GPU_1xA10"]
    assert not ddp.fits and not ddp.suggestions
    assert ddp.why.startswith("the base alone is 39.0 GiB > 20.6 usable: LoRA with training.sharding=ddp keeps a "
                              "whole base per GPU")


def test_lora_that_does_not_fit_suggests_checkpointing_and_blocks():
    r = load_recipe("gpt-oss-h100", ["data.packing.block_len=8192", "training.sharding=ddp"])  # 87.2 GiB > H100
    h100 = cards(plan.make_plan(r))["GPU_8xH100"]
    assert not h100.fits and round(h100.estimate.total, 1) == 87.2
    assert [s.overrides for s in h100.suggestions] == [("training.activation_checkpointing=full",),
                                                        ("data.packing.block_len=4096",),
                                                        ("model.quantization=mxfp4",), ("training.sharding=fsdp",)]
    # measured: 43.1 and 63.1, -, -
    assert [round(s.total_gib, 1) for s in h100.suggestions] == [42.1, 63.1, 61.6, 58.3]


@pytest.mark.parametrize("name", ["tiny-gpt-oss-cpu", "tiny-qwen-cpu", "tiny-qwen3-moe-cpu", "tiny-gemma3-cpu"])
def test_lora_adapter_size_equals_peft(name):
    import torch
    from peft import get_peft_model

    from ftcli.model.build import load_model
    from ftcli.train.lora.trainer import lora_config

    recipe = load_recipe(name, [] if name in ("tiny-gpt-oss-cpu", "tiny-qwen3-moe-cpu")
                         else ["training.method=lora", "lora.dropout=0", "training.precision={}"])
    model = load_model(recipe.model, dtype=torch.float32)
    peft_model = get_peft_model(model, lora_config(recipe.lora, recipe.model, model))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert adapter_params(recipe.training, recipe.lora, model_shape(recipe.model)) == trainable


def test_tiny_recipes_fit_everywhere_and_have_no_step_measurement():
    for name in ("tiny-qwen-cpu", "tiny-gpt-oss-cpu"):
        p = plan.make_plan(load_recipe(name))
        assert all(c.fits for c in p.cards)
        assert all(c.step.s_per_step is None and c.step.source.startswith("no measurement") for c in p.cards)


def _data_size(recipe) -> datasize.DataSize:
    """plan's data size of a recipe's training data."""
    from ftcli.data import data_spec

    return datasize.data_size(data_spec(recipe), recipe.model)

def test_sampled_token_count_is_close_to_the_pack_cache_and_the_cache_wins():
    from transformers import AutoTokenizer

    from ftcli.data import prepare_blocks
    from ftcli.config.recipe import resolve_path

    recipe = load_recipe("tiny-qwen-cpu")
    sampled = _data_size(recipe)
    assert sampled.source.startswith("estimate: first 300 of 3000 rows, chat template rendered")
    packed = prepare_blocks(recipe, AutoTokenizer.from_pretrained(resolve_path(recipe.model.tokenizer)))
    cached = _data_size(recipe)
    assert cached.source.startswith("pack cache") and cached.blocks == len(packed) == 262  # eval holds out 2%
    assert cached.tokens == packed.meta["num_tokens"]
    assert abs(sampled.tokens / cached.tokens - 1) < 0.10
    assert plan.make_plan(recipe).steps == 262


def test_sampled_token_count_is_the_same_for_every_row_format(tmp_path):
    """plan's sample reads rows through the data path's formats: the tiny chat data as messages (auto or named) and
    as ShareGPT rows give one token count."""
    src = Path(resolve_path("pkg://assets/tiny_chat.jsonl"))
    sharegpt = tmp_path / "sharegpt.jsonl"
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    with sharegpt.open("w") as f:
        for line in src.read_text().splitlines()[:400]:
            msgs = json.loads(line)["messages"]
            f.write(json.dumps({"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in msgs]}) + "\n")
    head = tmp_path / "messages.jsonl"
    head.write_text("\n".join(src.read_text().splitlines()[:400]) + "\n")
    sizes = {fmt_path: _data_size(load_recipe("tiny-qwen-cpu", [f"data.path={fmt_path[1]}",
                                                                         f"data.format={fmt_path[0]}"])).tokens
             for fmt_path in (("messages", head), ("auto", head), ("sharegpt", sharegpt), ("auto", sharegpt))}
    assert len(set(sizes.values())) == 1 and next(iter(sizes.values())) > 0, sizes


def test_synthetic_token_count_is_the_expected_length():
    from ftcli.data.synthetic import synthetic_examples

    recipe = load_recipe("tiny-qwen-cpu", ["data.source=synthetic", "data.synthetic.num_examples=4000"])
    size = _data_size(recipe)
    drawn = sum(len(ids) for _, ids, _ in synthetic_examples(recipe.data.synthetic, 1024))
    assert size.source.startswith("computed") and abs(size.tokens / drawn - 1) < 0.03
    assert size.blocks == -(-size.tokens // 1024)


def test_accelerator_option_and_unknown_cards():
    p = plan.make_plan(load_recipe("qwen-b300"), ["GPU_8xH100"])
    assert [c.accelerator for c in p.cards] == ["GPU_8xB300", "GPU_8xH100"]
    with pytest.raises(UserError, match="unknown card 'L4'"):
        plan.make_plan(load_recipe("qwen-b300"), ["GPU_8xL4"])
    with pytest.raises(UserError, match="is not GPU_<gpus per node>x<card>"):
        plan.make_plan(load_recipe("qwen-b300"), ["8xH100"])


def test_fit_check_refuses_with_the_nearest_setting():
    ok = plan.fit_check(load_recipe("qwen-b300"))
    assert ok.fits and ok.reason == "fits GPU_8xB300: 211.4 of 246.8 GiB usable per GPU"
    bad = plan.fit_check(load_recipe("qwen-b300", ["compute.accelerator_type=GPU_8xH100"]))
    assert not bad.fits
    assert bad.reason == ("qwen-b300 does not fit GPU_8xH100: 211.4 GiB per GPU > 68.5 usable of 80 GB; nearest that "
                          "fits: --set training.activation_checkpointing_keep=0 --set data.packing.block_len=16384 "
                          "(65.8 GiB)")


def test_plan_json_cli_and_no_torch():
    code = ("import sys; from ftcli.cli import run; sys.argv = ['ftcli', 'plan', '--recipe', 'qwen-b300', '--json']\n"
            "try:\n    run()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert out.stderr.strip() == "[]"
    assert data["recipe"] == "qwen-b300" and data["steps"] == 995
    own = data["cards"][0]
    assert own["accelerator"] == "GPU_8xB300" and own["fits"] and own["keep_layers"] == 17
    assert own["memory_gib"]["total"] == 211.41
    assert data["cards"][1]["fitting_settings"][0] == ["training.activation_checkpointing_keep=0",
                                                       "data.packing.block_len=16384"]


def test_plan_cli_table_and_bad_accelerator(tmp_path):
    from typer.testing import CliRunner

    from ftcli.cli import app

    result = CliRunner().invoke(app, ["plan", "--recipe", "qwen-b300"])
    assert result.exit_code == 0
    rows = [line.split() for line in result.output.splitlines() if line.startswith("GPU_") and " fit" not in line]
    assert "the recipe's accelerator: GPU_8xB300" in result.output
    assert rows[0] == ["GPU_8xB300", "8", "1", "12.6", "12.5", "25.0", "160.3", "0.9", "0.0", "211.4", "246.8", "yes",
                       "17"]
    assert rows[1][:3] == ["GPU_8xH100", "8", "1"] and rows[1][-2:] == ["no", "-"]
    assert rows[3][:3] == ["GPU_1xA10", "1", "8"]  # 1 GPU per node, 8 nodes for the recipe's 8 GPUs
    assert rows[4][:4] == ["GPU_8xB300", "3.60*", "60", "min"]  # the time table
    assert rows[6][:2] == ["GPU_8xH200", "8.19*"]
    assert ("GPU_8xH100 fits with one of:\n  --set training.activation_checkpointing_keep=0 --set "
            "data.packing.block_len=16384 (65.8 GiB)\n") in result.output
    bad = CliRunner().invoke(app, ["plan", "--recipe", "qwen-b300", "--accelerator", "GPU_8xL4"])
    assert bad.exit_code == 2 and "unknown card 'L4'" in bad.output


def test_a_recipe_on_an_unknown_card_is_planned_on_the_known_ones():
    p = plan.make_plan(load_recipe("qwen-b300", ["compute.accelerator_type=GPU_8xL40S"]))
    assert [c.accelerator for c in p.cards] == ["GPU_8xH100", "GPU_8xH200", "GPU_8xB300", "GPU_1xA10"]
    assert p.notes == ("no memory figures for the recipe's GPU_8xL40S: cards known: H100, H200, B300, A10",)
    assert plan.fit_check(load_recipe("qwen-b300", ["compute.accelerator_type=GPU_8xL40S"])).card is None


def test_a_model_without_a_config_here_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError, match=r"^plan needs org/not-here's config.json: .*hf download org/not-here"):
        model_shape(load_recipe("qwen-b300", ["model.id=org/not-here"]).model)


def test_a_local_model_directory_is_sized_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text((memory.shipped_shape_path("openai/gpt-oss-20b")).read_text())
    shape = model_shape(load_recipe("gpt-oss-h100", [f"model.id={tmp_path}"]).model)
    assert shape.total_params == 20_914_757_184


def test_block_suggestions_count_the_micro_batch():
    r = load_recipe("gpt-oss-h100", ["training.per_device_batch=2", "training.sharding=ddp"])  # 2 x 4096 tokens
    h100 = cards(plan.make_plan(r))["GPU_8xH100"]
    assert not h100.fits and h100.suggestions[1].overrides == ("data.packing.block_len=2048",)
    unpacked = load_recipe("gpt-oss-h100", ["data.packing.enabled=false", "data.max_length=8192",
                                            "model.attn_implementation=eager", "training.sharding=ddp"])
    assert cards(plan.make_plan(unpacked))["GPU_8xH100"].suggestions[1].overrides == ("data.max_length=4096",)


def test_gpt_oss_120b_recipe_fits_8xh100_only_sharded():
    """gpt-oss-120b (shipped config: 36 layers, 128 experts) with LoRA on attention and experts: the whole bf16
    base (219.6 GiB) fits no card with DDP; sharded over 8 H100s it is 27.5 GiB of a 44.1 GiB peak."""
    r = load_recipe("gpt-oss-120b-h100")
    assert (r.training.sharding, r.compute.accelerator_type) == ("fsdp", "GPU_8xH100")
    assert r.lora.target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    shape = model_shape(r.model)
    assert (shape.layers, shape.total_params, shape.expert_shapes[0][1]) == (36, 116_829_156_672, 128)
    p = plan.make_plan(r)
    h100 = cards(p)["GPU_8xH100"]
    assert h100.own and h100.fits and h100.sharding == "fsdp" and h100.gpus == 8
    e = h100.estimate
    a = p.setting.adapter_params
    assert a == 36 * (8 * 128 * (2880 + 5760) + 8 * 128 * (2880 + 2880)) + 36 * 8 * 20_736  # q k v o
    assert e.params == pytest.approx((116_829_156_672 * 2 + 4 * a) / 8 / memory.GiB)
    assert e.other == pytest.approx((1_158_269_760 + 2 * 3_213_080_192) * 2 / memory.GiB)  # root + 2 gathered layers
    assert round(e.total, 1) == 44.1 and round(h100.usable_gib, 1) == 68.5
    assert plan.fit_check(r).reason == "fits GPU_8xH100: 44.1 of 68.5 GiB usable per GPU"
    ddp = cards(plan.make_plan(load_recipe("gpt-oss-120b-h100", ["training.sharding=ddp"])))["GPU_8xH100"]
    assert not ddp.fits and round(ddp.estimate.params, 1) == 219.6
    assert ddp.suggestions[-1].overrides == ("training.sharding=fsdp",)


def test_auto_sharding_is_what_fits():
    assert resolved_sharding(load_recipe("gpt-oss-h100"))[0] == "ddp"
    chosen, why = resolved_sharding(load_recipe("gpt-oss-120b-h100", ["training.sharding=auto"]))
    assert (chosen, why) == ("fsdp", "training.sharding=auto: a whole base per GPU does not fit GPU_8xH100")
    assert resolved_sharding(load_recipe("tiny-gpt-oss-cpu"))[0] == "ddp"
    assert resolved_sharding(load_recipe("tiny-gpt-oss-cpu", ["training.sharding=fsdp"])) == (
        "fsdp", "training.sharding")


def test_plan_cli_for_the_120b_recipe_offline(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from ftcli.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached: the shipped config is used
    result = CliRunner().invoke(app, ["plan", "--recipe", "gpt-oss-120b-h100"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.startswith("GPU_8xH100")]
    assert rows[0] == ["GPU_8xH100", "8", "1", "27.5", "0.2", "0.5", "1.8", "0.0", "14.1", "44.1", "68.5", "yes", "-"]
    assert "base sharded (fsdp)" in result.output and "LoRA base: GPU_8xH100 fsdp" in result.output


def test_120b_step_time_from_the_h200_depth_pair():
    """The 120b shape cut to 4 and 6 layers on one H200 (0.322 and 0.464 s per 4k block): 0.038 s + 0.0710 s x 36
    layers, with the all-gathers of the sharded base named as not counted."""
    own = cards(plan.make_plan(load_recipe("gpt-oss-120b-h100")))["GPU_8xH100"]
    assert round(own.step.s_per_step, 3) == round(0.322 - 4 * 0.071 + 0.071 * 36, 3) == 2.594
    assert own.step.source == (
        "scaled from H200, 1 GPU, openai/gpt-oss-120b at 4 and 6 layers, block 4096, 2026-12-01 13:26-13:31 UTC: "
        "x peak bf16 FLOP/s H200/H100; 4 and 6 -> 36 layers by the per-layer fit (0.038 s + 0.0710 s x layers); "
        "per-GPU time of 1 GPU taken for 8 (the sharded base's all-gathers not counted)")
    assert own.step.command.startswith("python benchmarks/lora_scale_gpu.py --layers 4")


# ------------------------------------------------------------------------------------ step-time provenance
RECIPES = ("qwen-b300", "gpt-oss-h100", "gpt-oss-120b-h100", "tiny-qwen-cpu", "tiny-gpt-oss-cpu")


def test_every_measured_step_time_names_card_gpus_block_date_and_command():
    for row in memory.measured()["step_time"]:
        assert row["card"] in CARDS and row["gpus"] >= 1 and row["block_len"] >= 512
        assert len(row["date"]) == 10 and row["command"].startswith("python benchmarks/")


@pytest.mark.parametrize("name", RECIPES)
def test_every_step_time_says_where_it_came_from(name):
    for c in plan.make_plan(load_recipe(name)).cards:
        st = c.step
        if st.s_per_step is None:
            assert st.source.startswith("no measurement for ") and st.command is None and c.wall_hours is None
            continue
        assert st.source.startswith("measured: " if st.measured else "scaled from ")
        rows = [r for r in memory.measured()["step_time"] if r["command"] in st.command.split(" && ")
                and f"{r['card']}, {r['gpus']} GPU" in st.source and f"block {r['block_len']}, {r['date']}" in st.source]
        depths = sorted({r["layers"] for r in rows})
        fitted = f"{rows[0]['model']} at {' and '.join(map(str, depths))} layers" in st.source
        assert fitted or any(f"{r['model']} at {r['layers']} layers" in st.source for r in rows)
        assert st.measured == (rows[0]["card"] == c.card and "layers by matmul work" not in st.source
                               and "per-layer fit" not in st.source and "(recipe: " not in st.source
                               and "micro-batches" not in st.source)


def test_step_time_table_exact(capsys):
    plan_command.print_plan(plan.make_plan(load_recipe("gpt-oss-h100", EAGER)))
    out = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    table = out[out.index("Time (* estimate)"):]
    point = "H200, 1 GPU, openai/gpt-oss-20b at 24 layers, block 4096, 2026-12-01"
    assert table[1:] == [
        "accelerator s/step wall GPU-h from",
        "─────────────────────────────────────",
        "GPU_8xH100   0.37*    -     - [1] [2]",
        "GPU_8xH200    0.37    -     - [3] [2]",
        "GPU_8xB300   0.16*    -     - [4] [2]",
        "GPU_1xA10    2.96*    -     - [5] [2]",
        f"[1] scaled from {point}: x peak bf16 FLOP/s H200/H100; per-GPU time of 1 GPU taken for 8",
        "[2] measured by benchmarks/lora_gpt_oss_gpu.py (the command: plan --json, BENCHMARKS.md)",
        f"[3] measured: {point}; per-GPU time of 1 GPU taken for 8",
        f"[4] scaled from {point}: x peak bf16 FLOP/s H200/B300; per-GPU time of 1 GPU taken for 8",
        f"[5] scaled from {point}: x peak bf16 FLOP/s H200/A10; measured with ddp, loss trl (recipe: fsdp, loss trl); "
        "per-GPU time of 1 GPU taken for 8 (the sharded base's all-gathers not counted)"]


BF16 = ["training.precision.fp8=false", "training.compile=false"]  # qwen-b300 without its speed settings
IMAGE_ROWS = ("H200, 1 GPU, Qwen/Qwen3.8-27B at 4 and 8 layers, block 32768, 2026-12-01 13:48-13:52 UTC, kernels "
              "flash-attn 2.8.3.post2 varlen attention, causal-conv1d 1.7.0, fla 0.6.0 + tilelang gated-delta (the "
              "Databricks image's), the newest of this setting's rows (rows with other kernels not mixed in)")
IMAGE_COMMANDS = ("python benchmarks/levers_gpu.py --parts 32768:4:keep2 32768:8:keep2 --published 32768:0.2658:0.729 "
                  "&& python benchmarks/levers_gpu.py --parts 32768:4:base")


def test_step_time_json_exact():
    data = plan.make_plan(load_recipe("qwen-b300", BF16)).to_dict()
    h200 = next(c for c in data["cards"] if c["accelerator"] == "GPU_8xH200")
    assert {k: h200[k] for k in ("s_per_step", "step_source", "step_measured", "step_command", "wall_hours",
                                 "gpu_hours")} == {
        "s_per_step": 13.003,
        "step_source": f"scaled from {IMAGE_ROWS}: 4 and 8 -> 64 layers by the per-layer fit, 14 of them kept (0.428 s "
                       "+ 0.2060 s x 50 recomputed + 0.1625 s x 14 kept layers; kept layers counted: a kept layer's "
                       "cost from the 4-layer rows at keep 2 and 4, a recomputed one's from the keep 2 rows); per-GPU "
                       "time of 1 GPU taken for 8",
        "step_measured": False,
        "step_command": IMAGE_COMMANDS,
        "wall_hours": 3.594, "gpu_hours": 28.75}
    tiny = plan.make_plan(load_recipe("tiny-qwen-cpu")).to_dict()["cards"][0]
    assert (tiny["s_per_step"], tiny["step_command"], tiny["wall_hours"]) == (None, None, None)
    assert tiny["step_source"] == "no measurement for qwen3_5 at hidden 128, full, 1024 tokens, checkpointing none"


def test_a_suggested_short_block_comes_with_the_faster_loss():
    """Full SFT with liger: a suggested block of 8k or less also switches to the chunked loss (measured faster
    there on an H200), a 16k one keeps liger (16k not measured)."""
    from ftcli.estimate import memory
    from ftcli.estimate.fit import fitting_settings
    from ftcli.features.loss import FUSED_LINEAR_CE

    assert FUSED_LINEAR_CE["liger"].chunked_faster_up_to == 8192
    shape = memory.shipped_shape("Qwen/Qwen3.8-27B")
    liger = memory.Setting(method="full", tokens=32768, loss="liger", checkpointing="full")
    on_h200 = fitting_settings(shape, memory.Setting(**{**vars(liger), "world": 8}), "H200", 8)
    assert on_h200[0].overrides == ("data.packing.block_len=16384",)
    on_a10 = fitting_settings(shape, memory.Setting(**{**vars(liger), "world": 64}), "A10", 8)
    assert [s.overrides for s in on_a10] == [("data.packing.block_len=8192", "training.loss.impl=chunked")]
    chunked = memory.Setting(**{**vars(liger), "world": 64, "loss": "chunked"})
    assert fitting_settings(shape, chunked, "A10", 8)[0].overrides == ("data.packing.block_len=8192",)


def test_kept_layers_go_with_every_suggestion_and_lora_has_none():
    """A recipe that keeps layers' activations: every suggestion but "keep fewer" also drops them (the last
    resort included: it was once computed without them but did not say so); LoRA has no kept layers (a LoRA
    recipe that asks for some is refused)."""
    from ftcli.estimate import memory
    from ftcli.estimate.fit import fitting_settings

    shape = memory.shipped_shape("Qwen/Qwen3.8-27B")
    kept = memory.Setting(method="full", tokens=32768, loss="chunked", checkpointing="full", keep=14, world=8)
    last_resort = fitting_settings(shape, memory.Setting(**{**vars(kept), "world": 32}), "A10", 8)
    assert [s.overrides for s in last_resort] == [(
        "training.activation_checkpointing_keep=0", "training.activation_checkpointing=full",
        "training.precision.master_dtype=bfloat16", "data.packing.block_len=4096")]
    one_change = fitting_settings(shape, memory.Setting(**{**vars(kept), "world": 64}), "A10", 8)
    assert [s.overrides for s in one_change] == [("training.activation_checkpointing_keep=0",
                                                  "data.packing.block_len=8192")]
    with pytest.raises(UserError, match=r"^invalid recipe 'gpt-oss-h100': training.activation_checkpointing_keep "
                                        r"belongs to training.method=full \(this recipe's is lora\): leave it out"):
        load_recipe("gpt-oss-h100", ["training.activation_checkpointing=full", "training.activation_checkpointing_keep=4"])
    lora = load_recipe("gpt-oss-h100", ["training.activation_checkpointing=full"])
    assert setting_of(lora, model_shape(lora.model)).keep == 0


# ------------------------------------------------------------------------------------------ kept layers
def test_layer_fit_counts_kept_layers_from_rows_that_differ_only_in_keep():
    """(layers, kept, s/step): keep 2 at 4 and 8 layers gives the recomputed slope, keep 2 and 4 at 4 layers a kept
    layer's cost; without rows that differ only in keep it is the plain depth fit, without two depths none."""
    fit = steptime.layer_fit([(4, 2, 1.165), (8, 2, 1.989), (4, 4, 1.078)])
    assert (fit.fixed, fit.recomputed, fit.kept_layer) == pytest.approx((0.428, 0.206, 0.1625))
    assert (fit.depths, fit.depth_keep, fit.keeps, fit.keep_depth) == ((4, 8), 2, (2, 4), 4)
    assert fit.seconds(64, 14) == pytest.approx(0.428 + 50 * 0.206 + 14 * 0.1625)  # 13.003
    assert fit.seconds(4, 4) == pytest.approx(1.078) and fit.seconds(8, 2) == pytest.approx(1.989)
    plain = steptime.layer_fit([(4, 0, 1.242), (8, 0, 2.071)])
    assert plain.kept_layer is None and (plain.fixed, plain.recomputed) == pytest.approx((0.413, 0.20725))
    assert plain.seconds(64, 14) == pytest.approx(0.413 + 64 * 0.20725)  # kept layers not counted
    assert plain.text(64, 14) == "4 and 8 -> 64 layers by the per-layer fit (0.413 s + 0.2073 s x layers)"
    assert steptime.layer_fit([(4, 2, 1.165), (4, 4, 1.078)]) is None


def test_no_kept_layers_is_the_same_rows_fit_with_every_layer_recomputed():
    h200 = cards(plan.make_plan(load_recipe("qwen-b300", [*BF16, "training.activation_checkpointing_keep=0"])))["GPU_8xH200"]
    assert h200.step.s_per_step == pytest.approx(0.428 + 64 * 0.206) and round(h200.step.s_per_step, 2) == 13.61
    assert h200.step.source == (
        f"scaled from {IMAGE_ROWS}: 4 and 8 -> 64 layers by the per-layer fit, 0 of them kept (0.428 s + 0.2060 s x "
        "64 recomputed + 0.1625 s x 0 kept layers; kept layers counted: a kept layer's cost from the 4-layer rows at "
        "keep 2 and 4, a recomputed one's from the keep 2 rows); per-GPU time of 1 GPU taken for 8")
    assert h200.step.command == IMAGE_COMMANDS


def test_a_measured_depth_and_keep_is_the_row_itself():
    """At a measured (layers, keep) the row is taken as it is: 4 layers with keep 14 keep all 4 (1.078 s)."""
    from dataclasses import replace

    r = load_recipe("qwen-b300", BF16)
    shape = model_shape(r.model).cut(4)
    for keep, seconds, command in ((14, 1.078, "--parts 32768:4:base"), (2, 1.165, "--parts 32768:4:keep2 ")):
        st = steptime.step_time(r.training, shape, replace(setting_of(r, shape), keep=keep), "H200", 1)
        assert st.measured and st.s_per_step == seconds and command in st.command
        assert st.source == ("measured: H200, 1 GPU, Qwen/Qwen3.8-27B at 4 layers, block 32768, 2026-12-01 "
                             "13:48-13:52 UTC, kernels flash-attn 2.8.3.post2 varlen attention, causal-conv1d 1.7.0, "
                             "fla 0.6.0 + tilelang gated-delta (the Databricks image's), the newest of this setting's "
                             "rows (rows with other kernels not mixed in)")


def test_settings_without_keep_rows_keep_the_depth_fit_and_say_kept_layers_are_not_counted():
    """8k blocks were measured at keep 0 only (with torch's varlen attention): the same fit and note as before."""
    h200 = cards(plan.make_plan(load_recipe("qwen-b300", [*BF16, "data.packing.block_len=8192"])))["GPU_8xH200"]
    assert h200.step.s_per_step == pytest.approx(0.518 + (0.749 - 0.518) / 4 * 60)  # 3.983
    assert h200.step.source == (
        "scaled from H200, 1 GPU, Qwen/Qwen3.8-27B at 4 and 8 layers, block 8192, 2026-12-01: 4 and 8 -> 64 layers by "
        "the per-layer fit (0.287 s + 0.0577 s x layers); measured with keep 0 (recipe: keep 14, not counted); "
        "per-GPU time of 1 GPU taken for 8")
    assert h200.step.command.startswith("python benchmarks/levers_gpu.py --parts 32768:4:base 32768:8:base 8192:4")
    chunked = cards(plan.make_plan(load_recipe("qwen-b300", [*BF16, "data.packing.block_len=8192", "training.loss.impl=chunked",
                                                             "training.activation_checkpointing_keep=0"])))
    assert chunked["GPU_8xH200"].step.s_per_step == pytest.approx(0.39 + (0.621 - 0.39) / 4 * 60)  # not train_full's 0.469


def test_kernels_are_never_mixed_in_one_fit(monkeypatch):
    """Two sittings of one setting: the newer one's rows alone, whatever the older rows (other kernels) say."""
    rows = [r for r in memory.measured()["step_time"] if r["block_len"] == 32768 and r["loss"] == "liger"
            and r["checkpointing"] == "full" and r["master"] == "fp32" and not r.get("speed")]
    assert [(r["layers"], r.get("keep", 0), r.get("kernels", "")[:10]) for r in rows] == [
        (4, 0, ""), (8, 0, ""), (4, 2, "flash-attn"), (8, 2, "flash-attn"), (4, 4, "flash-attn")]
    older = [{**r, "s_per_step": 99.0} if "kernels" not in r else r for r in rows]
    monkeypatch.setattr(memory, "measured", lambda: {"step_time": older})
    assert cards(plan.make_plan(load_recipe("qwen-b300", BF16)))["GPU_8xH200"].step.s_per_step == pytest.approx(13.003)
    later = [{**r, "utc": "15:00-15:05"} if "kernels" not in r else r for r in rows]  # the older kernels, re-run later
    monkeypatch.setattr(memory, "measured", lambda: {"step_time": later})
    st = cards(plan.make_plan(load_recipe("qwen-b300", BF16)))["GPU_8xH200"].step
    assert st.s_per_step == pytest.approx(1.242 + (2.071 - 1.242) / 4 * 60)
    assert "2026-12-01 15:00-15:05 UTC, the newest of this setting's rows" in st.source
    assert "measured with keep 0 (recipe: keep 14, not counted)" in st.source
