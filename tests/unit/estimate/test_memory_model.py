"""The memory model (ftcli.estimate.memory): exact parameter counts, the fit, and the measured H200 peaks within 10%."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

from ftcli.estimate import memory
from ftcli.config.recipe import resolve_path

ROOT = Path(__file__).resolve().parents[3]


def meta_param_count(cfg: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    period = cfg.get("layer_types")
    if period:  # the shipped configs give the repeating period; transformers wants one type per layer
        cfg["layer_types"] = [period[i % len(period)] for i in range(cfg["num_hidden_layers"])]
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("layers", [4, 64])
def test_qwen_param_count_equals_transformers(layers):
    text = json.loads(memory.shipped_shape_path("Qwen/Qwen3.8-27B").read_text())["text_config"]
    cfg = {**text, "num_hidden_layers": layers}
    shape = memory.shape_from_config(cfg)
    assert shape.total_params == meta_param_count(cfg)
    assert shape.total_params == (4_064_876_704 if layers == 4 else 26_895_998_464)
    assert shape.root_params == 2 * 248320 * 5120 + 5120


def test_gpt_oss_param_count_equals_transformers():
    cfg = {k: v for k, v in json.loads(memory.shipped_shape_path("openai/gpt-oss-20b").read_text()).items()
           if not k.startswith("_")}
    cut = {**cfg, "num_hidden_layers": 2, "layer_types": cfg["layer_types"][:2]}
    assert memory.shape_from_config(cut).total_params == meta_param_count(cut)
    assert memory.shape_from_config(cfg).total_params == 20_914_757_184  # the published gpt-oss example: 20.9B


@pytest.mark.parametrize("asset", ["tiny-qwen3_5.json", "tiny-gpt-oss.json"])
def test_tiny_param_counts_equal_transformers(asset):
    cfg = json.loads(Path(resolve_path(f"pkg://assets/{asset}")).read_text())
    assert memory.shape_from_config(cfg).total_params == meta_param_count(cfg)


def test_fit_reproduces_the_shipped_constants():
    fitted = memory.fit()
    for family, value in memory.STORED_LAYER_BYTES.items():
        assert fitted["stored_layer_bytes"][family] == pytest.approx(value, rel=1e-3)
    assert fitted["full_logits_bytes"] == pytest.approx(memory.FULL_LOGITS_BYTES, rel=1e-3)


def test_every_measured_h200_peak_within_10_percent():
    points = memory.measured()["memory"]
    assert len(points) == 20
    errors = {}
    for p in points:
        shape, s = memory.point_setting(p)
        errors[(p["model"], p["layers"], p["block_len"], p["master"], p["checkpointing"], p.get("keep", 0), p["loss"],
                p.get("utc"))] = (
            memory.estimate(shape, s).total / p["peak_gib"] - 1)
    assert len(errors) == 20 and all(abs(e) < 0.10 for e in errors.values()), errors
    assert max(abs(e) for e in errors.values()) == pytest.approx(0.072, abs=0.001)  # selective, fp32: 96.8 vs 90.3


def test_measured_points_are_the_benchmarks_md_rows():
    """Every peak in measured.json is a peak in BENCHMARKS.md, with its command (one fact, copied once)."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    sft = {float(m) for m in re.findall(r"\| \**(\d+\.\d)\** \(\d+\.\d\) \|$", text, flags=re.M)}  # full SFT table
    sft |= {float(m) for m in re.findall(r"\| (\d+\.\d) \| \d+\.\d+ \| \d+(?:\.\d+)? \|$", text, flags=re.M)}
    sft |= {float(m) for m in re.findall(r"^\| \d+ \| \d+ \| (\d+\.\d) \| \d+\.\d \| \d+\.\d \|$", text, flags=re.M)}  # kept
    lora = {float(m) for m in re.findall(r"\| (\d+\.\d)(?: \(\d+\.\d\))? \| \d\.\d\dx \|$", text, flags=re.M)}
    lora |= {float(m) for m in re.findall(r"\| (\d+\.\d) \(\d+\.\d\) \| \d+\.\d \| \d\.\d\d \|", text)}  # 120b
    for p in memory.measured()["memory"]:
        assert p["peak_gib"] in (sft if p["method"] == "full" else lora), p
        assert p["command"].split(" --")[0] in text and p["card"] == "H200" and p["date"] == "2026-12-01"


def test_state_is_exact_and_sharded():
    q = memory.shipped_shape("Qwen/Qwen3.8-27B")
    e8 = memory.estimate(q, memory.Setting(world=8))
    e16 = memory.estimate(q, memory.Setting(world=16))
    assert e8.params == pytest.approx((26_895_998_464 * 4 + 460_000_000 * 2) / 8 / memory.GiB)
    assert e8.optimizer == pytest.approx(2 * e8.grads)
    assert e16.state == pytest.approx(e8.state / 2)
    assert e16.total - e16.state == pytest.approx(e8.total - e8.state)  # the transient does not shard


def test_a_reference_model_objective_adds_a_frozen_copy_sharded_like_the_model(monkeypatch):
    """The objective's memory term (ftcli.objectives: `reference_model`): full training keeps a frozen reference in
    the compute dtype beside the trained weights, sharded like them; LoRA's reference is its own base (nothing more);
    SFT has none."""
    from dataclasses import replace

    from ftcli import objectives

    monkeypatch.setitem(objectives.OBJECTIVES, "with_reference",
                        replace(objectives.OBJECTIVES["sft"], name="with_reference", reference_model=True))
    q = memory.shipped_shape("Qwen/Qwen3.8-27B")
    sft, ref = (memory.estimate(q, memory.Setting(world=8, objective=o)) for o in ("sft", "with_reference"))
    assert ref.params - sft.params == pytest.approx((26_895_998_464 + 460_000_000) * 2 / 8 / memory.GiB)
    assert (ref.grads, ref.optimizer, ref.activations) == (sft.grads, sft.optimizer, sft.activations)
    g = memory.shipped_shape("openai/gpt-oss-20b")
    lora = memory.Setting(method="lora", tokens=4096, checkpointing="none", loss="trl", adapter_params=3_981_312)
    assert memory.estimate(g, replace(lora, objective="with_reference")) == memory.estimate(g, lora)


def test_a_precomputed_reference_holds_no_model_and_adds_no_forward():
    """training.preference.reference: model (full: a frozen copy in params; a forward per block in the step time, x 1.25
    with full checkpointing, of the SFT rows) | precomputed (neither: its log-probs come with the blocks)."""
    from dataclasses import replace

    from ftcli.config.recipe import load_recipe
    from ftcli.estimate import fit, steptime

    recipe = load_recipe("qwen-b300-dpo")
    shape = memory.shipped_shape(recipe.model.id)
    live = fit.setting_of(recipe, shape)
    stored = fit.setting_of(load_recipe("qwen-b300-dpo", ["training.preference.reference=precomputed"]), shape)
    assert (live.reference, stored.reference, live.checkpointing) == ("model", "precomputed", "full")
    sft = replace(live, objective="sft")
    assert memory.estimate(shape, stored) == memory.estimate(shape, sft)
    assert memory.estimate(shape, live).params - memory.estimate(shape, sft).params == pytest.approx(
        (shape.total_params + shape.frozen_params) * 2 / 8 / memory.GiB)
    seconds = {k: steptime.step_time(recipe.training, shape, s, "H200") for k, s in
               (("live", live), ("stored", stored), ("sft", sft))}
    assert seconds["live"].s_per_step == pytest.approx(1.25 * seconds["sft"].s_per_step)
    assert seconds["stored"].s_per_step == seconds["sft"].s_per_step
    assert "x 1.25 for the reference's forward" in seconds["live"].source
    assert "reference" not in seconds["stored"].source


def test_lora_keeps_the_whole_base_on_every_gpu():
    g = memory.shipped_shape("openai/gpt-oss-20b")
    s = memory.Setting(method="lora", tokens=4096, checkpointing="none", loss="trl", adapter_params=3_981_312)
    one, eight = memory.estimate(g, memory.Setting(**{**s.__dict__, "world": 1})), memory.estimate(g, s)
    assert one.total == eight.total == pytest.approx(63.1, abs=0.05)
    assert eight.params == pytest.approx((20_914_757_184 * 2 + 4 * 3_981_312) / memory.GiB)


def test_64_layer_recipe_figures():
    q = memory.shipped_shape("Qwen/Qwen3.8-27B")
    liger = memory.Setting(tokens=32768, world=8, loss="liger")
    assert round(memory.estimate(q, liger).total, 1) == 81.5
    assert round(memory.estimate(q, memory.Setting(tokens=32768, world=8, loss="liger", master="bf16")).total, 1) == 61.2
    assert [memory.layers_to_keep(q, liger, gb) for gb in (80, 141, 288)] == [0, 4, 17]


def test_kept_layers_and_the_recompute_do_not_share_the_peak():
    """Full checkpointing, n layers, the last `keep` kept: n - keep checkpointed inputs (2 bytes x T x hidden each)
    plus the larger of the kept layers and one recomputed layer (K x T x hidden bytes each), by hand."""
    q = memory.shipped_shape("Qwen/Qwen3.8-27B").cut(8)
    k, u = memory.STORED_LAYER_BYTES["qwen3_5"], 32768 * 5120
    act = {keep: memory.estimate(q, memory.Setting(tokens=32768, world=1, loss="liger", keep=keep)).activations
           for keep in (0, 1, 2, 8, 20)}
    assert act[0] == pytest.approx((1 * k * u + 8 * 2 * u) / memory.GiB)
    assert act[1] == pytest.approx((1 * k * u + 7 * 2 * u) / memory.GiB)  # the kept last layer drops its input
    assert act[2] == pytest.approx((2 * k * u + 6 * 2 * u) / memory.GiB)
    assert act[8] == act[20] == pytest.approx(8 * k * u / memory.GiB)  # all kept: nothing checkpointed
    lora = memory.Setting(method="lora", tokens=4096, loss="trl", keep=5)  # LoRA ignores keep
    g = memory.shipped_shape("openai/gpt-oss-20b")
    assert memory.estimate(g, lora).total == memory.estimate(g, memory.Setting(**{**lora.__dict__, "keep": 0})).total
    usable = memory.usable_gib(288)
    s = memory.Setting(tokens=32768, world=8, loss="liger")
    q64 = memory.shipped_shape("Qwen/Qwen3.8-27B")
    brute = max(keep for keep in range(65) if memory.estimate(
        q64, memory.Setting(**{**s.__dict__, "keep": keep})).total <= usable)
    assert memory.layers_to_keep(q64, s, 288) == brute == 17


def test_reference_loop_on_8xh100_fits_8k_not_16k():
    """The published example: an 8xH100 node fits 8,192-token blocks of the 27B model, not 16k (bf16 master
    weights, full checkpointing, full-logit loss)."""
    q = memory.shipped_shape("Qwen/Qwen3.8-27B")
    usable = memory.usable_gib(80)
    at = {t: memory.estimate(q, memory.Setting(tokens=t, world=8, master="bf16", loss="full")).total
          for t in (8192, 16384)}
    assert at[8192] < usable < at[16384]


def test_benchmark_script_prints_the_package_model(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["memory_model.py"])
    runpy.run_path(str(ROOT / "benchmarks" / "memory_model.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "| 32k | fp32 | full | liger | 50.2 | 31.3 | 81.5 | no | yes | yes |" in out
    assert "| fp32 | 0 | 4 | 17 |" in out
