"""Request bodies that routes read themselves (raw bytes, not FastAPI's body parsing)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ember.errors import MalformedRequest

M = TypeVar("M", bound=BaseModel)


def parse_object(
    raw: bytes | str, schema: type[M], what: str = "the body"
) -> tuple[M, dict[str, Any]]:
    """``raw`` as a JSON object validated by ``schema``: the model and the plain document.

    Malformed JSON, another JSON type or a schema violation is a 400 that names (up to
    five of) the offending fields."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise MalformedRequest(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise MalformedRequest(f"{what} must be a JSON object")
    try:
        return schema.model_validate(document), document
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in exc.errors(include_url=False)[:5]
        )
        raise MalformedRequest(f"invalid {what.removeprefix('the ')}: {problems}") from None
