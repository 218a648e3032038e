"""Access events: what the gateway refused to show a tenant.

Tenant isolation answers another tenant's id exactly as an id that never existed (a 404
with the same detail), so the answer cannot say which it was; the audit log can. Every
404 of a lookup answered to an authenticated tenant is one `lookup.refused` event in that
tenant's stream: the caller, what was asked for (method, route template, the path as sent)
and the 404's detail, which names the id. It is recorded for every such 404, not only for
ids another tenant owns, because finding the owner first would make the two answers take
different times (an existence oracle); an operator tells them apart from the ids.
"""

from __future__ import annotations

from openrl_core.events.base import Payload, event_type, register

FAMILY = "access"


class LookupRefused(Payload):
    method: str
    route: str  # the route template, e.g. /api/v1/training_runs/{run_id}
    path: str  # the path as the client sent it (cut to a bounded length)
    reason: str  # the 404's detail, which names the id that was not found


LOOKUP_REFUSED = register(event_type(FAMILY, "lookup", "refused"), LookupRefused)
