"""Context parallelism (training.context_parallel): a block split into N slices over N ranks trains exactly as the
block whole (ftcli.model.kernels.cp, ftcli.data.collate.slice_model_inputs, the loop in ftcli.train.full).

    op level, no launch      the slices' inputs (labels that reach across, positions, pieces of segments), which
                             ranks carry a gated-delta state in, the loss of T/N + 1 labels
    one 4-rank launch        tiny Qwen3.5, Llama, Gemma 3 and gpt-oss: CP=2 and CP=4 (contiguous slices, and
                             balanced: two chunks per rank) against the whole block,
                             activation checkpointing off and on (tests/support/_cp_worker.py); the DPO loss with
                             a frozen reference on pairs crossing the slice boundaries (tiny Qwen3.5)
    two training launches    2 x CP=2 (balanced) on 4 ranks for 4 steps (checkpoint at 2), then a resume of step 2 on 1
                             rank (CP=1): steps 3 and 4 and the eval at step 4 agree
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from _run_common import REPO, FAST, env, ftcli, metrics, output_tail, train_args  # noqa: F401 (env: a fixture)

from ftcli.data.collate import block_to_model_inputs, slice_model_inputs
from ftcli.data.packing import IGNORE_INDEX, make_block
from ftcli.model.kernels.cp import CPSlice

LOGITS_ATOL = 1e-5
GRAD_RTOL = 1e-5  # max |grad difference| over the largest gradient entry
LEAK = 1e-2  # the slice alone (nothing across the boundary) moves the logits by far more


def a_block(lengths=(5, 7, 4), mask_every=3):
    ids = np.arange(10, 10 + sum(lengths), dtype=np.int32)
    mask = np.arange(sum(lengths)) % mask_every != 0
    return make_block(ids, mask, list(lengths), sum(lengths), pad_id=0)


# ------------------------------------------------------------------------------------------- op level
def test_slices_keep_positions_segments_and_the_label_across_the_boundary():
    block = a_block()  # segments [0, 5) [5, 12) [12, 16); slices of 8: segment 1 crosses
    whole = block_to_model_inputs(block)
    first, second = (slice_model_inputs(block, r, 2) for r in (0, 1))
    assert torch.equal(torch.cat([first["input_ids"], second["input_ids"]], 1), whole["input_ids"])
    assert torch.equal(torch.cat([first["position_ids"], second["position_ids"]], 1), whole["position_ids"])
    assert second["position_ids"][0].tolist() == [3, 4, 5, 6, 0, 1, 2, 3]  # segment 1 goes on counting
    assert first["cu_seq_lens_q"].tolist() == [0, 5, 8] and second["cu_seq_lens_q"].tolist() == [0, 4, 8]
    assert (first["max_length_q"], second["max_length_q"]) == (5, 4)
    assert torch.equal(torch.cat([first["seq_idx"], second["seq_idx"]], 1), whole["seq_idx"])
    # T/N + 1 labels: rank 0's last position (7) predicts rank 1's first token (8); the last rank pads one -100
    assert first["labels"][0].tolist() == whole["labels"][0, :9].tolist()
    assert second["labels"][0].tolist() == [*whole["labels"][0, 8:].tolist(), IGNORE_INDEX]
    trained = torch.cat([first["trained_positions"], second["trained_positions"] + 8])
    assert torch.equal(trained, whole["trained_positions"])


def test_balanced_slices_hold_two_chunks_with_their_labels_positions_and_pieces():
    block = a_block((5, 7, 4))  # segments [0, 5) [5, 12) [12, 16); 4 chunks of 4: rank 0 holds c0 c3, rank 1 c1 c2
    whole = block_to_model_inputs(block)
    first, second = (slice_model_inputs(block, r, 2, balanced=True) for r in (0, 1))
    order = [*range(0, 4), *range(12, 16), *range(4, 12)]  # rank 0's tokens, then rank 1's, in block positions
    for key in ("input_ids", "position_ids", "seq_idx"):
        assert torch.cat([first[key], second[key]], 1)[0].tolist() == whole[key][0, order].tolist(), key
    targets = [*whole["labels"][0, 1:].tolist(), IGNORE_INDEX]  # position t's target
    assert first["labels"][0, 1:].tolist() == [targets[t] for t in order[:8]]  # c0's last predicts c1's first
    assert second["labels"][0, 1:].tolist() == [targets[t] for t in order[8:]]
    assert first["cu_seq_lens_q"].tolist() == [0, 4, 8] and second["cu_seq_lens_q"].tolist() == [0, 1, 4, 8]
    cp = CPSlice.of(block.cu_seqlens, 1, 2, None, balanced=True)
    assert cp.chunks == (1, 2) and cp.pieces() == [(0, 4, 5), (5, 5, 8), (5, 8, 12)]
    assert [cp.continued(c) for c in range(4)] == [False, True, True, False] and cp.through(2) and not cp.through(1)
    assert cp.block_order().tolist() == [*range(0, 4), *range(8, 16), *range(4, 8)]  # rank 0 gathers c0 c3

    def causal_pairs(cp):  # (query, key) pairs of the rank's attention: its pieces' causal triangles
        return sum((q0 - s + 1 + q1 - s) * (q1 - q0) // 2 for s, q0, q1 in cp.pieces())

    one_document = [0, 1024]  # the balanced layout gives every rank the same causal work
    assert len({causal_pairs(CPSlice.of(one_document, r, 4, None, True)) for r in range(4)}) == 1
    assert [causal_pairs(CPSlice.of(one_document, r, 4, None)) for r in range(4)] == [32896, 98432, 163968, 229504]


def test_state_carried_in_only_where_a_segment_crosses():
    # segments [0, 70) [70, 73) [73, 74) [74, 94) [94, 128), four slices of 32
    cp = CPSlice.of([0, 70, 73, 74, 94, 128], 0, 4, group=None)
    assert [cp.continued(r) for r in range(4)] == [False, True, True, True]
    # rank 1 lies inside segment 0, rank 3 inside segment 4: a state passes through them
    assert [cp.through(r) for r in range(4)] == [False, True, False, True]
    assert CPSlice.of([0, 70, 73, 74, 94, 128], 2, 4, None).pieces() == [(0, 64, 70), (70, 70, 73), (73, 73, 74),
                                                                         (74, 74, 94), (94, 94, 96)]


def test_loss_of_the_slices_adds_up_to_the_block_loss():
    from ftcli.train.loss import count_trained_tokens, token_loss_sum

    block = a_block((9, 23, 8, 24))

    def to_vocab(labels):  # token ids into a vocabulary of 11
        return torch.where(labels == IGNORE_INDEX, labels, labels % 11)

    torch.manual_seed(0)
    hidden, weight = torch.randn(1, 64, 8), torch.randn(11, 8)
    whole = token_loss_sum(hidden, weight, to_vocab(block_to_model_inputs(block)["labels"]), "full", 16)
    slices, counts = [], []
    for r in range(4):
        local = slice_model_inputs(block, r, 4)
        slices.append(token_loss_sum(hidden[:, r * 16:(r + 1) * 16], weight, to_vocab(local["labels"]), "chunked", 5,
                                     trained_positions=local["trained_positions"]))
        counts.append(count_trained_tokens(local["labels"]))
    assert sum(slices).item() == pytest.approx(whole.item(), rel=1e-6)
    assert sum(counts) == block.num_trained_tokens


def test_recipe_refuses_what_cannot_split():
    from ftcli.config.errors import UserError
    from ftcli.config.recipe import load_recipe

    from ftcli.config.recipe import CP_SLICE_MULTIPLE
    from ftcli.data.collate import FLA_CHUNK

    assert CP_SLICE_MULTIPLE == FLA_CHUNK  # the config's copy of the data code's constant (the config imports no torch)
    assert load_recipe("tiny-qwen-cpu", ["training.context_parallel=2"]).training.context_parallel == 2
    with pytest.raises(UserError, match="multiple of 192"):
        load_recipe("tiny-qwen-cpu", ["training.context_parallel=3"])
    with pytest.raises(UserError, match="packing.enabled: true"):
        load_recipe("tiny-qwen-cpu", ["training.context_parallel=2", "data.packing.enabled=false"])
    assert load_recipe("tiny-qwen-cpu", ["training.context_parallel=4", "training.context_parallel_balance=true",
                                         "data.packing.block_len=512"]).training.context_parallel_balance
    with pytest.raises(UserError, match="multiple of 512 .2N chunks"):
        load_recipe("tiny-qwen-cpu", ["training.context_parallel=4", "training.context_parallel_balance=true",
                                      "data.packing.block_len=768"])
    with pytest.raises(UserError, match="compile: regions or false"):
        load_recipe("tiny-qwen-cpu", ["training.context_parallel=2", "training.compile=true"])


def test_a_launch_whose_ranks_do_not_split_into_cp_groups_is_refused_before_it_starts(monkeypatch):
    from ftcli.config.errors import UserError
    from ftcli.config.recipe import load_recipe
    from ftcli.train.launch import check_context_parallel

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    check_context_parallel(load_recipe("tiny-qwen-cpu", ["training.context_parallel=2"]))  # 2 CPU processes
    with pytest.raises(UserError, match="context_parallel=4 does not divide the 2 ranks"):
        check_context_parallel(load_recipe("tiny-qwen-cpu", ["training.context_parallel=4"]))


@pytest.mark.parametrize("window", [16, None])
def test_gpt_oss_flex_attention_across_slices_equals_the_eager_reference(window):
    """gpt-oss's CUDA path under CP (flex attention with a block-coordinate mask, then the sinks; contiguous and
    balanced slices), run here on CPU
    (forward only: flex attention has no CPU backward; benchmarks/cp_gpu.py checks its gradients on the GPU),
    against the per-piece eager reference with the sinks."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    from ftcli.model.kernels import cp as cp_ops

    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    module = GptOssAttention(config, layer_idx=0 if window else 1)
    assert module.sliding_window == window
    q, k, v = (torch.randn(1, h, 128, 16) for h in (4, 2, 2))
    with torch.no_grad():
        module.sinks.normal_(0.0, 1.0)
        for n, balanced in ((2, False), (4, False), (2, True), (4, True)):
            for r in range(n):
                s = CPSlice.of([0, 70, 73, 74, 94, 128], r, n, None, balanced)
                local = q[:, :, s.positions()]
                eager, _ = cp_ops._attention_pieces(local, k, v, s, 0.25, 0.0, window, module, True)
                flex, _ = cp_ops._attention_flex_sinks(local, k, v, s, 0.25, window, module.sinks)
                assert (eager - flex).abs().max() < 1e-5


# ----------------------------------------------------------------------------------- plan and memory
LONG = ["data.packing.block_len=131072", "training.context_parallel=8"]  # qwen-b300 at 128k on one 8xB300 node


def test_memory_of_a_cp_rank_is_a_slice_plus_the_gathered_attention():
    from ftcli.estimate import memory

    shape = memory.shipped_shape("Qwen/Qwen3.8-27B")
    whole = memory.Setting(tokens=131072, world=8, checkpointing="full", loss="liger")
    for cp in (2, 8):
        split, sliced = memory.estimate(shape, replace(whole, cp=cp)), memory.estimate(shape, replace(whole, tokens=131072 // cp))
        assert (split.activations, split.loss, split.state) == (sliced.activations, sliced.loss, sliced.state)
        q_dim, kv_dim = memory.attention_dims(shape)
        assert (q_dim, kv_dim) == (24 * 256, 4 * 256)
        # full checkpointing: one full-attention layer's gathered K/V and per-segment copies, and their gradient
        assert split.other - sliced.other == pytest.approx(2 * 2 * 131072 * (q_dim + kv_dim) * 2 / memory.GiB)


def test_plan_names_the_fewest_cp_ranks_that_fit_and_the_128k_recipe_fits_b300():
    from ftcli.config.recipe import load_recipe
    from ftcli.estimate import fit, memory
    from ftcli.estimate.plan import fit_check, make_plan

    recipe = load_recipe("qwen-b300", LONG)
    assert fit_check(recipe).fits
    plan = make_plan(recipe, ["GPU_8xH200", "GPU_8xH100"])
    assert plan.setting.cp == 8 and plan.to_dict()["setting"]["context_parallel"] == 8
    shape = memory.shipped_shape("Qwen/Qwen3.8-27B")
    for card in plan.cards:
        n, gb = card.cp_fits, fit.CARDS[card.card]["memory_gb"]
        s = fit.setting_of(recipe, shape, card.gpus)
        if n is None:  # not even every GPU of the node on one block
            assert not fit.fits_card(shape, replace(s, cp=8, keep=0), gb)[0]
        else:
            assert fit.fits_card(shape, replace(s, cp=n, keep=0), gb)[0]
            assert n == 1 or not fit.fits_card(shape, replace(s, cp=n // 2, keep=0), gb)[0]
    assert plan.steps == plan.data.blocks  # 8 GPUs, one block per step: every block its own step
    assert fit.cp_degrees(fit.setting_of(recipe, shape)) == [1, 2, 4, 8]


# ---------------------------------------------------------------------------------- the four families
@pytest.fixture(scope="module")
def cp_report(tmp_path_factory) -> dict:
    from _run_common import subprocess_env

    tmp = tmp_path_factory.mktemp("cp")
    out = tmp / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(REPO / "tests" / "support" / "_cp_worker.py"), str(out), "qwen3_5,llama3,gemma3,gpt-oss,dpo", "off,on", "2,4,2b,4b"]
    res = subprocess.run(cmd, cwd=REPO, env=subprocess_env(tmp / "cache"), capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, output_tail(res)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["qwen3_5", "llama3", "gemma3", "gpt-oss"])
def test_context_parallel_equals_the_whole_block(cp_report, name):
    """Logits, summed loss and gradients (summed over the slices) of CP=2 and CP=4, contiguous and balanced (two
    chunks per rank), equal the whole block's, with and without activation checkpointing; the slices alone, without
    the ops across the boundary, do not."""
    checked = {k: v for k, v in cp_report.items() if k.startswith(name + "/")}
    assert len(checked) == 8  # cp 2 and 4, contiguous and balanced, x checkpointing off and on
    for key, d in checked.items():
        assert d["logits"] < LOGITS_ATOL, key
        assert d["loss"] <= 1e-5 * d["loss_value"], key
        assert d["grads"] <= GRAD_RTOL * d["grad_scale"], key
        assert d["logits_slice_alone"] > LEAK, key


def test_preference_loss_over_slices_equals_the_whole_block(cp_report):
    """DPO with a frozen reference on a block of two pairs whose sides cross the slice boundaries: the CP group's
    losses add up to the whole block's, the per-segment log-prob sums and token counts added over the group are the
    block's (so SimPO's and ORPO's per-token means are too), each pair is counted once, and the gradients agree."""
    for size in ("2", "4", "2b", "4b"):  # b: balanced
        d = cp_report[f"dpo/qwen3_5/cp={size}"]
        # float32: the loss is beta (0.5) x a margin of log-prob sums of ~264, each rounded to ~3e-5; measured up to
        # 1.5e-5 on 1.79 (CP=2 balanced)
        assert d["loss"] <= 2e-5 * d["loss_value"], size
        assert d["logps"] <= 1e-6 * d["logps_scale"] and d["counts"] == 0 and d["pairs_counted"] == 2, size
        assert d["simpo"] < 1e-5, size
        # float32: the DPO gradient's noise measured up to 1.1e-5 of the largest entry (CP=2)
        assert d["grads"] <= 2 * GRAD_RTOL * d["grad_scale"] and d["num_grads"] > 50, size


# ------------------------------------------------------------------------------------- the training loop
def test_cp2_training_and_a_resume_on_cp1_agree(tmp_path, env):
    """4 ranks as 2 data-parallel groups x CP=2 balanced (two blocks per step, each in four chunks of 64, rank 0 of a
    group holding chunks 0 and 3, rank 1 chunks 1 and 2) for 4 steps, checkpoint at
    step 2; the step-2 checkpoint resumed on 1 rank without CP (grad_accum 2: the same two blocks per step) trains
    steps 3 and 4 with the same losses, grad norms and token counts; the eval at the end (the held-out blocks in
    slices over each CP group) gives the same loss."""
    common = ["training.max_steps=4", "data.packing.block_len=256", "training.checkpoint.every_steps=2",
              "training.checkpoint.save_final_hf=false", *FAST]
    cp_run = tmp_path / "cp2"
    res = ftcli(train_args(cp_run, "training.cpu_processes=4", "training.context_parallel=2",
                           "training.context_parallel_balance=true", *common), tmp_path, env)
    assert res.returncode == 0, output_tail(res)
    assert "steps of 1 block per group of 2 context-parallel ranks" in res.stdout
    resumed = tmp_path / "cp1"
    res = ftcli([*train_args(resumed, "training.cpu_processes=1", "training.grad_accum=2", *common),
                 "--resume", str(cp_run / "checkpoints" / "step_00000002")], tmp_path, env)
    assert res.returncode == 0, output_tail(res)
    assert "blocks per optimizer step" not in res.stdout  # the same 2 blocks per step: no warning
    two, one = metrics(cp_run), metrics(resumed)
    assert [m["step"] for m in two] == [1, 2, 3, 4] and [m["step"] for m in one] == [3, 4]
    for a, b in zip(two[2:], one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert (a["tokens_trained"], a["tokens_seen"]) == (b["tokens_trained"], b["tokens_seen"])
    # the last step's eval: the held-out blocks in slices over each CP group (2 groups) == whole on 1 rank
    assert two[3]["eval_loss"] == pytest.approx(one[1]["eval_loss"], rel=1e-5)
    assert two[3]["eval_tokens"] == one[1]["eval_tokens"] > 0
