"""A resume continues the run it names, or says in one line why it cannot, before anything is written:
the checkpoint's files are the ones the save wrote (sizes and CRC32s in meta.json), and the recipe
changes only what may change on resume (ftcli.train.resume). In-process: the launcher refuses before
torchrun starts."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from _run_common import train_args
from ftcli.config.errors import UserError

SETS = ["tracking.enabled=false"]


def _save(root, step):
    from ftcli.train.checkpoint import rng_state, save_checkpoint

    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))  # shards of tens of KiB
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 64)).square().sum().backward()
    optimizer.step()
    return save_checkpoint(root, step, model, optimizer, {"data": {"consumed": step}, "rng": rng_state()},
                           {"result": {}, "blocks_per_step": 2}, keep_last=3)  # tiny-qwen-cpu: 2 ranks x 1


@pytest.fixture
def run_dir(tmp_path, one_rank):
    """A run dir of tiny-qwen-cpu (marker, recipe.yaml) with committed checkpoints of steps 1 and 2."""
    from ftcli.artifacts.rundir import prepare_run_dir
    from ftcli.config.recipe import load_recipe

    run_dir = prepare_run_dir(load_recipe("tiny-qwen-cpu", [f"output.dir={tmp_path / 'run'}", *SETS]))
    _save(run_dir / "checkpoints", 1)
    _save(run_dir / "checkpoints", 2)
    return run_dir


def _resume(run_dir, *sets):
    from ftcli import cli

    return CliRunner().invoke(cli.app, [*train_args(run_dir, *SETS, *sets), "--resume", "latest"])


def _refusal(res) -> str:
    """The one line a refused command printed (exit code 2)."""
    assert res.exit_code == 2, res.output
    return " ".join(res.output.split())


def test_save_records_size_and_crc32_of_every_file(run_dir):
    import zlib

    ckpt = run_dir / "checkpoints" / "step_00000002"
    sums = json.loads((ckpt / "meta.json").read_text())["checksums"]
    assert sums["algorithm"] == "crc32"
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != "meta.json")
    assert sorted(sums["files"]) == on_disk == [".metadata", "__0_0.distcp", "rank_00000.json",
                                                "rank_00000.safetensors"]
    assert sums["chunk_bytes"] == 16 * 2**20
    for name, (size, crcs) in sums["files"].items():
        data = (ckpt / name).read_bytes()
        assert (size, crcs) == (len(data), [zlib.crc32(data)])  # one chunk each at this size


def test_chunked_crcs_cover_every_byte(tmp_path):
    import zlib

    from ftcli.train.checkpoint import file_checksums

    (tmp_path / "f").write_bytes(bytes(range(256)) * 40)  # 10240 bytes: chunks of 4096, 4096, 2048
    data = (tmp_path / "f").read_bytes()
    assert file_checksums(tmp_path, ["f"], chunk_bytes=4096, threads=2) == {
        "f": [10240, [zlib.crc32(data[:4096]), zlib.crc32(data[4096:8192]), zlib.crc32(data[8192:])]]}


def test_zeroed_page_in_a_shard_refuses_resume_naming_the_previous_intact_checkpoint(run_dir):
    newest = run_dir / "checkpoints" / "step_00000002"
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    assert len(data) > 3 * 4096
    data[4096:8192] = bytes(4096)
    shard.write_bytes(bytes(data))
    res = _resume(run_dir)
    previous = run_dir / "checkpoints" / "step_00000001"
    assert res.exit_code == 2
    assert " ".join(res.output.split()) == (
        f"error: checkpoint {newest}: __0_0.distcp does not match the checksum taken at save (damaged since); "
        f"the previous intact checkpoint is {previous} (resume from it with --resume {previous})")


def test_truncated_shard_is_one_line_and_no_intact_one_is_said_so(run_dir):
    from ftcli.train.checkpoint import verify_checkpoint

    ckpts = run_dir / "checkpoints"
    for step in (1, 2):
        shard = ckpts / f"step_0000000{step}" / "__0_0.distcp"
        size = shard.stat().st_size
        shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(UserError) as err:
        verify_checkpoint(ckpts / "step_00000002")
    assert str(err.value) == (f"checkpoint {ckpts / 'step_00000002'}: __0_0.distcp has 1000 bytes, the save wrote "
                              f"{size} (truncated or replaced since); no earlier checkpoint verifies; start again "
                              "without --resume (--force)")


def test_checkpoint_without_checksums_resumes_with_a_warning(run_dir):
    from ftcli.train.checkpoint import verify_checkpoint

    ckpt = run_dir / "checkpoints" / "step_00000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["checksums"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    said = []
    verify_checkpoint(ckpt, warn=said.append)
    assert said == [f"warning: checkpoint {ckpt} has no checksums (saved by an older ftcli); resuming from it "
                    "unverified"]


def test_resume_with_a_wider_model_is_refused_and_recipe_yaml_unchanged(run_dir):
    before = (run_dir / "recipe.yaml").read_bytes()
    res = _resume(run_dir, "model.config_overrides.hidden_size=256")
    assert res.exit_code == 2
    assert " ".join(res.output.split()) == (
        f"error: --resume: the recipe differs from the run's {run_dir / 'recipe.yaml'} at "
        "model.config_overrides.hidden_size (the model, its parameter shapes or the data order the checkpoint "
        "continues); undo these edits to resume, or train them as a new run (another output.dir)")
    assert (run_dir / "recipe.yaml").read_bytes() == before


def test_resume_with_another_lr_is_refused_since_the_checkpoint_holds_the_old_one(run_dir):
    before = (run_dir / "recipe.yaml").read_bytes()
    res = _resume(run_dir, "training.optimizer.lr=0.01", "data.packing.block_len=512")
    assert res.exit_code == 2
    assert " ".join(res.output.split()) == (
        f"error: --resume: the recipe differs from the run's {run_dir / 'recipe.yaml'} at "
        "data.packing.block_len (the model, its parameter shapes or the data order the checkpoint continues); "
        "and at training.optimizer.lr (its optimizer state and schedule were saved with the old values; ftcli "
        "does not change them on resume); undo these edits to resume, or train them as a new run (another "
        "output.dir)")
    assert (run_dir / "recipe.yaml").read_bytes() == before


def test_cadence_and_tracking_edits_are_applied_on_resume_with_one_warning(run_dir):
    from ftcli.config.recipe import load_recipe
    from ftcli.train.resume import check_resume_recipe, classify_changes

    recipe = load_recipe("tiny-qwen-cpu", [f"output.dir={run_dir}", *SETS, "training.log_every=5",
                                           "training.checkpoint.every_steps=10", "training.cpu_processes=1"])
    said = []
    check_resume_recipe(run_dir, recipe, warn=said.append)
    assert said == ["warning: resuming with changed training.checkpoint.every_steps, training.cpu_processes, "
                    "training.log_every (applied from here on)"]
    assert classify_changes(["tracking.experiment", "training.schedule.warmup", "training.max_steps", "lora.r",
                             "data.path"]) == (["tracking.experiment"], ["training.schedule.warmup",
                                                                         "training.max_steps"],
                                               ["lora.r", "data.path"])


def test_resume_from_another_runs_checkpoint_compares_with_that_runs_recipe(run_dir, tmp_path):
    """`--resume <run>/checkpoints/step_N` into a new dir: the recipe is compared with the recipe the checkpoint
    was written with (<run>/recipe.yaml), as for one's own run; nothing is written in the new dir."""
    from ftcli import cli

    new = tmp_path / "new"
    ckpt = run_dir / "checkpoints" / "step_00000002"
    res = CliRunner().invoke(cli.app, [*train_args(new, *SETS, "training.optimizer.lr=0.01"), "--resume", str(ckpt)])
    assert _refusal(res) == (
        f"error: --resume: the recipe differs from the run's {run_dir / 'recipe.yaml'} at training.optimizer.lr (its "
        "optimizer state and schedule were saved with the old values; ftcli does not change them on resume); undo "
        "these edits to resume, or train them as a new run (another output.dir)")
    assert not new.exists()


def test_resume_on_fewer_ranks_proposes_the_grad_accum_that_keeps_the_global_batch(run_dir):
    """A checkpoint of 2 ranks x grad_accum 1 (2 blocks per step): `--resume` on 1 process alone is refused with
    the fix; 1 process x grad_accum 2 passes the recipe comparison (grad_accum applied, said in one line)."""
    from ftcli.config.recipe import load_recipe
    from ftcli.train.launch import check_resume

    before = (run_dir / "recipe.yaml").read_bytes()
    assert _refusal(_resume(run_dir, "training.cpu_processes=1")) == (
        f"error: --resume: {run_dir / 'checkpoints' / 'step_00000002'} was trained with 2 blocks per optimizer step "
        "(1 rank x training.grad_accum 2), this launch takes 1 (1 rank x 1); resuming on 1 rank: set "
        "training.grad_accum=2 to keep 2 blocks per step")
    assert _refusal(_resume(run_dir, "training.cpu_processes=3", "training.grad_accum=1")).endswith(
        "no training.grad_accum keeps 2 blocks per step on 3 ranks; resume on a number of ranks that divides 2")
    assert (run_dir / "recipe.yaml").read_bytes() == before

    said = []
    recipe = load_recipe("tiny-qwen-cpu", [f"output.dir={run_dir}", *SETS, "training.cpu_processes=1",
                                           "training.grad_accum=2"])
    import sys

    from unittest import mock

    with mock.patch.object(sys.stderr, "write", side_effect=said.append):
        check_resume(recipe, run_dir, "latest", world_size=1)
    assert "".join(said) == ("warning: resuming with changed training.cpu_processes, training.grad_accum "
                             "(applied from here on)\n")
    with pytest.raises(UserError, match="this launch takes 4 .2 ranks x 2.; resuming on 2 ranks: set "
                                        "training.grad_accum=1 to keep 2 blocks per step"):
        check_resume(recipe, run_dir, "latest", world_size=2)
