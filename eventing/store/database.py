"""Engines for the event store and the one way its schema is made: `alembic upgrade head`.

SQLite (embedded) gets WAL and a busy timeout so the gateway's and the projector's threads
can write without "database is locked"; PostgreSQL (distributed) needs nothing special.
"""

from __future__ import annotations

import json
from pathlib import Path

import pydantic_core
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine

from eventing.store import pg_round_trips

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def json_text(value) -> str:
    """JSON columns' text. A future's result holds its arrays (a forward_backward's logprobs
    per token), and `json.dumps` spent about 30 us on such a result where pydantic's Rust
    serializer takes 6 (a tenth of a replay's fold went to it). Its text is compact and
    UTF-8 rather than `json.dumps`'s, and reads back through `json.loads` as the same value,
    NaN and the infinities included (written as `json.dumps` writes them). What it cannot
    write as UTF-8 (a lone surrogate in a string) goes through `json.dumps`, which escapes it.
    Keys are strings in every JSON column here (they come from JSON, or are metric names)."""
    try:
        return pydantic_core.to_json(value, inf_nan_mode="constants").decode()
    except pydantic_core.PydanticSerializationError:
        return json.dumps(value)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Connections are kept for every thread that may read at once (the gateway's worker
        # threads, the projector, the workers): past pool_size a checked-in connection is
        # closed, and opening one (with its pragmas) costs more than most queries.
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=32,
            max_overflow=32,
            json_serializer=json_text,
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    # Up to 30 connections at once, as many threads of a gateway read side by side, and all
    # of them kept: with 10 kept and 20 more opened on demand, a busy gateway closed and
    # reopened about one connection every five futures, and a new PostgreSQL connection
    # (a backend process started and authenticated) cost more than the queries it served
    # (bench/futures_throughput.py, embedded log + PostgreSQL: 247 against 207 futures/s).
    # A connection is pinged before use only after sitting idle (pg_round_trips).
    engine = create_engine(url, pool_size=30, max_overflow=0, json_serializer=json_text)
    pg_round_trips.install(engine)
    return engine


def alembic_config(engine: Engine):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False))
    return config


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest migration; safe to run on every start."""
    from alembic import command

    config = alembic_config(engine)
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            # Every process of a distributed deployment migrates on start; the lock makes
            # them take turns instead of racing to create the same tables.
            connection.exec_driver_sql("SELECT pg_advisory_xact_lock(727271)")
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
