"""`ftcli train` with a LoRA recipe, end to end on 2 CPU processes (gloo): a tiny gpt-oss written in
MXFP4 by the fixture is loaded dequantized, trained with LoRA on attention and experts, saved, reloaded,
stopped by SIGTERM and resumed, and merged. In one process: the timed checkpoint save and the token counts it carries."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from _lora_common import adapter_weights as _adapter, run_ftcli, tiny_model, tiny_recipe
from _run_common import metrics as _metrics

STEPS, SAVE_EVERY, LOG_EVERY = 30, 15, 5


@pytest.fixture(scope="module")
def mxfp4_base(tmp_path_factory):
    from transformers import AutoTokenizer

    from ftcli.model import mxfp4
    from ftcli.config.recipe import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-gpt-oss"))
    return mxfp4.save_mxfp4(tiny_model(seed=0, dtype=torch.bfloat16), tmp_path_factory.mktemp("base") / "tiny-mxfp4",
                            tokenizer=tok)


def _train_args(base, run_dir, *extra):
    return ["train", "--recipe", "tiny-gpt-oss-cpu", "--set", "model.init=pretrained", "--set", f"model.id={base}",
            "--set", "model.quantization=mxfp4_dequantize", "--set", f"training.max_steps={STEPS}",
            "--set", f"training.checkpoint.every_steps={SAVE_EVERY}", "--set", "training.checkpoint.keep_last=3",
            "--set", f"training.log_every={LOG_EVERY}", "--set", "data.max_examples=800", "--set", f"output.dir={run_dir}",
            *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mxfp4_base):
    work = tmp_path_factory.mktemp("lora-train")
    run_dir = work / "run"
    proc = run_ftcli(_train_args(mxfp4_base, run_dir), cwd=work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return work, run_dir, proc


def test_mxfp4_base_loads_dequantized_through_ftcli_modeling(mxfp4_base):
    from safetensors.torch import load_file

    from ftcli.model import mxfp4
    from ftcli.model.build import load_model
    from ftcli.config.recipe import ModelConfig

    model = load_model(ModelConfig(id=str(mxfp4_base), model_type="gpt_oss", dtype="float32",
                                   quantization="mxfp4_dequantize"))
    stored = load_file(str(mxfp4_base / "model.safetensors"))
    param = model.model.layers[1].mlp.experts.down_proj
    name = "model.layers.1.mlp.experts.down_proj"
    assert param.dtype == torch.float32
    assert torch.equal(param, mxfp4.dequantize_mxfp4(stored[f"{name}_blocks"], stored[f"{name}_scales"], torch.float32))


def test_lora_training_loss_falls(trained):
    _, run_dir, proc = trained
    assert "2 x cpu" in proc.stdout
    # the CPU run says how it shards, not what the recipe's GPU card would fit (was "... fits GPU_1xA10")
    assert "base ddp (training.sharding=auto, on CPU processes)" in proc.stdout and "GPU_1xA10" not in proc.stdout
    m = _metrics(run_dir)
    assert [r["step"] for r in m] == [1, *range(LOG_EVERY, STEPS + 1, LOG_EVERY)]
    first, last = m[0]["loss"], m[-1]["loss"]
    print(f"loss {first:.3f} -> {last:.3f} over {STEPS} steps")
    assert 6.0 < first < 7.5  # ~ln(796 tokens) at random init
    assert last < first - 1.0
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in m)


def test_expert_lora_weights_exist_and_are_trained(trained):
    _, run_dir, _ = trained
    adapter = _adapter(run_dir)
    for layer in range(2):
        prefix = f"base_model.model.model.layers.{layer}"
        for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.experts", "mlp.experts.base_layer"):
            a, b = adapter[f"{prefix}.{module}.lora_A.weight"], adapter[f"{prefix}.{module}.lora_B.weight"]
            assert a.abs().sum() > 0
            assert b.abs().max() > 1e-4, module  # lora_B starts at zero: nonzero means it was trained
    # experts: gate_up_proj [E=4, in=128, out=256] -> A [r*E, 128], B [256, r*E] with r=16
    assert adapter["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (64, 128)
    assert adapter["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"].shape == (256, 64)
    config = json.loads((run_dir / "final" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert (run_dir / "final" / "chat_template.jinja").is_file() and (run_dir / "final" / "tokenizer.json").is_file()


def test_adapter_reloads_onto_the_base(trained, mxfp4_base):
    from peft import PeftModel

    from ftcli.model.build import load_model
    from ftcli.config.recipe import ModelConfig

    _, run_dir, _ = trained
    cfg = ModelConfig(id=str(mxfp4_base), model_type="gpt_oss", dtype="float32", quantization="mxfp4_dequantize")
    ids = torch.randint(0, 700, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = load_model(cfg)(input_ids=ids).logits
        model = PeftModel.from_pretrained(load_model(cfg), str(run_dir / "final"))
        adapted = model(input_ids=ids).logits
    saved = _adapter(run_dir)
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert (adapted - base_logits).abs().max() > 0.1


def test_run_json_and_mlflow(trained, mxfp4_base):
    import mlflow

    work, run_dir, _ = trained
    run = json.loads((run_dir / "run.json").read_text())
    assert run["method"] == "lora" and run["model_dir"] == "final" and run["status"] == "completed"
    assert run["steps"] == STEPS
    assert run["base_model"]["id"] == str(mxfp4_base) and run["base_model"]["model_type"] == "gpt_oss"
    assert run["tokens"]["seen"] == STEPS * 2 * 1024  # 2 ranks x one 1024-token block per step
    assert 0 < run["tokens"]["trained"] < run["tokens"]["seen"]
    assert run["final_loss"] == _metrics(run_dir)[-1]["loss"]
    assert run["mlflow"]["tracking_uri"] == f"sqlite:///{work / 'mlflow.db'}"  # the local default store
    client = mlflow.MlflowClient(tracking_uri=run["mlflow"]["tracking_uri"])
    history = client.get_metric_history(run["mlflow"]["run_id"], "loss")
    assert [h.step for h in history] == [r["step"] for r in _metrics(run_dir)]
    params = client.get_run(run["mlflow"]["run_id"]).data.params
    assert params["lora.r"] == "16" and params["training.optimizer.lr"] == "0.003"  # the resolved recipe
    grad_norms = client.get_metric_history(run["mlflow"]["run_id"], "grad_norm")
    assert [h.value for h in grad_norms] == pytest.approx([r["grad_norm"] for r in _metrics(run_dir)])


def test_sigterm_stops_with_a_trl_checkpoint_and_resume_continues_the_same_run(trained, mxfp4_base, tmp_path):
    """The trained run again, SIGTERM to its launcher after the first step line: it stops at the next step with
    a TRL checkpoint-N and the one `stopped at step N` line (no traceback). The `--resume` of that line logs
    each step once and ends where the uninterrupted run ended: losses, adapter, token counts."""
    import os
    import signal
    import subprocess
    import sys
    import time

    work, reference, _ = trained
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "FTCLI_CACHE": str(work / "cache")}  # run_ftcli's environment, the trained run's data cache
    proc = subprocess.Popen([sys.executable, "-m", "ftcli", *_train_args(mxfp4_base, run_dir)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().endswith("\n")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    lines = [line for line in (out + err).splitlines() if "stopped" in line]
    assert len(lines) == 1, lines
    step = int(lines[0].split("stopped at step ")[1].split(";")[0])
    assert lines[0] == f"stopped at step {step}; resume with `ftcli train --recipe {run_dir / 'recipe.yaml'} --resume`"
    assert 1 <= step < STEPS - 2 * LOG_EVERY
    saved = run_dir / "checkpoints" / f"checkpoint-{step}"
    assert [p.name for p in (run_dir / "checkpoints").glob("checkpoint-*")] == [saved.name]
    assert (saved / "adapter_model.safetensors").is_file()
    assert json.loads((saved / "trainer_state.json").read_text())["global_step"] == step
    assert not (run_dir / "final").exists() and not (run_dir / "run.json").exists()
    before = _metrics(run_dir)
    assert [r["step"] for r in before] == [s for s in [1, *range(LOG_EVERY, STEPS + 1, LOG_EVERY)] if s <= step]

    with open(run_dir / "metrics.jsonl", "a") as f:  # a step logged after the checkpoint (a kill -9)
        f.write(json.dumps({"step": step + 1, "loss": 0.0}) + "\n")
    proc = run_ftcli(["train", "--recipe", str(run_dir / "recipe.yaml"), "--resume"], cwd=tmp_path,
                     env={"FTCLI_CACHE": str(work / "cache")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    after, uninterrupted = _metrics(run_dir), _metrics(reference)
    assert [r["step"] for r in after] == [r["step"] for r in uninterrupted]  # cut back to the checkpoint: each once
    assert after[: len(before)] == before
    # a logged loss is the mean since the last log: from the first whole window after the resume, the same
    compared = [(a, b) for a, b in zip(after, uninterrupted) if a["step"] - LOG_EVERY >= step]
    assert len(compared) >= 2
    for a, b in compared:
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    adapter_after, adapter_reference = _adapter(run_dir), _adapter(reference)
    assert max((adapter_after[k] - adapter_reference[k]).abs().max().item() for k in adapter_reference) < 1e-4
    run = json.loads((run_dir / "run.json").read_text())
    assert run["steps"] == STEPS and run["tokens"]["seen"] == STEPS * 2 * 1024  # counts carried over the resume
    assert run["tokens"]["trained"] == json.loads((reference / "run.json").read_text())["tokens"]["trained"]


def test_merge_lora_of_the_trained_run(trained):
    from ftcli.artifacts.merge import merge_lora

    _, run_dir, _ = trained
    out = merge_lora(run_dir, dtype="float32")
    assert out == run_dir / "merged"
    report = json.loads((out / "merge.json").read_text())
    assert report["passed"] and report["max_abs_diff"] < 1e-4 and report["adapter_effect"] > 0.1
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_every_minutes_saves_on_time_and_checkpoints_carry_token_counts(tmp_path):
    """training.checkpoint.every_minutes alone (no every_steps): rank 0's clock triggers TRL's save; every
    checkpoint-N holds the run's token counts at step N, which a resume starts from."""
    from trl import SFTConfig

    from ftcli.data import load_tokenizer, prepare_blocks
    from ftcli.train.lora.trainer import TOKENS_FILE, build_trainer, sft_config_kwargs, training_blocks

    recipe = tiny_recipe("training.max_steps=3", "training.checkpoint.every_steps=null", "training.log_every=1",
                         "training.checkpoint.every_minutes=0.000001", "training.checkpoint.keep_last=5",
                         "data.max_examples=60", f"data.cache_dir={tmp_path / 'cache'}", "tracking.enabled=false")
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, tmp_path / "run")
    assert kwargs["save_strategy"] == "no"  # only the clock saves here
    tokenizer = load_tokenizer(recipe.model, recipe.data)
    rows = training_blocks(recipe, tokenizer)
    trainer, step_log = build_trainer(recipe, tiny_model(), tokenizer, rows,
                                      SFTConfig(**{**kwargs, "disable_tqdm": True}, use_cpu=True),
                                      metrics_path=tmp_path / "metrics.jsonl")
    trainer.train()
    saved = {n: json.loads((tmp_path / "run" / "checkpoints" / f"checkpoint-{n}" / TOKENS_FILE).read_text())
             for n in (1, 2, 3)}
    assert [saved[n]["seen"] for n in (1, 2, 3)] == [1024, 2048, 3072]  # one 1024-token block per step
    # the blocks of the first 3 batches (the seeded sampler gives the same order again), by their own counts
    packed, order = prepare_blocks(recipe, tokenizer), list(iter(trainer.get_train_dataloader().batch_sampler))
    by_block = [sum(packed[i].num_trained_tokens for i in order[n]) for n in range(3)]
    assert [saved[n]["trained"] for n in (1, 2, 3)] == list(np.cumsum(by_block)), (saved, by_block)
    assert (step_log.trained, step_log.seen) == (saved[3]["trained"], saved[3]["seen"])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["tokens_seen"]) for m in lines] == [(1, 1024), (2, 2048), (3, 3072)]
    assert [m["tokens_trained"] for m in lines] == [saved[n]["trained"] for n in (1, 2, 3)]


def test_a_crafted_pickle_in_a_lora_checkpoint_is_refused_and_never_runs(trained, mxfp4_base, tmp_path):
    """A TRL checkpoint from anywhere: its optimizer / RNG files are pickles. One whose __reduce__ would run code
    is refused in one error line naming the checkpoint; the code never runs."""
    import shutil

    import torch

    work, run_dir, _ = trained
    crafted = tmp_path / f"checkpoint-{SAVE_EVERY}"
    shutil.copytree(run_dir / "checkpoints" / f"checkpoint-{SAVE_EVERY}", crafted)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    for name in ("optimizer.pt", *[p.name for p in crafted.glob("rng_state*.pth")]):
        torch.save({"state": Payload()}, crafted / name)
    (crafted / "ftcli_checksums.json").unlink()  # crafted with no checksums (they would name optimizer.pt first)
    out = tmp_path / "run"
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("checkpoints", "final", "run.json"))
    proc = run_ftcli(_train_args(mxfp4_base, out, "--resume", str(crafted)), cwd=work)
    assert proc.returncode != 0
    assert not marker.exists()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert any(f"checkpoint {crafted} holds more than tensors and plain data, so it is not loaded" in e
               for e in errors), proc.stderr[-3000:]


def test_lora_logs_are_the_full_paths_step_lines_and_bar(tmp_path, capfd):
    """No tqdm bar between the step lines, no raw `{'train_runtime': ...}` dict, no FutureWarning: the step line
    and the progress bar of the full path."""
    import re
    import warnings

    from trl import SFTConfig

    from ftcli.data import load_tokenizer
    from ftcli.train.lora.trainer import build_trainer, sft_config_kwargs, training_blocks

    recipe = tiny_recipe("training.max_steps=3", "training.log_every=1", "training.checkpoint.enabled=false",
                         "data.max_examples=60", f"data.cache_dir={tmp_path / 'cache'}", "tracking.enabled=false",
                         "eval=null")
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, tmp_path / "run")
    assert kwargs["disable_tqdm"] is True
    tokenizer = load_tokenizer(recipe.model, recipe.data)
    rows = training_blocks(recipe, tokenizer)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = build_trainer(recipe, tiny_model(), tokenizer, rows, SFTConfig(**kwargs, use_cpu=True))
        trainer.train()
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    out = capfd.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    assert all(re.match(r"step \d/3 \| loss \d+\.\d{4} \| gnorm [\d.]+ \| lr ", s) for s in steps)
    assert "train_runtime" not in out.out + out.err and "it/s]" not in out.out + out.err
    assert re.match(r"train\s.*3/3", lines[-1]), lines[-1]  # the bar, drawn once at the end without a terminal
