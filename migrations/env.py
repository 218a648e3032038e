"""Alembic environment: runs migrations on the connection OpenRL hands it (or on the URL)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from eventing.store.tables import metadata

config = context.config


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        _run_on(conn)


def _run_on(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run()
