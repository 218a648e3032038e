"""Replay speed: rebuild every projection from 100,000 stored events, on SQLite and PostgreSQL.

For each store, in one run: append a realistic history through `EventStore.append` (the
live write path, one transaction per event, timed too), then time reading the events back
alone (rows only, and rows decoded into typed events, which is what replay reads), then
`eventing.replay.rebuild` into a fresh, migrated database of the same kind, then `diff`,
which must be empty. The gap between the read and the rebuild is the fold's cost: each
event's insert and projection change, one transaction per batch of events.

The history is what training runs leave: sessions with heartbeats, models created, steps of
forward_backward (2 datums x 64 tokens, cross_entropy) and optim_step, each requested and
completed, the odd failure and refused seq_id, sampler weights every 10 steps with 4
samples from them, a named checkpoint every 25 steps, sessions finished. Payloads are small
and inline, as the codec keeps them below its claim-check limit.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import scratch_pg
from sqlalchemy import select

STEPS_PER_MODEL = 100
TOKENS = 64


def life(target: int, seed: int = 0) -> Iterator[tuple[object, Optional[object]]]:
    """(event, dedup) pairs, as the gateway and the workers append them, until `target` events."""
    from eventing.store.event_store import Dedup
    from openrl_core.datum import Datum, DatumRecord
    from openrl_core.events import new_event
    from openrl_core.events import sampling as sa
    from openrl_core.events import sessions as se
    from openrl_core.events import training as te
    from openrl_core.events.lifecycle import (
        BlobRef,
        CheckpointSaved,
        RequestCompleted,
        RequestFailed,
        SamplingSessionBound,
    )
    from openrl_core.ids import new_request_id, sampling_session_id_for
    from openrl_core.params import AdamParams, LoraConfig, SamplingParams
    from openrl_core.tensors import Array

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    base_model = "openrl/tiny-qwen3"
    count = 0

    def blob() -> BlobRef:
        return BlobRef(sha256=f"{rng.getrandbits(256):064x}", size=rng.randint(10_000, 2_000_000))

    def event(type_, payload, tenant, key=None, subject=None, dedup=None):
        nonlocal count
        count += 1
        return new_event(type_, payload, tenant=tenant, source="/bench", key=key, subject=subject), dedup

    def datum() -> DatumRecord:
        tokens = nrng.integers(0, 150_000, TOKENS, dtype=np.int64)
        weights = (np.arange(TOKENS) >= TOKENS // 2).astype(np.float32)
        return DatumRecord.from_datum(Datum(tokens, {"target_tokens": np.roll(tokens, -1), "weights": weights}))

    def ask_and_answer(family, payload, tenant, model_id, dedup, result, fail=False, **extra):
        yield event(family["requested"], payload, tenant, key=model_id, subject=payload.request_id, dedup=dedup)
        if fail:
            answer = RequestFailed(request_id=payload.request_id, error="CUDA out of memory", category="server")
            yield event(family["failed"], answer, tenant, key=model_id, subject=payload.request_id)
        else:
            answer = RequestCompleted(request_id=payload.request_id, result=result, **extra)
            yield event(family["completed"], answer, tenant, key=model_id, subject=payload.request_id)

    while count < target:
        tenant = f"tenant-{rng.randrange(4)}"
        session_id = str(uuid.UUID(int=rng.getrandbits(128)))
        model_id = f"{session_id}:train:0"
        yield event(
            se.SESSION_CREATED,
            se.SessionCreated(session_id=session_id, tags=["bench"], sdk_version="0.38.0"),
            tenant,
            key=session_id,
            subject=session_id,
        )
        created = te.CreateModelRequested(
            request_id=new_request_id(), session_id=session_id, model_id=model_id, model_seq_id=0,
            base_model=base_model, lora_config=LoraConfig(rank=16),
        )  # fmt: skip
        yield from ask_and_answer(te.CREATE_MODEL, created, tenant, model_id, Dedup.of(f"model:{session_id}:0", created.model_dump_json().encode()),
                                  {"model_id": model_id, "type": "create_model"})  # fmt: skip
        seq, samplers = 0, 0
        for step in range(1, STEPS_PER_MODEL + 1):
            if count >= target:
                break
            seq += 1
            fb = te.ForwardBackwardRequested(
                request_id=new_request_id(),
                model_id=model_id,
                seq_id=seq,
                loss_fn="cross_entropy",
                data=[datum(), datum()],
            )
            outputs = [
                {"logprobs": Array.from_numpy(nrng.standard_normal(TOKENS).astype(np.float32)).model_dump()}
                for _ in range(2)
            ]
            result = {
                "loss_fn_output_type": "ArrayRecord",
                "loss_fn_outputs": outputs,
                "metrics": {"loss:sum": rng.uniform(10, 100)},
            }
            dedup = Dedup.of(f"seq:{model_id}:{seq}", fb.model_dump_json().encode())
            yield from ask_and_answer(
                te.FORWARD_BACKWARD, fb, tenant, model_id, dedup, result, fail=rng.random() < 0.01
            )
            if rng.random() < 0.005:  # a request the gateway refused still uses its seq_id
                seq += 1
                skipped = te.SeqSkipped(model_id=model_id, seq_id=seq, reason="data[0] holds token id -1")
                yield event(
                    te.SEQ_SKIPPED,
                    skipped,
                    tenant,
                    key=model_id,
                    dedup=Dedup.of(f"seq:{model_id}:{seq}", b"bad").refused(),
                )
            seq += 1
            opt = te.OptimStepRequested(
                request_id=new_request_id(), model_id=model_id, seq_id=seq, adam_params=AdamParams(learning_rate=1e-4)
            )
            dedup = Dedup.of(f"seq:{model_id}:{seq}", opt.model_dump_json().encode())
            yield from ask_and_answer(
                te.OPTIM_STEP, opt, tenant, model_id, dedup, {"metrics": {"optim/grad_norm": rng.uniform(0, 5)}}
            )
            if step % 10 == 0:
                yield event(se.SESSION_HEARTBEAT, se.SessionHeartbeat(session_id=session_id), tenant, key=session_id)
                seq += 1
                sampling_session_id = sampling_session_id_for(session_id, samplers)
                samplers += 1
                save = te.SaveWeightsForSamplerRequested(
                    request_id=new_request_id(), model_id=model_id, seq_id=seq, sampling_session_id=sampling_session_id
                )
                bound = SamplingSessionBound(sampling_session_id=sampling_session_id, session_id=session_id, base_model=base_model,
                                             adapter={"adapter_model.safetensors": blob(), "adapter_config.json": blob()})  # fmt: skip
                dedup = Dedup.of(f"seq:{model_id}:{seq}", save.model_dump_json().encode())
                result = {"sampling_session_id": sampling_session_id, "type": "save_weights_for_sampler"}
                yield from ask_and_answer(
                    te.SAVE_WEIGHTS_FOR_SAMPLER, save, tenant, model_id, dedup, result, sampling_session=bound
                )
                for sample_seq in range(4):
                    request_id = new_request_id()
                    sample = sa.SampleRequested(
                        request_id=request_id, sampling_session_id=sampling_session_id, seq_id=sample_seq, base_model=base_model,
                        adapter=bound.adapter, prompt_tokens=[rng.randrange(150_000) for _ in range(32)], num_samples=4,
                        sampling_params=SamplingParams(max_tokens=16, temperature=1.0), sample_sequence_ids=[f"{request_id}:{i}" for i in range(4)],
                    )  # fmt: skip
                    sequences = [{"tokens": [rng.randrange(150_000) for _ in range(16)], "logprobs": [rng.uniform(-5, 0) for _ in range(16)],
                                  "stop_reason": "length"} for _ in range(4)]  # fmt: skip
                    dedup = Dedup.of(f"sample:{sampling_session_id}:{sample_seq}", sample.model_dump_json().encode())
                    yield from ask_and_answer(sa.SAMPLE, sample, tenant, sampling_session_id, dedup,
                                              {"sequences": sequences, "prompt_logprobs": None, "topk_prompt_logprobs": None})  # fmt: skip
            if step % 25 == 0:
                seq += 1
                save = te.SaveWeightsRequested(
                    request_id=new_request_id(), model_id=model_id, seq_id=seq, name=f"step-{step}"
                )
                saved = CheckpointSaved(
                    run_id=model_id, kind="weights", name=save.name, files={"state.safetensors": blob()}
                )
                dedup = Dedup.of(f"seq:{model_id}:{seq}", save.model_dump_json().encode())
                yield from ask_and_answer(
                    te.SAVE_WEIGHTS,
                    save,
                    tenant,
                    model_id,
                    dedup,
                    {"path": saved.tinker_path, "type": "save_weights"},
                    checkpoint=saved,
                )
        yield event(
            se.SESSION_FINISHED,
            se.SessionFinished(session_id=session_id, reason="success"),
            tenant,
            key=session_id,
            subject=session_id,
        )


class Scratch:
    """Fresh, migrated event stores that disappear afterwards: SQLite files or PostgreSQL databases."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind = kind
        self.directory = directory
        self.engines: list = []
        self.databases: list[str] = []

    def store(self, name: str):
        from eventing.blobs import BlobStore
        from eventing.codec import Codec
        from eventing.store import database
        from eventing.store.event_store import EventStore
        from eventing.store.queries import Projections

        if self.kind == "sqlite":
            url = f"sqlite:///{self.directory / (name + '.db')}"
        else:
            database_name, url = scratch_pg.create(f"openrl_bench_{name}")
            self.databases.append(database_name)
        engine = database.make_engine(url)
        database.upgrade(engine)
        self.engines.append(engine)
        return EventStore(engine, Codec(BlobStore(self.directory / "blobs"))), Projections(engine)

    def close(self) -> None:
        for engine in self.engines:
            engine.dispose()
        for name in self.databases:
            scratch_pg.drop(name)


def read_rows(store, batch: int = 2000) -> int:
    """The events table in store order, rows only: what any reader pays before decoding."""
    from eventing.store import tables as t

    count, position = 0, 0
    with store.engine.connect() as conn:
        while True:
            rows = conn.execute(
                select(t.events).where(t.events.c.position > position).order_by(t.events.c.position).limit(batch)
            ).all()
            if not rows:
                return count
            count += len(rows)
            position = rows[-1].position


def read_events(store, batch: int = 2000) -> int:
    """What `rebuild` reads, as it reads it: the rows as the driver gives them, decoded into
    typed events with their dedup identities and stored payloads (`read_packed`), with the
    cyclic garbage collector off as the rebuild has it (`Rebuilder.append`). With it on, its
    passes over the decoded events cost more than the decoding (79 against 23 us an event
    here), and the fold-only column, the rebuild minus this read, would be flattered."""
    count, position = 0, 0
    collecting = gc.isenabled()
    gc.disable()
    try:
        while True:
            chunk = store.read_packed(position, batch)
            if not chunk:
                return count
            count += len(chunk)
            position = chunk[-1][0]
    finally:
        if collecting:
            gc.enable()


def timed(fn, *args):
    started = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - started


def bench(kind: str, events: int, directory: Path) -> dict:
    from eventing.replay import diff, rebuild

    scratch = Scratch(kind, directory)
    try:
        live_store, live = scratch.store("live")
        history = list(itertools.islice(life(events), events))  # made first, so the append is timed alone
        mix = Counter(".".join(event.type.split(".")[2:5]) for event, _ in history)

        def append_all(history: list) -> int:
            for event, dedup in history:
                live_store.append(event, dedup=dedup)
            return len(history)

        appended, append_seconds = timed(append_all, history)
        del history  # freed before the timed reads
        rows, rows_seconds = timed(read_rows, live_store)
        decoded, decode_seconds = timed(read_events, live_store)
        target_store, rebuilt = scratch.store("rebuilt")
        (replayed, rebuild_seconds) = rebuild(live_store, target_store)
        differences, diff_seconds = timed(diff, live, rebuilt)
        return {
            "appended": appended, "append_s": append_seconds, "rows": rows, "rows_s": rows_seconds,
            "decoded": decoded, "decode_s": decode_seconds, "replayed": replayed, "rebuild_s": rebuild_seconds,
            "diff_s": diff_seconds, "differences": differences, "mix": mix,
        }  # fmt: skip
    finally:
        scratch.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument(
        "--pg-events", type=int, default=None,
        help="PostgreSQL gets the first this many events of the same history (default: --events); at a round trip "
        "per statement its live append is the slow part of this bench",
    )  # fmt: skip
    parser.add_argument("--stores", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory(prefix="openrl-replay-") as root:
        for kind in [k.strip() for k in args.stores.split(",") if k.strip()]:
            directory = Path(root) / kind
            directory.mkdir()
            results[kind] = bench(
                kind,
                args.events if kind == "sqlite" or args.pg_events is None else min(args.events, args.pg_events),
                directory,
            )
            r = results[kind]
            print(
                f"{kind}: appended {r['appended']} events in {r['append_s']:.0f} s, rebuilt in {r['rebuild_s']:.0f} s",
                flush=True,
            )

    largest = max(results.values(), key=lambda r: r["appended"])
    print(
        f"\nthe history of {largest['appended']} events: "
        + ", ".join(f"{name} {n}" for name, n in largest["mix"].most_common())
    )
    print(
        f"\n{'store':10} {'events':>7} {'append (live)':>14} {'read rows':>11} {'read+decode':>12} {'rebuild':>9} {'fold only':>10} {'diff':>7}  replay"
    )
    for kind, r in results.items():
        fold_seconds = r["rebuild_s"] - r["decode_s"]
        print(
            f"{kind:10} {r['appended']:7d} {r['appended'] / r['append_s']:10.0f} e/s {r['rows'] / r['rows_s']:7.0f} e/s {r['decoded'] / r['decode_s']:8.0f} e/s "
            f"{r['replayed'] / r['rebuild_s']:5.0f} e/s {r['replayed'] / fold_seconds:6.0f} e/s {r['diff_s']:5.1f} s  "
            + (
                "projections match"
                if not r["differences"]
                else f"{len(r['differences'])} DIFFERENCES: {r['differences'][:3]}"
            )
        )
    print("e/s = events per second; rebuild = read+decode and append each event into a fresh store (replay.rebuild);")
    print(
        "fold only = events / (rebuild time - read+decode time); from PostgreSQL the rebuild fetches the next chunk while it"
    )
    print(
        "folds, and into either store the last chunk is written while the next is folded (PostgreSQL: a thread; a SQLite file:"
    )
    print("a writer process, eventing/store/sqlite_writer.py), so it is an upper bound on the fold's own rate")
    if any(r["differences"] for r in results.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
