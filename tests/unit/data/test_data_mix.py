"""Dataset mixing (`data.sources`): per-source fields and weights, deterministic, counted per source."""

from __future__ import annotations

import json

import pytest
from _data_common import recipe, tokenizer, write_jsonl
from typer.testing import CliRunner

from ftcli.cli import app
from ftcli.data import BlockStream, load_tokenizer, prepare_blocks
from ftcli.data.pipeline import weighted
from ftcli.data.summary import data_summary
from ftcli.config.recipe import RecipeError

U = {"role": "user", "content": "What is 7 plus 6?"}
S = {"role": "system", "content": "Be brief."}


def _rows(n: int, word: str, field: str = "messages") -> list[dict]:
    return [{field: [U, {"role": "assistant", "content": f"{word} {i}"}]} for i in range(n)]


def _mix(tmp_path, sources: list[dict], **overrides):
    return recipe(tmp_path, data__path="null", data__sources=json.dumps(sources), data__packing__strategy="bfd",
                  data__packing__block_len=256, **overrides)


def _blocks(packed):
    return [(b.input_ids.tolist(), b.labels.tolist()) for b in (packed.block(i) for i in range(len(packed)))]


def test_single_source_form_equals_a_one_entry_mix(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", _rows(30, "alpha"))
    tok = tokenizer("qwen")
    single = prepare_blocks(recipe(tmp_path, data__path=path, data__packing__block_len=256), tok)
    mixed = prepare_blocks(recipe(tmp_path, data__path="null", data__sources=json.dumps([{"source": "local", "path": str(path)}]),
                                  data__packing__block_len=256), tok)
    assert _blocks(single) == _blocks(mixed) and len(single) == 8


def test_weights_repeat_and_sample_rows_deterministically(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", _rows(40, "alpha"))
    b = write_jsonl(tmp_path / "b.jsonl", _rows(40, "beta", field="conversation"))
    sources = [{"name": "a", "source": "local", "path": str(a), "weight": 2},
               {"name": "b", "source": "local", "path": str(b), "weight": 0.5, "messages_field": "conversation"}]
    tok = tokenizer("qwen")
    packed = prepare_blocks(_mix(tmp_path / "1", sources), tok)
    again = prepare_blocks(_mix(tmp_path / "2", sources), tok)
    other_seed = prepare_blocks(_mix(tmp_path / "3", sources, data__mix_seed=1), tok)
    st = packed.stats
    assert st.sources["a"].examples_read == 80 and st.sources["a"].examples_kept == 80
    assert st.sources["b"].examples_read == 20 and st.sources["b"].skipped == {}  # a seeded half of 40
    assert st.examples_read == 100 and _blocks(packed) == _blocks(again)
    assert other_seed.stats.sources["b"].examples_read != 20 or _blocks(other_seed) != _blocks(packed)
    # every example is one bfd segment: the per-source trained tokens add up to the blocks' exactly
    assert sum(s.trained_tokens for s in st.sources.values()) == int(packed.block_trained.sum())
    assert sum(s.tokens for s in st.sources.values()) == st.tokens


def test_weighted_passes():
    rows = [(i, i) for i in range(1000)]
    once_and_half = [i for i, _ in weighted(lambda: iter(rows), 1.5, 0, 0)]
    assert once_and_half[:1000] == list(range(1000)) and 450 < len(once_and_half) - 1000 < 550
    assert [i for i, _ in weighted(lambda: iter(rows), 1.5, 0, 0)] == once_and_half
    assert len([i for i, _ in weighted(lambda: iter(rows), 3, 7, 1)]) == 3000


def test_mix_with_synthetic_and_strict_names_the_source(tmp_path):
    good = write_jsonl(tmp_path / "g.jsonl", _rows(5, "alpha"))
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": [U]}])
    sources = [{"name": "syn", "source": "synthetic", "synthetic": {"num_examples": 7, "mean_tokens": 40}},
               {"name": "good", "source": "local", "path": str(good)},
               {"name": "bad", "source": "local", "path": str(bad)}]
    packed = prepare_blocks(_mix(tmp_path, sources), tokenizer("qwen"))
    assert {k: (v.examples_read, v.examples_kept) for k, v in packed.stats.sources.items()} == {
        "syn": (7, 7), "good": (5, 5), "bad": (1, 0)}
    with pytest.raises(Exception, match="^data row 0 of source 'bad': no assistant turn"):
        prepare_blocks(_mix(tmp_path / "s", sources, data__strict="true"), tokenizer("qwen"))


def test_mix_schema_errors_are_one_line(tmp_path):
    with pytest.raises(RecipeError, match="data.sources: two sources have the same name/path"):
        _mix(tmp_path, [{"source": "local", "path": "/x.jsonl"}, {"source": "local", "path": "/x.jsonl"}])
    with pytest.raises(RecipeError, match=r"data.sources.0.weight"):
        _mix(tmp_path, [{"source": "local", "path": "/x.jsonl", "weight": 0}])


def test_pack_preview_shows_per_source_rows_tokens_and_trained_tokens(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", _rows(12, "alpha"))
    b = write_jsonl(tmp_path / "b.jsonl", _rows(6, "beta") + [{"messages": [U]}])
    sources = [{"name": "a", "source": "local", "path": str(a)}, {"name": "b", "source": "local", "path": str(b)}]
    sets = ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.path=null", "--set", f"data.sources={json.dumps(sources)}",
            "--set", "data.packing.strategy=bfd", "--set", "data.packing.block_len=256", "--set", "eval=null"]
    res = CliRunner().invoke(app, ["pack-preview", "-r", "tiny-qwen-cpu", *sets, "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    r = _mix(tmp_path, sources)
    packed = prepare_blocks(r, load_tokenizer(r.model, r.data))
    assert packed.from_cache
    blocks = list(BlockStream(packed, 0, 1))
    assert {k: (v["rows_read"], v["kept"], v["skipped_by_reason"]) for k, v in summary["sources"].items()} == {
        "a": (12, 12, {}), "b": (7, 6, {"no assistant turn": 1})}
    assert sum(v["trained_tokens"] for v in summary["sources"].values()) == summary["trained_tokens"] == sum(
        b.num_trained_tokens for b in blocks)
    assert summary == {**data_summary(r, packed).to_dict(), "from_cache": False,
                       "preview_seconds": summary["preview_seconds"]}
    args = ["pack-preview", "-r", "tiny-qwen-cpu", *sets, "--blocks", "0"]
    text = CliRunner().invoke(app, args, env={"COLUMNS": "200"}).stdout
    assert "sources" in text and "skipped by reason" in text and "no assistant turn 1" in text


def test_the_one_source_keys_are_the_shorthand_for_one_sources_entry():
    """data.sources is the one form every reader sees; the one-source keys become its single entry and are what a
    dump writes back; both forms at once are one line that says how to drop the shorthand."""
    from ftcli.config.recipe import Recipe, SourceConfig, dump_recipe, load_recipe, parse_yaml

    short = load_recipe("tiny-qwen-cpu")
    assert short.data.sources == [SourceConfig(source="local", path="pkg://assets/tiny_chat.jsonl", split="train")]
    assert short.data.one_source and "sources" not in short.to_dict()["data"]
    mix = load_recipe("tiny-qwen-cpu", ["data.path=null", "data.sources=[{source: local, path: pkg://assets/tiny_chat.jsonl}]"])
    assert not mix.data.one_source and mix.data.source_list() == short.data.source_list()
    assert mix.to_dict()["data"]["path"] is None and len(mix.to_dict()["data"]["sources"]) == 1
    for r in (short, mix):
        assert Recipe.model_validate(parse_yaml(dump_recipe(r))) == r
    with pytest.raises(RecipeError) as e:
        load_recipe("tiny-qwen-cpu", ["data.sources=[{source: synthetic}]"])
    assert str(e.value) == ("invalid recipe 'tiny-qwen-cpu': data: data.sources and data.source, data.path are both set; those keys "
                            "are the shorthand for a single data.sources entry: keep one form (--set data.path=null "
                            "drops the shorthand)")


def test_source_labels_are_the_shortest_unique_path_tails():
    from ftcli.data.summary import short_labels

    assert short_labels(["/tmp/new/a.jsonl", "/tmp/new/b.jsonl", "mine"]) == {
        "/tmp/new/a.jsonl": "a.jsonl", "/tmp/new/b.jsonl": "b.jsonl", "mine": "mine"}
    assert short_labels(["/x/a/data.jsonl", "/y/b/data.jsonl", "pkg://assets/tiny_chat.jsonl"]) == {
        "/x/a/data.jsonl": "a/data.jsonl", "/y/b/data.jsonl": "b/data.jsonl",
        "pkg://assets/tiny_chat.jsonl": "tiny_chat.jsonl"}
    assert short_labels(["/d/data.jsonl", "/e/d/data.jsonl"]) == {"/d/data.jsonl": "d/data.jsonl",
                                                                  "/e/d/data.jsonl": "e/d/data.jsonl"}


def test_pack_preview_names_unnamed_sources_apart_at_80_columns(tmp_path):
    long_dir = tmp_path / "a-rather-long-directory-name-for-my-data"
    long_dir.mkdir()
    a = write_jsonl(long_dir / "alpha.jsonl", _rows(4, "alpha"))
    b = write_jsonl(long_dir / "beta.jsonl", _rows(4, "beta"))
    sources = [{"source": "local", "path": str(a)}, {"source": "local", "path": str(b)}]
    sets = ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.path=null", "--set", f"data.sources={json.dumps(sources)}",
            "--set", "data.packing.strategy=bfd", "--set", "data.packing.block_len=256", "--set", "eval=null"]
    res = CliRunner().invoke(app, ["pack-preview", "-r", "tiny-qwen-cpu", *sets, "--blocks", "0"],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    summary, sources = res.stdout.split("\nsources")
    assert "│   source alpha.jsonl │" in summary and "│   source beta.jsonl  │" in summary
    rows = sources.split("─\n", 1)[1].splitlines()  # the compact table: the rows under its header rule
    assert [line.split()[0] for line in rows if line.strip()] == ["alpha.jsonl", "beta.jsonl"]  # whole labels
    assert "…" not in sources and str(long_dir) not in res.stdout
