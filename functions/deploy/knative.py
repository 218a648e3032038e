"""The Knative Serving client: typed calls on `serving.knative.dev/v1` Services over the official client.

`KnativeServing` creates, gets, lists, patches (JSON merge patch), deletes and waits for a
Service to be `Ready`, through `kubernetes.client.CustomObjectsApi`. Every write passes its
Content-Type explicitly (`create_namespaced_custom_object` sends none otherwise; a test
checks the header on the wire).
`readiness` reads a Service's `Ready` condition into (ready, reason): a Service that never
becomes ready fails `wait_ready` with that reason, not a bare timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from functions.deploy.errors import ClusterError, NotReady

GROUP, VERSION, PLURAL = "serving.knative.dev", "v1", "services"
Obj = dict[str, Any]
# kubernetes 37's create_namespaced_custom_object ignores `_content_type` and sends no
# Content-Type at all; the header itself is passed instead.
JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str


def readiness(service: Obj) -> Readiness:
    status = service.get("status") or {}
    generation = (service.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    for condition in status.get("conditions") or []:
        if condition.get("type") != "Ready":
            continue
        why = ": ".join(filter(None, [condition.get("reason"), condition.get("message")])) or condition.get(
            "status", ""
        )
        # A Ready condition of an older generation says nothing about the current spec.
        if generation is not None and observed is not None and observed < generation:
            return Readiness(False, f"generation {generation} not observed yet (at {observed})")
        return Readiness(condition.get("status") == "True", why or "Ready")
    return Readiness(False, "no Ready condition yet")


class KnativeServing:
    def __init__(self, api_client, namespace: str) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.namespace = namespace

    def _call(self, what: str, fn: Callable, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(GROUP, VERSION, self.namespace, PLURAL, *args, **kwargs)
        except ApiException as exc:
            raise ClusterError(f"Knative Service {what}: {exc.status} {exc.reason}", exc.status) from None

    def create(self, service: Obj) -> Obj:
        name = service["metadata"]["name"]
        return self._call(f"{name} create", self.api.create_namespaced_custom_object, service, _headers=JSON)

    def get(self, name: str) -> Optional[Obj]:
        try:
            return self._call(f"{name} get", self.api.get_namespaced_custom_object, name)
        except ClusterError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, label_selector: str = "") -> list[Obj]:
        from functions.deploy.kube import selects

        body = self._call("list", self.api.list_namespaced_custom_object, label_selector=label_selector)
        return [s for s in body.get("items") or [] if selects(label_selector, s["metadata"].get("labels") or {})]

    def patch(self, name: str, patch: Obj) -> Obj:
        return self._call(
            f"{name} patch",
            self.api.patch_namespaced_custom_object,
            name,
            patch,
            _content_type="application/merge-patch+json",
        )

    def delete(self, name: str) -> bool:
        try:
            self._call(f"{name} delete", self.api.delete_namespaced_custom_object, name)
            return True
        except ClusterError as exc:
            if exc.status == 404:
                return False
            raise

    def wait_ready(self, name: str, timeout: float = 300.0, poll: float = 2.0) -> Obj:
        """The Service once its Ready condition is True; NotReady with its last reason after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            service = self.get(name)
            state = readiness(service) if service is not None else Readiness(False, "not found")
            if state.ready:
                return service
            if time.monotonic() >= deadline:
                raise NotReady(
                    f"Knative Service {self.namespace}/{name} not Ready after {timeout:.0f} s: {state.reason}"
                )
            time.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))
