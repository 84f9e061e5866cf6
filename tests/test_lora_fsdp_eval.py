"""Eval and samples in the LoRA path with the frozen base sharded by FSDP2 (`training.sharding: fsdp`), 2 CPU
processes (gloo), tiny gpt-oss with LoRA on attention and experts: the eval loss through accelerate's FSDP root
equals the DDP one for the same adapter, the greedy samples (every rank generating) are the same text, and the
best adapter is gathered whole and written once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EVAL_TOKENS = 201  # the trained tokens of the eval.max_examples=12 rows of tiny_chat.jsonl (measured)


def _worker(out: Path, sharding: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(Path(__file__).with_name("_lora_fsdp_eval_worker.py")), str(out), sharding],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / f"{sharding}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-fsdp-eval")
    return out, _worker(out, "ddp"), _worker(out, "fsdp")


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
