"""How long a waiting `retrieve_future` takes to return once its completion event exists.

Raw HTTP against `openrl serve`: for each of N cheap requests (optim_step on a tiny
model), submit, long-poll `retrieve_future`, note the wall-clock time it returned; then
read each completion event's own timestamp (set by the worker when it emitted it) from
the server's event store. The difference is log → projector → store → notify → HTTP
response. Also prints the whole submit-to-result round trip.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from sqlalchemy import create_engine, select

KEY = "tml-bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()

    from eventing.store import tables
    from eventing.store.projections import utc
    from functions.local_server import LocalServer

    with tempfile.TemporaryDirectory() as data_dir:
        returned: dict[str, float] = {}
        round_trips: list[float] = []
        with LocalServer(data_dir, ["openrl/tiny-qwen3"], KEY) as server:
            http = httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": KEY}, timeout=60)
            session = http.post("/create_session", json={}).json()["session_id"]
            created = http.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": "openrl/tiny-qwen3", "lora_config": {"rank": 4}}).json()  # fmt: skip
            http.post("/retrieve_future", json={"request_id": created["request_id"]})
            for seq in range(1, args.requests + 1):
                started = time.time()
                future = http.post("/optim_step", json={"model_id": created["model_id"], "seq_id": seq}).json()
                result = http.post("/retrieve_future", json={"request_id": future["request_id"]})
                returned[future["request_id"]] = time.time()
                assert "metrics" in result.json(), result.text
                round_trips.append(returned[future["request_id"]] - started)
            http.close()
        engine = create_engine(f"sqlite:///{Path(data_dir) / 'events.db'}")
        with engine.connect() as conn:
            rows = conn.execute(
                select(tables.events.c.subject, tables.events.c.time).where(
                    tables.events.c.type.like("%optim_step.completed%")
                )
            ).all()
        engine.dispose()
    wake = [(returned[subject] - utc(when).timestamp()) * 1000 for subject, when in rows if subject in returned]
    trips = [t * 1000 for t in round_trips]
    print(f"{len(wake)} optim_step futures on openrl/tiny-qwen3, retrieve_future long-polling")
    print(
        f"completion event -> retrieve_future returns: p50 {statistics.median(wake):.1f} ms, p99 {percentile(wake, 0.99):.1f} ms"
    )
    print(
        f"submit -> result round trip:                 p50 {statistics.median(trips):.1f} ms, p99 {percentile(trips, 0.99):.1f} ms"
    )


if __name__ == "__main__":
    main()
