"""ftcli.train.distributed: rank 0 first across nodes, and rank 0's decisions shared by every rank."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from _run_common import metrics, recipe_file, subprocess_env


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return subprocess_env(tmp_path_factory.mktemp("ftcli-cache"))


def test_rank0_decides_is_the_flag_without_a_process_group():
    from ftcli.train.distributed import rank0_decides

    assert rank0_decides(True) is True and rank0_decides(0) is False


def test_rank0_first_fills_every_node_local_data_cache(tmp_path, env):
    """Two torchrun agents as two nodes (one process each) whose data caches are separate directories, as on
    nodes without a shared disk: each node's local rank 0 prepares its own cache and the run trains to the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recipe = recipe_file(tmp_path / "r.yaml", "training.max_steps=2", "training.log_every=1", "tracking.enabled=false",
                         "training.checkpoint.enabled=false", "training.checkpoint.save_final_hf=false",
                         f"output.dir={tmp_path / 'run'}")
    nodes = []
    for node in (0, 1):
        node_env = {**env, "FTCLI_CACHE": str(tmp_path / f"cache-node{node}")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
               "-m", "ftcli", "train", "--recipe", str(recipe)]
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=node_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2]
    assert all(any((tmp_path / f"cache-node{node}").rglob("meta.json")) for node in (0, 1))
