"""ftcli.train.export: which model the run session puts in final/ and best/, and that the best -> final path of
both trainers renames no export dir (only the small ftcli_export.json record), so a kill mid-export leaves a
final/ that `locate` refuses and nothing is deleted before every check passed."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from ftcli.artifacts.publish import EXPORT_RECORD, begin_export, publish_export
from ftcli.config.errors import TrainingStopped, UserError
from ftcli.train.export import export_models


def test_which_model_goes_where(tmp_path):
    """The table of ftcli.train.export: the exports each case calls, in order, and run.json's best_model_dir."""
    calls = []

    def run(best_step, last_step, export):
        calls.clear()
        where = export_models(tmp_path, best_step, last_step, export,
                              export_last=lambda out: calls.append(("last", out.name)),
                              export_best=lambda out: calls.append(("best", out.name)))
        return where, list(calls)

    assert run(None, 8, "best") == (None, [("last", "final")])
    assert run(None, 8, None) == (None, [("last", "final")])
    assert run(8, 8, "best") == ("final", [("last", "final")])
    assert run(8, 8, "last") == ("final", [("last", "final")])
    assert run(3, 8, "best") == ("final", [("best", "final")])  # the last model is not written
    assert run(3, 8, "last") == ("best", [("last", "final"), ("best", "best")])


# ------------------------------------------------------------------------------------ the full loop
def test_full_best_to_final_renames_only_the_export_records(tmp_path, one_rank, renames):
    """The full loop's plug (export_hf, best_from_checkpoint): export=best writes the best checkpoint's weights into
    final/, export=last the last weights into final/ and the best's into best/; the only renamed file is each
    export's ftcli_export.json (twice per export: "incomplete", then the file list), whatever the model's size."""
    import torch
    from safetensors.torch import load_file

    from ftcli.artifacts.resolve import locate
    from ftcli.config.recipe import load_recipe
    from ftcli.data.chat import load_tokenizer
    from ftcli.model.build import load_model
    from ftcli.train.checkpoint import rng_state, save_checkpoint
    from ftcli.train.export import best_from_checkpoint
    from ftcli.train.full import export_hf

    recipe = load_recipe("tiny-qwen-cpu")
    torch.manual_seed(0)
    model = load_model(recipe.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    optimizer.step()
    best_state = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = save_checkpoint(tmp_path / "checkpoints", 3, model, optimizer,
                           {"scheduler": {}, "data": {}, "rng": rng_state()}, {"result": {}}, keep_last=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)  # the last model differs from the best everywhere
    last_state = {k: v.clone() for k, v in model.state_dict().items()}
    export = export_hf(model, recipe.model, load_tokenizer(recipe.model, recipe.data))

    def weights(model_dir):
        exported = load_file(model_dir / "model.safetensors")
        assert exported and exported.keys() <= best_state.keys()
        return exported

    for mode, where, exports in (("last", "best", 2), ("best", "final", 1)):
        run = tmp_path / mode
        renames.clear()
        assert export_models(run, 3, 8, mode, export_last=export,
                             export_best=best_from_checkpoint(ckpt, model, export)) == where
        assert {name for name, _ in renames} == {EXPORT_RECORD} and len(renames) == 2 * exports
        assert sum(n for _, n in renames) < 4096 * exports
        final = weights(run / "final")
        expected = best_state if mode == "best" else last_state
        assert all(torch.equal(final[k], expected[k]) for k in final), mode
        assert locate(run / "final").model_dir == run / "final"
        if mode == "last":
            best = weights(run / "best")
            assert all(torch.equal(best[k], best_state[k]) for k in best)
        else:
            assert not (run / "best").exists()
    model_bytes = (tmp_path / "best" / "final" / "model.safetensors").stat().st_size
    assert model_bytes > 100 * 4096  # what a renamed export dir would have moved, at the least


# ------------------------------------------------------------------------------------------- LoRA
def _adapter(out: Path, fill: int, size: int = 300_000) -> None:
    """A published adapter dir like EvalCallback.save_best writes (its files stand in for PEFT's)."""
    begin_export(out)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "fill": fill}))
    (out / "adapter_model.safetensors").write_bytes(bytes([fill]) * size)
    publish_export(out)


def _lora_exports(run_dir: Path, best_step: int, last_step: int, export: str, last_calls: list):
    """export_models as the LoRA trainer's session calls it (the best adapter kept in best/, main process, no
    process group); export_last writes a stand-in for the last adapter."""
    def export_last(out_dir):
        last_calls.append(out_dir.name)
        _adapter(out_dir, 1)

    return export_models(run_dir, best_step, last_step, export, export_last=export_last, what="adapter")


def test_lora_best_to_final_is_a_published_copy_that_renames_only_its_record(tmp_path, renames):
    """export=best, best eval before the last step: final/ is written once, a copy of best/ published in place (the
    last adapter is not saved), then best/ goes; renamed: ftcli_export.json twice (< 4 KiB), where the rename of
    best/ to final/ (with the last adapter moved aside first) moved both adapters' bytes. export=last keeps best/."""
    from ftcli.artifacts.resolve import locate

    run = tmp_path / "run"
    _adapter(run / "best", 2)
    best_files = {p.name: p.read_bytes() for p in (run / "best").iterdir() if p.name != EXPORT_RECORD}
    renames.clear()
    last_calls = []
    assert _lora_exports(run, 2, 4, "best", last_calls) == "final"
    assert last_calls == []
    assert [name for name, _ in renames] == [EXPORT_RECORD, EXPORT_RECORD] and sum(n for _, n in renames) < 4096
    assert {p.name: p.read_bytes() for p in (run / "final").iterdir() if p.name != EXPORT_RECORD} == best_files
    assert locate(run / "final").kind == "adapter"
    assert sorted(p.name for p in run.iterdir()) == ["final"]  # best/ goes once final/ is published

    other = tmp_path / "other"
    _adapter(other / "best", 2)
    renames.clear()
    assert _lora_exports(other, 2, 4, "last", last_calls) == "best"
    assert last_calls == ["final"] and {name for name, _ in renames} == {EXPORT_RECORD}
    assert (other / "best" / "adapter_model.safetensors").read_bytes() == best_files["adapter_model.safetensors"]


def test_a_kill_mid_copy_leaves_a_final_that_locate_refuses_and_best_intact(tmp_path, monkeypatch):
    from ftcli.artifacts.resolve import locate

    run = tmp_path / "run"
    _adapter(run / "best", 2)
    before = {p.name: p.read_bytes() for p in (run / "best").iterdir()}
    real = shutil.copyfile
    copied = []

    class Killed(BaseException):
        pass

    def killed_after_one(src, dst, *args, **kwargs):
        if copied:
            raise Killed  # SIGKILL: nothing after this line runs
        copied.append(real(src, dst, *args, **kwargs))

    monkeypatch.setattr(shutil, "copyfile", killed_after_one)
    with pytest.raises(Killed):
        _lora_exports(run, 2, 4, "best", [])
    assert len(copied) == 1 and (run / "final" / EXPORT_RECORD).is_file()
    with pytest.raises(UserError, match="says the export is incomplete"):
        locate(run / "final")
    assert {p.name: p.read_bytes() for p in (run / "best").iterdir()} == before

    def disk_full(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(shutil, "copyfile", disk_full)  # a full disk: one line, no partial final/, best/ kept
    with pytest.raises(UserError, match=rf"^the best adapter to {run / 'final'} could not be written: No space left "
                                        r"on device .*; nothing half-written is left in its place$"):
        _lora_exports(run, 2, 4, "best", [])
    assert not (run / "final").exists()
    assert {p.name: p.read_bytes() for p in (run / "best").iterdir()} == before


def test_lora_export_best_without_a_whole_best_keeps_the_last_adapter_in_one_line(tmp_path):
    """best/ missing (removed by hand before a resume), or not whole: final/ gets the last adapter, the error is one
    line on every rank (TrainingStopped: rank 0 reports it), and best/ is left as it was. best/ a link: refused
    before anything of final/ is written."""
    run = tmp_path / "run"
    last_calls = []
    with pytest.raises(TrainingStopped) as err:
        _lora_exports(run, 2, 4, "best", last_calls)
    assert str(err.value) == (f"export: best needs the best eval's adapter in {run / 'best'}, which is missing; the "
                              f"last adapter stays in {run / 'final'}")
    assert last_calls == ["final"] and (run / "final" / "adapter_model.safetensors").read_bytes()[:1] == b"\x01"

    _adapter(run / "best", 2)
    (run / "best" / "adapter_model.safetensors").write_bytes(b"cut short")
    with pytest.raises(TrainingStopped, match=r"which is not whole \(adapter_model.safetensors has 9 bytes, the "
                                              r"export wrote 300000\); the last adapter stays in "):
        _lora_exports(run, 2, 4, "best", last_calls)
    assert (run / "best" / "adapter_model.safetensors").read_bytes() == b"cut short"

    victim = tmp_path / "victim"
    _adapter(victim, 3)
    shutil.rmtree(run / "best")
    (run / "best").symlink_to(victim)
    final_before = (run / "final" / EXPORT_RECORD).read_text()
    with pytest.raises(UserError, match=rf"^{run / 'best'} is a symbolic link \(to {victim}\); ftcli does not write"):
        _lora_exports(run, 2, 4, "best", [])
    assert (run / "final" / EXPORT_RECORD).read_text() == final_before and (victim / EXPORT_RECORD).is_file()
