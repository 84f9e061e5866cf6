"""`ftcli train` with a preference objective (the full FSDP2 loop, CPU, gloo): the tiny DPO recipe end to end,
2 ranks x 2 micro-batches == 1 rank x 4 == one context-parallel group of 2 ranks step by step, the precomputed
reference == the live one, and a resume (of the precomputed run: its reference store read again, no reference forward)
that continues the uninterrupted run exactly."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from _run_common import env, ftcli, metrics, output_tail  # noqa: F401 (env: a fixture)

STEPS = 4
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def _args(run_dir, *sets):
    args = ["train", "--recipe", "tiny-dpo-cpu", "--set", f"output.dir={run_dir}"]
    for s in (f"training.max_steps={STEPS}", "training.log_every=1", "eval.every_steps=2", *sets):
        args += ["--set", s]
    return args


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, env):  # noqa: F811
    """2 processes x grad_accum 2, checkpoints at steps 2 and 4."""
    cwd = tmp_path_factory.mktemp("dpo")
    res = ftcli(_args(cwd / "run", "training.checkpoint.every_steps=2"), cwd, env)
    assert res.returncode == 0, output_tail(res)
    return {"cwd": cwd, "run_dir": cwd / "run", "stdout": res.stdout + res.stderr}


def test_dpo_recipe_trains_end_to_end_with_trl_metrics(dpo_run):
    run_dir = dpo_run["run_dir"]
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=2e-3)  # policy == reference at step 1: -logsigmoid(0)
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    for m in steps:
        assert set(METRICS) <= set(m) and 0.0 <= m["rewards/accuracies"] <= 1.0
        assert m["logps/chosen"] < 0 and m["logps/rejected"] < 0
    evals = [m for m in steps if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2, 4] and all(m["eval_tokens"] > 0 for m in evals)  # eval pairs
    assert all(0.0 <= m["eval_rewards/accuracies"] <= 1.0 for m in evals)
    summary = json.loads((run_dir / "run.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert "DPO reference: a frozen copy of the starting model" in dpo_run["stdout"]
    assert " | acc " in dpo_run["stdout"] and "format preference" in dpo_run["stdout"]
    assert (run_dir / "final" / "config.json").is_file()

    # the next run can start from this one: model.id = the run dir means the model it wrote (its final/)
    from ftcli.config.recipe import load_recipe
    from ftcli.train.launch import starting_model

    nxt = starting_model(load_recipe("tiny-dpo-cpu", ["model.init=pretrained", f"model.id={run_dir}"]))
    assert nxt.model.id == str((run_dir / "final").resolve())


def test_dpo_loss_same_for_1_and_2_ranks(dpo_run, tmp_path, env):  # noqa: F811
    """1 process x 4 micro-batches per step gives the 2 x 2 run's losses, metrics and grad norms, step by step."""
    run_dir = tmp_path / "one_rank"
    res = ftcli(_args(run_dir, "training.cpu_processes=1", "training.grad_accum=4", "training.checkpoint.enabled=false",
                      "training.checkpoint.save_final_hf=false"), tmp_path, env)
    assert res.returncode == 0, output_tail(res)
    one, two = metrics(run_dir), metrics(dpo_run["run_dir"])
    assert [m["step"] for m in one] == [m["step"] for m in two]
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-7)
        assert a["tokens_trained"] == b["tokens_trained"]


@pytest.fixture(scope="module")
def precomputed_run(tmp_path_factory, env):  # noqa: F811
    """dpo_run with training.preference.reference=precomputed (the starting model's log-probs stored once beside the
    pack cache, no second model), checkpoints at steps 2 and 4."""
    cwd = tmp_path_factory.mktemp("precomputed")
    res = ftcli(_args(cwd / "run", PRECOMPUTED, "training.checkpoint.every_steps=2"), cwd, env)
    assert res.returncode == 0, output_tail(res)
    return {"cwd": cwd, "run_dir": cwd / "run", "stdout": res.stdout + res.stderr}


PRECOMPUTED = "training.preference.reference=precomputed"


def test_precomputed_reference_equals_the_live_reference(dpo_run, precomputed_run):
    """training.preference.reference=precomputed: the live-reference run's losses, grad norms, TRL metrics and evals,
    step by step (1e-6)."""
    out = precomputed_run["stdout"]
    assert "DPO reference: the starting model's log-probs, precomputed (no second model)" in out
    assert "frozen copy" not in out and "reference log-probs (train): " in out
    stored, live = metrics(precomputed_run["run_dir"]), metrics(dpo_run["run_dir"])
    assert [m["step"] for m in stored] == [m["step"] for m in live] == list(range(1, STEPS + 1))
    for a, b in zip(stored, live):
        keys = ["loss", "grad_norm", *METRICS, *(k for k in b if k.startswith("eval_") and k != "eval_tokens")]
        assert set(keys) <= set(a)
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k)


def test_dpo_with_context_parallel_equals_data_parallel(dpo_run, tmp_path, env):  # noqa: F811
    """2 processes as one context-parallel group (training.context_parallel=2, grad_accum 4: the same 4 blocks per
    step, each in two slices of 256 tokens, the frozen reference sliced alike) log the 2 x 2 run's losses, metrics and
    grad norms, step by step, and its eval loss and accuracy (the eval blocks sliced too)."""
    run_dir = tmp_path / "cp2"
    res = ftcli(_args(run_dir, "training.context_parallel=2", "training.grad_accum=4",
                      "training.checkpoint.enabled=false", "training.checkpoint.save_final_hf=false"), tmp_path, env)
    assert res.returncode == 0, output_tail(res)
    assert "per group of 2 context-parallel ranks" in res.stdout
    cp, dp = metrics(run_dir), metrics(dpo_run["run_dir"])
    assert [m["step"] for m in cp] == [m["step"] for m in dp]
    for a, b in zip(cp, dp):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        for k in METRICS:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
        assert (a["tokens_trained"], a["tokens_seen"]) == (b["tokens_trained"], b["tokens_seen"])
        assert ("eval_loss" in a) == ("eval_loss" in b)
        if "eval_loss" in a:
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
            assert (a["eval_tokens"], a["eval_rewards/accuracies"]) == (b["eval_tokens"], b["eval_rewards/accuracies"])


def test_dpo_resume_continues_the_uninterrupted_run(precomputed_run, tmp_path, env):  # noqa: F811
    """The precomputed-reference run dir as it was at its step-2 checkpoint, resumed: the reference store the first
    run wrote is read again (the starting model's, not the resumed policy's: its key names the starting model), no
    reference forward runs and no frozen copy is built, and steps 3 and 4 are the uninterrupted run's (#41)."""
    run_dir = tmp_path / "run"
    # what the run dir held after its step-2 save: no step-4 checkpoint, no final model, no run.json (written at the end)
    shutil.copytree(precomputed_run["run_dir"], run_dir,
                    ignore=shutil.ignore_patterns("step_00000004", "final", "run.json"))
    res = ftcli([*_args(run_dir, PRECOMPUTED, "training.checkpoint.every_steps=2"), "--resume", "latest"], tmp_path,
                env)
    assert res.returncode == 0, output_tail(res)
    out = res.stdout + res.stderr
    written = re.findall(r"^(reference log-probs \(.+\)): \d+ blocks, \d+ sequences in [\d.]+ s, stored in (\S+)$",
                         precomputed_run["stdout"], re.M)
    assert [label for label, _ in written] == ["reference log-probs (train)",  # the train set, the eval set (its data)
                                               "reference log-probs (pkg://assets/tiny_prefs.jsonl)"]
    assert re.findall(r"^reference log-probs .*$", out, re.M) == [f"{label}: read from {path}" for label, path in written]
    assert "frozen copy" not in out
    resumed, full = metrics(run_dir), metrics(precomputed_run["run_dir"])
    assert "resumed from" in out and (run_dir / "final" / "config.json").is_file()
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed[2:], full[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["rewards/chosen"] == pytest.approx(b["rewards/chosen"], rel=1e-5, abs=1e-8)
    assert resumed[3]["eval_loss"] == pytest.approx(full[3]["eval_loss"], rel=1e-6)  # the eval store, read again


def test_lora_dpo_loss_same_for_1_and_2_ranks(tmp_path, env):  # noqa: F811
    """training.method=lora (TRL + PEFT, the reference the adapter off): 2 processes x 2 micro-batches and 1 x 4 give
    the same losses and preference metrics step by step (the step normalizes by its global pair count), and step 1
    is log 2 (a fresh adapter: policy == reference). The 1-process run reads the reference's log-probs precomputed
    by the base (training.preference.reference=precomputed: no adapter-off forward), the 2-process run computes them
    live, so the two also agree that the stored reference is the live one."""
    lora = ["training.method=lora", "training.precision={}", "training.checkpoint.enabled=false",
            "training.optimizer.lr=1.0e-2", "eval.every_steps=4"]
    runs, outputs = {}, {}
    for name, sets in (("two", ["training.grad_accum=2"]),
                       ("one", ["training.cpu_processes=1", "training.grad_accum=4",
                                "training.preference.reference=precomputed"])):
        res = ftcli(_args(tmp_path / name, *lora, *sets), tmp_path, env)
        assert res.returncode == 0, output_tail(res)
        runs[name], outputs[name] = metrics(tmp_path / name), res.stdout + res.stderr
    assert "DPO reference: the base's log-probs, precomputed (no adapter-off forward)" in outputs["one"]
    assert "reference log-probs" not in outputs["two"]
    assert [m["step"] for m in runs["one"]] == [m["step"] for m in runs["two"]] == list(range(1, STEPS + 1))
    assert runs["two"][0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    for a, b in zip(runs["one"], runs["two"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-7)
    assert runs["one"][-1]["eval_loss"] == pytest.approx(runs["two"][-1]["eval_loss"], rel=1e-5)
    assert runs["two"][-1]["loss"] < 0.69 and "eval_rewards/accuracies" in runs["two"][-1]
    assert (tmp_path / "two" / "final" / "adapter_config.json").is_file()


def _one_rank(run_dir, *sets):
    return _args(run_dir, "training.cpu_processes=1", "training.grad_accum=1", "eval.enabled=false",
                 "training.checkpoint.enabled=false", "training.checkpoint.save_final_hf=false", *sets)


def test_ipo_step_1_is_the_squared_target_margin(dpo_run, tmp_path, env):  # noqa: F811
    """training.objective=ipo through `ftcli train`, started from the DPO run (model.id = its run dir): at step 1 the
    policy is the reference, every pair's per-token log-ratio margin h is 0, so the loss is (0 - 1 / (2 beta))^2 = 25
    at beta 0.1; step 2's is below (h moved up). run.json and the MLflow run name the run it started from. Compute in
    bf16 over fp32 masters: the frozen copy is held in bf16 and its forward is the policy's, bit for bit (margin 0)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = ftcli(_one_rank(tmp_path / "ipo", "training.objective=ipo", "training.max_steps=2", "model.init=pretrained",
                          f"model.id={dpo_run['run_dir']}", "training.precision.param_dtype=bfloat16",
                          "tracking.enabled=true", f"tracking.tracking_uri={uri}",
                          "tracking.log_system_metrics=false"), tmp_path, env)
    assert res.returncode == 0, output_tail(res)
    parent_json = json.loads((dpo_run["run_dir"] / "run.json").read_text())
    run = json.loads((tmp_path / "ipo" / "run.json").read_text())
    assert run["parent_run"] == {
        "run_dir": str(dpo_run["run_dir"].resolve()), "model_dir": "final", "recipe": "tiny-dpo-cpu",
        "recipe_digest": parent_json["recipe_digest"], "method": "full", "objective": "dpo", "mlflow_run_id": None,
        "mlflow_experiment_id": None}  # the DPO run ran without tracking
    tags = MlflowClient(uri).get_run(run["mlflow"]["run_id"]).data.tags
    assert (tags["ftcli.parent.run_dir"], tags["ftcli.parent.recipe_digest"], tags["ftcli.parent.objective"]) == \
        (str(dpo_run["run_dir"].resolve()), parent_json["recipe_digest"], "dpo")
    steps = metrics(tmp_path / "ipo")
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["loss"] == pytest.approx((0 - 1 / (2 * 0.1)) ** 2, rel=1e-6)
    assert steps[0]["rewards/margins"] == 0.0 and steps[0]["rewards/chosen"] == 0.0
    assert steps[1]["loss"] < steps[0]["loss"] and steps[1]["rewards/margins"] > 0
    assert "IPO reference: a frozen copy of the starting model, sharded like the policy, in bfloat16" in res.stdout


def test_simpo_step_1_follows_from_its_logged_mean_logps(tmp_path, env):  # noqa: F811
    """training.objective=simpo through `ftcli train`, no reference: one pair (data.max_examples=1), so step 1's loss
    is -logsigmoid(beta * (avg_c - avg_r) - gamma) of its logged per-token mean log-probs, and its rewards
    beta * avg."""
    import math

    res = ftcli(_one_rank(tmp_path / "simpo", "training.objective=simpo", "data.max_examples=1",
                          "training.preference.beta=2.0", "training.preference.simpo_gamma=0.3"), tmp_path, env)
    assert res.returncode == 0, output_tail(res)
    (step,) = metrics(tmp_path / "simpo")
    c, r = step["logps/chosen"], step["logps/rejected"]
    assert -20 < c < 0 and -20 < r < 0 and c != r
    z = 2.0 * (c - r) - 0.3
    assert step["loss"] == pytest.approx(math.log1p(math.exp(-z)), rel=1e-5)  # -logsigmoid(z)
    assert (step["rewards/chosen"], step["rewards/rejected"]) == (pytest.approx(2.0 * c), pytest.approx(2.0 * r))
    assert "reference:" not in res.stdout + res.stderr and "reference log-probs" not in res.stdout + res.stderr
