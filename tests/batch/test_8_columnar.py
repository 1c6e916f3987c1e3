"""Reading a shard columnar (pyarrow, one array check per shard) gives exactly what the
row-by-row path gives: the same rows kept, the same instances, the same rejects and
reasons, the same row numbers. No platform needed."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ember.batch import datasets
from ember.batch.shards import _output
from ember.errors import InvalidInput
from ember.registry.tables import BatchRun

SCHEMA = {"shape": [4], "dtype": "float32"}
V = [0.5, 1.0, -2.25, 3.0]


def jsonl(rows: list[Any], sep: str = "\n") -> bytes:
    text = sep.join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows)
    return text.encode() + b"\n"


def row_path(
    data: bytes, fmt: str, start: int, end: int, keys: list[str], schema: Any
) -> datasets.ShardRows:
    rows = datasets.parse_rows(data, fmt, "u", start, end)
    return datasets._from_rows(rows, start, keys, "features", schema, fmt)


def same(a: datasets.ShardRows, b: datasets.ShardRows) -> None:
    assert a.total == b.total
    assert a.rejects == b.rejects
    assert {k: v.to_pylist() for k, v in a.keys.items()} == {
        k: v.to_pylist() for k, v in b.keys.items()
    }
    if isinstance(b.instances, np.ndarray):
        assert isinstance(a.instances, np.ndarray)
        assert a.instances.dtype == b.instances.dtype
        assert np.array_equal(a.instances, b.instances, equal_nan=True)
    else:
        assert a.instances == b.instances


def each(make: Any, n: int = 9, sep: str = "\n") -> bytes:
    """JSONL of ``make(i)`` for ``i < n``."""
    return jsonl([make(i) for i in range(n)], sep)


def with_features(i: int, features: Any) -> dict[str, Any]:
    return {"id": i, "features": features}


ID = ["id"]
CASES: dict[str, tuple[bytes, list[str], Any]] = {
    "clean": (each(lambda i: with_features(i, V), 30), ID, SCHEMA),
    "blank lines": (each(lambda i: with_features(i, V), 30, "\n \n\n"), ID, SCHEMA),
    "ints for floats": (each(lambda i: with_features(i, [1, 2, 3, i]), 30), ID, SCHEMA),
    "bools": (each(lambda i: with_features(i, [True, False, True, i % 2 == 0])), ID, SCHEMA),
    "wrong lengths and nulls": (
        each(lambda i: with_features(i, V if i % 7 else ([1.0] if i % 2 else None)), 30),
        ID,
        SCHEMA,
    ),
    "missing column": (
        each(lambda i: {"id": i, **({"features": V} if i % 5 else {})}, 30), ID, SCHEMA
    ),
    "null inside": (
        each(lambda i: with_features(i, [0.5, None, 1, 2] if i == 4 else V)), ID, SCHEMA
    ),
    "strings inside": (each(lambda i: with_features(i, ["a"] * 4 if i == 4 else V)), ID, SCHEMA),
    "numeric strings": (each(lambda i: with_features(i, ["1.5"] * 4)), ID, SCHEMA),
    "not json": (jsonl([with_features(0, V), "{not json", "[1, 2]", with_features(3, V)]),
                 ID, SCHEMA),
    "missing and null keys": (
        jsonl([{"id": None, "features": V}, {"features": V}, with_features(2, V)]), ID, SCHEMA
    ),
    "two keys": (each(lambda i: {"user": f"u{i}", "day": i, "features": V}), ["user", "day"],
                 SCHEMA),
    "no keys": (each(lambda i: {"features": V}), [], SCHEMA),
    "crlf": (each(lambda i: with_features(i, V), 9, "\r\n"), ID, SCHEMA),
    "unicode": (each(lambda i: {"id": f"é{i}\u2028", "features": V}), ID, SCHEMA),
    "non-ascii keys": (each(lambda i: {"id": f"é{i}", "features": V}), ID, SCHEMA),
    "unicode blank": (jsonl([with_features(1, V), "\u00a0", with_features(2, V)]), ID, SCHEMA),
    "matrix": (
        each(lambda i: with_features(i, [[1, 2], [3, i]] if i != 3 else [[1, 2, 3]])),
        ID,
        {"shape": [2, 2], "dtype": "float64"},
    ),
    "int dtype": (each(lambda i: with_features(i, [i, 2, 3, 4])), ID,
                  {"shape": [4], "dtype": "int64"}),
    "strings schema": (each(lambda i: with_features(i, "text" if i % 3 else 3)), ID,
                       {"type": "string"}),
    "duplicate names": (jsonl(['{"id": 1, "features": [1, 2, 3, 4], "features": [5, 6, 7, 8]}',
                               with_features(2, V)]), ID, SCHEMA),
    "object keys": (each(lambda i: {"id": {"n": i}, "features": V}), ID, SCHEMA),
    "float keys and floats": (each(lambda i: {"id": i / 3, "features": [i / 7, 1e-30, 3e38, 0]}),
                              ID, {"shape": [4], "dtype": "float64"}),
    "big ints": (each(lambda i: with_features(i, [2**62 + i, -(2**63), 0, 1])), ID,
                 {"shape": [4], "dtype": "int64"}),
    "floats for ints": (each(lambda i: with_features(i, [1.5, 2, 3, 4])), ID,
                        {"shape": [4], "dtype": "int64"}),
    "int32": (each(lambda i: with_features(i, [2**40, 1, 2, 3])), ID,
              {"shape": [4], "dtype": "int32"}),
    "number as features": (each(lambda i: with_features(i, 1.5)), ID, SCHEMA),
    "string keys": (each(lambda i: {"id": f"user-{i}", "features": V}), ID, SCHEMA),
    "no schema": (each(lambda i: with_features(i, {"a": i})), ID, None),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_jsonl_columnar_is_the_row_path(name: str) -> None:
    data, keys, schema = CASES[name]
    total = datasets.count_rows(data, "jsonl", "u")
    for start, end in ((0, total), (0, total // 2), (total // 3, total)):
        fast = datasets.read_shard(data, "jsonl", "u", start, end, keys, "features", schema)
        same(fast, row_path(data, "jsonl", start, end, keys, schema))


@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_are_counted_as_the_row_path_numbers_them(name: str) -> None:
    data = CASES[name][0]
    assert datasets.count_rows(data, "jsonl", "u") == len(
        datasets.parse_rows(data, "jsonl", "u", 0, 0)
    )


def test_the_clean_vectors_take_simdjson_and_the_rest_do_not() -> None:
    """The clean case of a rank-1 schema is read by ``_jsonl_vectors`` (and the test
    above shows it reads what the row path reads); what it cannot vouch for is left to
    the other paths."""
    memo = datasets.Memo()

    def vectors(name: str) -> Any:
        data, keys, schema = CASES[name]
        total = datasets.count_rows(data, "jsonl", "u")
        return datasets._jsonl_vectors(data, 0, total, keys, "features", schema, memo)

    for taken in (
        "clean",
        "blank lines",
        "ints for floats",
        "two keys",
        "no keys",
        "non-ascii keys",
        "float keys and floats",
        "big ints",
        "string keys",
    ):
        assert vectors(taken) is not None, taken
        memo = datasets.Memo()
    for left in (
        "bools",
        "wrong lengths and nulls",
        "missing column",
        "null inside",
        "strings inside",
        "not json",
        "missing and null keys",
        "crlf",
        "matrix",
        "duplicate names",
        "object keys",
        "floats for ints",
        "int32",
        "number as features",
        "strings schema",
        "no schema",
    ):
        assert vectors(left) is None, left
        memo = datasets.Memo()


def test_the_clean_case_is_columnar() -> None:
    data, keys, schema = CASES["clean"]
    assert datasets._jsonl_table(data, 5, 25, None) is not None
    rows = datasets.read_shard(data, "jsonl", "u", 5, 25, keys, "features", schema)
    assert rows.instances.shape == (20, 4) and rows.instances.dtype == np.float32
    assert rows.keys["id"].to_pylist() == list(range(5, 25)) and rows.rejects == []
    bad, _, _ = CASES["wrong lengths and nulls"]
    assert datasets._jsonl_table(bad, 0, 30, None) is not None  # rejects found without the row path
    assert datasets._jsonl_table(CASES["non-ascii keys"][0], 0, 3, None) is not None
    for odd in ("crlf", "unicode", "unicode blank"):
        assert datasets._jsonl_table(CASES[odd][0], 0, 3, None) is None


def test_a_key_column_of_mixed_types_is_a_clear_error() -> None:
    data = jsonl([with_features(1, V), {"id": "two", "features": V}])
    with pytest.raises(InvalidInput, match="key column 'id'"):
        datasets.read_shard(data, "jsonl", "u", 0, 2, ID, "features", SCHEMA)


def test_parquet_columnar_is_the_row_path() -> None:
    features = [V, None, [1.0], V, [0.5, None, 1.0, 2.0], V]
    table = pa.table({"id": [0, None, 2, 3, 4, 5], "features": features})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    for start, end in ((0, 6), (2, 4)):
        fast = datasets.read_shard(data, "parquet", "u", start, end, ["id"], "features", SCHEMA)
        rows: list[Any] = datasets.parse_rows(data, "parquet", "u", start, end)
        same(fast, datasets._from_rows(rows, start, ["id"], "features", SCHEMA, "parquet"))
    fixed = pa.table({"id": [1, 2], "features": pa.array([V, V], pa.list_(pa.float32(), 4))})
    sink = io.BytesIO()
    pq.write_table(fixed, sink)
    rows_ = datasets.read_shard(sink.getvalue(), "parquet", "u", 0, 2, ["id"], "features", SCHEMA)
    assert rows_.instances.shape == (2, 4) and rows_.rejects == []


def test_csv_reads_as_before() -> None:
    lines = ["user,features"] + [f'u{i},"{json.dumps(V)}"' for i in range(5)] + ["u9,[1]", "u10"]
    data = ("\n".join(lines) + "\n").encode()
    rows = datasets.read_shard(data, "csv", "u", 0, 7, ["user"], "features", SCHEMA)
    assert rows.instances.shape == (5, 4) and rows.keys["user"].to_pylist() == [
        f"u{i}" for i in range(5)
    ]
    assert [r["row"] for r in rows.rejects] == [5, 6]
    assert "shape" in rows.rejects[0]["reason"] and "no 'features'" in rows.rejects[1]["reason"]


def test_output_columns() -> None:
    run = BatchRun(
        uid="br_x", tenant_id=1, spec={}, model="m", deployment="m", version="3",
        input_uri="file:///x", output_uri="file:///y", artifact_sha256="ab" * 32,
    )  # fmt: skip
    at = datetime(2026, 1, 2, tzinfo=UTC)
    keys = {"id": pa.array([1, 2])}
    table = _output(run, keys, [[0.5, 1.5], [2.5, 3.5]], at)
    assert table.schema.field("prediction").type == pa.list_(pa.float64(), 2)
    assert table.to_pylist()[1] == {
        "id": 2, "prediction": [2.5, 3.5], "model": "m", "version": "3",
        "artifact_sha256": "ab" * 32, "scored_at": at,
    }  # fmt: skip
    labels = _output(run, keys, [1, 2], at)
    assert labels.schema.field("prediction").type == pa.int64()
    mixed = _output(run, keys, [{"a": 1}, [1, "x"]], at)
    assert mixed.column("prediction").to_pylist() == ['{"a": 1}', '[1, "x"]']
    ragged = _output(run, keys, [[1.0], [1.0, None]], at)
    assert ragged.column("prediction").to_pylist() == [[1.0], [1.0, None]]


@pytest.mark.parametrize("block", [1, 7, 64])
def test_line_offsets_do_not_depend_on_the_scan_blocks(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jsonl_lines`` scans in blocks: a line break or an odd byte on either side of a
    block's edge counts as in one pass over the whole file."""
    whole = {name: datasets.jsonl_lines(CASES[name][0]) for name in CASES}
    monkeypatch.setattr(datasets, "_BLOCK", block)
    for name, (data, _, _) in CASES.items():
        lines = datasets.jsonl_lines(data)
        expected = whole[name]
        assert (lines is None) == (expected is None), name
        if lines is not None:
            assert np.array_equal(lines, expected), name
            assert len(lines) == len(datasets.parse_rows(data, "jsonl", "u", 0, 0)), name
    late_cr = jsonl([with_features(i, V) for i in range(20)]) + b'{"id": 1}\r\n'
    assert datasets.jsonl_lines(late_cr) is None  # past the first blocks: still seen
