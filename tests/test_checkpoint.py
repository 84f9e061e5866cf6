"""ftcli.train.checkpoint without torch.distributed: which checkpoint --resume means, and when to save."""

from __future__ import annotations

import json
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
    checkpoint dir -> itself. An unfinished save (.tmp_ dir, no meta.json) is never picked."""
    from ftcli.train.checkpoint import resolve_resume

    for kind, make in (("dcp", _dcp), ("trl", _trl)):
        run = tmp_path / kind
        root = run / "checkpoints"
        older, newer = make(root, 2), make(root, 10)
        (root / ".tmp_step_00000012").mkdir()
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
