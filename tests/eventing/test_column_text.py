"""What the store writes for JSON and SQLite datetime columns, against the reference each
replaced: `json.dumps` (`database.json_text`) and SQLAlchemy's own SQLite DATETIME bind
processor (`driver_writes._bind_processor`)."""

from __future__ import annotations

import json
import math
from datetime import date, datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import DateTime, select
from sqlalchemy.dialects import sqlite

from eventing.store import database, tables
from eventing.store.driver_writes import _bind_processor

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_json_text_reads_back_as_json_dumps_would(value):
    """Read back and written again by `json.dumps`, the text is `json.dumps`'s own: the same
    value, NaN, the infinities, big integers, any string (lone surrogates too) included."""
    assert json.dumps(json.loads(database.json_text(value))) == json.dumps(value)


def test_json_text_writes_nan_and_infinities_as_json_dumps_does():
    assert database.json_text([math.nan, math.inf, -math.inf]) == "[NaN,Infinity,-Infinity]"
    assert database.json_text("\ud800") == json.dumps("\ud800")  # not UTF-8: json.dumps escapes it


def test_a_json_column_on_a_live_store_holds_json_texts_value(tmp_path):
    engine = database.make_engine(f"sqlite:///{tmp_path / 'store.db'}")
    database.upgrade(engine)
    result = {"metrics": {"loss:sum": math.nan, "lr": 1e-4}, "tokens": [1, 2**70], "note": "é\n\u2028"}
    with engine.begin() as conn:
        conn.execute(tables.futures.insert().values(request_id="r", tenant="t", kind="optim_step", state="completed",
                                                    created_at=datetime.now(timezone.utc), result=result))  # fmt: skip
        stored = conn.exec_driver_sql("SELECT result FROM futures").scalar()
        read = conn.execute(select(tables.futures.c.result)).scalar()
    assert stored == database.json_text(result)
    assert json.dumps(read) == json.dumps(result)


reference = sqlite.DATETIME().bind_processor(sqlite.dialect())
fast = _bind_processor(DateTime(timezone=True), sqlite.dialect())
offsets = st.integers(min_value=-23 * 60, max_value=23 * 60).map(lambda minutes: timezone(timedelta(minutes=minutes)))


@settings(max_examples=400, deadline=None)
@given(st.datetimes(timezones=st.none() | st.just(timezone.utc) | offsets))
def test_sqlite_datetimes_are_bound_as_sqlalchemy_binds_them(moment):
    assert fast(moment) == reference(moment)


def test_sqlite_datetime_edges_and_what_is_not_a_datetime():
    for moment in (
        datetime(1, 1, 1),
        datetime(999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc),
        datetime(2026, 12, 5, 7, 0),
    ):
        assert fast(moment) == reference(moment)
    assert fast(date(2026, 12, 5)) == reference(date(2026, 12, 5)) == "2026-12-05 00:00:00.000000"
    assert fast(None) is None
    assert _bind_processor(DateTime(timezone=True), sqlite.dialect()) is not None
    other = sqlite.DATETIME(
        storage_format="%(year)04d/%(month)02d/%(day)02d"
    )  # a format of its own keeps its own processor
    assert _bind_processor(other, sqlite.dialect())(datetime(2026, 12, 5)) == "2026/12/05"
