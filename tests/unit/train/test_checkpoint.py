"""ftcli.train.checkpoint in one process: which checkpoint --resume means, when to save, a save or an export
that the disk stops."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftcli.config.errors import UserError


def _dcp(root, step):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text("{}")
    return path


def _trl(root, step):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_resume_resolves_latest_a_dir_or_a_folder_of_checkpoints(tmp_path):
    """Both kinds: None -> fresh start; "latest" and a checkpoints/ folder -> the newest complete one; a
    checkpoint dir -> itself. An unfinished save (a step dir without meta.json, an older ftcli's .tmp_ dir) is never
    picked."""
    from ftcli.train.checkpoint import resolve_resume

    for kind, make in (("dcp", _dcp), ("trl", _trl)):
        run = tmp_path / kind
        root = run / "checkpoints"
        older, newer = make(root, 2), make(root, 10)
        (root / ".tmp_step_00000012").mkdir()
        (root / "step_00000014").mkdir()  # a save in progress: its shards, no meta.json yet
        (root / "step_00000014" / "__0_0.distcp").write_bytes(b"partial")
        assert resolve_resume(run, None, kind=kind) is None
        assert resolve_resume(run, "latest", kind=kind) == newer
        assert resolve_resume(run, str(root), kind=kind) == newer
        assert resolve_resume(run, str(older), kind=kind) == older


def test_resume_without_a_checkpoint_is_one_line_per_kind(tmp_path):
    from ftcli.train.checkpoint import resolve_resume

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"^--resume: no checkpoint in .*/checkpoints; train without --resume$"):
        resolve_resume(tmp_path, "latest", kind="dcp")
    with pytest.raises(UserError, match=r"^--resume: no checkpoint-N in .*/checkpoints; train without --resume to "):
        resolve_resume(tmp_path, "latest", kind="trl")
    with pytest.raises(UserError, match=rf"^--resume {empty}: not a complete ftcli checkpoint \(no meta.json\)$"):
        resolve_resume(tmp_path, str(empty), kind="dcp")
    with pytest.raises(UserError, match=rf"^--resume {empty}: not a LoRA checkpoint \(no trainer_state.json\)$"):
        resolve_resume(tmp_path, str(empty), kind="trl")
    _trl(tmp_path / "lora", 3)  # a LoRA checkpoint is no DCP checkpoint
    with pytest.raises(UserError, match="not a complete ftcli checkpoint"):
        resolve_resume(tmp_path, str(tmp_path / "lora" / "checkpoint-3"), kind="dcp")


def test_checkpoint_schedule_every_steps_and_every_minutes():
    from ftcli.train.checkpoint import CheckpointSchedule

    now = [100.0]
    cfg = SimpleNamespace(enabled=True, every_steps=3, every_minutes=0.5)
    schedule = CheckpointSchedule.from_config(cfg, clock=lambda: now[0])
    assert [s for s in range(1, 10) if schedule.due(s, time_due=False)] == [3, 6, 9]
    now[0] += 29.9
    assert not schedule.time_due()
    now[0] += 0.1  # 30 s = 0.5 min since the start
    assert schedule.time_due() and schedule.due(4, time_due=schedule.time_due())
    schedule.mark_saved()
    assert not schedule.time_due()
    assert not CheckpointSchedule(False, 3, 0.5).due(3, time_due=True)  # checkpoints off: never
    steps_only = CheckpointSchedule(True, None, None)
    assert not steps_only.time_due() and not steps_only.due(3, time_due=False)


# --------------------------------------------------------------------- a save that cannot be written
def _save(root, step):
    import torch

    from ftcli.train.checkpoint import rng_state, save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = {"scheduler": {}, "data": {"consumed": step}, "rng": rng_state()}
    return save_checkpoint(root, step, model, optimizer, state, {"result": {}}, keep_last=3)


def _disk_full(monkeypatch, errno_=28):
    """Every file DCP opens for writing fails as a full disk does (no real disk is filled)."""
    import contextlib
    import errno
    import os

    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode:
            raise OSError(errno_, os.strerror(errno_), str(path))
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    return errno.errorcode[errno_]


def test_disk_full_during_a_save_is_one_line_and_the_last_checkpoint_survives(tmp_path, one_rank, monkeypatch, capsys):
    from ftcli.train.checkpoint import CheckpointNotSaved, latest_checkpoint, list_checkpoints

    root = tmp_path / "checkpoints"
    good = _save(root, 1)
    good_files = sorted(p.name for p in good.iterdir())
    _disk_full(monkeypatch)
    with pytest.raises(CheckpointNotSaved) as err:
        _save(root, 2)
    message = str(err.value)
    assert message.startswith("the checkpoint of step 2 could not be saved: No space left on device "
                              f"({root}/step_00000002/")
    assert message.endswith(
        f"[errno 28]; the last good checkpoint, step 1 ({good}), is intact: free space, then resume with "
        f"`ftcli train --recipe {tmp_path}/recipe.yaml --resume`")
    assert "\n" not in message and isinstance(err.value, UserError)
    assert list_checkpoints(root) == [good] and latest_checkpoint(root) == good
    assert sorted(p.name for p in good.iterdir()) == good_files
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # the half-written save is gone
    assert "Traceback" not in capsys.readouterr().err


def test_a_commit_renames_only_its_two_small_markers(tmp_path, one_rank, renames):
    """Shards are written at their final paths; a commit renames DCP's .metadata and ftcli's meta.json (written
    last) and nothing else: the bytes renamed per checkpoint are those two files' sizes, whatever the model size.
    Rotation (keep_last) removes the oldest only after the newest is committed."""
    from ftcli.train.checkpoint import list_checkpoints

    root = tmp_path / "checkpoints"
    moved = renames
    first = _save(root, 1)
    assert sorted(name for name, _ in moved) == [".metadata", "meta.json"]
    markers = (first / ".metadata").stat().st_size + (first / "meta.json").stat().st_size
    assert sum(n for _, n in moved) == markers
    shards = sum(p.stat().st_size for p in first.iterdir() if p.name not in (".metadata", "meta.json"))
    assert shards > 0 and markers < 8192  # the markers do not grow with the model
    for step in (2, 3, 4):
        moved.clear()
        _save(root, step)
        assert sorted(name for name, _ in moved) == [".metadata", "meta.json"]
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002", "step_00000003", "step_00000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003", "step_00000004"]


def test_a_checkpoint_under_volumes_goes_through_the_vendors_dcp_storage():
    """Under /Volumes, DCP writes and reads through databricks-sdk-air's UCVolumeWriter / UCVolumeReader (the
    `databricks` extra); elsewhere through torch's FileSystemWriter / Reader. (Constructing them touches no
    Volume: writing to one needs a workspace.)"""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from ftcli.train.checkpoint import dcp_storage

    air = pytest.importorskip("databricks.air.data")
    volume = Path("/Volumes/main/ml/ckpts/run/checkpoints/step_00000200")
    writer, reader = dcp_storage(volume, "writer"), dcp_storage(volume, "reader")
    assert (type(writer), type(reader)) == (air.UCVolumeWriter, air.UCVolumeReader)
    assert str(writer.path) == str(volume) and writer.validate_checkpoint_id(volume)
    local = dcp_storage(Path("/tmp/run/checkpoints/step_00000200"), "writer")
    assert type(local) is FileSystemWriter and type(dcp_storage(Path("/tmp/x"), "reader")) is FileSystemReader


def test_a_link_planted_at_a_checkpoint_or_export_path_is_unlinked_never_written_through(tmp_path, one_rank):
    from ftcli.artifacts.publish import EXPORT_RECORD, begin_export

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "meta.json").write_text("keep")
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step_00000001").symlink_to(victim)
    path = _save(root, 1)
    assert not path.is_symlink() and json.loads((path / "meta.json").read_text())["step"] == 1
    (tmp_path / "final").symlink_to(victim)
    begin_export(tmp_path / "final")
    assert not (tmp_path / "final").is_symlink() and (tmp_path / "final" / EXPORT_RECORD).is_file()
    assert [p.name for p in victim.iterdir()] == ["meta.json"] and (victim / "meta.json").read_text() == "keep"


def test_a_save_killed_before_its_commit_is_never_listed_or_resumed_and_is_removed_at_the_next_start(
        tmp_path, one_rank, monkeypatch):
    """A kill after every shard is on disk but before meta.json (the commit) leaves step_N with its shards and no
    meta.json: not listed, not resumed from, `--resume <it>` refused; the previous checkpoint is intact; the next
    start removes it. (SystemExit stands for the kill: nothing of the save runs after it.)"""
    import ftcli.train.checkpoint as ckpt

    root = tmp_path / "run" / "checkpoints"
    good = _save(root, 1)
    real = ckpt.write_atomic

    def killed_at_commit(path, text):
        if Path(path).name == "meta.json":
            raise SystemExit(137)
        real(path, text)

    monkeypatch.setattr(ckpt, "write_atomic", killed_at_commit)
    with pytest.raises(SystemExit):
        _save(root, 2)
    monkeypatch.setattr(ckpt, "write_atomic", real)
    partial = root / "step_00000002"
    assert sorted(p.name for p in partial.iterdir()) == [".metadata", "__0_0.distcp", "rank_00000.json",
                                                         "rank_00000.safetensors"]
    assert ckpt.list_checkpoints(root) == [good]
    assert ckpt.resolve_resume(tmp_path / "run", "latest") == good
    with pytest.raises(UserError, match="not a complete ftcli checkpoint"):
        ckpt.resolve_resume(tmp_path / "run", str(partial))
    ckpt.verify_checkpoint(good)  # every file as its save wrote it
    assert ckpt.remove_interrupted_saves(root) == [partial]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]
    assert _save(root, 2) == partial and ckpt.list_checkpoints(root) == [good, partial]


def test_a_rank_state_that_cannot_be_written_stops_the_save_in_one_line(tmp_path, one_rank, monkeypatch):
    """The per-rank files (no collective of their own) fail together with DCP's: every rank agrees."""
    import errno

    import ftcli.train.checkpoint as ckpt

    def write_rank_state(*args, **kwargs):
        raise OSError(errno.EDQUOT, "Disk quota exceeded", "rank_00000.json")

    monkeypatch.setattr(ckpt, "write_rank_state", write_rank_state)
    with pytest.raises(ckpt.CheckpointNotSaved) as err:
        _save(tmp_path / "checkpoints", 3)
    assert str(err.value) == (
        "the checkpoint of step 3 could not be saved: Disk quota exceeded (rank_00000.json) [errno 122]; there is no "
        f"earlier checkpoint: free space, then start again with `ftcli train --recipe {tmp_path}/recipe.yaml --force`")
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_disk_full_during_the_hf_export_is_one_line_and_leaves_no_partial_export(tmp_path, one_rank, monkeypatch):
    """ENOSPC while save_pretrained writes the export (an OSError, or safetensors' own error): one UserError naming
    the file, the space the export needs and the space free; the half-written final/ is removed (the export is
    written in place: an earlier final/ there was unpublished and removed first, never mixed with the new files)."""
    import errno
    import os
    import shutil

    import torch

    from ftcli.config.recipe import load_recipe
    from ftcli.model.build import build_empty_model, load_model
    from ftcli.train.checkpoint import save_hf_checkpoint

    recipe = load_recipe("tiny-qwen-cpu")
    model = load_model(recipe.model, dtype=torch.float32)
    out = tmp_path / "final"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier export")

    def full_disk(self, save_directory, **kwargs):
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        (Path(save_directory) / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(save_directory) / "model.safetensors"))

    monkeypatch.setattr(type(model), "save_pretrained", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2**30, used=2**30, free=3 * 2**19))
    tokenizer = SimpleNamespace(save_pretrained=lambda d: pytest.fail("the tokenizer is written after the weights"))
    with pytest.raises(UserError) as err:
        save_hf_checkpoint(model, lambda: build_empty_model(recipe.model, torch.float32), tokenizer, out, torch.float32)
    needed = sum(t.numel() * 4 for t in model.state_dict().values()) / 2**20
    assert str(err.value) == (
        f"the Hugging Face export to {out} could not be written: No space left on device "
        f"({out / 'model.safetensors'}) [errno 28]; it needs about {needed:,.1f} MiB, 1.5 MiB are "
        "free there: free space; nothing half-written is left in its place")
    assert list(tmp_path.iterdir()) == []  # no partial final/, no .tmp_final

    from safetensors import SafetensorError

    def safetensors_full(self, save_directory, **kwargs):  # how safetensors says it (not an OSError)
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(type(model), "save_pretrained", safetensors_full)
    with pytest.raises(UserError) as err:
        save_hf_checkpoint(model, lambda: build_empty_model(recipe.model, torch.float32), tokenizer, out, torch.float32)
    assert str(err.value) == (
        f"the Hugging Face export to {out} could not be written: Error while serializing: I/O error: No space left "
        f"on device (os error 28); it needs about {needed:,.1f} MiB, 1.5 MiB are free there: free space; nothing "
        "half-written is left in its place")
    assert list(tmp_path.iterdir()) == []


def test_the_hf_export_is_written_in_place_and_published_by_its_record(tmp_path, one_rank, renames):
    """The export renames only its small record (ftcli_export.json: "incomplete" first, the file list last); an
    earlier export at that path is unpublished before its files go; a reader (`locate`) refuses an export whose
    record says incomplete or whose file has another size, and reads a dir without a record as before."""
    import json as json_

    import torch

    from ftcli.artifacts.publish import EXPORT_RECORD
    from ftcli.artifacts.resolve import locate
    from ftcli.config.recipe import load_recipe
    from ftcli.model.build import build_empty_model, load_model
    from ftcli.data.chat import load_tokenizer
    from ftcli.train.checkpoint import save_hf_checkpoint

    recipe = load_recipe("tiny-qwen-cpu")
    model = load_model(recipe.model, dtype=torch.float32)
    out = tmp_path / "final"
    out.mkdir()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"an earlier export's shard")
    moved = renames
    moved.clear()
    save_hf_checkpoint(model, lambda: build_empty_model(recipe.model, torch.float32), load_tokenizer(recipe),
                       out, torch.float32)
    assert {name for name, _ in moved} == {EXPORT_RECORD}
    assert sum(n for _, n in moved) < 4096
    record = json_.loads((out / EXPORT_RECORD).read_text())
    assert record["complete"] is True and "model-00009-of-00009.safetensors" not in record["files"]
    assert record["files"]["model.safetensors"] == (out / "model.safetensors").stat().st_size
    assert sorted(record["files"]) == sorted(p.name for p in out.iterdir() if p.name != EXPORT_RECORD)
    assert locate(out).model_dir == out

    (out / "config.json").write_text((out / "config.json").read_text() + " ")
    with pytest.raises(UserError, match=rf"^{out} is not a whole model export: config.json has \d+ bytes, the "
                                        r"export wrote \d+; export it again"):
        locate(out)
    (out / EXPORT_RECORD).write_text(json_.dumps({"complete": False}))
    with pytest.raises(UserError, match="says the export is incomplete"):
        locate(out)
    (out / EXPORT_RECORD).unlink()  # an older ftcli's export, or a model from elsewhere
    assert locate(out).kind == "checkpoint"


def test_a_damaged_lora_checkpoint_file_is_one_line_naming_it_and_the_intact_one(tmp_path, capsys):
    """A LoRA (TRL) checkpoint-N carries each file's size and CRC32s (record_trl_checksums, written after the
    save); the launcher's resume check (`check_resume`) names the first damaged file and the newest earlier
    checkpoint that verifies. A checkpoint without checksums (an older ftcli) resumes with a warning."""
    from ftcli.config.recipe import load_recipe
    from ftcli.train.checkpoint import TRL_CHECKSUMS, record_trl_checksums
    from ftcli.train.launch import check_resume

    root = tmp_path / "run" / "checkpoints"
    older, newer = _trl(root, 2), _trl(root, 4)
    for ckpt in (older, newer):
        (ckpt / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 64)
        (ckpt / "optimizer_0").mkdir()
        (ckpt / "optimizer_0" / "__0_0.distcp").write_bytes(b"shard" * 100)  # accelerate's FSDP layout: a subdir
        record_trl_checksums(ckpt)
    recorded = json.loads((newer / TRL_CHECKSUMS).read_text())["files"]
    assert sorted(recorded) == ["adapter_model.safetensors", "optimizer_0/__0_0.distcp", "trainer_state.json"]
    recipe = load_recipe("tiny-gpt-oss-cpu", [f"output.dir={tmp_path / 'run'}"])
    check_resume(recipe, tmp_path / "run", "latest", world_size=1)  # intact: nothing said
    assert capsys.readouterr().err == ""

    damaged = bytearray((newer / "optimizer_0" / "__0_0.distcp").read_bytes())
    damaged[7] ^= 0xFF  # one flipped byte, the size unchanged
    (newer / "optimizer_0" / "__0_0.distcp").write_bytes(bytes(damaged))
    with pytest.raises(UserError) as err:
        check_resume(recipe, tmp_path / "run", "latest", world_size=1)
    assert str(err.value) == (
        f"checkpoint {newer}: optimizer_0/__0_0.distcp does not match the checksum taken at save (damaged since); "
        f"the previous intact checkpoint is {older} (resume from it with --resume {older})")
    check_resume(recipe, tmp_path / "run", str(older), world_size=1)

    (older / TRL_CHECKSUMS).unlink()
    check_resume(recipe, tmp_path / "run", str(older), world_size=1)
    assert capsys.readouterr().err == (f"warning: checkpoint {older} has no checksums (saved by an older ftcli); "
                                       "resuming from it unverified\n")


def test_a_lora_save_that_a_full_disk_stops_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    """An error out of TRL's save of checkpoint-N (no checksums yet: they are recorded after the save; an OSError,
    or torch.save's RuntimeError) is one line naming the step, the error, the space free and the last intact
    checkpoint, and the half-written checkpoint-N is removed; an error while checkpoint-N is complete (checksums
    recorded), absent, or the checkpoint the run resumed from, is not the save's (and nothing is removed)."""
    import errno
    import re
    import shutil

    from ftcli.train.checkpoint import record_trl_checksums, trl_save_failed

    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    intact, partial = _trl(root, 2), _trl(root, 4)
    record_trl_checksums(intact)
    (partial / "adapter_model.safetensors").write_bytes(b"half")
    full = OSError(errno.ENOSPC, "No space left on device", str(partial / "optimizer.pt"))
    not_saved = trl_save_failed(root, 4, full, run_dir)
    free = f"{shutil.disk_usage(root).free / 2**20:,.1f} MiB free there"
    assert re.fullmatch(re.escape(
        f"the checkpoint of step 4 could not be saved: No space left on device ({partial / 'optimizer.pt'}) "
        f"[errno 28] (") + r"[\d,.]+" + re.escape(f" MiB free there); the last good checkpoint, step 2 ({intact}), "
        f"is intact: free space, then resume with `ftcli train --recipe {run_dir / 'recipe.yaml'} --resume`"),
        str(not_saved)), (str(not_saved), free)
    assert not partial.exists() and intact.is_dir()
    assert trl_save_failed(root, 4, full, run_dir) is None  # nothing of step 4 left: not the save's error
    assert trl_save_failed(root, 2, full, run_dir) is None  # complete, with its checksums
    resumed = _trl(root, 6)  # an older ftcli's checkpoint (no checksums) that the run resumed from
    assert trl_save_failed(root, 6, RuntimeError("bad"), run_dir, resumed) is None and resumed.is_dir()
    only = _trl(tmp_path / "fresh" / "checkpoints", 3)
    torch_full = RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                              "data/0: file write failed")
    assert str(trl_save_failed(only.parent, 3, torch_full, tmp_path / "fresh")).endswith(
        f"there is no earlier checkpoint: free space, then start again with "
        f"`ftcli train --recipe {tmp_path / 'fresh' / 'recipe.yaml'} --force`")
