"""Whether a request's store work grows with the store, on SQLite (the embedded store).

For each size N a fresh, migrated SQLite store is filled directly (one executemany per
table, not through the fold: the rows only need to be there) with N submissions, N run
steps (of N/100 runs) and N published events; then, median of `--repeats` each:
- a gateway batch: 8 `optim_step` requests of 8 runs, with their dedup rows, through
  `EventStore.append_many` (what the appender's writer does per batch);
- the outbox relay's read (`EventStore.unpublished`, every 5 s, under the writer's lock);
- one run's view (`RunViews.run`: `openrl runs show`, the dashboard's run page).
A read that walks a table shows as a time that grows with N.

Run it from two trees (`PYTHONPATH=<tree>`) to compare them side by side.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import insert

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.store import database
from eventing.store import tables as t
from eventing.store.event_store import Dedup, EventStore
from eventing.store.run_views import RunViews
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.params import AdamParams


def filled(root: Path, n: int) -> EventStore:
    engine = database.make_engine(f"sqlite:///{root / 'events.db'}")
    database.upgrade(engine)
    now = datetime.datetime.now(datetime.timezone.utc)
    with engine.begin() as conn:
        conn.execute(insert(t.submissions), [
            dict(tenant="alice", dedup_key=f"seq:old:{i}", request_id=f"old-{i}", payload_sha256="ab" * 32, rejected=False) for i in range(n)
        ])  # fmt: skip
        conn.execute(insert(t.run_steps), [
            dict(model_id=f"old-run-{i // 100}", step=i % 100, tenant="alice", tokens=1, forward_backward=1, first_request_at=now, completed_at=now)
            for i in range(n)
        ])  # fmt: skip
        conn.execute(insert(t.events), [
            dict(id=str(uuid.uuid4()), type=te.OPTIM_STEP["requested"], source="/bench", tenant="alice", key=f"old-run-{i // 100}",
                 subject=f"old-{i}", time=now, data=b'{"request_id": "x"}')
            for i in range(n)
        ])  # fmt: skip
    return EventStore(engine, Codec(BlobStore(root / "blobs")))


def median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,200000", help="comma-separated store sizes N")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(
        f"{'N':>9} {'gateway batch of 8':>19} {'outbox relay read':>18} {'one run view':>13}   (ms, median of {args.repeats})"
    )
    for n in [int(size) for size in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory(prefix="openrl-growth-") as root:
            store = filled(Path(root), n)
            views, seq = RunViews(store.engine), iter(range(1, 10**9))

            def batch():
                items = []
                for k in range(8):
                    s = next(seq)
                    payload = te.OptimStepRequested(
                        request_id=f"q{s}", model_id=f"run-{k}", seq_id=s, adam_params=AdamParams()
                    )
                    event = new_event(
                        te.OPTIM_STEP["requested"], payload, tenant="alice", source="/bench", key=f"run-{k}"
                    )
                    items.append((event, "openrl.alice.training", Dedup.of(f"seq:run-{k}:{s}", b"body")))
                store.append_many(items)

            row = (
                median_ms(batch, args.repeats),
                median_ms(store.unpublished, args.repeats),
                median_ms(lambda: views.run("alice", "old-run-0"), args.repeats),
            )
            print(f"{n:>9,} {row[0]:>19.2f} {row[1]:>18.2f} {row[2]:>13.2f}")
            store.engine.dispose()


if __name__ == "__main__":
    main()
