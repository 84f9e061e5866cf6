"""`source: delta`: rows from a Delta table, read with deltalake (delta-rs: no JVM, no Spark).

    data:
      source: delta
      path: /Volumes/main/sft/raw/chats      a table dir: local, a Volume, s3:// abfss:// gs:// ...
            main.sft.chats                   or a Unity Catalog name (catalog.schema.table)
      revision: 12                           the table version to read, or a timestamp (2026-12-01T00:00:00Z):
                                             the newest version committed by then (deltalake dates a commit by
                                             its log file's modification time); unset: the newest version,
                                             resolved once and recorded
      columns: [messages, tools]             read only these (unset: every column)
      filter: [[lang, "=", en], [score, ">=", 3]]
                                             read only the rows where it holds (ftcli.config.rowfilter:
                                             deltalake's tuple form, a conjunction or an OR of them)

Each row is a dict of its columns, exactly as a Parquet row of the same table would be, so every row format
ftcli reads from files (messages, ShareGPT, Alpaca, prompt/completion, and the preference forms) reads from a
table too: this module knows no format. Rows stream in Arrow record batches of `BATCH_ROWS`, in the order of
the table's files at that version (deterministic: the same version gives the same rows in the same order).
A table whose reader features pyarrow datasets cannot read (deletion vectors, column mapping: common on
Databricks) is read through deltalake's own engine (`DeltaTable.scan`), whose row order is the engine's:
the pack cache keeps what one read produced.

A filter is checked against the table's schema before anything is read (each column exists; each value
converts to its column's type, as deltalake converts partition values: "3" compares with an integer column
as 3), then applied twice: deltalake prunes the files that cannot hold a matching row (exactly on partition
columns, by the files' min/max statistics on the others) and pyarrow filters the rows of the files read, so
the rows are exactly those where it holds, in the same order as without it. It is part of the pack cache key
and of the lineage a run records (run.json, MLflow).

The version read is resolved once per process (`open_table`): the pack cache key (`fingerprint`) and
the rows read come from the same version even when the table is written meanwhile, and run.json and MLflow
record it.

A Unity Catalog name is resolved with the Databricks SDK (databricks-sdk, present on Databricks) to the
table's storage location plus temporary read credentials (Unity Catalog credential vending); without the
SDK it is one line saying so. Storage credentials for a path are deltalake's: the environment
(AWS_*, AZURE_*, GOOGLE_*), as delta-rs reads them.
"""

from __future__ import annotations

import functools
import operator
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from ftcli.config.errors import UserError
from ftcli.config.recipe import parse_delta_revision
from ftcli.config.rowfilter import describe_filter

BATCH_ROWS = 1024
UC_NAME = re.compile(r"^[A-Za-z0-9_`-]+\.[A-Za-z0-9_`-]+\.[A-Za-z0-9_`-]+$")
_OPENED: dict[tuple[str, str | None], Any] = {}  # (table URI, revision) -> the DeltaTable this process reads
_LOCATIONS: dict[str, tuple[str, dict[str, str] | None]] = {}  # data.path -> (URI, options): one catalog call


def _deltalake():
    try:
        import deltalake
    except ImportError:
        raise UserError("data.source=delta needs the deltalake package: pip install 'ftcli[databricks]' "
                        "(or pip install deltalake)") from None
    return deltalake


def is_uc_name(path: str) -> bool:
    """`catalog.schema.table` (and no such local path)."""
    return bool(UC_NAME.match(path)) and not Path(path).exists()


def table_location(path: str) -> tuple[str, dict[str, str] | None]:
    """(the table's URI, storage options) for deltalake: a path as given (a local one made absolute), or a
    Unity Catalog name resolved through the Databricks SDK with temporary read credentials."""
    if not is_uc_name(path):
        if "://" in path:
            return path, None
        local = Path(path).expanduser()
        if not local.exists():
            raise UserError(f"data.path {path!r} does not exist (a delta source: a table dir, a cloud URI or a "
                            "Unity Catalog name catalog.schema.table)")
        return str(local.resolve()), None
    return _unity_catalog_table(path)


def _unity_catalog_table(name: str) -> tuple[str, dict[str, str]]:
    try:
        from databricks.sdk import WorkspaceClient
        from databricks.sdk.service.catalog import TableOperation
    except ImportError:
        raise UserError(f"data.path {name!r} is a Unity Catalog table name; resolving it needs the Databricks SDK "
                        "(pip install databricks-sdk, present on Databricks), or give the table's path") from None
    try:
        client = WorkspaceClient()
        table = client.tables.get(name)
        creds = client.temporary_table_credentials.generate_temporary_table_credentials(
            operation=TableOperation.READ, table_id=table.table_id)
    except Exception as e:  # noqa: BLE001 - auth, permission, not found: one line
        first = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise UserError(f"Unity Catalog table {name}: {first}") from None
    if not table.storage_location:
        raise UserError(f"Unity Catalog table {name} has no storage location (a view or a foreign table?); "
                        "give a Delta table")
    return table.storage_location, _storage_options(creds)


def _storage_options(creds) -> dict[str, str]:
    """delta-rs (object_store) options from Unity Catalog's temporary credentials."""
    if creds.aws_temp_credentials is not None:
        aws = creds.aws_temp_credentials
        return {"AWS_ACCESS_KEY_ID": aws.access_key_id, "AWS_SECRET_ACCESS_KEY": aws.secret_access_key,
                "AWS_SESSION_TOKEN": aws.session_token}
    if creds.azure_user_delegation_sas is not None:
        return {"AZURE_STORAGE_SAS_TOKEN": creds.azure_user_delegation_sas.sas_token}
    if creds.gcp_oauth_token is not None:
        return {"GOOGLE_BEARER_TOKEN": creds.gcp_oauth_token.oauth_token}
    return {}


def open_table(data):
    """The DeltaTable of a delta source at its resolved version."""
    deltalake = _deltalake()
    if data.path not in _LOCATIONS:
        _LOCATIONS[data.path] = table_location(data.path)
    uri, options = _LOCATIONS[data.path]
    key = (uri, None if data.revision is None else str(data.revision))
    if key in _OPENED:  # one log replay per table and revision: the version is resolved once, then kept
        return _OPENED[key]
    try:
        pin = parse_delta_revision(data.revision)
        table = deltalake.DeltaTable(uri, version=pin if isinstance(pin, int) else None, storage_options=options)
        if isinstance(pin, datetime):
            table.load_as_version(pin)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - TableNotFoundError, a version that does not exist, storage errors
        first = (str(e).strip() or type(e).__name__).splitlines()[0]
        at = f" at revision {data.revision}" if data.revision is not None else ""
        raise UserError(f"cannot read Delta table {data.path}{at}: {first}") from None
    _OPENED[key] = table
    return table


def fingerprint(data) -> dict[str, Any]:
    """What identifies the rows (a cache-key part): the table, the version read, the columns, the row filter
    (checked against the table here, before any launch)."""
    table = open_table(data)
    row_filter(table, data)
    key = {"source": "delta", "path": _LOCATIONS[data.path][0], "version": table.version(), "columns": data.columns,
           "split": data.split}
    return {**key, "filter": describe_filter(data.filter)} if data.filter else key


def delta_rows(data) -> tuple[Iterator[tuple[int, dict[str, Any]]], int | None]:
    """(iterator of (row index, row dict), the row count) of a delta source at its resolved version."""
    table = open_table(data)
    names = [f.name for f in table.schema().fields]
    missing = [c for c in data.columns or [] if c not in names]
    if missing:
        raise UserError(f"Delta table {data.path} (version {table.version()}) has no column "
                        f"{', '.join(missing)} (it has {', '.join(names)}); fix data.columns")
    where = row_filter(table, data)
    import pyarrow as pa

    try:
        pruned = table.to_pyarrow_dataset(file_pruning_predicate=_pruning(data.filter)) if where is not None \
            else table.to_pyarrow_dataset()
        dataset = _in_commit_order(table, pruned)
    except _deltalake().exceptions.DeltaProtocolError:  # deletion vectors, column mapping: the table's own engine
        read = data.columns and [*data.columns, *(c for c in _filter_columns(data.filter) if c not in data.columns)]
        batches = pa.RecordBatchReader.from_stream(table.scan(columns=read or None))
        if where is None:
            return _rows(batches), None
        plain = pa.schema([f.with_type(_without_views(f.type)) for f in batches.schema])
        return _rows(_filtered(batches, plain, row_filter(table, data, plain), data.columns)), None
    batches = dataset.to_batches(columns=data.columns, filter=where, batch_size=BATCH_ROWS)
    return _rows(batches), dataset.count_rows(filter=where)


_OPS = {"=": "__eq__", "!=": "__ne__", "<": "__lt__", "<=": "__le__", ">": "__gt__", ">=": "__ge__"}


def row_filter(table, data, schema=None):
    """A delta source's `filter` as a pyarrow expression over `table`'s columns (typed as `schema` has them,
    default the table's; None: no filter); a column the table lacks, or a value that does not convert to its
    column's type, is one line."""
    if not data.filter:
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = schema or pa.schema(table.schema().to_arrow())
    at = f"Delta table {data.path} (version {table.version()})"

    def value(column: str, v):
        try:
            scalar = pa.scalar(v)
            return scalar if scalar.type == schema.field(column).type else scalar.cast(schema.field(column).type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise UserError(f"data.filter: {v!r} cannot be compared with column {column} of {at}, a "
                            f"{schema.field(column).type} column ({str(e).splitlines()[0]}); fix data.filter") from None

    groups = []
    for group in data.filter:
        terms = []
        for column, op, v in group:
            if column not in schema.names:
                raise UserError(f"data.filter: {at} has no column {column} (it has {', '.join(schema.names)}); "
                                "fix data.filter")
            field = pc.field(column)
            if op in ("in", "not in"):
                values = pa.array([value(column, x).as_py() for x in v], type=schema.field(column).type)
                terms.append(field.isin(values) if op == "in" else ~field.isin(values))
            else:
                terms.append(getattr(field, _OPS[op])(value(column, v)))
        groups.append(functools.reduce(operator.and_, terms))
    return functools.reduce(operator.or_, groups)


def _pruning(groups) -> list[list[tuple]]:
    """The filter as deltalake's file_pruning_predicate (DNF tuples; dates and datetimes as it encodes them)."""
    return [[(column, op, list(v) if isinstance(v, list) else v) for column, op, v in group] for group in groups]


def _filter_columns(groups) -> list[str]:
    return list(dict.fromkeys(column for group in groups or [] for column, _, _ in group))


def _filtered(batches, schema, where, columns):
    """The table engine's batches with the row filter applied, and only `columns` kept (it read the filter's too).
    Its batches hold string_view columns, which pyarrow's filter cannot take: cast to `schema` first."""
    import pyarrow as pa

    for batch in batches:
        kept = pa.Table.from_batches([batch.cast(schema)]).filter(where)
        yield from (kept.select(columns) if columns else kept).to_batches()


def _without_views(t):
    """An Arrow type with its string_view / binary_view parts (what deltalake's engine returns) as large_string /
    large_binary, nested ones included."""
    import pyarrow as pa

    if t == pa.string_view():
        return pa.large_string()
    if t == pa.binary_view():
        return pa.large_binary()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_without_views(f.type)) for f in t])
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        return pa.large_list(t.value_field.with_type(_without_views(t.value_type)))
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(_without_views(t.key_type)), t.item_field.with_type(_without_views(t.item_type)))
    return t


def _in_commit_order(table, dataset):
    """The dataset with its files in the order they were added (each add action's time, then its path: part-00000
    before part-00001), so rows come in the order they were written; deltalake lists the newest first."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    added = pa.table(table.get_add_actions(flatten=True)).select(["path", "modification_time"]).to_pylist()
    when = {a["path"]: a["modification_time"] for a in added}
    fragments = sorted(dataset.get_fragments(), key=lambda f: (when.get(f.path, 0), f.path))
    return ds.FileSystemDataset(fragments, schema=dataset.schema, format=dataset.format,
                                filesystem=dataset.filesystem)


def _rows(batches) -> Iterator[tuple[int, dict[str, Any]]]:
    index = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield index, row
            index += 1
