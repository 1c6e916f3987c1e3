"""Alembic environment: runs on the connection handed in by ``ember.registry.db.migrate``
(or on ``sqlalchemy.url`` when invoked through the alembic CLI)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlmodel import SQLModel

import ember.registry.tables  # noqa: F401 - registers the tables on SQLModel.metadata

target_metadata = SQLModel.metadata
config = context.config


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.begin() as conn:
            _run(conn)
    else:
        _run(connection)


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies tables
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run()
