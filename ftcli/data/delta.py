"""`source: delta`: rows from a Delta table, read with deltalake (delta-rs: no JVM, no Spark).

    data:
      source: delta
      path: /Volumes/main/sft/raw/chats      a table dir: local, a Volume, s3:// abfss:// gs:// ...
            main.sft.chats                   or a Unity Catalog name (catalog.schema.table)
      revision: 12                           the table version to read, or a timestamp (2026-12-01T00:00:00Z);
                                             unset: the newest version, resolved once and recorded
      columns: [messages, tools]             read only these (unset: every column)

Each row is a dict of its columns, exactly as a Parquet row of the same table would be, so every row format
ftcli reads from files (messages, ShareGPT, Alpaca, prompt/completion, and the preference forms) reads from a
table too: this module knows no format. Rows stream in Arrow record batches of `BATCH_ROWS`, in the order of
the table's files at that version (deterministic: the same version gives the same rows in the same order).
A table whose reader features pyarrow datasets cannot read (deletion vectors, column mapping: common on
Databricks) is read through deltalake's own engine (`DeltaTable.scan`), whose row order is the engine's:
the pack cache keeps what one read produced.

The version read is resolved once per process (`open_table`): the pack cache key (`fingerprint`) and
the rows read come from the same version even when the table is written meanwhile, and run.json and MLflow
record it.

A Unity Catalog name is resolved with the Databricks SDK (databricks-sdk, present on Databricks) to the
table's storage location plus temporary read credentials (Unity Catalog credential vending); without the
SDK it is one line saying so. Storage credentials for a path are deltalake's: the environment
(AWS_*, AZURE_*, GOOGLE_*), as delta-rs reads them.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from ftcli.config.errors import UserError
from ftcli.config.recipe import parse_delta_revision

BATCH_ROWS = 1024
UC_NAME = re.compile(r"^[A-Za-z0-9_`-]+\.[A-Za-z0-9_`-]+\.[A-Za-z0-9_`-]+$")
_RESOLVED: dict[tuple[str, str | None], int] = {}  # (table URI, revision) -> the version this process reads
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
    try:
        if key in _RESOLVED:
            return deltalake.DeltaTable(uri, version=_RESOLVED[key], storage_options=options)
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
    _RESOLVED[key] = table.version()
    return table


def fingerprint(data) -> dict[str, Any]:
    """What identifies the rows (a cache-key part): the table, the version read, the columns."""
    table = open_table(data)
    return {"source": "delta", "path": _LOCATIONS[data.path][0], "version": table.version(), "columns": data.columns,
            "split": data.split}


def delta_rows(data) -> tuple[Iterator[tuple[int, dict[str, Any]]], int | None]:
    """(iterator of (row index, row dict), the row count) of a delta source at its resolved version."""
    table = open_table(data)
    missing = [c for c in data.columns or [] if c not in {f.name for f in table.schema().fields}]
    if missing:
        have = ", ".join(f.name for f in table.schema().fields)
        raise UserError(f"Delta table {data.path} (version {table.version()}) has no column "
                        f"{', '.join(missing)} (it has {have}); fix data.columns")
    import pyarrow as pa

    try:
        dataset = _in_commit_order(table, table.to_pyarrow_dataset())
    except _deltalake().exceptions.DeltaProtocolError:  # deletion vectors, column mapping: the table's own engine
        return _rows(pa.RecordBatchReader.from_stream(table.scan(columns=data.columns))), None
    return _rows(dataset.to_batches(columns=data.columns, batch_size=BATCH_ROWS)), dataset.count_rows()


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
