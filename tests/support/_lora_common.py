"""Shared helpers of the LoRA / merge / MXFP4 tests (tiny gpt-oss on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]


def tiny_recipe(*overrides: str, output_dir: Path | None = None):
    from ftcli.config.recipe import load_recipe

    sets = list(overrides)
    if output_dir is not None:
        sets.append(f"output.dir={output_dir}")
    return load_recipe("tiny-gpt-oss-cpu", sets)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, attn: str | None = None):
    from ftcli.model.build import load_model

    torch.manual_seed(seed)
    return load_model(tiny_recipe().model, dtype=dtype, attn_implementation=attn)


def packed_row(rng: np.random.Generator, segment_lengths: list[int], trained_fraction: float, vocab: int = 700):
    """One packed block (`ftcli.data.Block`): segments end to end, the last `trained_fraction` of every segment
    trained."""
    from ftcli.data import make_block

    ids, trained = [], []
    for n in segment_lengths:
        ids.append(rng.integers(20, vocab, size=n))
        mask = np.zeros(n, dtype=bool)
        mask[max(1, int(round(n * (1 - trained_fraction)))):] = True
        trained.append(mask)
    ids = np.concatenate(ids)
    return make_block(ids, np.concatenate(trained), segment_lengths, len(ids), pad_id=0)


def run_ftcli(args: list[str], cwd: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`ftcli ...` in a subprocess with one thread per process (2 shared cores)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "FTCLI_CACHE": str(cwd / "cache"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "ftcli", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def adapter_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trained adapter of a LoRA run dir (final/adapter_model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "adapter_model.safetensors"))


def token_mean_grads(model, rows):
    """Reference: one backward of sum over both rows of token NLL / total trained tokens; `.loss` keeps the step's
    loss, for the logged one."""
    from ftcli.train.lora.trainer import collate_blocks

    model.zero_grad()
    total_loss, total_tokens = 0.0, 0
    for row in rows:
        batch = collate_blocks([row])
        labels = batch.pop("labels")
        logits = model(**batch).logits[0, :-1].float()
        target = labels[0, 1:]
        total_loss = total_loss + F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        total_tokens += int((target != -100).sum())
    (total_loss / total_tokens).backward()
    token_mean_grads.loss = float(total_loss / total_tokens)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
