"""Scratch PostgreSQL databases for the benches: made fresh for a run, dropped after it."""

from __future__ import annotations

import os
import uuid

from sqlalchemy import create_engine, text

PG_ADMIN = os.environ.get("OPENRL_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def admin_sql(statement: str) -> None:
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(statement))
    finally:
        admin.dispose()


def create(prefix: str) -> tuple[str, str]:
    """A new empty database: (its name, its SQLAlchemy URL)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin_sql(f'CREATE DATABASE "{name}"')
    return name, PG_ADMIN.rsplit("/", 1)[0] + "/" + name


def drop(name: str) -> None:
    admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
