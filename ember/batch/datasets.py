"""Batch input and output files.

Inputs are JSONL (one JSON object a line), CSV (a header row; the input column holds a
JSON value) or Parquet, chosen by extension (``.jsonl``/``.json``/``.ndjson``, ``.csv``,
``.parquet``/``.pq``) or by the spec's ``format``. An input URI may contain glob
characters (``*``, ``?``, ``[``) in its last path segments; ``file://`` and ``s3://`` are
listed through the object stores of ``ember.loader.stores`` (same access limits).

A row that cannot be parsed is still a row: it is counted when the run is planned and
rejected with its reason when its shard runs, so row numbers never shift.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ember.config import Settings
from ember.errors import InvalidInput, LoaderError, PayloadTooLarge
from ember.loader.stores import FileStore, ObjectInfo, S3Store, open_store

GLOB_CHARS = "*?["
FORMATS = ("jsonl", "csv", "parquet")
MAX_FILE_BYTES = 2 * 1024**3


class BadRow(Exception):
    """A row that cannot be scored; its reason goes to the rejects file."""


def detect_format(uri: str, wanted: str) -> str:
    if wanted != "auto":
        return wanted
    name = uri.rsplit("/", 1)[-1].lower()
    for ext, fmt in (
        (".jsonl", "jsonl"),
        (".ndjson", "jsonl"),
        (".json", "jsonl"),
        (".csv", "csv"),
        (".parquet", "parquet"),
        (".pq", "parquet"),
    ):
        if name.endswith(ext):
            return fmt
    raise InvalidInput(
        f"cannot tell the format of {uri!r} from its extension: set `format` ({', '.join(FORMATS)})"
    )


def list_inputs(settings: Settings, pattern: str, max_files: int) -> list[ObjectInfo]:
    """The objects ``pattern`` names (sorted by URI); an error if there are none."""
    store = open_store(pattern, settings)
    if not any(c in pattern for c in GLOB_CHARS):
        return [store.stat(pattern)]
    scheme_end = pattern.index("://") + 3
    first = min(i for i in (pattern.find(c, scheme_end) for c in GLOB_CHARS) if i >= 0)
    base = pattern[:first].rsplit("/", 1)[0]
    found: list[ObjectInfo] = []
    if isinstance(store, FileStore):
        root = store.path_of(base + "/")
        if root.is_dir():
            for path in sorted(root.rglob("*")):
                uri = path.as_uri()
                if path.is_file() and fnmatch.fnmatchcase(uri, pattern):
                    found.append(store.stat(uri))
                    if len(found) > max_files:
                        break
    elif isinstance(store, S3Store):
        bucket, key = store.split(base + "/x")
        pages = store.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=key[:-1]
        )
        for page in pages:
            for obj in page.get("Contents", []):
                uri = f"s3://{bucket}/{obj['Key']}"
                if fnmatch.fnmatchcase(uri, pattern):
                    found.append(ObjectInfo(uri, int(obj["Size"]), str(obj["ETag"])))
            if len(found) > max_files:
                break
    if len(found) > max_files:
        raise InvalidInput(
            f"{pattern!r} matches more than {max_files} files (EMBER_BATCH_MAX_FILES)"
        )
    if not found:
        raise InvalidInput(f"no input file matches {pattern!r}", input_uri=pattern)
    return sorted(found, key=lambda i: i.uri)


def read_object(settings: Settings, info: ObjectInfo) -> bytes:
    if info.size > MAX_FILE_BYTES:
        raise PayloadTooLarge(f"{info.uri} is {info.size} bytes; one input file may be 2 GiB")
    store = open_store(info.uri, settings)
    return b"".join(store.iter_chunks(info.uri, etag=info.etag))


def count_rows(data: bytes, fmt: str, uri: str) -> int:
    """Rows in a file, without parsing them (a malformed row still counts)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return int(pq.ParquetFile(io.BytesIO(data)).metadata.num_rows)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
            raise InvalidInput(f"{uri} is not a readable Parquet file: {exc}"[:500]) from exc
    return len(parse_rows(data, fmt, uri, 0, 0))


def parse_rows(
    data: bytes, fmt: str, uri: str, start: int = 0, end: int | None = None
) -> list[dict[str, Any] | BadRow]:
    """Rows ``[start, end)`` of a file: a dict, or a ``BadRow`` with why it is not one.
    For text formats the rows outside the range are counted, not parsed (``end=0``
    counts all: the list then holds placeholders)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
            raise InvalidInput(f"{uri} is not a readable Parquet file: {exc}"[:500]) from exc
        stop = table.num_rows if end is None else end
        return list(table.slice(start, max(0, stop - start)).to_pylist())
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{uri} is not UTF-8 text: {exc}") from exc
    rows: list[dict[str, Any] | BadRow] = []
    skip = BadRow("outside the range")
    if fmt == "jsonl":
        index = 0
        for n, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            index += 1
            if index - 1 < start or (end is not None and index - 1 >= end):
                rows.append(skip)
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                rows.append(BadRow(f"line {n + 1} is not JSON: {exc}"))
                continue
            rows.append(doc if isinstance(doc, dict) else BadRow(f"line {n + 1} is not an object"))
        return rows if end == 0 else rows[start:end]
    try:
        reader = csv.DictReader(io.StringIO(text))
        for record in reader:
            if None in record:
                rows.append(BadRow(f"line {reader.line_num} has more fields than the header"))
            else:
                rows.append(dict(record))
    except csv.Error as exc:
        raise InvalidInput(f"{uri} is not readable CSV: {exc}") from exc
    return rows if end == 0 else rows[start:end]


def instance_of(row: dict[str, Any], column: str, fmt: str) -> Any:
    if column not in row or row[column] is None:
        raise BadRow(f"no {column!r} column")
    value = row[column]
    if fmt == "csv" and isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise BadRow(f"{column!r} is not a JSON value: {exc}") from exc
    return value


def write_parquet(settings: Settings, uri: str, columns: dict[str, list[Any]]) -> None:
    """One Parquet object, written whole (a temporary file, then an atomic put)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(columns)
    put(settings, uri, lambda path: pq.write_table(table, path))


def write_bytes(settings: Settings, uri: str, data: bytes) -> None:
    put(settings, uri, lambda path: Path(path).write_bytes(data))


def put(settings: Settings, uri: str, write: Any) -> None:
    store = open_store(uri, settings)
    fd, tmp = tempfile.mkstemp(prefix="ember-batch-")
    os.close(fd)
    try:
        write(tmp)
        store.put_file(Path(tmp), uri)
    finally:
        Path(tmp).unlink(missing_ok=True)


def check_readable(settings: Settings, uri: str) -> None:
    """An output prefix the store accepts (scheme, roots, buckets)."""
    try:
        store = open_store(uri, settings)
        if isinstance(store, FileStore):
            store.path_of(uri.rstrip("/") + "/x")
        elif isinstance(store, S3Store):
            store.split(uri.rstrip("/") + "/x")
    except LoaderError as exc:
        raise InvalidInput(exc.detail) from exc
