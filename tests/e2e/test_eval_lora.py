"""Held-out evaluation in the LoRA path (TRL + PEFT, 2 CPU processes): ftcli's own token-normalized eval
from the step-log callback, not TRL's. The eval losses of the 2-process run equal a 1-process eval of the
saved adapters (to 1e-6), training losses are exactly those of a run without eval, keep_best with
eval.export=best makes the best eval's adapter (an earlier step's) the final one (best/ removed, final/ whole),
early stopping stops with a final checkpoint, and the samples are what sample_greedy gives on the adapter of their
step. Two runs of 8 steps share the tests."""

from __future__ import annotations

import json

import pytest
import torch

from _lora_common import run_ftcli

SOURCE = "pkg://assets/tiny_chat.jsonl"
COMMON = ["training.max_steps=8", "training.log_every=1", "data.max_examples=300", "tracking.enabled=false"]
# measured: eval 0: 6.963, step 3: 6.399 (better by > 0.5: the best), step 6: 6.052 (better, by < 0.5): stop at 6
EVAL = ["eval.holdout=null", f"eval.path={SOURCE}", "eval.max_examples=30", "eval.every_steps=3", "eval.at_start=true",
        "eval.early_stop={patience: 1, min_delta: 0.5}", "training.checkpoint.keep_best=true", "eval.export=best",
        "training.checkpoint.every_steps=3", 'eval.samples=["What is 2 plus 3?"]',
        "eval.samples_max_new_tokens=6"]


def _args(run_dir, *sets):
    out = ["train", "--recipe", "tiny-gpt-oss-cpu", "--set", f"output.dir={run_dir}"]
    for s in sets:
        out += ["--set", s]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora-eval")
    out = {}
    for name, sets in (("plain", ["eval=null"]), ("eval", EVAL)):  # the same training rows in both
        proc = run_ftcli(_args(work / name, *COMMON, *sets), cwd=work)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        out[name] = (work / name, proc.stdout)
    out["work"] = work
    return out


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _load_adapter(run_dir, adapter: str):
    from peft import PeftModel

    from ftcli.model.build import load_model
    from ftcli.config.recipe import load_recipe
    from ftcli.train.lora.trainer import _attn_implementation

    recipe = load_recipe(str(run_dir / "recipe.yaml"))
    cfg = recipe.model.model_copy(update={"init": "pretrained", "id": str(run_dir / "base")})
    base = load_model(cfg, attn_implementation=_attn_implementation(recipe, torch.device("cpu")), dtype=torch.float32)
    return recipe, PeftModel.from_pretrained(base, str(run_dir / adapter))


def _eval_in_one_process(run_dir, adapter: str) -> float:
    from ftcli.data import data_spec, load_tokenizer
    from ftcli.train.evaluate import Evaluator, prepare_eval
    from ftcli.train.loss import attach_loss

    recipe, model = _load_adapter(run_dir, adapter)
    base = model.get_base_model()
    attach_loss(base, "chunked", 4096)
    evaluator = Evaluator(prepare_eval(data_spec(recipe), recipe.eval, load_tokenizer(recipe.model, recipe.data)), 0, 1, torch.device("cpu"))
    return evaluator.run(model, lambda inputs: base.loss_sum(**inputs), 0).loss


def test_lora_run_with_eval_trains_exactly_like_one_without(runs):
    plain = _lines(runs["plain"][0])
    with_eval = [m for m in _lines(runs["eval"][0]) if "loss" in m]
    assert [m["step"] for m in with_eval] == [1, 2, 3, 4, 5, 6]  # early stop at 6
    for a, b in zip(plain, with_eval):
        assert (a["step"], a["loss"], a["grad_norm"], a["tokens_trained"]) == \
            (b["step"], b["loss"], b["grad_norm"], b["tokens_trained"])


def test_lora_eval_loss_equals_one_process_eval_of_the_saved_adapters(runs, monkeypatch):
    """2 ranks in the run, 1 process here: the best adapter (step 3, exported to final/) and the last one (step 6,
    its checkpoint)."""
    run_dir = runs["eval"][0]
    monkeypatch.setenv("FTCLI_CACHE", str(runs["work"] / "cache"))
    record = json.loads((run_dir / "run.json").read_text())
    evals = {e["step"]: e["loss"] for e in record["evals"]}
    assert list(evals) == [0, 3, 6] and evals[0] > 6.5 and evals[6] < evals[3] < evals[0] - 0.5, evals
    assert [m["eval_loss"] for m in _lines(run_dir) if m["step"] in (0, 3, 6) and "eval_loss" in m] == \
        [evals[0], evals[3], evals[6]]
    assert _eval_in_one_process(run_dir, "final") == pytest.approx(evals[3], rel=1e-6, abs=0)
    assert _eval_in_one_process(run_dir, "checkpoints/checkpoint-6") == pytest.approx(evals[6], rel=1e-6, abs=0)


def test_lora_early_stop_and_export_best(runs):
    """eval.export=best with the best eval (step 3) before the last step (6): final/ holds step 3's adapter, whole
    (its ftcli_export.json complete, every listed file there at its size), best/ is gone, run.json says final."""
    from safetensors.torch import load_file

    from ftcli.artifacts.publish import EXPORT_RECORD, export_problem

    run_dir, stdout = runs["eval"]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["steps"] == 6 and record["best_step"] == 3 and record["best_model_dir"] == "final"
    assert record["model_dir"] == "final"
    assert record["stopped_early"].startswith("early stop") and "early stop" in stdout
    assert (run_dir / "checkpoints" / "checkpoint-6" / "trainer_state.json").is_file()  # the final checkpoint
    assert not (run_dir / "best").exists()
    final = run_dir / "final"
    export = json.loads((final / EXPORT_RECORD).read_text())
    assert export["complete"] is True and {"adapter_model.safetensors", "adapter_config.json"} <= set(export["files"])
    assert export_problem(final) is None
    weights = load_file(final / "adapter_model.safetensors")
    best, last = (load_file(run_dir / "checkpoints" / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (3, 6))
    assert weights.keys() == best.keys() == last.keys() and weights
    assert all(torch.equal(weights[k], best[k]) for k in weights)  # the best step's adapter, bit for bit
    assert not all(torch.equal(weights[k], last[k]) for k in weights)  # not the last step's
    assert f"best eval: step 3, eval loss {record['best_eval_loss']:.4f}, model in {final}" in stdout
    assert f"done: 6 steps, final loss {record['final_loss']:.4f}, adapter in {final}" in stdout
    assert record["data"]["blocks"] > 0 and record["data"]["examples"]["read"] == 300


def test_lora_samples_equal_sample_greedy_on_the_adapter_of_their_step(runs):
    from transformers import AutoTokenizer

    from ftcli.inference import sample_greedy

    run_dir = runs["eval"][0]
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    for row, adapter in zip(rows, ("final", "checkpoints/checkpoint-6")):  # final/: the best step's (3)
        recipe, model = _load_adapter(run_dir, adapter)
        assert row["completion"] == sample_greedy(model, tokenizer, recipe.eval.sample_conversations(), 6)[0]
