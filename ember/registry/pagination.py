"""Keyset pagination with opaque cursors (stable under concurrent inserts and deletes)."""

from __future__ import annotations

import base64
from typing import Any, TypeVar

from sqlmodel import Session, SQLModel
from sqlmodel.sql.expression import SelectOfScalar

from ember.errors import InvalidInput

M = TypeVar("M", bound=SQLModel)
MAX_LIMIT = 500


def encode_cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(f"id:{last_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, value = raw.partition(":")
        if kind != "id" or not value.isdigit() or len(value) > 18:
            raise ValueError(raw)
        return int(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cursor {cursor[:64]!r} is not a cursor this API issued") from exc


def paginate(
    session: Session, query: SelectOfScalar[M], id_column: Any, limit: int, cursor: str | None
) -> tuple[list[M], str | None]:
    if cursor:
        query = query.where(id_column > decode_cursor(cursor))
    rows = list(session.exec(query.order_by(id_column).limit(min(limit, MAX_LIMIT) + 1)))
    if len(rows) > limit:
        rows = rows[:limit]
        return rows, encode_cursor(getattr(rows[-1], "id"))  # noqa: B009
    return rows, None
