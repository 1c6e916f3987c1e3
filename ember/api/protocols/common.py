"""What the protocol adapters share: the refusal of a model the protocol cannot serve, and
the ``X-Ember-Priority`` header read as a protocol violation when it names no class."""

from __future__ import annotations

from ember.domain.spec import Priority
from ember.errors import InvalidInput, MalformedRequest


class ProtocolMismatch(InvalidInput):
    """The model exists but this protocol cannot serve it (an LLM on v2, a tensor model
    on OpenAI's routes)."""

    status = 400
    code = "protocol-mismatch"
    title = "Not served by this protocol"


def requested_priority(header: str | None) -> Priority:
    """``X-Ember-Priority`` (online when absent); a bad value is a 400."""
    try:
        return Priority.requested(header)
    except ValueError as exc:
        raise MalformedRequest(str(exc)) from None
