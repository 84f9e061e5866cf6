"""LoRA with the frozen base sharded by FSDP2 (`training.sharding: fsdp`, accelerate's FSDP2 through TRL) on 2 CPU
processes (gloo), tiny gpt-oss with LoRA on attention and experts: the step's gradients equal DDP's (fp32, bf16),
the grouped expert LoRA (ftcli.model.moe_lora) under FSDP2 equals PEFT's folded one under FSDP2 and itself on one
rank, with and without activation checkpointing, for gpt-oss and Qwen3-MoE, the eval loss through accelerate's
FSDP root equals the DDP one for the same adapter, the greedy samples (every rank generating) are the same text,
the best adapter is gathered whole and written once, a resumed run ends where the uninterrupted one ended, and the
adapter is written once, whole, in PEFT format, and merges."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _lora_common import run_ftcli
from _lora_common import adapter_weights as _adapter
from _run_common import metrics as _metrics

STEPS, SAVE_EVERY = 6, 3
EVAL_TOKENS = 201  # the trained tokens of the eval.max_examples=12 rows of tiny_chat.jsonl (measured)


def _worker(out: Path, sharding: str, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(Path(__file__).parents[1] / "support" / "_lora_fsdp_worker.py"), str(out), sharding, *extra],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> Path:
    """The runs of tests/support/_lora_fsdp_worker.py, then the eval-and-samples run: one torchrun per sharding (DDP,
    FSDP2; FSDP2 also through PEFT's folded expert LoRA, with activation checkpointing and over the tiny Qwen3-MoE),
    and the float32 run in this process (one rank, grad_accum 4: the same four blocks per step)."""
    import _lora_fsdp_worker

    out = tmp_path_factory.mktemp("lora-steps")
    _worker(out, "ddp", "fp32,bf16,eval")
    _worker(out, "fsdp", "fp32,fp32+peft,fp32+ac,bf16,fp32+qwen3,fp32+qwen3+peft,eval")
    _lora_fsdp_worker.step(out, "ddp", "fp32")
    return out


@pytest.fixture(scope="module")
def runs(steps):
    """The eval runs of those torchruns (tests/support/_lora_fsdp_eval_worker.py): the directory, DDP's and FSDP2's records."""
    return steps, *(json.loads((steps / f"{sharding}.json").read_text()) for sharding in ("ddp", "fsdp"))


def test_fsdp_lora_gradients_equal_ddp(steps):
    """One step, grad_accum 2 x 2 ranks over blocks of 6..170 trained tokens: every LoRA gradient (attention and
    expert adapters) under FSDP2 equals the DDP one; every base weight was a DTensor holding half of itself."""
    tmp_path = steps
    ddp, fsdp = torch.load(tmp_path / "grads-ddp-fp32.pt"), torch.load(tmp_path / "grads-fsdp-fp32.pt")
    assert ddp.keys() == fsdp.keys() and len(ddp) == 24  # A and B of q/k/v/o + 2 expert params, 2 layers
    worst = max(((fsdp[n] - ddp[n]).abs().max() / ddp[n].abs().max()).item() for n in ddp)
    print(f"FSDP2 vs DDP LoRA gradients: max relative difference {worst:.2e}")
    assert worst < 1e-5
    sharded = json.loads((tmp_path / "sharded-fsdp-fp32.json").read_text())
    assert len(sharded) == 37 and all(sharded.values())  # every base tensor of the tiny gpt-oss
    assert json.loads((tmp_path / "sharded-ddp-fp32.json").read_text()) == {}


def _run(out: Path, tag: str):
    """(logged losses, the first step's LoRA gradients, the adapter after the run, grouped GEMM calls) of one run."""
    record = json.loads((out / f"loss-{tag}.json").read_text())
    tensors = (torch.load(out / f"{kind}-{tag}.pt") for kind in ("grads", "adapter"))
    return record["train"], *tensors, record["grouped"]


@pytest.mark.parametrize("run, other", [
    ("fsdp-fp32", "fsdp-fp32+peft"),              # grouped vs PEFT's folded expert LoRA, both under FSDP2
    ("fsdp-fp32", "1rank-fp32"),                  # FSDP2 on 2 ranks vs one rank, both grouped
    ("fsdp-fp32+ac", "fsdp-fp32"),                # FSDP2's activation checkpointing (whole units, recomputed)
    ("fsdp-fp32+qwen3", "fsdp-fp32+qwen3+peft"),  # Qwen3-MoE's [E, out, in] experts, grouped vs folded
])
def test_grouped_expert_lora_under_fsdp_equals_peft_folded_and_one_rank(steps, run, other):
    """Three float32 steps (grad_accum 2 x 2 ranks, or 4 on one rank, over the same four packed blocks with flex
    attention and gpt-oss's sinks): the grouped expert LoRA over the FSDP2-sharded base logs the losses of `other`
    (1e-5 relative; measured <= 7e-8, with checkpointing 0), the first step's LoRA gradients agree to 1e-5 of each
    one's largest entry (measured <= 1e-6) and the adapters after three AdamW steps to 1e-4 absolute, a thirtieth of
    the lr (measured 1.4e-5 gpt-oss, 6.8e-5 Qwen3-MoE against the folded path: AdamW's first step moves every entry
    by about the lr, whatever its gradient, so entries whose gradient is ~1e-8 take the summation order's noise
    up to the lr; 2e-5 on one rank, 0 with checkpointing). The grouped runs went through GroupedLoraMatmul (with
    the checkpoint's recompute: every forward twice), the folded ones never; every base tensor was sharded."""
    losses, grads, adapter, calls = _run(steps, run)
    want_losses, want_grads, want_adapter, other_calls = _run(steps, other)
    assert len(losses) == 3 and losses == pytest.approx(want_losses, rel=1e-5, abs=0)
    assert grads.keys() == want_grads.keys() == adapter.keys() == want_adapter.keys() and len(grads) == 24
    worst_grad = max(((grads[n] - want_grads[n]).abs().max() / want_grads[n].abs().max()).item() for n in grads)
    worst_weight = max((adapter[n] - want_adapter[n]).abs().max().item() for n in adapter)
    print(f"{run} vs {other}: losses {losses} vs {want_losses}, gradients {worst_grad:.1e}, adapter {worst_weight:.1e}")
    assert worst_grad < 1e-5 and worst_weight < 1e-4
    for tag, n in ((run, calls), (other, other_calls)):  # rank 0's forwards (steps x micro-batches) x 2 layers x 2
        forwards = 0 if "peft" in tag else 3 * (4 if tag.startswith("1rank") else 2) * (2 if "+ac" in tag else 1)
        assert n == forwards * 2 * 2, (tag, n)
    sharded = json.loads((steps / f"sharded-{run}.json").read_text())
    print(f"{run}: {len(sharded)} base tensors, {calls} grouped GEMM calls")
    assert len(sharded) == (25 if "qwen3" in run else 37) and all(sharded.values())  # every base tensor


def test_bf16_fsdp_lora_sums_the_loss_and_gradients_in_fp32(steps):
    """bfloat16 weights under FSDP2 mixed precision, the same step as above, against DDP (which sums TRL's float32
    per-token log-probs and the adapter's gradients in float32), the experts through the grouped expert LoRA in
    both: the logged loss and every LoRA gradient agree to 1e-6 (measured 0 and 2.9e-9; 0 and 5.5e-9 through
    PEFT's folded expert LoRA in both, before the grouped one ran under FSDP2), and ftcli's eval loss after the
    step is a float32 sum within 1e-3 of DDP's (measured 8.5e-5, 2.7e-4 through the folded one: outside the
    trainer's autocast DDP applies the adapter in float32, FSDP in bf16, its param_dtype). With accelerate's own
    bf16 policy (output and reduce in bf16) the loss was 1.6e-2 off, the gradients 1.3e-2 and the eval sum bf16
    (1192.0 vs 1187.8); with a float32 output cast the eval failed (float32 activations into the bf16 LM head); with
    the bf16 reduce alone the gradients were 3.4e-3 off."""
    tmp_path = steps
    ddp_out = json.loads((tmp_path / "loss-ddp-bf16.json").read_text())
    fsdp_out = json.loads((tmp_path / "loss-fsdp-bf16.json").read_text())
    print(f"bf16 step loss: DDP {ddp_out['train']}, FSDP2 {fsdp_out['train']}")
    assert len(ddp_out["train"]) == len(fsdp_out["train"]) == 1
    assert abs(ddp_out["train"][0] - fsdp_out["train"][0]) <= 1e-6
    ddp, fsdp = torch.load(tmp_path / "grads-ddp-bf16.pt"), torch.load(tmp_path / "grads-fsdp-bf16.pt")
    assert ddp.keys() == fsdp.keys() and len(ddp) == 24
    worst = max(((fsdp[n] - ddp[n]).abs().max() / ddp[n].abs().max()).item() for n in ddp)
    print(f"bf16 FSDP2 vs DDP LoRA gradients: max relative difference {worst:.2e}")
    assert worst < 1e-6
    print(f"bf16 eval sums: DDP {ddp_out['eval_sums']}, FSDP2 {fsdp_out['eval_sums']}")
    assert len(fsdp_out["eval_sums"]) == 4
    for d, f in zip(ddp_out["eval_sums"], fsdp_out["eval_sums"], strict=True):
        assert f["dtype"] == d["dtype"] == "torch.float32"
        assert abs(f["value"] - d["value"]) <= 1e-3 * abs(d["value"])


# ----------------------------------------------------------------- eval and samples under FSDP2
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fsdp_eval_loss_equals_ddp(runs):
    """Step 0 and the last step (1): the same loss (rel 1e-5) over the same tokens; the base really was sharded."""
    out, ddp, fsdp = runs
    assert [e["step"] for e in ddp["evals"]] == [e["step"] for e in fsdp["evals"]] == [0, 1]
    for d, f in zip(ddp["evals"], fsdp["evals"]):
        assert d["tokens"] == f["tokens"] == EVAL_TOKENS
        assert f["loss"] == pytest.approx(d["loss"], rel=1e-5, abs=0), (d, f)
    print(f"FSDP vs DDP eval loss: {fsdp['evals'][0]['loss']:.6f} vs {ddp['evals'][0]['loss']:.6f}")
    assert 6.0 < ddp["evals"][0]["loss"] < 8.0  # ~ln(vocab) of a random tiny model, not 0 or a NaN
    assert len(fsdp["sharded"]) == 37 and all(fsdp["sharded"].values()) and ddp["sharded"] == {}
    # the step line of the last step carries its eval, in both runs
    last = {s: [m for m in _rows(out / s / "metrics.jsonl") if m["step"] == 1 and "loss" in m] for s in ("ddp", "fsdp")}
    assert last["fsdp"][0]["eval_loss"] == pytest.approx(last["ddp"][0]["eval_loss"], rel=1e-5, abs=0)


def test_fsdp_samples_equal_ddp(runs):
    """Greedy samples at the last step: written once by rank 0, the same text under FSDP2 as under DDP."""
    out, _, _ = runs
    ddp, fsdp = _rows(out / "ddp" / "samples.jsonl"), _rows(out / "fsdp" / "samples.jsonl")
    assert [r["step"] for r in fsdp] == [1, 1]
    assert [r["completion"] for r in fsdp] == [r["completion"] for r in ddp]
    assert all(r["completion"] for r in fsdp)


def test_fsdp_best_adapter_is_whole_and_equals_ddp(runs):
    """keep_best under FSDP2: <run>/best holds the whole adapter (gathered on every rank, written by rank 0), equal
    to the DDP run's best adapter."""
    from safetensors.torch import load_file

    out, ddp, fsdp = runs
    assert ddp["best_step"] == fsdp["best_step"] == 0  # lr 0: step 1's eval ties step 0's, no improvement
    best = {s: load_file(str(out / s / "best" / "adapter_model.safetensors")) for s in ("ddp", "fsdp")}
    assert best["fsdp"].keys() == best["ddp"].keys() and len(best["fsdp"]) == 24
    assert best["fsdp"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (16, 128)
    assert all(torch.equal(best["fsdp"][k], best["ddp"][k]) for k in best["ddp"])


# ----------------------------------------------------------------------------- a whole run
def _train_args(run_dir, *extra):
    return ["train", "--recipe", "tiny-gpt-oss-cpu", "--set", "training.sharding=fsdp",
            "--set", f"training.max_steps={STEPS}", "--set", f"training.checkpoint.every_steps={SAVE_EVERY}",
            "--set", "training.checkpoint.keep_last=3", "--set", "training.log_every=1",
            "--set", "data.max_examples=400", "--set", "tracking.enabled=false", "--set", "eval=null",
            "--set", f"output.dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora-fsdp")
    run_dir = work / "run"
    proc = run_ftcli(_train_args(run_dir), cwd=work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return work, run_dir, proc


def test_the_run_says_its_base_is_sharded(fsdp_run):
    _, run_dir, proc = fsdp_run
    assert "base fsdp (training.sharding)" in proc.stdout
    assert "expert LoRA: grouped, unmerged (2 experts modules" in proc.stdout  # lora.experts' default under FSDP2
    assert [m["step"] for m in _metrics(run_dir)] == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]


def test_adapter_saved_once_whole_in_peft_format_and_loadable(fsdp_run):
    """<run>/final holds one PEFT adapter with full (gathered) tensors; PEFT loads it onto the saved base and holds
    exactly those weights, and merge-lora merges it (the experts trained through the grouped expert LoRA)."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from ftcli.artifacts.merge import merge

    _, run_dir, _ = fsdp_run
    final = run_dir / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}
    assert not list(final.glob("pytorch_model*")) and not list(final.glob("model*.safetensors"))  # no base weights
    saved = _adapter(run_dir)
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"]) == ("LORA", 16)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    a = saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert a.shape == (16, 128)  # the whole matrix, not one rank's shard
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run_dir / "base", dtype=torch.float32),
                                      str(final))
    loaded = get_peft_model_state_dict(model)
    assert loaded.keys() == saved.keys() and len(saved) == 24
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert max(v.abs().max().item() for k, v in saved.items() if "lora_B" in k) > 0  # trained
    # the experts' factors, trained through the grouped expert LoRA under FSDP2: PEFT's whole [E·r, in] / [out, r·E]
    assert saved["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (64, 128)
    assert saved["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"].shape == (256, 64)
    _, report = merge(run_dir, output=run_dir.parent / "merged", dtype="float32")  # merge-lora folds them
    assert report["passed"] and report["adapter_effect"] > 0.1


def test_resume_from_checkpoint_is_exact(fsdp_run):
    """--resume checkpoint-3 (accelerate's per-rank DCP shards of model and optimizer) replays steps 4..6 with the
    uninterrupted losses and ends with the same adapter."""
    work, run_dir, _ = fsdp_run
    before, adapter_before = _metrics(run_dir), _adapter(run_dir)
    proc = run_ftcli(_train_args(run_dir, "--resume", str(run_dir / "checkpoints" / f"checkpoint-{SAVE_EVERY}")),
                     cwd=work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    after = _metrics(run_dir)  # cut back to the checkpoint's step, then the resumed steps: each step once
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    resumed = [r for r in after if r["step"] > SAVE_EVERY]
    worst_loss = max(abs(r["loss"] - next(b for b in before if b["step"] == r["step"])["loss"]) for r in resumed)
    adapter_after = _adapter(run_dir)
    worst_weight = max((adapter_after[k] - adapter_before[k]).abs().max().item() for k in adapter_before)
    print(f"resume vs uninterrupted: max loss difference {worst_loss:.2e}, max adapter difference {worst_weight:.2e}")
    assert worst_loss < 1e-5 and worst_weight < 1e-6
    run = json.loads((run_dir / "run.json").read_text())
    assert run["steps"] == STEPS and run["tokens"]["seen"] == STEPS * 2 * 1024


def test_sft_config_for_a_sharded_base():
    """training.sharding=fsdp -> accelerate's FSDP2 (version 2, resharded after forward, rank-0 loading, per-rank
    checkpoint shards) with FSDP's own activation checkpointing instead of the TrainingArguments flag."""
    from ftcli.config.recipe import load_recipe
    from ftcli.train.lora.trainer import checkpointing_arg, sft_config_kwargs

    recipe = load_recipe("gpt-oss-120b-h100")
    fsdp = sft_config_kwargs(recipe.training, recipe.model, recipe.name, Path("/tmp/run"), "fsdp")
    assert fsdp["fsdp"] is True and fsdp["fsdp_config"] == {
        "version": 2, "reshard_after_forward": True, "activation_checkpointing": True,
        "cpu_ram_efficient_loading": True, "state_dict_type": "SHARDED_STATE_DICT"}
    assert fsdp[checkpointing_arg()] is False and fsdp[f"{checkpointing_arg()}_kwargs"] is None
    ddp = sft_config_kwargs(recipe.training, recipe.model, recipe.name, Path("/tmp/run"), "ddp")
    assert "fsdp" not in ddp and ddp[checkpointing_arg()] is True
    assert {k: v for k, v in fsdp.items() if k not in ("fsdp", "fsdp_config") and "checkpointing" not in k} == {
        k: v for k, v in ddp.items() if "checkpointing" not in k}

