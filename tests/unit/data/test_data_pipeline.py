"""The data path end to end: sources, row validation, strict mode, cache hits, synthetic data."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from _data_common import ASSETS, BAD_ROWS, A, S, U, recipe, tokenizer, write_jsonl

from ftcli.data import iter_examples, open_prepared, prepare, prepare_blocks
from ftcli.data import pipeline
from ftcli.data.cache import BlockWriter
from ftcli.data.stats import DataStats
from ftcli.config.errors import UserError

def test_bad_rows_are_counted_by_reason_with_first_indices(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    r = recipe(tmp_path, data__path=path, data__packing__block_len=64)
    packed = prepare_blocks(r, tokenizer("qwen"))
    stats = packed.stats
    assert stats.examples_read == 13 and stats.examples_kept == 3
    assert stats.skipped == {
        "invalid JSON": 1, "messages missing": 1, "messages not a list": 1, "unknown role": 2,
        "content not a string": 1, "no assistant turn": 2, "system not first": 1, "no messages": 1,
    }
    assert stats.dropped_turns == {"trailing user/tool turn": 1} and stats.rows_with_dropped_turns == 1
    assert list(stats.sources) == [str(path)] and stats.sources[str(path)].skipped == stats.skipped
    assert stats.first_skipped["unknown role"] == [4, 12] and stats.first_skipped["invalid JSON"] == [1]


def test_strict_stops_at_first_bad_row_with_index_and_reason(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS[:1] + BAD_ROWS[4:])
    r = recipe(tmp_path, data__path=path, data__strict="true")
    with pytest.raises(UserError) as e:
        prepare_blocks(r, tokenizer("qwen"))
    assert str(e.value) == (
        "data row 1: unknown role: message 1 has role 'robot'; expected one of system, developer, user, "
        "assistant, tool (data.strict is on; turn it off to skip and count bad rows)"
    )
    # a lenient run caches the result; a strict run on that cache still stops at the first bad row
    prepare_blocks(recipe(tmp_path, data__path=path), tokenizer("qwen"))
    with pytest.raises(UserError, match=r"^data row 1: unknown role: message 1 has role .robot."):
        prepare_blocks(r, tokenizer("qwen"))


def test_zero_trained_examples_are_counted_not_trained(tmp_path):
    long_user = {"role": "user", "content": "count " * 200}
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [U, A]}, {"messages": [long_user, A]}])
    r = recipe(tmp_path, data__path=path, data__max_length=64, data__packing__enabled="false")
    stats = DataStats()
    examples = list(iter_examples(r, tokenizer("qwen"), stats))
    assert [e.index for e in examples] == [0]
    assert stats.skipped == {"zero trained tokens": 1} and stats.first_skipped == {"zero trained tokens": [1]}
    assert stats.truncated == 0 and stats.zero_trained == 1  # counted once, as skipped
    assert stats.trained_lost_truncation == 8  # "\n</think>\n\n13<|im_end|>\n" of the cut example


def test_rows_over_max_row_chars_are_skipped_and_counted_before_tokenizing(tmp_path, monkeypatch):
    """A 3 MB row (generated here, never committed) is skipped under its reason before the chat encoder
    sees it: the encoder is only ever handed rows within the bound."""
    huge = {"messages": [{"role": "user", "content": "word " * 600_000}, A]}
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [U, A]}, huge, {"messages": [S, U, A]}])
    assert path.stat().st_size > 3_000_000
    encoded = []
    real = pipeline.ChatEncoder.encode

    def encode(self, messages, *args, **kwargs):
        encoded.append(sum(len(m.get("content") or "") for m in messages))
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(pipeline.ChatEncoder, "encode", encode)
    r = recipe(tmp_path, data__path=path, data__packing__block_len=64)
    assert pipeline.row_char_limit(r.data) == 64 * 64  # the default: 64 characters per block token
    stats = prepare_blocks(r, tokenizer("qwen")).stats
    assert (stats.examples_read, stats.examples_kept) == (3, 2)
    assert stats.skipped == {"row too long": 1} and stats.first_skipped == {"row too long": [1]}
    assert stats.first_detail["row too long"] == "3,000,002 characters > data.max_row_chars 4,096"  # 3,000,000 + "13"
    assert encoded == [19, 28]  # the two small rows only
    encoded.clear()
    r = recipe(tmp_path, data__path=path, data__packing__block_len=64, data__max_row_chars=20)
    stats = prepare_blocks(r, tokenizer("qwen")).stats  # a setting of its own: a new cache entry
    assert stats.skipped == {"row too long": 2} and stats.first_skipped == {"row too long": [1, 2]}
    assert encoded == [19]
    assert pipeline.row_char_limit(recipe(tmp_path, data__packing__enabled="false", data__max_length=100).data) == 6400


def test_packed_blocks_without_a_trained_token_are_dropped_and_counted(tmp_path):
    """split packing cuts a long prompt into blocks that hold only prompt tokens: those are not written."""
    from ftcli.data import data_summary

    long_prompt = {"messages": [{"role": "user", "content": "count " * 250}, A]}
    path = write_jsonl(tmp_path / "d.jsonl", [long_prompt])
    tok = tokenizer("qwen")
    (example,) = iter_examples(recipe(tmp_path, data__path=path, data__packing__enabled="false"), tok)
    trained = np.asarray(example.labels) != -100
    starts = range(0, len(trained), 64)
    per_block = [int(trained[k + 1 : k + 64].sum()) for k in starts]  # label[0] of a block is unused
    assert len(per_block) >= 4 and per_block.count(0) >= 3
    r = recipe(tmp_path, data__path=path, data__packing__block_len=64, data__packing__strategy="split")
    packed = prepare_blocks(r, tok)
    assert packed.stats.blocks_without_trained == per_block.count(0)
    assert packed.stats.blocks == len(packed) == len(per_block) - per_block.count(0)
    assert [int(n) for n in packed.block_trained] == [n for n in per_block if n]
    assert ("  dropped blocks", f"{per_block.count(0)} with no trained token (not in blocks)") in (
        data_summary(r, packed).rows())


def test_iter_examples_labels_are_unshifted_masked_ids(tmp_path):
    r = recipe(tmp_path, data__max_examples=5, data__packing__enabled="false")
    tok = tokenizer("qwen")
    for ex in iter_examples(r, tok):
        assert len(ex.input_ids) == len(ex.labels) == len(ex["input_ids"])
        trained = [t for t, lab in zip(ex.input_ids, ex.labels) if lab != -100]
        assert trained == [lab for lab in ex.labels if lab != -100]
        assert tok.decode(trained).endswith("<|im_end|>\n")


def test_cache_hit_on_second_call_does_not_retokenize(tmp_path):
    r = recipe(tmp_path, data__max_examples=200)
    tok = tokenizer("qwen")
    builds = pipeline.BUILDS["count"]
    first = prepare_blocks(r, tok)
    mtime = (first.path / "meta.json").stat().st_mtime_ns
    second = prepare_blocks(r, tok)
    assert pipeline.BUILDS["count"] == builds + 1
    assert not first.from_cache and second.from_cache and second.path == first.path
    assert (second.path / "meta.json").stat().st_mtime_ns == mtime
    assert [second.block(i).input_ids.tolist() for i in range(len(second))] == [
        first.block(i).input_ids.tolist() for i in range(len(first))
    ]
    # everything that changes the bytes changes the key
    for change in (dict(data__train_on="all"), dict(data__packing__block_len=512), dict(data__max_examples=100)):
        assert prepare(recipe(tmp_path, **{"data__max_examples": 200, **change}), tok) != first.path
    assert pipeline.BUILDS["count"] == builds + 4


def test_cache_key_follows_local_file_changes(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [U, A]}])
    r = recipe(tmp_path, data__path=path)
    before = prepare(r, tokenizer("qwen"))
    write_jsonl(path, [{"messages": [U, A]}, {"messages": [S, U, A]}])
    os.utime(path, ns=(1, 2))
    after = prepare(r, tokenizer("qwen"))
    assert after != before and open_prepared(r, tokenizer("qwen")).stats.examples_read == 2
    # an edit that keeps the size, with its mtime put back (as `touch -d` does): its ctime changed
    st = path.stat()
    text = path.read_text()
    path.write_text(text.replace("13", "31"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    edited = prepare(r, tokenizer("qwen"))
    assert edited not in (before, after)


def test_other_ranks_read_what_rank0_prepared(tmp_path):
    r = recipe(tmp_path, data__max_examples=50)
    with pytest.raises(UserError, match="no prepared data"):
        open_prepared(r, tokenizer("qwen"))
    path = prepare(r, tokenizer("qwen"))
    assert open_prepared(r, tokenizer("qwen")).path == path


def test_concurrent_cache_writes_keep_one_complete_entry(tmp_path):
    from ftcli.data.cache import cache_key

    parts = {"format_version": 1, "data": "x"}
    final = tmp_path / cache_key(parts)
    writers = [BlockWriter(final) for _ in range(2)]
    for k, w in enumerate(writers):
        w.add(np.array([1, 2, 3], np.int32) + k, np.ones(3, bool), [3])
    for k, w in enumerate(writers):
        assert w.commit({"format_version": 1, "key": final.name, "key_parts": parts, "writer": k}) == final
    assert json.loads((final / "meta.json").read_text())["writer"] == 0  # the first rename won
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]  # the loser's temp dir is gone


# ------------------------------------------------------------------ a cache entry is checked before it is used
def _blocks(packed) -> list[list[int]]:
    return [packed.block(i).input_ids.tolist() for i in range(len(packed))]


def _damage_shuffle(entry: Path) -> None:
    ids = np.fromfile(entry / "input_ids.bin", dtype=np.int32)
    np.random.default_rng(0).permutation(ids).tofile(entry / "input_ids.bin")  # same size, other order


def _damage_truncate(entry: Path) -> None:
    os.truncate(entry / "loss_mask.bin", 5)


def _damage_garble_meta(entry: Path) -> None:
    (entry / "meta.json").write_text('{"format_version": 1, "key": ')


def _damage_remove_meta(entry: Path) -> None:
    (entry / "meta.json").unlink()


def _damage_edit_counts(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps({**meta, "num_blocks": meta["num_blocks"] + 5}))


@pytest.mark.parametrize("damage, why", [
    (_damage_shuffle, "input_ids.bin does not match the checksum taken when it was written (changed since)"),
    (_damage_truncate, "loss_mask.bin has 5 bytes, "),
    (_damage_garble_meta, "its meta.json is unreadable"),
    (_damage_remove_meta, "it has no meta.json"),
    (_damage_edit_counts, "its meta.json's block and token counts do not match its files"),
])
def test_a_damaged_cache_entry_is_rebuilt_with_one_line(tmp_path, capsys, damage, why):
    """Shuffled ids (same size), a truncated file, a garbled or removed meta.json, edited counts: the next
    prepare says why in one line, rebuilds the entry in place (the same blocks as before) and leaves no
    temp dir; the other ranks' open refuses in one line instead of training on it. A removed meta.json used to
    wedge every later run (`Directory not empty`, one more .tmp-* each time)."""
    r = recipe(tmp_path, data__max_examples=60)
    tok = tokenizer("qwen")
    first = prepare_blocks(r, tok)
    want, entry = _blocks(first), first.path
    del first
    damage(entry)
    if damage is not _damage_shuffle:  # the other ranks check the sizes (rank 0 has just checked the checksums)
        with pytest.raises(UserError) as err:
            open_prepared(r, tok)
        assert str(err.value).startswith(f"the pack cache entry {entry} is not usable: {why}")
    capsys.readouterr()
    builds = pipeline.BUILDS["count"]
    again = prepare_blocks(r, tok)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"note: the pack cache entry {entry} is not used: {why}")
    assert lines[0].endswith("; rebuilding it")
    assert pipeline.BUILDS["count"] == builds + 1 and again.path == entry and _blocks(again) == want
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]
    assert _blocks(prepare_blocks(r, tok)) == want and pipeline.BUILDS["count"] == builds + 1  # trusted again


def test_another_tokenizers_entry_under_this_key_is_never_used(tmp_path, capsys):
    """An entry written for another tokenizer, copied under this spec's key: its key_parts do not hash to the
    name, so it is rebuilt (the blocks are this tokenizer's), never trained on."""
    import shutil

    r = recipe(tmp_path, data__max_examples=60)
    qwen, llama = tokenizer("qwen"), tokenizer("llama3")
    want = _blocks(prepare_blocks(r, qwen))
    mine, other = pipeline.entry_path(r, qwen), prepare(r, llama)
    assert other != mine
    shutil.rmtree(mine)
    shutil.copytree(other, mine)
    capsys.readouterr()
    assert _blocks(prepare_blocks(r, qwen)) == want
    assert "it was written for other data or another tokenizer" in capsys.readouterr().err


def test_a_link_at_the_cache_entry_is_refused_and_its_target_untouched(tmp_path):
    r = recipe(tmp_path, data__max_examples=20)
    tok = tokenizer("qwen")
    entry = pipeline.entry_path(r, tok)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "meta.json").write_text("VICTIM")
    entry.parent.mkdir(parents=True)
    entry.symlink_to(victim)
    with pytest.raises(UserError) as err:
        prepare_blocks(r, tok)
    assert str(err.value) == (f"{entry} is a symbolic link (to {victim}); ftcli does not write, rename or delete "
                              "through links in the pack cache: remove it or set data.cache_dir elsewhere")
    assert sorted(p.name for p in victim.iterdir()) == ["meta.json"] and (victim / "meta.json").read_text() == "VICTIM"


def test_a_full_disk_while_caching_is_one_line_and_leaves_no_temp_dir(tmp_path, monkeypatch):
    """An OSError out of a cache write (ENOSPC), also when closing the files fails too (the flush of a full
    disk): one UserError, the temp dir removed; the next run builds the entry."""
    import errno

    r = recipe(tmp_path, data__max_examples=60)
    tok = tokenizer("qwen")
    real_add, real_close = BlockWriter.add, BlockWriter._close

    def full(self, *a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BlockWriter, "add", full)
    monkeypatch.setattr(BlockWriter, "_close", full)
    with pytest.raises(UserError) as err:
        prepare_blocks(r, tok)
    entry = pipeline.entry_path(r, tok)
    assert re.fullmatch(rf"the pack cache entry {re.escape(str(entry))} could not be written: No space left on "
                        r"device \([\d,.]+ MiB free there\); nothing half-written is left: free space or set "
                        r"data.cache_dir elsewhere", str(err.value))
    assert list(entry.parent.iterdir()) == []
    monkeypatch.setattr(BlockWriter, "add", real_add)
    monkeypatch.setattr(BlockWriter, "_close", real_close)
    assert len(prepare_blocks(r, tok)) > 0


def test_local_jsonl_parquet_arrow_and_directory_give_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (ASSETS / "tiny_chat.jsonl").read_text().splitlines()[:40]]
    table = pa.Table.from_pylist(rows)
    (tmp_path / "dir").mkdir()
    pq.write_table(table.slice(0, 25), tmp_path / "dir" / "a.parquet")
    with pa.ipc.new_stream(str(tmp_path / "dir" / "b.arrow"), table.schema) as w:
        w.write_table(table.slice(25))
    write_jsonl(tmp_path / "all.jsonl", rows)
    tok = tokenizer("qwen")
    got = {}
    for name in ("all.jsonl", "dir", "dir/a.parquet"):
        r = recipe(tmp_path, data__path=tmp_path / name, data__packing__enabled="false")
        got[name] = [e.input_ids for e in iter_examples(r, tok)]
    assert len(got["all.jsonl"]) == 40 and got["dir"] == got["all.jsonl"] and got["dir/a.parquet"] == got["dir"][:25]


def test_prompt_completion_rows_use_the_chat_template(tmp_path):
    rows = [
        {"prompt": "What is 7 plus 6?", "completion": " 13."},
        {"prompt": [U], "completion": [A]},
        {"prompt": "x", "completion": ["y"]},
        {"prompt": "x"},
    ]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    r = recipe(tmp_path, data__path=path, data__format="prompt_completion", data__packing__enabled="false")
    tok = tokenizer("qwen")
    stats = DataStats()
    text, chat = list(iter_examples(r, tok, stats))
    assert stats.skipped == {"prompt/completion types differ": 1, "completion missing": 1}
    # string fields: the user turn + assistant turn generate/chat ask in, not prompt + completion + eos
    assert tok.decode(text.input_ids).endswith("<|im_start|>user\nWhat is 7 plus 6?<|im_end|>\n"
                                               "<|im_start|>assistant\n<think>\n\n</think>\n\n13.<|im_end|>\n")
    assert tok.decode([t for t, lab in zip(text.input_ids, text.labels) if lab != -100]) == "\n</think>\n\n13.<|im_end|>\n"
    assert tok.decode([lab for lab in chat.labels if lab != -100]) == "\n</think>\n\n13<|im_end|>\n"


def test_prompt_completion_rows_are_plain_text_only_without_a_chat_template():
    import copy
    from types import SimpleNamespace

    tok = copy.deepcopy(tokenizer("qwen"))
    tok.chat_template = None
    src = SimpleNamespace(format="prompt_completion", messages_field="messages", tools_field="tools")
    data = SimpleNamespace(source_list=lambda: [src], train_on="assistant", special_tokens_in_text="keep",
                           max_row_chars=None, max_length=None, packing=SimpleNamespace(enabled=True, block_len=1024))
    ids, mask, _, _ = pipeline.RowEncoder(data, tok)(0, {"prompt": "What is 7 plus 6?", "completion": " 13."})
    assert tok.decode(ids.tolist()) == "What is 7 plus 6? 13.<|im_end|>"
    assert tok.decode(ids[mask].tolist()) == " 13.<|im_end|>"


def test_synthetic_data_is_seeded_long_tailed_and_masked(tmp_path):
    def lengths(seed):
        r = recipe(tmp_path, data__source="synthetic", data__synthetic__num_examples=2000,
                   data__synthetic__mean_tokens=400, data__synthetic__seed=seed, data__packing__enabled="false")
        ex = list(iter_examples(r, tokenizer("qwen")))
        return np.array([len(e.input_ids) for e in ex]), ex

    a, ex_a = lengths(0)
    b, _ = lengths(0)
    c, _ = lengths(1)
    assert (a == b).all() and not (a == c).all()
    assert abs(a.mean() / 400 - 1) < 0.1 and np.median(a) < 0.7 * a.mean() and a.max() > 4 * a.mean()
    masked = np.mean([np.mean(np.array(e.labels) == -100) for e in ex_a])
    assert abs(masked - 0.3) < 0.05  # prompt_fraction
    special = set(tokenizer("qwen").added_tokens_decoder)
    assert not special & {t for e in ex_a[:200] for t in e.input_ids}


def test_data_package_is_pure_data_code():
    root = Path(__file__).resolve().parents[3] / "ftcli" / "data"
    for f in root.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"^\s*(import|from)\s+(torch\.distributed|mlflow|typer|ftcli\.cli)", text, re.M), f
        if f.name != "collate.py":
            assert not re.search(r"^\s*(import|from)\s+torch\b", text, re.M), f


def test_hub_source_streams_rows_like_a_local_file(tmp_path):
    """The hub path (`datasets.load_dataset(path, revision, split, streaming)`), on a local dataset dir."""
    rows = [{"messages": [U, A]}, {"messages": [S, U, A, U, A]}, {"messages": [U]}]
    (tmp_path / "ds").mkdir()
    write_jsonl(tmp_path / "ds" / "train.jsonl", rows)
    tok = tokenizer("qwen")
    hub = recipe(tmp_path, data__source="hub", data__path=tmp_path / "ds", data__split="train",
                 data__streaming="true", data__packing__enabled="false")
    local = recipe(tmp_path, data__path=tmp_path / "ds" / "train.jsonl", data__packing__enabled="false")
    stats = DataStats()
    assert [e.input_ids for e in iter_examples(hub, tok, stats)] == [e.input_ids for e in iter_examples(local, tok)]
    assert stats.examples_read == 3 and stats.skipped == {"no assistant turn": 1}
    with pytest.raises(UserError, match="cannot load hub dataset"):
        missing = recipe(tmp_path, data__source="hub", data__path=tmp_path / "nope", data__streaming="true")
        list(iter_examples(missing, tok))


def test_a_fifo_or_device_as_data_path_is_named_for_what_it_is(tmp_path):
    """#47 item 15: it said "no ... files in this directory"."""
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/null")):
        with pytest.raises(UserError) as err:
            prepare(recipe(tmp_path, data__path=str(path)), tokenizer("qwen"))
        assert str(err.value) == (f"data.path {path} is not a regular file or a directory (a pipe or a device); "
                                  "write the rows to a file and point data.path at it")
