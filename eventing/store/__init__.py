"""The event store (SQLAlchemy; SQLite embedded, PostgreSQL distributed) and its projections."""
