"""The schema is made only by Alembic, and the migrations match the table definitions."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from eventing.store import database
from eventing.store.tables import metadata


def test_upgrade_head_makes_every_table_and_autogenerate_finds_no_drift(store_url):
    engine = database.make_engine(store_url)
    database.upgrade(engine)
    database.upgrade(engine)  # idempotent on every start
    assert set(metadata.tables) <= set(inspect(engine).get_table_names())
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(context, metadata)
    engine.dispose()
    assert diff == []
