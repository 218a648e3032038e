"""The audit function over the real embedded log and real catalogue events: the lines it
writes, redelivery without duplicates, tenant separation, and the HTTP path."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from functions.audit import AuditConsumer, AuditJournal, new, read_entries
from functions.audit import journal as journal_module
from functions.audit.journal import path_for, tail_lines
from functions.cli import main
from tests.functions.audit.scenario import BASE, GATEWAY, TRAINER, Stream


@pytest.fixture
def rig(tmp_path):
    log = EmbeddedLog(tmp_path / "log.db", fsync=False)
    codec = Codec(BlobStore(tmp_path / "blobs"))
    yield log, codec, EventPublisher(log, codec)
    log.close()


def realistic(stream: Stream) -> dict[str, object]:
    """Session, create_model, a forward_backward that works and one that fails, a save."""
    s = stream
    s.session_created(t=0)
    create = s.create_model("req-create", t=1)
    s.completed(create, 2, {"model_id": s.model})
    fb = s.forward_backward("req-fb-1", t=3)
    s.completed(fb, 4, {"loss_fn_outputs": [], "metrics": {"loss:sum": 1.5}})
    bad = s.forward_backward("req-fb-2", t=5)
    s.failed(bad, 6, "data[0].model_input holds token id 999999, outside the vocabulary", category="user")
    save = s.save_weights("req-save", t=7, name="ckpt-1")
    saved = s.saved(save, t=8)
    return {"fb": fb, "bad": bad, "saved": saved}


def drain(consumer: AuditConsumer) -> None:
    while consumer.run_once(timeout=0.05):
        pass


def lines_of(directory, tenant: str) -> list[dict]:
    return [json.loads(line) for line in path_for(directory, tenant).read_text().splitlines()]


def test_a_realistic_sequence_becomes_one_line_per_event(rig, tmp_path):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    marks = realistic(stream)
    consumer = AuditConsumer(log, codec, AuditJournal(tmp_path / "audit"))
    drain(consumer)
    consumer.close()

    lines = {line["id"]: line for line in lines_of(tmp_path / "audit", "alice")}
    assert sorted(lines) == sorted(e.id for e in stream.events)
    fb = marks["fb"]
    assert lines[fb.id] == {
        "time": "2026-03-01T12:00:03+00:00",
        "id": fb.id,
        "type": "ai.openrl.training.forward_backward.requested.v1",
        "actor": {"tenant": "alice", "source": GATEWAY},
        "ids": {"request_id": "req-fb-1", "model_id": "s1:train:0"},
        "detail": {"seq_id": 1, "loss_fn": "cross_entropy", "forward_only": False, "data_count": 2},
    }
    failure = next(line for line in lines.values() if line["type"].endswith("forward_backward.failed.v1"))
    assert failure["actor"] == {"tenant": "alice", "source": TRAINER}
    assert failure["ids"] == {"request_id": "req-fb-2", "key": "s1:train:0"}
    assert failure["outcome"] == {
        "status": "failed", "category": "user", "error": "data[0].model_input holds token id 999999, outside the vocabulary"
    }  # fmt: skip
    saved = lines[marks["saved"].id]
    assert saved["outcome"] == {"status": "completed", "checkpoint": "tinker://s1:train:0/weights/ckpt-1"}
    assert saved["ids"] == {"request_id": "req-save", "run_id": "s1:train:0", "checkpoint_id": "weights/ckpt-1"}
    create = next(line for line in lines.values() if line["type"].endswith("create_model.requested.v1"))
    assert create["detail"] == {"base_model": BASE, "model_seq_id": 0, "lora_rank": 8}
    session = next(line for line in lines.values() if line["type"] == "ai.openrl.session.create.completed.v1")
    assert session["ids"] == {"session_id": "s1"} and session["outcome"] == {"status": "completed"}
    # Only ids and small facts: no tensor, token list or result ever reaches the file.
    text = path_for(tmp_path / "audit", "alice").read_text()
    # keys, not substrings: a random event id may well contain the letters b64
    assert '"b64"' not in text and '"target_tokens"' not in text and '"loss:sum"' not in text


def test_redelivery_after_a_crash_writes_no_line_twice(rig, tmp_path):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    realistic(stream)
    audit = tmp_path / "audit"
    # The first consumer writes (and fsyncs) part of the stream, then dies before committing.
    first = AuditConsumer(log, codec, AuditJournal(audit))
    records = first.consumer.poll(max_records=5, timeout=0.1)
    assert first.journal.append([codec.decode(r.message) for r in records]) == 5
    first.consumer.close()
    first.journal.close()
    before = path_for(audit, "alice").read_bytes()

    second = AuditConsumer(log, codec, AuditJournal(audit))
    drain(second)
    second.close()
    after = path_for(audit, "alice").read_bytes()
    assert after.startswith(before)  # appended to, never rewritten
    ids = [line["id"] for line in lines_of(audit, "alice")]
    assert len(ids) == len(set(ids)) == len(stream.events)

    # Everything committed now: a third start has nothing to deliver and writes nothing.
    third = AuditConsumer(log, codec, AuditJournal(audit))
    drain(third)
    third.close()
    assert path_for(audit, "alice").read_bytes() == after


def test_a_line_torn_by_a_crash_is_closed_not_repaired(rig, tmp_path):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    stream.session_created(t=0)
    stream.create_model("req-create", t=1)
    audit = tmp_path / "audit"
    audit.mkdir()
    torn = b'{"time":"2026-03-01T12:00:00+00:00","id":"' + stream.events[0].id.encode()[:10]
    path_for(audit, "alice").write_bytes(torn)  # the writer died mid-line, before any commit

    consumer = AuditConsumer(log, codec, AuditJournal(audit))
    drain(consumer)
    consumer.close()
    raw = path_for(audit, "alice").read_bytes()
    assert raw.startswith(torn + b"\n")
    entries = list(read_entries(audit, "alice"))
    assert sorted(e["id"] for e in entries) == sorted(e.id for e in stream.events)


def test_one_tenants_events_never_reach_anothers_file(rig, tmp_path):
    log, codec, publisher = rig
    alice, bob = Stream("alice", publisher), Stream("bob", publisher, session="s9")
    for stream in (alice, bob):
        realistic(stream)
    consumer = AuditConsumer(log, codec, AuditJournal(tmp_path / "audit"))
    drain(consumer)
    consumer.close()
    for stream, other in ((alice, bob), (bob, alice)):
        lines = lines_of(tmp_path / "audit", stream.tenant)
        assert {line["id"] for line in lines} == {e.id for e in stream.events}
        assert {line["actor"]["tenant"] for line in lines} == {stream.tenant}
        assert not {line["id"] for line in lines} & {e.id for e in other.events}
    assert sorted(p.name for p in (tmp_path / "audit").iterdir()) == ["alice.jsonl", "bob.jsonl"]


def test_the_http_function_writes_the_same_lines_as_the_log_consumer(rig, tmp_path):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    realistic(stream)
    consumer = AuditConsumer(log, codec, AuditJournal(tmp_path / "from-log"))
    drain(consumer)
    consumer.close()

    function = new()
    function.start({"DATA_DIR": str(tmp_path / "knative")})
    assert function.ready() == (True, "ready")

    async def deliver():
        transport = httpx.ASGITransport(app=function.handle)
        async with httpx.AsyncClient(transport=transport, base_url="http://audit") as client:
            answers = []
            for event in stream.events + stream.events[:2]:  # the first two delivered twice
                headers, body = codec.encode_http(event)
                answers.append((await client.post("/", headers=headers, content=body)).json()["written"])
            rejected = await client.post("/", headers={"content-type": "application/json"}, content=b"{}")
            wrong_method = await client.get("/")
            return answers, rejected.status_code, wrong_method.status_code

    answers, rejected, wrong_method = asyncio.run(deliver())
    function.stop()
    assert answers == [1] * len(stream.events) + [0, 0]
    assert (rejected, wrong_method) == (400, 405)
    by_log = {line["id"]: line for line in lines_of(tmp_path / "from-log", "alice")}
    by_http = {line["id"]: line for line in lines_of(tmp_path / "knative" / "audit", "alice")}
    assert by_http == by_log


def test_show_lists_a_tenants_entries(rig, tmp_path, capsys):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    realistic(stream)
    consumer = AuditConsumer(log, codec, AuditJournal(tmp_path / "audit"))
    drain(consumer)
    consumer.close()

    assert main(["audit", "--data-dir", str(tmp_path), "--show", "--tenant", "alice", "--type", "failed"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [entry["ids"]["request_id"] for entry in shown] == ["req-fb-2"]
    assert main(["audit", "--data-dir", str(tmp_path), "--show", "--tenant", "alice", "-n", "3"]) == 0
    last_three = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert last_three == lines_of(tmp_path / "audit", "alice")[-3:]
    assert main(["audit", "--data-dir", str(tmp_path), "--show", "--tenant", "nobody"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["audit", "--data-dir", str(tmp_path), "--show", "--tenant", "../etc"]) == 2


def test_the_dedup_window_is_read_back_from_the_end_of_a_long_file(tmp_path):
    stream = Stream("alice")
    for i in range(50):
        stream.session_created(t=i)
    journal = AuditJournal(tmp_path, window=10)
    assert journal.append(stream.events) == 50
    journal.close()
    reopened = AuditJournal(tmp_path, window=10)
    # The last ten are remembered, so their redelivery adds nothing…
    assert reopened.append(stream.events[-10:]) == 0
    # …and the window is exactly ten lines: the eleventh from the end is no longer known.
    assert reopened.append(stream.events[-11:-10]) == 1
    reopened.close()


def test_tail_lines_reads_backwards_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "_BLOCK", 7)
    path = tmp_path / "lines"
    path.write_bytes(b"".join(b"line-%d\n" % i for i in range(30)))
    assert tail_lines(path, 4) == [b"line-26", b"line-27", b"line-28", b"line-29"]
    assert tail_lines(path, 100) == [b"line-%d" % i for i in range(30)]
    path.write_bytes(b"one\ntwo\nthr")  # a torn last line is returned, for the writer to notice
    assert tail_lines(path, 2) == [b"two", b"thr"]
