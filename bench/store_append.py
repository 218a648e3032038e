"""One event's append to the event store, in process: what the gateway's writer pays per
batch for an `optim_step` request and the projector for its completion, without HTTP, the
log or other threads.

A store (SQLite or PostgreSQL, fresh and migrated) first takes `--history` events of
`bench/replay_speed.py`'s realistic history, one transaction each; then every `optim_step`
requested and completed event of the next `--measure` events is timed alone through
`EventStore.append_many` (the requested ones with an outbox topic, as the gateway appends
them), the rest appended untimed in between. Prints each kind's median and p90 in ms.

Run it from two trees (`PYTHONPATH=<tree>`) to compare them side by side.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay_speed  # noqa: E402  (the history and the scratch stores)

TIMED = ("optim_step.requested.v1", "optim_step.completed.v1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    parser.add_argument("--history", type=int, default=2000, help="events stored before timing")
    parser.add_argument("--measure", type=int, default=3000, help="events appended while timing")
    args = parser.parse_args()

    events = list(itertools.islice(replay_speed.life(args.history + args.measure), args.history + args.measure))
    with tempfile.TemporaryDirectory(prefix="openrl-append-") as root:
        for kind in [k.strip() for k in args.stores.split(",") if k.strip()]:
            directory = Path(root) / kind
            directory.mkdir()
            scratch = replay_speed.Scratch(kind, directory)
            try:
                store, _projections = scratch.store("live")

                def append(pair) -> None:
                    event, dedup = pair
                    store.append_many([(event, "openrl.bench" if event.phase == "requested" else None, dedup)])

                for pair in events[: args.history]:
                    append(pair)
                timings: dict[str, list[float]] = {name: [] for name in TIMED}
                for pair in events[args.history :]:
                    name = next((n for n in TIMED if pair[0].type.endswith(n)), None)
                    if name is None:
                        append(pair)
                        continue
                    started = time.perf_counter()
                    append(pair)
                    timings[name].append((time.perf_counter() - started) * 1000)
                for name, values in timings.items():
                    values.sort()
                    print(
                        f"{kind:8} {name:26} {len(values):5d} appends  p50 {statistics.median(values):.3f} ms  "
                        f"p90 {values[int(len(values) * 0.9)]:.3f} ms"
                    )
            finally:
                scratch.close()


if __name__ == "__main__":
    main()
