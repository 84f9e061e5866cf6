"""`source: delta` (ftcli.data.delta): rows from Delta tables the tests write with deltalake (no mock of the
table): every row format packs exactly as the same rows in a JSONL file, a version or a timestamp pins what is
read, a schema change between versions, the version in the pack cache key; a row filter reads exactly its rows,
prunes partitions, and is in the cache key and the lineage."""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone

import pytest
from _data_common import recipe, tokenizer, write_jsonl

from ftcli.config.errors import UserError
from ftcli.config.recipe import RecipeError
from ftcli.data import prepare_blocks
from ftcli.data.pipeline import recipe_cache_parts
from ftcli.data.summary import data_summary

pa = pytest.importorskip("pyarrow")
deltalake = pytest.importorskip("deltalake")

U = {"role": "user", "content": "What is 7 plus 6?"}

FORMATS = {
    "messages": lambda i: {"messages": [U, {"role": "assistant", "content": f"answer {i}"}]},
    "sharegpt": lambda i: {"conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": f"reply {i}"}]},
    "alpaca": lambda i: {"instruction": f"Add {i} and 1.", "input": "" if i % 2 else f"{i}", "output": f"{i + 1}"},
    "prompt_completion": lambda i: {"prompt": f"Count to {i}:", "completion": " ".join(map(str, range(i % 5 + 1)))},
}


def _blocks(packed):
    return [(b.input_ids.tolist(), b.labels.tolist()) for b in (packed.block(i) for i in range(len(packed)))]


def _write(path, rows, **kwargs):
    deltalake.write_deltalake(str(path), pa.Table.from_pylist(rows), **kwargs)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_delta_table_packs_like_the_same_rows_in_a_jsonl_file(tmp_path, fmt):
    """Two appends (two files, version 1) read in order: blocks, labels, format detection and counts equal the
    JSONL file's; the summary records the source as delta."""
    rows = [FORMATS[fmt](i) for i in range(24)]
    table = tmp_path / "table"
    _write(table, rows[:10])
    _write(table, rows[10:], mode="append")
    tok = tokenizer("qwen")
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    by_file = recipe(tmp_path / "f", data__path=jsonl, data__format="auto", data__packing__block_len=128)
    by_table = recipe(tmp_path / "d", data__source="delta", data__path=table, data__format="auto",
                      data__packing__block_len=128)
    from_file, from_table = prepare_blocks(by_file, tok), prepare_blocks(by_table, tok)
    assert len(from_table) > 1 and _blocks(from_table) == _blocks(from_file)
    file_sum, table_sum = data_summary(by_file, from_file), data_summary(by_table, from_table)
    assert table_sum.examples == file_sum.examples and table_sum.examples["kept"] == 24
    (only,) = table_sum.sources.values()
    assert only.format == fmt and only.rows_read == 24


def test_version_and_timestamp_pin_the_rows_across_a_schema_change(tmp_path):
    """v0: 3 rows; v1: 2 appended; v2: overwritten with a new column (schema change) and 4 rows. A version, or
    the timestamp of a commit, reads that version; unset reads the newest; `columns` reads a subset, and a column
    the version does not have is one line. The version read is in the cache key."""
    from ftcli.data import delta, sources

    table = tmp_path / "table"
    _write(table, [FORMATS["messages"](i) for i in range(3)])
    _write(table, [FORMATS["messages"](i) for i in range(3, 5)], mode="append")
    _write(table, [{**FORMATS["messages"](i), "score": i} for i in range(10, 14)], mode="overwrite",
           schema_mode="overwrite")
    # Time travel by timestamp reads the commit files' modification times (Delta's rule without in-commit
    # timestamps); writes a millisecond apart can share one, so the test dates the three commits a month apart.
    for version, month in enumerate((1, 2, 3)):
        stamp = datetime(2026, month, 1, tzinfo=timezone.utc).timestamp()
        os.utime(table / "_delta_log" / f"{version:020d}.json", (stamp, stamp))

    def read(revision=None, columns=None):
        src = recipe(tmp_path, data__source="delta", data__path=table,
                     **({"data__revision": revision} if revision is not None else {}),
                     **({"data__columns": json.dumps(columns)} if columns else {})).data.source_list()[0]
        rows, total = sources.open_rows(src)
        return [row for _, row in rows], total, sources.fingerprint(src)

    v0, total0, key0 = read(0)
    assert [r["messages"][1]["content"] for r in v0] == ["answer 0", "answer 1", "answer 2"] and total0 == 3
    assert set(v0[0]) == {"messages"} and key0["version"] == 0
    v1, _, key1 = read(1)
    assert sorted(r["messages"][1]["content"] for r in v1) == [f"answer {i}" for i in range(5)]
    delta._OPENED.clear()
    assert read("2026-02-15T00:00:00Z")[2]["version"] == 1
    newest, total, key = read()
    assert key["version"] == 2 and total == 4
    assert [(r["messages"][1]["content"], r["score"]) for r in newest] == [(f"answer {i}", i) for i in range(10, 14)]
    assert [set(r) for r in read(columns=["messages"])[0]] == [{"messages"}] * 4
    with pytest.raises(UserError, match=r"^Delta table .* \(version 0\) has no column score \(it has messages\); fix "):
        read(0, columns=["score"])

    parts = [recipe_cache_parts(recipe(tmp_path, data__source="delta", data__path=table, data__revision=v))
             for v in (0, 1)]
    assert parts[0]["sources"][0]["rows"]["version"] == 0 and parts[1]["sources"][0]["rows"]["version"] == 1
    assert {**parts[0]["sources"][0]["rows"], "version": 1} == parts[1]["sources"][0]["rows"]
    with pytest.raises(UserError, match=r"^cannot read Delta table .* at revision 7: "):
        read(7)


def test_delta_source_keys_are_checked_in_the_recipe(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match="revision 'last week' of a delta source: a table version"):
        recipe(tmp_path, data__source="delta", data__path=tmp_path, data__revision="'last week'")
    with pytest.raises(RecipeError, match="give the timestamp's time zone"):
        recipe(tmp_path, data__source="delta", data__path=tmp_path, data__revision="2026-12-01T00:00:00")
    with pytest.raises(RecipeError, match="columns is for source=delta"):
        recipe(tmp_path, data__columns="[messages]")

    from ftcli.data import delta

    assert delta.is_uc_name("main.sft.chats") and not delta.is_uc_name("s3://b/t") and not delta.is_uc_name(
        str(tmp_path))
    monkeypatch.setitem(sys.modules, "databricks.sdk", None)  # the SDK not installed
    src = recipe(tmp_path, data__source="delta", data__path="main.sft.chats").data.source_list()[0]
    with pytest.raises(UserError, match=r"^data.path 'main.sft.chats' is a Unity Catalog table name; resolving it "
                                        r"needs the Databricks SDK \(pip install databricks-sdk"):
        delta.open_table(src)


def test_plan_sizes_a_delta_source_from_its_rows_as_it_does_files(tmp_path):
    """`ftcli plan`'s data size reads a Delta table's first rows and its row count like a JSONL file's: the same
    estimate for the same rows."""
    from ftcli.data import data_spec
    from ftcli.estimate.datasize import data_size

    def size(r):
        return data_size(data_spec(r), r.model)

    rows = [FORMATS["messages"](i) for i in range(40)]
    _write(tmp_path / "table", rows)
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    by_table = size(recipe(tmp_path / "d", data__source="delta", data__path=tmp_path / "table"))
    by_file = size(recipe(tmp_path / "f", data__path=jsonl))
    assert by_table.tokens == by_file.tokens > 0 and by_table.blocks == by_file.blocks
    assert by_table.source.startswith("estimate: first 40 of 40 rows")


# ------------------------------------------------------------------------------------------- data.filter
def _chat(i, lang):
    return {"messages": [U, {"role": "assistant", "content": f"answer {i}"}], "lang": lang, "score": i % 5}


def test_a_row_filter_reads_exactly_its_rows_and_prunes_partitions(tmp_path, monkeypatch):
    """A table partitioned by lang, written in 3 appends (9 files): a conjunction, an OR of conjunctions and a
    filter on a column `columns` leaves out read exactly the rows Python's filter keeps, in the unfiltered
    order; deltalake prunes the other partitions' files (only lang=en's 3 files are opened); the row count is
    the filtered one. A table with deletion vectors (deltalake's own engine) gives the same rows."""
    import datetime

    from ftcli.data import delta, sources

    langs = ["en", "de", "fr"]
    rows = [{**_chat(i, langs[i % 3]), "day": datetime.date(2026, 1, 1 + i % 7)} for i in range(60)]
    table, dv_table = tmp_path / "table", tmp_path / "dv"
    for part in (rows[:20], rows[20:40], rows[40:]):
        _write(table, part, mode="append", partition_by=["lang"])
        _write(dv_table, part, mode="append", configuration={"delta.enableDeletionVectors": "true"})
    opened = []
    real_order = delta._in_commit_order
    monkeypatch.setattr(delta, "_in_commit_order", lambda t, ds: opened.append(
        sorted(f.path.split("/")[0] for f in ds.get_fragments())) or real_order(t, ds))

    def read(where, path=table, columns=None):
        src = recipe(tmp_path, data__source="delta", data__path=path, data__filter=json.dumps(where),
                     **({"data__columns": json.dumps(columns)} if columns else {})).data.source_list()[0]
        got, total = sources.open_rows(src)
        return [row for _, row in got], total

    def answers(kept):
        return [r["messages"][1]["content"] for r in kept]

    everything, _ = read([["score", ">=", 0]])
    order = answers(everything)  # the unfiltered order (every score is >= 0)
    cases = {
        '[["lang", "=", "en"], ["score", ">=", 3]]': lambda r: r["lang"] == "en" and r["score"] >= 3,
        '[[["lang", "in", ["de", "fr"]], ["day", "<", "2026-01-03"]], [["score", "=", 4]]]':
            lambda r: (r["lang"] in ("de", "fr") and r["day"] < datetime.date(2026, 1, 3)) or r["score"] == 4,
        '[["lang", "not in", ["en"]], ["score", "!=", "2"]]': lambda r: r["lang"] != "en" and r["score"] != 2,
    }
    for where, keep in cases.items():
        opened.clear()
        kept, total = read(json.loads(where))
        want = [f"answer {r['messages'][1]['content'].split()[1]}" for r in rows if keep(r)]
        assert answers(kept) == [a for a in order if a in want] and sorted(answers(kept)) == sorted(want), where
        assert total == len(want) > 0
        dv, dv_total = read(json.loads(where), path=dv_table)
        assert sorted(answers(dv)) == sorted(want) and dv_total is None  # the engine's order, no cheap count
        if where.startswith('[["lang", "="'):
            assert opened == [["lang=en"] * 3]  # pruned: the de and fr files are never opened
    kept, _ = read([["score", "<", 1]], columns=["messages"])  # a filter on a column not read
    assert [set(r) for r in kept] == [{"messages"}] * 12 and answers(kept) == [a for a in order if int(a.split()[1]) % 5 == 0]
    dv, _ = read([["score", "<", 1]], path=dv_table, columns=["messages"])
    assert [set(r) for r in dv] == [{"messages"}] * 12


def test_a_row_filter_is_in_the_cache_key_and_the_lineage_and_bad_ones_are_one_line(tmp_path):
    """The filter (in one spelling: a conjunction or its DNF, `==` or `=`) is part of the pack cache key and of
    the recorded origin (run.json, MLflow: `where lang = "en"`); a column the table lacks, a value its column's
    type cannot hold, an unknown op, an `in` without a list, and a filter on a non-delta source are one line each
    (the table's checks run with the cache key, before any launch)."""
    from ftcli.artifacts.rundir import DataSourceRecord
    from ftcli.data import sources

    table = tmp_path / "table"
    _write(table, [_chat(i, "en" if i % 2 else "de") for i in range(8)])

    def src(where):
        return recipe(tmp_path, data__source="delta", data__path=table,
                      **({"data__filter": json.dumps(where)} if where is not None else {})).data.source_list()[0]

    plain, en = sources.fingerprint(src(None)), sources.fingerprint(src([["lang", "=", "en"]]))
    assert "filter" not in plain and en == {**plain, "filter": 'lang = "en"'}
    assert sources.fingerprint(src([[["lang", "==", "en"]]])) == en  # DNF and ==: the same rows, the same key
    parts = [recipe_cache_parts(recipe(tmp_path, data__source="delta", data__path=table, data__filter=json.dumps(w)))
             for w in ([["lang", "=", "en"]], [["lang", "=", "de"]])]
    assert parts[0]["sources"][0]["rows"]["filter"] == 'lang = "en"' and parts[0] != parts[1]
    origin = sources.origin(src([["lang", "=", "en"], ["score", ">", 1]]))
    assert origin["filter"] == 'lang = "en" AND score > 1' and origin["digest"] != sources.origin(src(None))["digest"]
    record = DataSourceRecord(label="t", rows_read=4, rows_kept=4, **origin)
    assert record.describe().startswith(f'delta {table}@0 where lang = "en" AND score > 1 (train) rows 4 read')
    assert "filter" not in sources.origin(src(None))

    at = f"Delta table {table} (version 0)"
    with pytest.raises(UserError) as err:
        sources.fingerprint(src([["lng", "=", "en"]]))
    assert str(err.value) == f"data.filter: {at} has no column lng (it has messages, lang, score); fix data.filter"
    with pytest.raises(UserError, match=r"^data.filter: 'high' cannot be compared with column score of .* a int64 "
                                        r"column \(.*\); fix data.filter$"):
        sources.fingerprint(src([["score", ">", "high"]]))
    for where, message in (([["lang", "~", "en"]], r"data.filter.0.0.1: Input should be '=', '!=', '<', '<=', '>', "
                                                   r"'>=', 'in' or 'not in' \(got '~'\)"),
                           ([["lang", "in", "en"]], r"\[lang, in, 'en'\]: 'in' takes a non-empty list of values"),
                           ([], "give at least one \\[column, op, value\\] condition")):
        with pytest.raises(RecipeError, match=message):
            src(where)
    with pytest.raises(RecipeError, match=r"filter is for source=delta \(a Delta table's row filter\), not "
                                          "source=local"):
        recipe(tmp_path, data__path=tmp_path, data__filter='[["lang", "=", "en"]]')

    from ftcli.data.checks import source_problems

    nothing = recipe(tmp_path, data__source="delta", data__path=table, data__filter='[["lang", "=", 3]]')
    assert source_problems(nothing.data, prepare_blocks(nothing, tokenizer("qwen")).stats) == [
        f"data source '{table}' keeps 0 of the 0 rows read [format messages]; its filter (lang = 3) matches no row "
        "of the table: fix data.filter"]
