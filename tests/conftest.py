"""Test isolation shared by every test module."""

from __future__ import annotations

import os

import pytest


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
