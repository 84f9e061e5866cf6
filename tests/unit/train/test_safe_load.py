"""Loading a checkpoint runs no code from it: ftcli's own trainer state is JSON + safetensors, DCP's
pickled metadata and non-tensor items pass an allowlist / weights_only=True first. A crafted pickle
(whose __reduce__ would write a file) is one UserError naming the file, and the file never appears."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from ftcli.config.errors import UserError


class Payload:
    """Unpickling this runs `exec(code)`: it writes `marker`."""

    def __init__(self, marker):
        self.code = f"open({str(marker)!r}, 'w').write('pwned')"

    def __reduce__(self):
        return exec, (self.code,)


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _load_error(path) -> str:
    """The one-line UserError `load_checkpoint(path)` into a fresh model and optimizer raises."""
    from ftcli.train.checkpoint import load_checkpoint

    model, optimizer = _model_and_optimizer()
    with pytest.raises(Exception) as err:
        load_checkpoint(path, model, optimizer)
    assert isinstance(err.value, UserError), repr(err.value)[:500]
    return str(err.value)


def _save(root, step=1, param_groups_extra=None):
    from ftcli.train.checkpoint import rng_state, save_checkpoint

    model, optimizer = _model_and_optimizer()
    if param_groups_extra:
        optimizer.param_groups[0].update(param_groups_extra)
    state = {"scheduler": {"last_epoch": 3, "base_lrs": [1e-3], "_last_lr": [0.25]}, "data": {"consumed": 7},
             "rng": rng_state()}
    path = save_checkpoint(root, step, model, optimizer, state, {"result": {}}, keep_last=3)
    return path, model, optimizer, state


def test_payload_runs_under_plain_pickle(tmp_path):
    """The test's payload is live: plain pickle (what torch.load(weights_only=False) and DCP's
    metadata reader use) executes it."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.read_text() == "pwned"


def test_trainer_state_round_trips_through_json_and_safetensors(tmp_path, one_rank):
    from ftcli.train.checkpoint import load_checkpoint, set_rng_state

    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path, model, optimizer, saved = _save(tmp_path / "ckpts")
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata", "__0_0.distcp", "meta.json", "rank_00000.json", "rank_00000.safetensors"]
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    fresh, fresh_opt = _model_and_optimizer(seed=1)
    state, meta = load_checkpoint(path, fresh, fresh_opt)
    assert meta["step"] == 1 and meta["world_size"] == 1
    assert state["scheduler"] == saved["scheduler"] and state["data"] == {"consumed": 7}
    assert isinstance(state["rng"]["python"], tuple) and state["rng"]["python"] == saved["rng"]["python"]
    assert state["rng"]["numpy"][1].dtype == np.uint32
    assert torch.equal(state["rng"]["torch"], saved["rng"]["torch"])
    set_rng_state(state["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected  # exactly the same draws
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])


def test_crafted_legacy_rank_pt_is_one_line_and_never_runs(tmp_path, one_rank):
    """An older ftcli wrote rank_XXXXX.pt (a pickle): a plain one loads (weights_only=True, numpy RNG
    allowed); a crafted one is refused."""
    from ftcli.train.checkpoint import read_rank_state

    path, _, _, saved = _save(tmp_path / "ckpts")
    (path / "rank_00000.json").unlink()
    (path / "rank_00000.safetensors").unlink()
    torch.save(saved, path / "rank_00000.pt")  # what an older ftcli wrote
    legacy = read_rank_state(path, 0)
    assert legacy["rng"]["python"] == saved["rng"]["python"] and legacy["data"] == {"consumed": 7}

    marker = tmp_path / "ran"
    torch.save({"scheduler": Payload(marker)}, path / "rank_00000.pt")
    assert _load_error(path) == (f"checkpoint {path}: rank_00000.pt holds more than tensors and plain data, so ftcli "
                                 "does not load it (loading could run code: Unsupported global: GLOBAL exec)")
    assert not marker.exists()


def test_crafted_dcp_metadata_is_one_line_and_never_runs(tmp_path, one_rank):
    from ftcli.train.checkpoint import check_dcp_metadata

    path, _, _, _ = _save(tmp_path / "ckpts")
    check_dcp_metadata(path)  # what DCP wrote passes the allowlist
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    assert _load_error(path) == (f"checkpoint {path}: .metadata is not DCP metadata ftcli can load safely "
                                 "(builtins.exec is not allowed in DCP metadata); resume from another checkpoint")
    assert not marker.exists()
    (path / ".metadata").write_bytes(b"\x80\x04not a pickle")
    assert _load_error(path).startswith(f"checkpoint {path}: .metadata is not DCP metadata ftcli can load safely (")


def test_crafted_dcp_item_is_one_line_and_never_runs(tmp_path, one_rank):
    """DCP stores non-tensor values (optimizer hyperparameters) as pickles and its default planner loads
    them with weights_only=False; ftcli's planner refuses one that is more than plain data."""
    marker = tmp_path / "ran"
    path, _, _, _ = _save(tmp_path / "ckpts", param_groups_extra={"lr": Payload(marker)})
    assert not marker.exists()  # saving pickles it, nothing runs
    error = _load_error(path)
    assert not marker.exists()
    assert error == (f"checkpoint {path}: item optim.param_groups.0.lr holds more than plain data, so ftcli "
                     "does not load it (loading could run code: Unsupported global: GLOBAL exec)")
