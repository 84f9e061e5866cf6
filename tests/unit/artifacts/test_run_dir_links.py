"""Nothing outside the run dir is touched: a link planted in a run dir (the lock file, metrics.jsonl,
run.json, a temp file) is refused in one line or replaced, never written through; a failed start leaves
no directory it created; a dangling link on the way to output.dir is refused."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from _run_common import train_args
from ftcli.config.errors import UserError

VICTIM_TEXT = "precious notes, 41 bytes long, keep them\n"
STEP = {"step": 1, "loss": 1.0, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 10.0, "tokens_per_s_per_device": 5.0,
        "mfu": None, "peak_mem": 1.0, "peak_mem_reserved": None, "mem_unit": "GiB", "s_per_step": 0.1}


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    return victim


def _train(run_dir, *extra):
    from ftcli import cli

    return CliRunner().invoke(cli.app, [*train_args(run_dir, "tracking.enabled=false"), *extra])


@pytest.mark.parametrize("dangling", [False, True])
def test_planted_lock_symlink_is_refused_and_its_target_untouched(tmp_path, dangling):
    shared = tmp_path / "shared"
    shared.mkdir()
    target = tmp_path / "nothing-here" if dangling else _victim(tmp_path)
    (shared / ".ftcli.lock").symlink_to(target)
    res = _train(shared)
    assert res.exit_code == 2
    assert " ".join(res.output.split()) == (
        f"error: {shared / '.ftcli.lock'} is a symbolic link (to {target}); ftcli does not write through links "
        "in a run dir: remove it")
    if dangling:
        assert not os.path.lexists(target)
    else:
        assert target.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in shared.iterdir()) == [".ftcli.lock"]


def test_a_dir_holding_only_a_planted_lock_link_is_not_empty(tmp_path):
    from ftcli.artifacts.rundir import check_run_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / ".ftcli.lock").symlink_to(_victim(tmp_path))
    with pytest.raises(UserError, match=r"holds files that are not an ftcli run \(\.ftcli\.lock\)"):
        check_run_dir("tiny-qwen-cpu", shared)
    (shared / ".ftcli.lock").unlink()
    (shared / ".ftcli.lock").write_text("123\n")  # a regular lock file a failed start left: still empty
    assert check_run_dir("tiny-qwen-cpu", shared) == shared


def test_lock_file_with_foreign_text_or_hard_links_is_never_truncated(tmp_path):
    from ftcli.config.recipe import load_recipe
    from ftcli.train.launch import run_dir_lock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = load_recipe("tiny-qwen-cpu", [f"output.dir={run_dir}"])
    (run_dir / ".ftcli.lock").write_text("not a pid\n")
    with pytest.raises(UserError, match="is not an ftcli lock file"):
        with run_dir_lock(recipe, resume=None, force=False):
            pass
    assert (run_dir / ".ftcli.lock").read_text() == "not a pid\n"

    (run_dir / ".ftcli.lock").unlink()
    victim = _victim(tmp_path)
    os.link(victim, run_dir / ".ftcli.lock")
    with pytest.raises(UserError, match="has 1 other hard link"):
        with run_dir_lock(recipe, resume=None, force=False):
            pass
    assert victim.read_text() == VICTIM_TEXT

    (run_dir / ".ftcli.lock").unlink()
    (run_dir / ".ftcli.lock").write_text("4242\n")  # an earlier start's: ours to reuse
    with run_dir_lock(recipe, resume=None, force=False):
        assert (run_dir / ".ftcli.lock").read_text() == f"{os.getpid()}\n"


@pytest.mark.parametrize("dangling", [False, True])
def test_run_files_refuse_links_and_leave_their_targets(tmp_path, dangling):
    """metrics.jsonl (appended), run.json (replaced), samples.jsonl: a link in their place is one UserError;
    a link planted as write_atomic's temp file is removed, not followed."""
    from ftcli.artifacts.rundir import RunRecord, write_run_record
    from ftcli.config.safe_files import write_atomic
    from ftcli.train.metrics import log_step

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = tmp_path / "nothing-here" if dangling else _victim(tmp_path)
    for name in ("metrics.jsonl", "run.json"):
        (run_dir / name).symlink_to(target)
    with pytest.raises(UserError) as err:
        log_step(STEP, 1, say=lambda s: None, metrics_path=run_dir / "metrics.jsonl")
    assert str(err.value).startswith(f"{run_dir / 'metrics.jsonl'} is a symbolic link (to {target})")
    with pytest.raises(UserError, match="is a symbolic link"):
        write_run_record(run_dir, RunRecord(method="full"))
    assert not os.path.lexists(target) if dangling else target.read_text() == VICTIM_TEXT

    (run_dir / ".tracking.json.tmp").symlink_to(target)
    write_atomic(run_dir / "tracking.json", "{}\n")
    assert (run_dir / "tracking.json").read_text() == "{}\n" and not (run_dir / "tracking.json").is_symlink()
    assert not os.path.lexists(run_dir / ".tracking.json.tmp")
    assert not os.path.lexists(target) if dangling else target.read_text() == VICTIM_TEXT


def test_failed_start_leaves_no_parent_it_created(tmp_path, monkeypatch):
    """output.dir=p/q/r and a start that fails after the lock (here: the data is missing): p is gone."""
    monkeypatch.chdir(tmp_path)
    res = _train("p/q/r", "--set", "data.path=/nonexistent.jsonl")
    assert res.exit_code == 2 and res.output.strip() == "error: data.path '/nonexistent.jsonl' does not exist"
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    (tmp_path / "p").mkdir()  # an existing parent stays, only what this start made goes
    res = _train("p/q/r", "--set", "data.path=/nonexistent.jsonl")
    assert res.exit_code == 2 and sorted(p.name for p in tmp_path.rglob("*")) == ["p"]


def test_output_dir_through_a_dangling_link_is_refused(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone" / "deeper")
    res = _train(link / "q" / "r")
    assert res.exit_code == 2
    assert " ".join(res.output.split()) == (
        f"error: output dir {link / 'q' / 'r'}: {link} is a symlink to {tmp_path / 'gone' / 'deeper'}, which does "
        "not exist; ftcli does not create directories through it: set output.dir elsewhere")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


# ------------------------------------------------------- links planted where a run writes, renames or deletes
def _finished_run(tmp_path):
    """A finished ftcli run dir of tiny-qwen-cpu (its marker, recipe, run.json, a checkpoint, final/)."""
    import json

    from ftcli.artifacts.rundir import prepare_run_dir
    from ftcli.config.recipe import load_recipe

    run_dir = tmp_path / "run"
    prepare_run_dir(load_recipe("tiny-qwen-cpu", [f"output.dir={run_dir}"]))
    (run_dir / "run.json").write_text(json.dumps({"method": "full", "status": "completed", "steps": 3}))
    (run_dir / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000003" / "meta.json").write_text("{}")
    (run_dir / "final").mkdir()
    (run_dir / "final" / "config.json").write_text("{}")
    return run_dir


def _tree(root):
    return sorted((str(p.relative_to(root)), p.is_symlink()) for p in root.rglob("*"))


@pytest.mark.parametrize("planted", [".tmp_final", "base", "checkpoints", "final", "best", ".tmp_best",
                                     "checkpoints/.tmp_step_00000006", "checkpoints/step_00000006", "run.json"])
@pytest.mark.parametrize("how", [["--force"], ["--resume", "latest"]], ids=["force", "resume"])
def test_a_link_where_a_run_writes_is_refused_before_anything_happens(tmp_path, planted, how):
    """The run dir of a finished run with a link planted where train writes, renames or deletes (the temp
    export dirs, LoRA's random-init base, checkpoints/, final/, best/, a checkpoint's dir or its temp dir):
    `train --force` and `train --resume` are one line naming the link; the victim and the run dir stay
    exactly as they were (no checkpoint of another run deleted, nothing written into the victim)."""
    run_dir = _finished_run(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.json").write_text("VICTIM\n")
    (victim / "step_00000001").mkdir()  # another run's checkpoints, if the link stands for checkpoints/
    target = victim / "config.json" if planted == "run.json" else victim
    path = run_dir / planted
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    path.symlink_to(target)
    before, victim_before = _tree(run_dir), _tree(victim)
    res = _train(run_dir, "--set", "training.max_steps=6", *how)
    assert res.exit_code == 2, res.output
    assert " ".join(res.output.split()) == (
        f"error: {path} is a symbolic link (to {target}); ftcli does not write, rename or delete through links in "
        "a run dir: remove it")
    assert _tree(run_dir) == before and _tree(victim) == victim_before
    assert (victim / "config.json").read_text() == "VICTIM\n"


def test_a_hard_linked_run_file_is_refused_before_anything_happens(tmp_path):
    run_dir = _finished_run(tmp_path)
    victim = _victim(tmp_path)
    os.link(victim, run_dir / "metrics.jsonl")
    res = _train(run_dir, "--force")
    assert res.exit_code == 2 and " ".join(res.output.split()) == (
        f"error: {run_dir / 'metrics.jsonl'} has 1 other hard link(s); ftcli does not write, delete or upload a file shared "
        "with another path in a run dir: remove it")
    assert victim.read_text() == VICTIM_TEXT and (run_dir / "metrics.jsonl").exists()


def test_removing_and_replacing_never_follow_a_link(tmp_path):
    """What every writer uses when a link turns up after the launcher's check: remove_tree unlinks a link
    (dangling or not) and leaves its target; replace_dir puts the new dir in place of a link, never into it,
    and refuses a temp dir that is a link."""
    from ftcli.config.safe_files import remove_tree, replace_dir

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    link = tmp_path / ".tmp_final"
    link.symlink_to(victim)
    remove_tree(link)
    assert not os.path.lexists(link) and (victim / "keep.txt").read_text() == "keep"

    tree = tmp_path / "tree"  # a real dir holding a link: the link goes, its target stays
    tree.mkdir()
    (tree / "inner").symlink_to(victim)
    remove_tree(tree)
    assert not tree.exists() and (victim / "keep.txt").read_text() == "keep"

    final, tmp = tmp_path / "final", tmp_path / ".tmp_new"
    final.symlink_to(victim)
    tmp.mkdir()
    (tmp / "config.json").write_text("new")
    replace_dir(tmp, final)
    assert not final.is_symlink() and (final / "config.json").read_text() == "new"
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]

    tmp.symlink_to(victim)
    with pytest.raises(UserError, match=r"\.tmp_new is a symbolic link"):
        replace_dir(tmp, final)
    assert (final / "config.json").read_text() == "new" and sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
