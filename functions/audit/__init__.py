"""The audit function: an append-only log of who did what, one JSON line per event, per tenant.

It reads every OpenRL event (the log consumer, `openrl audit`, or CloudEvents pushed over
HTTP to `new().handle` by a KafkaSource) and appends one line per event id to
`<data_dir>/audit/<tenant>.jsonl`: time, id, type, actor (tenant and source function), the
object ids, and an outcome for terminal events; never payload tensors. Lines are fsynced
before the delivery is acknowledged and never rewritten; a redelivered event adds nothing.
`read_entries` (and `openrl audit --tenant T --show`) lists a tenant's entries.
"""

from functions.audit.consumer import AuditConsumer, AuditFunction
from functions.audit.journal import AuditJournal, read_entries


def new() -> AuditFunction:
    return AuditFunction()


__all__ = ["AuditConsumer", "AuditFunction", "AuditJournal", "new", "read_entries"]
