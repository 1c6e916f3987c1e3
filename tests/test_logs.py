"""Every line logged inside a model's context carries model and version."""

from __future__ import annotations

import io
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ember.config import Settings
from ember.logs import configure_logging, get_logger, model_context, submit_in_context
from ember.registry import catalog
from ember.registry.db import make_engine, migrate, session_scope
from ember.registry.schemas import ModelCreate, ModelVersionCreate
from tests.artifacts import write_valid


@pytest.fixture
def captured() -> io.StringIO:
    stream = io.StringIO()
    configure_logging("DEBUG", "json", stream)
    yield stream
    configure_logging("INFO", "console")


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_structlog_stdlib_and_threads_all_carry_model_and_version(captured: io.StringIO) -> None:
    log = get_logger("ember.test")
    with model_context("minilm", "3", request_id="r-1"):
        log.info("structlog line", n=1)
        logging.getLogger("some.library").warning("stdlib line %s", "x")
        with ThreadPoolExecutor(1) as pool:
            submit_in_context(pool, log.info, "thread line").result()
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("with traceback")
    log.info("outside")
    records = lines(captured)
    inside = [r for r in records if r["event"] != "outside"]
    assert len(inside) == 4
    for record in inside:
        assert record["model"] == "minilm" and record["version"] == "3", record
        assert record["request_id"] == "r-1"
    outside = next(r for r in records if r["event"] == "outside")
    assert "model" not in outside and "version" not in outside


def test_registry_log_lines_carry_model_and_version(captured: io.StringIO, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    engine = make_engine(settings.registry_url)
    migrate(engine)
    artifact = write_valid(tmp_path / "objects" / "w.safetensors")
    with session_scope(engine) as session:
        from ember.registry.tenants import bootstrap

        bootstrap(session, None)
        model = catalog.create_model(session, 1, ModelCreate(name="minilm"))
        body = ModelVersionCreate(
            version="7",
            artifact_uri=artifact.as_uri(),
            engine="torch",
            engine_config={"factory": "ember.engine.examples.mlp:mlp"},
        )
        catalog.register_version(session, settings, model, body)
    registered = [r for r in lines(captured) if r["event"] == "version registered"]
    assert registered and registered[0]["model"] == "minilm" and registered[0]["version"] == "7"


def test_console_format_is_used_on_a_tty() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    configure_logging("INFO", "auto", stream)
    with model_context("m", "1"):
        get_logger("x").info("hello")
    configure_logging("INFO", "console")
    text = stream.getvalue()
    assert "hello" in text and "model" in text and not text.lstrip().startswith("{")


def test_a_context_restores_what_it_covered_and_survives_leaving_elsewhere(
    captured: io.StringIO,
) -> None:
    import contextvars

    from ember.logs import bound

    log = get_logger("ctx")
    with bound(request_id="r1"), model_context("m", "1", request_id="r2"):
        log.info("inner")
    with bound(request_id="r1"):
        with model_context("m", "2"):
            pass
        log.info("after")  # the inner block's model/version are gone, r1 is back
    log.info("outside")
    # entered in one context, left in a copy (a task that was handed the block): no error,
    # and the ids are dropped where it was left
    block = bound(job_id="j")
    block.__enter__()
    contextvars.copy_context().run(block.__exit__, None, None, None)
    block.__exit__(None, None, None)
    log.info("done")
    got = {e["event"]: e for e in lines(captured)}
    assert got["inner"]["request_id"] == "r2" and got["inner"]["version"] == "1"
    assert got["after"]["request_id"] == "r1" and "version" not in got["after"]
    assert "request_id" not in got["outside"] and "job_id" not in got["done"]
