"""The audit files: `<dir>/<tenant>.jsonl`, one JSON line per event, append-only, per tenant.

Invariants:
- A line is only ever appended; nothing here seeks back to rewrite or truncate a file.
- `append` returns only after every file it wrote to is fsynced, so a caller that commits
  log offsets (or answers an HTTP delivery) afterwards never acknowledges an unwritten line.
- An event id is written at most once per tenant file, as long as its earlier line is among
  the last `window` lines of that file. On opening a file the ids of its last `window` lines
  are read back (from the end, so start-up does not scale with the file); after that the
  window follows the appends. A redelivery is at most what was polled since the last commit
  (one batch, which the consumer keeps below the window), or a push retried by a KafkaSource
  shortly after the first attempt, so a window of thousands makes redelivery exact without
  an index that grows with the file.
- A crash in the middle of a write leaves a last line without its newline. It is never
  repaired in place: the next open appends a newline, which closes the fragment (readers
  skip lines that are not JSON) and the event, never acknowledged, is written again whole.
- Tenant names are checked before they name a file, so an event cannot write outside `<dir>`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, Optional

from openrl_core.audit_entries import entry_for
from openrl_core.errors import InvalidRequest
from openrl_core.events import Event
from openrl_core.ids import check_tenant_name

log = logging.getLogger(__name__)
_BLOCK = 64 * 1024


class _TenantFile:
    def __init__(self, path: Path, window: int) -> None:
        created = not path.exists()
        self.file = open(path, "ab")
        if created:
            _fsync_dir(path.parent)  # the new file's name must survive a crash too
        self.recent: deque[str] = deque(maxlen=window)
        self.ids: set[str] = set()
        lines = tail_lines(path, window)
        if lines and not _ends_with_newline(path):
            log.warning("audit: %s ends in a torn line; closing it, its event will be written again", path)
            self.file.write(b"\n")
            lines = lines[:-1]
        for line in lines:
            entry = _parse(line)
            if entry is not None and isinstance(entry.get("id"), str):
                self.remember(entry["id"])

    def remember(self, event_id: str) -> None:
        if len(self.recent) == self.recent.maxlen:
            self.ids.discard(self.recent[0])
        self.recent.append(event_id)
        self.ids.add(event_id)


class AuditJournal:
    def __init__(self, directory: Path, window: int = 10_000) -> None:
        if window < 1:
            raise ValueError("the dedup window needs at least one line")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.window = window
        self._files: dict[str, _TenantFile] = {}
        self._lock = threading.Lock()

    def append(self, events: Iterable[Event]) -> int:
        """Write the line of every event not yet written, then fsync; returns lines written."""
        written = 0
        touched: dict[str, _TenantFile] = {}
        with self._lock:
            for event in events:
                try:
                    tenant = self._tenant(event.tenant)
                except InvalidRequest:
                    log.error("audit: event %s names an invalid tenant %r; skipped", event.id, event.tenant)
                    continue
                if event.id in tenant.ids:
                    continue  # a redelivery: its line is already there
                line = json.dumps(entry_for(event), separators=(",", ":"), ensure_ascii=False) + "\n"
                tenant.file.write(line.encode())
                tenant.remember(event.id)
                touched[event.tenant] = tenant
                written += 1
            for tenant in touched.values():
                tenant.file.flush()
                os.fsync(tenant.file.fileno())
        return written

    def close(self) -> None:
        with self._lock:
            for tenant in self._files.values():
                tenant.file.close()
            self._files.clear()

    def _tenant(self, name: str) -> _TenantFile:
        opened = self._files.get(name)
        if opened is None:
            opened = self._files[name] = _TenantFile(path_for(self.directory, name), self.window)
        return opened


def path_for(directory: Path, tenant: str) -> Path:
    return Path(directory) / f"{check_tenant_name(tenant)}.jsonl"


def read_entries(directory: Path, tenant: str, *, type_contains: Optional[str] = None, last: int = 0) -> Iterator[dict]:
    """A tenant's audit entries, oldest first; `last` > 0 keeps only the final ones.

    A reader sees only complete lines; a torn last line (a writer that crashed) is skipped.
    """
    path = path_for(directory, tenant)
    if not path.exists():
        return
    if last > 0 and type_contains is None:
        lines: Iterable[bytes] = tail_lines(path, last)
    else:
        lines = _all_lines(path)
    matched = (e for e in map(_parse, lines) if e is not None and (not type_contains or type_contains in e["type"]))
    if last > 0 and type_contains is not None:
        yield from deque(matched, maxlen=last)
    else:
        yield from matched


def tail_lines(path: Path, count: int) -> list[bytes]:
    """The last `count` lines of a file, read backwards in blocks (a torn last line included)."""
    with open(path, "rb") as file:
        end = file.seek(0, os.SEEK_END)
        chunks: list[bytes] = []
        newlines = 0
        position = end
        while position > 0 and newlines <= count:
            step = min(_BLOCK, position)
            position -= step
            file.seek(position)
            chunk = file.read(step)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
    lines = b"".join(reversed(chunks)).split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if position > 0:
        lines = lines[1:]  # the first piece may start mid-line
    return lines[-count:] if count else []


def _all_lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as file:
        for line in file:
            if line.endswith(b"\n"):
                yield line[:-1]


def _parse(line: bytes) -> Optional[dict]:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and "type" in entry else None


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as file:
        if file.seek(0, os.SEEK_END) == 0:
            return True
        file.seek(-1, os.SEEK_END)
        return file.read(1) == b"\n"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
