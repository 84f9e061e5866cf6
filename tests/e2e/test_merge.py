"""`ftcli merge-lora`: merged weights behave like base + adapter; user mistakes are one-line errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from _lora_common import tiny_model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 2 * 2**-8)])
def test_merged_model_logits_equal_base_plus_adapter(lora_run, tmp_path, dtype, tol):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ftcli.artifacts.merge import merge_lora
    from ftcli.model.build import load_model
    from ftcli.config.recipe import ModelConfig

    run, base = lora_run
    out = merge_lora(run, output=tmp_path / "merged", dtype=dtype)
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "chat_template.jinja", "merge.json",
            "ftcli_export.json"} <= set(names)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gpt_oss"

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype))  # a plain checkpoint now
    assert merged.model.layers[0].mlp.experts.gate_up_proj.dtype == getattr(torch, dtype)
    reference = PeftModel.from_pretrained(
        load_model(ModelConfig(id=str(base), model_type="gpt_oss", dtype=dtype, quantization="mxfp4_dequantize")),
        str(run / "final"))
    ids = torch.randint(0, 700, (2, 40), generator=torch.Generator().manual_seed(1))
    got, want = _logits(merged, ids), _logits(reference, ids)
    per_token = (got - want).abs().amax(-1).flatten()
    report = json.loads((out / "merge.json").read_text())
    print(f"{dtype}: merged vs base+adapter max abs diff {per_token.max():.3g} (median {per_token.median():.3g}); "
          f"merge.json: {report['max_abs_diff']:.3g}, adapter effect {report['adapter_effect']:.3g}")
    assert report["passed"] and report["adapter_effect"] > 0.1
    if dtype == "float32":
        assert per_token.max() < tol
    else:  # bf16 rounds every merged weight once; near-tied MoE routers may pick other experts for a few tokens
        assert per_token.median() < tol


def _cli(args):
    from typer.testing import CliRunner

    from ftcli.cli import app

    return CliRunner().invoke(app, args)


def _one_error_line(output: str) -> bool:
    """The CLI's one red line (transformers' loading bars may share the captured stream)."""
    return "Traceback" not in output and len([ln for ln in output.splitlines() if ln.startswith("error:")]) == 1


def test_output_with_foreign_files_refused_earlier_merge_replaced_only_with_force(lora_run, tmp_path):
    run, _ = lora_run
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    for extra in ([], ["--force"]):  # files merge-lora did not write: never deleted, --force or not
        result = _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32", *extra])
        assert result.exit_code == 2 and _one_error_line(result.output)
        assert f"{out} holds files merge-lora did not write (keep.txt)" in " ".join(result.output.split())
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32"]).exit_code == 0
    written = json.loads((out / "merge.json").read_text())["files"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*written, "ftcli_export.json"])
    assert "model.safetensors.index.json" in written
    result = _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32"])
    assert result.exit_code == 2 and "holds an earlier merge; pass --force to replace it" in result.output
    result = _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32", "--force"])
    assert result.exit_code == 0, result.output
    rewritten = json.loads((out / "merge.json").read_text())["files"]  # new shard names (a new tag), same files else
    assert sorted(p.name for p in out.iterdir()) == sorted([*rewritten, "ftcli_export.json"])
    assert [f for f in rewritten if f not in written] == [f for f in rewritten if f.endswith("0001.safetensors")]
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # no temporary dir left beside it


def test_merged_files_follow_the_umask(lora_run, tmp_path):
    import os
    import stat

    from ftcli.artifacts.merge import merge_lora

    run, _ = lora_run
    old = os.umask(0o027)
    try:
        out = merge_lora(run, output=tmp_path / "merged", dtype="float32")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.iterdir()]}
    assert modes.pop("merged") == 0o750 and modes and set(modes.values()) == {0o640}, modes


def test_wrong_base_is_a_one_line_error(lora_run, tmp_path):
    """A base of another model_type, a base of the right type with other shapes, and a missing base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcli.config.recipe import resolve_path

    run, _ = lora_run
    qwen = tmp_path / "qwen"
    cfg = json.loads(open(resolve_path("pkg://assets/tiny-qwen3_5.json")).read())
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(qwen)
    narrow = tmp_path / "narrow-gpt-oss"
    tiny = tiny_model()
    narrow_cfg = tiny.config
    narrow_cfg.hidden_size, narrow_cfg.head_dim = 64, 16
    AutoModelForCausalLM.from_config(narrow_cfg).save_pretrained(narrow)

    cases = [
        (["--base", str(qwen)], "is a 'qwen3_5_text' model but the adapter was trained on 'gpt_oss'"),
        (["--base", str(narrow)], "does not fit base '%s': model.layers.0.self_attn.q_proj.lora_A.weight is "
                                  "[16, 128] in the adapter but [16, 64] on this base" % narrow),
        (["--base", str(tmp_path / "missing")], "cannot load its config"),
    ]
    for extra, message in cases:
        result = _cli(["merge-lora", str(run), "--output", str(tmp_path / "out"), "--dtype", "float32", *extra])
        assert result.exit_code == 2, result.output
        assert message in " ".join(result.output.split()), result.output
        assert _one_error_line(result.output), result.output
        assert not (tmp_path / "out").exists()


def test_adapter_that_does_not_fit_is_refused_before_peft_builds_it(lora_run, tmp_path):
    """adapter_config.json unreadable or not LoRA's, and a tensor for a module the base lacks: one line each,
    from ftcli's own checks (nothing parsed out of PEFT's messages)."""
    import shutil

    from safetensors.torch import load_file, save_file

    run, _ = lora_run

    def case(edit):
        copy = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        shutil.copytree(run, copy)
        edit(copy / "final")
        result = _cli(["merge-lora", str(copy), "--output", str(tmp_path / "out"), "--dtype", "float32"])
        assert result.exit_code == 2 and _one_error_line(result.output), result.output
        assert not (tmp_path / "out").exists()
        return " ".join(result.output.split())

    def rename_module(final):
        weights = load_file(final / "adapter_model.safetensors")
        save_file({k.replace("layers.1.self_attn.q_proj", "layers.1.self_attn.qq_proj"): v
                   for k, v in weights.items()}, final / "adapter_model.safetensors")

    config = lambda text: lambda final: (final / "adapter_config.json").write_text(text)  # noqa: E731
    assert "adapter_config.json: cannot read it (" in case(config("{not json"))
    assert "adapter_config.json: peft_type is 'IA3'; merge-lora merges LoRA adapters only" in case(
        config(json.dumps({"peft_type": "IA3"})))
    assert "has no adapter_model.safetensors; pass the adapter dir that training wrote" in case(
        lambda final: (final / "adapter_model.safetensors").unlink())
    assert ("does not fit base '%s': 2 adapter tensors have no place in it "
            "(e.g. base_model.model.model.layers.1.self_attn.qq_proj.lora_A.weight)" % lora_run[1]) in case(rename_module)

    def drop_module(final):  # a base whose layers the adapter does not all cover (e.g. a deeper one)
        weights = load_file(final / "adapter_model.safetensors")
        save_file({k: v for k, v in weights.items() if "layers.1.self_attn.q_proj" not in k},
                  final / "adapter_model.safetensors")

    assert ("does not fit base '%s': the adapter has no weights for 2 of its LoRA tensors on this base "
            "(e.g. model.layers.1.self_attn.q_proj.lora_A.weight)" % lora_run[1]) in case(drop_module)
    assert "cannot read the adapter weights (" in case(
        lambda final: (final / "adapter_model.safetensors").write_bytes(b"\x00" * 64))
    lying = b'{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":{"dtype":"F32","shape":[16,128],' \
            b'"data_offsets":[0,8192]}}'  # #47 item 11: a header that promises more bytes than the file has
    assert "cannot read the adapter weights (" in case(lambda final: (final / "adapter_model.safetensors").write_bytes(
        len(lying).to_bytes(8, "little") + lying + b"\0" * 16))

    def edit_config(**changes):  # #47 item 11: r: 10^8 allocated 51 GB in PEFT before any check
        def edit(final):
            config = json.loads((final / "adapter_config.json").read_text())
            (final / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return edit

    for key, changes in (("r", {"r": 10**8}), ("rank_pattern['q_proj']", {"rank_pattern": {"q_proj": 10**8}})):
        assert (f"adapter_config.json: {key} is 100000000, but no weight of the adapter has a dimension that large "
                "(the largest is 256); the config does not belong to these weights") in case(edit_config(**changes))
    assert ("does not fit base '%s': 16 adapter tensors adapt modules that its adapter_config.json target_modules / "
            "target_parameters do not select (e.g. base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight)"
            % lora_run[1]) in case(edit_config(target_modules=["nothing_here"]))
    nothing = case(edit_config(target_modules=["nothing_here"], target_parameters=None))  # PEFT's own ValueError
    assert "does not fit base '%s': " % lora_run[1] in nothing and "nothing_here" in nothing


def _adapter_dir(root, base_ref=None, revision=None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base_ref, "revision": revision}))
    return root


def _run_json(run_dir, base_model):
    (run_dir / "run.json").write_text(json.dumps({"method": "lora", "model_dir": "final", "base_model": base_model}))


def test_base_resolution_order_is_flag_then_saved_path_then_hub_id_then_adapter_config(tmp_path):
    """One resolver for merge-lora and register: --base, run.json base_model.path (relative to the run),
    base_model.id@revision, adapter_config.json; a reference naming a dir is that dir."""
    from ftcli.config.errors import UserError
    from ftcli.artifacts.merge import resolve_adapter
    from ftcli.artifacts.resolve import BaseRef, resolve_base

    run = tmp_path / "run"
    adapter = _adapter_dir(run / "final", "org/from-adapter", "abc")
    (run / "base").mkdir()
    (run / "base" / "config.json").write_text("{}")
    _run_json(run, {"id": "org/model", "revision": "r1", "path": "base", "init": "random"})

    def resolved(base=None):
        return resolve_base(*resolve_adapter(run), base=base)

    assert resolved() == BaseRef(path=run / "base")
    assert resolved(base="org/other") == BaseRef(id="org/other")
    assert resolved(base=str(run / "base")) == BaseRef(path=run / "base")
    _run_json(run, {"id": "org/model", "revision": "r1"})
    assert resolved() == BaseRef(id="org/model", revision="r1") and str(resolved()) == "org/model@r1"
    _run_json(run, {"revision": "r2"})
    assert resolved() == BaseRef(id="org/from-adapter", revision="r2")
    assert resolve_base(adapter, None, None) == BaseRef(id="org/from-adapter", revision="abc")  # a bare adapter
    _run_json(run, {"init": "random"})
    with pytest.raises(UserError, match=r"random-init and run.json has no base_model.path .*merge-lora --base DIR"):
        resolved()
    _run_json(run, {"path": "missing"})
    with pytest.raises(UserError, match=r"base model dir .*missing \(run.json base_model.path\) is missing"):
        resolved()
    with pytest.raises(UserError, match=r"does not say which base it belongs to"):
        resolve_base(_adapter_dir(tmp_path / "bare"), None, None)


def test_register_and_merge_resolve_the_same_base(tmp_path):
    """register's source resolution goes through merge.resolve_base: same BaseRef for the same run."""
    from ftcli.artifacts.merge import resolve_adapter
    from ftcli.artifacts.resolve import resolve_base
    from ftcli.commands.register import Source, resolve_source

    run = tmp_path / "run"
    adapter = _adapter_dir(run / "final", "org/from-adapter")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    (adapter / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    _run_json(run, {"id": "org/model", "revision": "r1"})
    source = resolve_source(run)
    assert isinstance(source, Source) and source.kind == "adapter" and source.model_dir == adapter
    assert source.base == resolve_base(*resolve_adapter(run))


def test_register_reuses_only_a_merge_of_the_same_adapter_dtype_and_format(tmp_path):
    """<run>/final and <run>/best merge into the same <run>/merged: a merge is reused only when its merge.json
    names this adapter, this dtype and this format, and it is newer than the adapter's weights."""
    import json
    import os

    from ftcli.artifacts.merge import is_newer_merge

    final, best, out = tmp_path / "final", tmp_path / "best", tmp_path / "merged"
    for adapter in (final, best):
        adapter.mkdir()
        (adapter / "adapter_model.safetensors").write_bytes(b"x")
        os.utime(adapter / "adapter_model.safetensors", (1000, 1000))
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"x")
    assert not is_newer_merge(out, final, "bfloat16")  # no merge.json: not known to be a merge of anything
    (out / "merge.json").write_text(json.dumps({"adapter": str(final), "dtype": "bfloat16", "format": "plain"}))
    assert is_newer_merge(out, final, "bfloat16")
    assert not is_newer_merge(out, best, "bfloat16")  # the other adapter's merge
    assert not is_newer_merge(out, final, "float32")
    assert not is_newer_merge(out, final, "bfloat16", "mxfp4")
    os.utime(final / "adapter_model.safetensors")  # the adapter written again after the merge
    assert not is_newer_merge(out, final, "bfloat16")


# ------------------------------------------------------------------------------------------------- #47 item 14
def test_a_killed_merges_temp_dir_is_removed_by_the_next_merge_a_running_ones_is_not(tmp_path):
    from ftcli.artifacts.merge import remove_stale_temps

    out = tmp_path / "merged"
    dead, alive = tmp_path / ".merged.999999999.k3j2.tmp", tmp_path / f".merged.{os.getpid()}.a8x1.tmp"
    other = tmp_path / ".other.999999999.k3j2.tmp"  # another output's
    for d in (dead, alive, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 10)
    assert remove_stale_temps(out) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])


def test_sigterm_during_a_merge_ends_in_cleanup_not_a_leftover():
    import signal

    from ftcli.artifacts.merge import _sigterm_ends_with_cleanup

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        with _sigterm_ends_with_cleanup():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs at the next bytecode boundary
                pass
    assert stop.value.code == 143 and signal.getsignal(signal.SIGTERM) == before


def test_each_base_file_is_opened_once_and_a_lying_header_is_one_line(tmp_path, monkeypatch):
    """A base of many tensors: its header is parsed once per file, not once per tensor (600k entries took over
    180 s); a header whose offsets lie is one UserError naming the file."""
    import safetensors
    import torch
    from safetensors.torch import save_file

    from ftcli.artifacts import merge
    from ftcli.config.errors import UserError

    save_file({f"w{i}": torch.full((2,), float(i)) for i in range(50)}, str(tmp_path / "model.safetensors"))
    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    reader = merge.CheckpointReader(tmp_path, torch.float32)
    assert [reader.get(f"w{i}")[0].item() for i in range(50)] == [float(i) for i in range(50)]
    assert len(opened) == 1

    lying = tmp_path / "lying"
    lying.mkdir()
    header = b'{"w0":{"dtype":"F32","shape":[1000000],"data_offsets":[0,4000000]}}'
    (lying / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(UserError) as err:
        merge.CheckpointReader(lying, torch.float32).get("w0")
    assert str(err.value).startswith(f"base file {lying / 'model.safetensors'}: ") and "\n" not in str(err.value)


# ------------------------------------------------------------------------------ #44: written in place
def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_merge_renames_only_its_two_small_records(lora_run, tmp_path, monkeypatch, renames):
    """The shards, config and tokenizer are written at their final paths; a merge renames only the export record
    (incomplete, then complete) and its pending record: a few hundred bytes per merge whatever the model's size,
    also when --force replaces an earlier merge."""
    from ftcli.artifacts import merge
    from ftcli.artifacts.resolve import locate

    run, _ = lora_run
    monkeypatch.setattr(merge, "MAX_SHARD_SIZE", "200KB")
    moved = renames
    out = merge.merge_lora(run, output=tmp_path / "merged", dtype="float32")
    model_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    for forced in (False, True):
        names = sorted({name for name, _ in moved})
        print(f"force={forced}: {len(moved)} renames, {sum(n for _, n in moved)} bytes; model {model_bytes} bytes")
        assert names == [".merge-lora.pending.json", "ftcli_export.json"], moved
        assert sum(n for _, n in moved) < 2048 and model_bytes > 1_000_000
        assert locate(out).model_dir == out and json.loads((out / "ftcli_export.json").read_text())["complete"]
        moved.clear()
        if not forced:
            merge.merge_lora(run, output=out, dtype="float32", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


class _Killed(BaseException):
    """A SIGKILL, as far as the files are concerned: no cleanup runs (see _kill_at)."""


def _kill_at(monkeypatch, *, shard: int | None = None, small_file: str | None = None) -> None:
    """Stop the next merge like a kill -9: before the `shard`-th shard's write, or before writing `small_file`
    (the publish step), with the abort (the cleanup an error, Ctrl-C or SIGTERM runs) switched off."""
    import builtins

    import safetensors.torch

    from ftcli.artifacts import merge

    monkeypatch.setattr(merge._InPlace, "abort", lambda self: None)
    writes, real_save, real_open = [], safetensors.torch.save_file, builtins.open

    def save_file(tensors, filename, **kwargs):
        writes.append(filename)
        if len(writes) == shard:
            raise _Killed
        return real_save(tensors, filename, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if small_file is not None and str(file).endswith("/" + small_file) and "x" in mode:
            raise _Killed
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(builtins, "open", open_)


def _accepted_by_generate_or_register(out) -> bool:
    from ftcli.artifacts.resolve import model_source
    from ftcli.commands.register import resolve_source
    from ftcli.config.errors import UserError

    answers = []
    for accept in (lambda: model_source(str(out)), lambda: resolve_source(out)):
        try:
            accept()
            answers.append(True)
        except UserError:
            answers.append(False)
    assert len(set(answers)) == 1, answers
    return answers[0]


def test_a_killed_merge_leaves_nothing_generate_or_register_accepts(lora_run, tmp_path, monkeypatch):
    """A kill (no cleanup at all) of a first merge, mid-shards or while its small files go: generate and register
    refuse what is left, and the next merge removes it without --force. A kill of a --force re-merge while its
    shards stream: the earlier merge is still whole, byte for byte, and published; after the earlier merge was
    unpublished: refused."""
    from ftcli.artifacts import merge

    run, _ = lora_run
    monkeypatch.setattr(merge, "MAX_SHARD_SIZE", "200KB")
    out = tmp_path / "merged"
    for kill in ({"shard": 2}, {"small_file": "config.json"}, {"small_file": "merge.json"}):
        with monkeypatch.context() as m:
            _kill_at(m, **kill)
            with pytest.raises(_Killed):
                merge.merge_lora(run, output=out, dtype="float32")
        assert (out / ".merge-lora.pending.json").is_file() and any(out.glob("model-*.safetensors")), kill
        assert not _accepted_by_generate_or_register(out), kill
        assert not merge.is_newer_merge(out, run / "final", "float32")  # register would merge again
    merge.merge_lora(run, output=out, dtype="float32")  # the leftovers are merge-lora's: no --force needed
    earlier = _snapshot(out)
    assert ".merge-lora.pending.json" not in earlier and _accepted_by_generate_or_register(out)

    with monkeypatch.context() as m:
        _kill_at(m, shard=3)
        with pytest.raises(_Killed):
            merge.merge_lora(run, output=out, dtype="float32", force=True)
    left = _snapshot(out)
    assert {k: v for k, v in left.items() if k in earlier} == earlier  # untouched, still published
    assert sorted(set(left) - set(earlier)) == [".merge-lora.pending.json", *sorted(
        f"model-{json.loads(left['.merge-lora.pending.json'])['tag']}-{i:05d}.safetensors" for i in (1, 2))]
    assert _accepted_by_generate_or_register(out) and merge.is_newer_merge(out, run / "final", "float32")

    with monkeypatch.context() as m:
        _kill_at(m, small_file="config.json")  # the check passed: the earlier merge was unpublished, then removed
        with pytest.raises(_Killed):
            merge.merge_lora(run, output=out, dtype="float32", force=True)
    assert not _accepted_by_generate_or_register(out)
    merge.merge_lora(run, output=out, dtype="float32")  # the earlier merge is gone: what is left is leftovers
    now = _snapshot(out)
    assert _accepted_by_generate_or_register(out) and ".merge-lora.pending.json" not in now
    assert sorted(now) == sorted([*json.loads(now["merge.json"])["files"], "ftcli_export.json"])
    weights = lambda snap: {k: v for k, v in snap.items() if k.endswith(".safetensors")}  # noqa: E731
    assert sorted(weights(now).values()) == sorted(weights(earlier).values())  # same bytes, the new tag's names


def test_a_merge_into_a_dir_a_running_merge_writes_is_refused(lora_run, tmp_path):
    run, _ = lora_run
    out = tmp_path / "merged"
    out.mkdir()
    (out / ".merge-lora.pending.json").write_text(json.dumps({"pid": os.getppid(), "tag": "0123abcd"}))
    (out / "model-0123abcd-00001.safetensors").write_bytes(b"x")
    result = _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32", "--force"])
    assert result.exit_code == 2 and _one_error_line(result.output)
    assert f"{out}: another merge-lora (pid {os.getppid()}) is writing there" in " ".join(result.output.split())
    assert sorted(p.name for p in out.iterdir()) == [".merge-lora.pending.json", "model-0123abcd-00001.safetensors"]
    # on a Volume shared between machines, a pid of another host says nothing: never taken as dead
    (out / ".merge-lora.pending.json").write_text(json.dumps({"host": "other-node", "pid": 1, "tag": "0123abcd"}))
    result = _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32", "--force"])
    assert result.exit_code == 2 and _one_error_line(result.output)
    assert (f"{out}: a merge-lora on other-node (pid 1) is writing there, or was killed; once it is gone, remove "
            f"{out / '.merge-lora.pending.json'} and {out}/model-0123abcd-*.safetensors (or pass another --output)"
            ) in " ".join(result.output.split())
    assert sorted(p.name for p in out.iterdir()) == [".merge-lora.pending.json", "model-0123abcd-00001.safetensors"]


def test_a_link_in_the_output_is_refused_before_anything_loads(lora_run, tmp_path):
    """A link planted in an earlier merge (at a name merge.json lists) is never written through or replaced."""
    run, _ = lora_run
    out = tmp_path / "merged"
    assert _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32"]).exit_code == 0
    victim = tmp_path / "victim.json"
    victim.write_text("VICTIM")
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(victim)
    result = _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32", "--force"])
    assert result.exit_code == 2 and _one_error_line(result.output)
    assert f"{out / 'config.json'} is a symbolic link (to {victim})" in " ".join(result.output.split())
    assert victim.read_text() == "VICTIM" and (out / "config.json").is_symlink()


def test_disk_full_during_a_merge_is_one_line_and_leaves_no_partial_files(lora_run, tmp_path, monkeypatch):
    """#47 item 10: ENOSPC while a shard is written (safetensors' own error, or an OSError) or while the small
    files go: one line with the space needed and free, no partial file left; an earlier merge that --force was
    replacing is intact (byte for byte, still published) when the failure comes before it was unpublished."""
    import builtins
    import errno
    import shutil
    from types import SimpleNamespace

    import safetensors.torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ftcli.artifacts import merge

    run, _ = lora_run
    monkeypatch.setattr(merge, "MAX_SHARD_SIZE", "200KB")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2**30, used=2**30, free=3 * 2**19))
    out, real_save, real_open = tmp_path / "merged", safetensors.torch.save_file, builtins.open
    calls = []

    def full_at(n, error):
        def save_file(tensors, filename, **kwargs):
            calls.append(filename)
            if len(calls) == n:
                with real_open(filename, "wb") as f:
                    f.write(b"half a shard")
                raise error
            return real_save(tensors, filename, **kwargs)
        calls.clear()
        return save_file

    def merge_fails(*extra):
        result = _cli(["merge-lora", str(run), "--output", str(out), "--dtype", "float32", *extra])
        assert result.exit_code == 2 and _one_error_line(result.output), result.output
        return " ".join(result.output.split())

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full_at(2, SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)")))
        message = merge_fails()
    assert list(tmp_path.iterdir()) == []  # no partial shard, no output dir
    merge.merge_lora(run, output=out, dtype="float32")
    earlier = _snapshot(out)
    needed = sum(t.numel() * t.element_size() for f in out.glob("*.safetensors") for t in load_file(f).values())
    assert message == (
        f"error: merge-lora could not write the merged model to {out}: Error while serializing: I/O error: No space "
        f"left on device (os error 28); it needs about {needed / 2**20:,.1f} MiB, 1.5 MiB are free there: free "
        "space; nothing half-written is left")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full_at(3, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
        message = merge_fails("--force")
    assert message.endswith("[Errno 28] No space left on device; it needs about %s MiB, 1.5 MiB are free there: "
                            "free space; nothing half-written is left (the earlier merge there is intact)"
                            % f"{needed / 2**20:,.1f}")
    assert _snapshot(out) == earlier and _accepted_by_generate_or_register(out)

    def open_(file, mode="r", *args, **kwargs):  # the weights went; the disk fills up on the index
        if str(file).endswith("/model.safetensors.index.json") and "x" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real_open(file, mode, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", open_)
        message = merge_fails("--force")
    assert message.startswith(f"error: merge-lora could not write the merged model to {out}: [Errno 28] No space "
                              f"left on device: '{out / 'model.safetensors.index.json'}'; it needs about ")
    assert message.endswith("nothing half-written is left")  # the earlier merge was already unpublished
    assert list(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []  # a dir it did not create stays, empty


def test_a_base_whose_safetensors_header_lies_is_one_line_through_the_cli(lora_run, tmp_path):
    """#47 item 11 through `ftcli merge-lora`: the base's header promises a tensor past the end of the file, or
    gives a tensor a dtype its bytes do not fit: one line naming the file (safetensors' own reason); nothing is
    left in -o."""
    import shutil

    run, base = lora_run
    for how in ("past-the-end", "other-dtype"):
        lying = tmp_path / f"base-{how}"
        shutil.copytree(base, lying)
        blob = (lying / "model.safetensors").read_bytes()
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
        name = next(k for k in header if k != "__metadata__" and header[k]["dtype"] == "BF16")
        if how == "past-the-end":
            header[name]["data_offsets"][1] += 10**9
        else:
            header[name]["dtype"] = "F32"  # the same bytes hold half as many values as the shape says
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        (lying / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + n:])
        out = tmp_path / f"out-{how}"
        result = _cli(["merge-lora", str(run), "--base", str(lying), "--output", str(out), "--dtype", "float32"])
        assert result.exit_code == 2 and _one_error_line(result.output), result.output
        assert (f"error: base file {lying / 'model.safetensors'}: safetensors cannot read it (Error while "
                "deserializing header: ") in " ".join(result.output.split()), result.output
        assert not out.exists()
