"""Test isolation shared by every test module, the fixtures that test modules of several rooms use, and the
order of the heavy modules. Helpers to import (`from _run_common import ...`) live in tests/support/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# One thread per pytest-xdist worker (`-n 2` on the 2-core CI box): each worker's in-process torch would start one
# OpenMP thread per core, and the two workers' spinning threads take the cores from each other and from the
# training runs they launch (measured: tests/unit/model/test_packed_kernels.py + test_decode.py beside one busy core took
# 62-86 s with 2 threads, 14-22 s with 1). Set before torch is imported; a serial run keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the Rust tokenizers' thread pool, likewise


@pytest.fixture(autouse=True)
def _no_leaked_mlflow_env():
    """`mlflow.set_tracking_uri` also sets $MLFLOW_TRACKING_URI, which every later `ftcli` subprocess would
    inherit (its runs would land in another test's store): restore the MLFLOW_* variables after each test."""
    before = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    for key in [k for k in os.environ if k.startswith("MLFLOW_") and k not in before]:
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-process gloo group, for the collectives a test calls in-process (save_checkpoint, load_checkpoint)."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("pg") / "store"
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def recipe_corpus(tmp_path_factory) -> Path:
    """The malformed-recipe corpus (tests/support/_recipe_corpus.py) written out, one <case>.yaml per recipe
    (tests/unit/test_cli_errors, tests/e2e/test_cli_real_process)."""
    from _recipe_corpus import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run dir (run.json + final/ adapter on attention and experts) over a tiny MXFP4 base
    (tests/e2e/test_merge, test_merge_stream, tests/unit/artifacts/test_data_loss)."""
    import torch
    from _lora_common import tiny_model, tiny_recipe
    from peft import get_peft_model
    from transformers import AutoTokenizer

    from ftcli.model import mxfp4
    from ftcli.model.build import load_model
    from ftcli.config.recipe import ModelConfig, resolve_path
    from ftcli.train.lora.trainer import lora_config

    root = tmp_path_factory.mktemp("merge")
    tok = AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-gpt-oss"))
    base = mxfp4.save_mxfp4(tiny_model(seed=0, dtype=torch.bfloat16), root / "base-mxfp4", tokenizer=tok)
    model = load_model(ModelConfig(id=str(base), model_type="gpt_oss", dtype="float32", quantization="mxfp4_dequantize"))
    peft_model = get_peft_model(model, lora_config(tiny_recipe().lora, tiny_recipe().model, model))
    torch.manual_seed(3)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.01)
    run = root / "run"
    peft_model.save_pretrained(run / "final")
    tok.save_pretrained(run / "final")
    (run / "run.json").write_text(json.dumps({
        "method": "lora", "model_dir": "final", "status": "completed",
        "base_model": {"id": str(base), "revision": None, "init": "pretrained", "model_type": "gpt_oss",
                       "model_class": "causal_lm"},
    }))
    return run, base


# The modules that launch training runs (torchrun, `ftcli train`, an MLflow server), heaviest first: seconds of
# one 2-worker run (`pytest --durations=60 --junitxml=...`, summed per module). Under `--dist loadfile` a module
# is one unit of work on one worker; xdist would hand them out by test count, which sends these few-test heavy
# modules out last, where one of them then runs alone on one worker while the other idles. Run first, the many
# light modules fill the end evenly (pyproject's addopts says --no-loadscope-reorder so this order is kept).
HEAVY_FIRST = ["test_slurm_e2e", "test_train_full", "test_context_parallel", "test_preemption", "test_lora_fsdp",
               "test_register", "test_lora_train", "test_eval",
               "test_resume_world_size", "test_secrets", "test_eval_lora", "test_run_lock", "test_mxfp4_lora",
               "test_families", "test_generate", "test_launch", "test_lora_loss", "test_lora_compile",
               "test_distributed", "test_plan", "test_worker_failures", "test_merge_stream", "test_doctor",
               "test_data_checks", "test_preference_train", "test_tracking",
               # not runs, but a TRL trainer or config built per test (TRL's import alone is seconds per worker)
               "test_preference_trl_oracle", "test_lora_trl_build",
               # not runs, but seconds each (moved out of the fast tier): a model merged, 200 recipes round-tripped,
               # the sbatch script's shell logic, fresh interpreters
               "test_merge", "test_slurm_script", "test_recipe_roundtrip", "test_data_workers", "test_light_imports",
               "test_cli_real_process"]


@pytest.fixture
def renames(monkeypatch) -> list[tuple[str, int]]:
    """(destination name, bytes moved) of every rename from here on (os.rename, os.replace, Path.rename: what
    a UC Volume's FUSE mount turns into a server-side copy of that many bytes); `.clear()` it where counting starts."""
    moved, rename, replace = [], os.rename, os.replace

    def size(path) -> int:
        path = Path(path)
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size

    def counted(real):
        def move(src, dst, *args, **kwargs):
            moved.append((Path(dst).name, size(src)))
            return real(src, dst, *args, **kwargs)
        return move

    monkeypatch.setattr(os, "rename", counted(rename))
    monkeypatch.setattr(os, "replace", counted(replace))
    return moved


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order
