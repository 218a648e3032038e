"""The trainer's turn order across tenants: round-robin over tenants, then over each tenant's
models in arrival order; a model's own requests stay in their (seq) order.

Pure CPU-side state, no I/O: the worker adds each model's ready requests as they become
ready and pops one model's requests per accelerator turn. Without it the trainer ran what
one poll made ready in arrival order, so a tenant with one model waited behind every model
of a tenant with many: its latency grew with the other tenant's job count. Here a tenant
that becomes ready while another's models are queued is served after at most one turn of
each tenant ahead of it in the ring, however many models those tenants have.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, Hashable, Optional, TypeVar

Item = TypeVar("Item")


class FairQueue(Generic[Item]):
    def __init__(self) -> None:
        self._ring: deque[str] = deque()  # tenants with queued work; the front is served next
        self._models: dict[str, OrderedDict[Hashable, list[Item]]] = {}

    def add(self, tenant: str, model: Hashable, items: list[Item]) -> None:
        """Queue a model's ready requests (after any of its own still queued)."""
        if not items:
            return
        models = self._models.get(tenant)
        if models is None:
            models = self._models[tenant] = OrderedDict()
            self._ring.append(tenant)  # a newly ready tenant waits behind those already queued
        models.setdefault(model, []).extend(items)

    def pop(self) -> Optional[tuple[str, Hashable, list[Item]]]:
        """The next turn: (tenant, model, its requests in order), or None when empty."""
        if not self._ring:
            return None
        tenant = self._ring.popleft()
        models = self._models[tenant]
        model, items = models.popitem(last=False)
        if models:
            self._ring.append(tenant)
        else:
            del self._models[tenant]
        return tenant, model, items

    def discard(self, model: Hashable) -> list[Item]:
        """Drop a model's queued requests (its run was cancelled); returns them."""
        for tenant, models in list(self._models.items()):
            if model in models:
                items = models.pop(model)
                if not models:
                    del self._models[tenant]
                    self._ring.remove(tenant)
                return items
        return []

    def __len__(self) -> int:
        return sum(len(models) for models in self._models.values())
