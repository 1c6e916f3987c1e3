"""Structured logging with model-version context.

``configure_logging()`` routes structlog *and* the standard library (uvicorn, celery,
botocore, alembic) through one processor chain whose first step merges the context
variables. Inside ``model_context(model, version, ...)`` every line — ours or a
library's — carries ``model`` and ``version`` (and whatever ids were bound).

Context variables do not cross into worker threads by themselves: submit work with
``submit_in_context`` (or ``contextvars.copy_context().run``) so threads keep the binding.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Executor, Future
from typing import Any, Literal, TypeVar

import structlog

T = TypeVar("T")

_PROCESS: dict[str, Any] = {}


def _merge_process(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key, value in _PROCESS.items():
        event.setdefault(key, value)
    return event


_SHARED: list[structlog.typing.Processor] = [
    structlog.contextvars.merge_contextvars,
    _merge_process,
    structlog.stdlib.add_logger_name,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.processors.StackInfoRenderer(),
]


def configure_logging(
    level: str = "INFO",
    fmt: Literal["auto", "json", "console"] = "auto",
    stream: Any = None,
) -> None:
    """Configure structlog and stdlib logging once per process (idempotent)."""
    stream = stream or sys.stderr
    as_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(
            colors=stream.isatty(),
            # never a traceback's local variables: a key or a secret may be one of them
            exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False),
        )
    )
    structlog.configure(
        # Below-level events are dropped first, before the context merge and the
        # timestamp: a debug line the level filters out cost ~the same as a written one.
        processors=[
            structlog.stdlib.filter_by_level,
            *_SHARED,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.ExtraAdder()],
        # JSON carries a traceback as a string; the console renderer draws its own.
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *([structlog.processors.format_exc_info] if as_json else []),
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_ember", False):
            root.removeHandler(old)
    handler._ember = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery"):
        lib = logging.getLogger(name)
        lib.handlers.clear()
        lib.propagate = True
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "alembic"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger


class _Bound:
    """Binds ids to the log context for a ``with`` block; on exit each is back to what
    it was (unset if it was). Tokens instead of structlog's ``bound_contextvars``, which
    reads the whole context and is a generator: this one runs on every request."""

    __slots__ = ("ids", "tokens")

    def __init__(self, ids: dict[str, Any]) -> None:
        self.ids = ids
        self.tokens: Mapping[str, Any] = {}

    def __enter__(self) -> None:
        self.tokens = structlog.contextvars.bind_contextvars(**self.ids)

    def __exit__(self, *exc: object) -> None:
        try:
            structlog.contextvars.reset_contextvars(**self.tokens)
        except ValueError:  # left in another context than entered: drop the ids there
            structlog.contextvars.unbind_contextvars(*self.ids)


def model_context(model: str, version: str, **ids: Any) -> _Bound:
    """Bind ``model`` and ``version`` (plus ids such as ``request_id``) to every log line."""
    return _Bound({"model": model, "version": version, **ids})


def bound(**ids: Any) -> _Bound:
    """Bind ids (request_id, job_id, tenant) outside a model context."""
    return _Bound(ids)


def submit_in_context(
    executor: Executor, fn: Callable[..., T], *args: Any, **kwargs: Any
) -> Future[T]:
    """``executor.submit`` that carries the caller's log context into the worker thread."""
    ctx = contextvars.copy_context()
    return executor.submit(ctx.run, fn, *args, **kwargs)


def bind_process(**fields: Any) -> None:
    """Fields on every line this process logs, from any thread (a replica binds its
    model, version and replica id once; a standby rebinds when it is assigned)."""
    _PROCESS.update(fields)
