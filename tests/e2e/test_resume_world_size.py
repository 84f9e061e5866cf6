"""A full-path checkpoint written by N ranks resumes on M (ftcli.train.checkpoint: DCP reshards the model and
optimizer; the data position is global blocks consumed, ftcli.data.BlockStream).

The comparison: the same global batch, i.e. ranks x training.grad_accum blocks per optimizer step (2 x 1
and 1 x 2), so every optimizer step trains the same blocks as the uninterrupted 2-rank run. Then
  * the blocks of every step are exactly the uninterrupted run's (each block once overall);
  * lr, trained and seen tokens are equal, losses within rel 1e-5 and grad norms within rel 1e-4 (fp32;
    only the order of the sums differs between layouts; measured: loss rel <= 1.8e-7, grad norm rel <= 1.1e-5,
    the bound test_train_full::test_loss_same_for_1_and_2_ranks uses for 1 vs 2 ranks).
Each leg but the last stops by SIGTERM to rank 0 only (tests/support/_preempt_worker.py): every rank stops there.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from _run_common import REPO, env, ftcli, metrics, output_tail, recipe_file, torchrun  # noqa: F401 (env: a fixture)

STEPS, STOP, STOP2 = 8, 4, 6
WORKER = REPO / "tests" / "support" / "_preempt_worker.py"
COMMON = [f"training.max_steps={STEPS}", "training.log_every=1", "tracking.enabled=false",
          "training.checkpoint.save_final_hf=false", "training.checkpoint.every_steps=100"]


def run_worker(tmp: Path, nproc: int, tag: str, run_dir: Path, grad_accum: int, *extra: str,
               env: dict) -> list[dict]:
    recipe = recipe_file(tmp / f"{tag}.yaml", f"output.dir={run_dir}", f"training.grad_accum={grad_accum}", *COMMON)
    res = torchrun(nproc, [str(tmp), tag, str(recipe), *extra], tmp, env, worker=WORKER)
    assert res.returncode == 0, output_tail(res)
    return [json.loads((tmp / f"{tag}_rank{r}.json").read_text()) for r in range(nproc)]


def blocks_per_step(ranks: list[dict], grad_accum: int, first_step: int) -> dict[int, list[int]]:
    """step -> the sorted packed-block indices every rank trained in it (padding blocks left out)."""
    out: dict[int, list[int]] = {}
    for r in ranks:
        for i, index in enumerate(r["blocks"]):
            if index >= 0:
                out.setdefault(first_step + i // grad_accum, []).append(index)
    return {step: sorted(v) for step, v in out.items()}


def numbers(run_dir: Path) -> list[dict]:
    return [{k: m[k] for k in ("step", "loss", "grad_norm", "lr", "tokens_trained", "tokens_seen")}
            for m in metrics(run_dir)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, env):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    ranks = run_worker(tmp, 2, "u", tmp / "run", 1, env=env)
    assert [r["steps"] for r in ranks] == [STEPS, STEPS]
    return {"blocks": blocks_per_step(ranks, 1, 1), "metrics": numbers(tmp / "run")}


def test_resume_on_another_world_size_trains_the_same_blocks_and_losses(uninterrupted, tmp_path, env):
    """One run on 2 ranks, stopped at step 4, resumed on 1 rank (2 -> 1), stopped at step 6, resumed on 2 ranks
    (1 -> 2) to the end: one launch per leg, each checkpoint written by one world size and read by the other."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    legs = []  # (ranks, grad_accum, first step, what each rank pulled)
    for tag, ranks, stop_at, first_step, extra in (("first", 2, STOP, 1, []),
                                                   ("second", 1, STOP2, STOP + 1, ["--resume", "latest"])):
        grad_accum = 2 // ranks  # 2 blocks per optimizer step in every layout
        pulled = run_worker(tmp_path, ranks, tag, run_dir, grad_accum, *extra,
                            "--sigterm-at-block", str((stop_at - first_step + 1) * grad_accum), env=env)
        assert [(r["stopped_at"], r["signal"]) for r in pulled] == [(stop_at, 15)] * ranks  # rank 0 got it; all stopped
        ckpt = ckpts / f"step_{stop_at:08d}"
        assert sorted(p.name for p in ckpts.iterdir())[-1] == ckpt.name
        meta = json.loads((ckpt / "meta.json").read_text())
        assert (meta["world_size"], meta["blocks_per_step"]) == (ranks, 2)
        assert sorted(p.name for p in ckpt.glob("rank_*.json")) == [f"rank_{r:05d}.json" for r in range(ranks)]
        legs.append((grad_accum, first_step, pulled))
        if tag == "first":
            branch_from_step_4_as_a_user_types_it(tmp_path, run_dir, uninterrupted, env)
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{STOP:08d}", f"step_{STOP2:08d}"]

    third = run_worker(tmp_path, 2, "third", run_dir, 1, "--resume", "latest", env=env)
    assert [r["steps"] for r in third] == [STEPS] * 2
    legs.append((1, STOP2 + 1, third))

    # the blocks: step by step the uninterrupted run's, so none repeated or skipped overall
    combined = {step: b for grad_accum, first_step, pulled in legs
                for step, b in blocks_per_step(pulled, grad_accum, first_step).items()}
    assert combined == uninterrupted["blocks"]
    assert sorted(combined) == list(range(1, STEPS + 1)) and all(len(b) == 2 for b in combined.values())
    overall = Counter(i for b in combined.values() for i in b)
    assert max(overall.values()) == 1 and len(overall) == 2 * STEPS

    # the trajectory: every step logged once, equal to the uninterrupted run within fp32 summation order
    got, want = numbers(run_dir), uninterrupted["metrics"]
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert (a["lr"], a["tokens_trained"], a["tokens_seen"]) == (b["lr"], b["tokens_trained"], b["tokens_seen"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert got[:STOP] == want[:STOP]  # the first leg is the uninterrupted run's layout: bit for bit


def branch_from_step_4_as_a_user_types_it(tmp_path: Path, run_dir: Path, uninterrupted: dict, env: dict) -> None:
    """The CLI leg (#47): `ftcli train --resume <run>/checkpoints/step_4` (2 ranks x grad_accum 1) into a new dir on 1
    process. Alone, `--set training.cpu_processes=1` is refused with the fix; with the grad_accum it proposes, the
    recipe is compared with the checkpoint's run recipe (only cpu_processes and grad_accum differ: applied), and
    steps 5..8 are the uninterrupted run's."""
    (run_dir / "recipe.yaml").write_text((tmp_path / "first.yaml").read_text())  # the recipe the checkpoint came from
    ckpt, branch = run_dir / "checkpoints" / f"step_{STOP:08d}", tmp_path / "branch"
    args = ["train", "--recipe", "tiny-qwen-cpu", "--resume", str(ckpt), "--set", f"output.dir={branch}",
            "--set", "training.cpu_processes=1"] + [a for s in COMMON for a in ("--set", s)]
    refused = ftcli(args, tmp_path, env)
    assert refused.returncode == 2 and " ".join(refused.stderr.split()) == (
        f"error: --resume: {ckpt} was trained with 2 blocks per optimizer step (2 ranks x training.grad_accum 1), "
        "this launch takes 1 (1 rank x 1); resuming on 1 rank: set training.grad_accum=2 to keep 2 blocks per step")
    res = ftcli([*args, "--set", "training.grad_accum=2"], tmp_path, env)
    assert res.returncode == 0, output_tail(res)
    assert "warning: resuming with changed training.cpu_processes, training.grad_accum (applied from here on)" in \
        res.stderr
    got, want = numbers(branch), uninterrupted["metrics"][STOP:]
    assert [m["step"] for m in got] == list(range(STOP + 1, STEPS + 1))
    for a, b in zip(got, want):
        assert (a["lr"], a["tokens_trained"], a["tokens_seen"]) == (b["lr"], b["tokens_trained"], b["tokens_seen"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    (run_dir / "recipe.yaml").unlink()
