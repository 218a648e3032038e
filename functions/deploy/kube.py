"""The Kubernetes API as OpenRL uses it: five verbs on plain dict objects, over the official client.

`KubeApi` is the protocol the deploy command and the scheduler depend on: `get`, `list`,
`create`, `patch` (JSON merge patch) and `delete` of any kind in `KINDS`, addressed by
`apiVersion` and `kind` as the manifests name them. `KubernetesApi` implements it with the
official `kubernetes` client's `ApiClient` (its configuration, authentication and TLS from a
kubeconfig or the in-cluster service account); only the resource paths are ours. Every
request sends its Content-Type: the generated custom-object calls were seen to omit it.

Objects stay dicts (the manifests' own shape): no conversion to generated model classes
that would drop fields of custom resources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from functions.deploy.errors import ClusterError, DeployConfigError

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    @property
    def key(self) -> tuple[str, str]:
        return (self.api_version, self.kind)

    def path(self, namespace: Optional[str] = None, name: Optional[str] = None) -> str:
        group, _, version = self.api_version.rpartition("/")
        head = f"/apis/{group}/{version}" if group else f"/api/{version}"
        if self.namespaced:
            if not namespace:
                raise DeployConfigError(f"{self.kind} is namespaced: give a namespace")
            head += f"/namespaces/{namespace}"
        head += f"/{self.plural}"
        return head + (f"/{name}" if name else "")


KINDS: dict[tuple[str, str], Kind] = {
    k.key: k
    for k in [
        Kind("v1", "Namespace", "namespaces", namespaced=False),
        Kind("v1", "Node", "nodes", namespaced=False),
        Kind("v1", "Pod", "pods"),
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Secret", "secrets"),
        Kind("v1", "Service", "services"),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("apps/v1", "DaemonSet", "daemonsets"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("rbac.authorization.k8s.io/v1", "ClusterRole", "clusterroles", namespaced=False),
        Kind("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "clusterrolebindings", namespaced=False),
        Kind("serving.knative.dev/v1", "Service", "services"),
        Kind("sources.knative.dev/v1beta1", "KafkaSource", "kafkasources"),
        Kind("kafka.strimzi.io/v1beta2", "KafkaTopic", "kafkatopics"),
    ]
}


def kind_of(obj_or_key: Obj | tuple[str, str]) -> Kind:
    key = (
        obj_or_key if isinstance(obj_or_key, tuple) else (obj_or_key.get("apiVersion", ""), obj_or_key.get("kind", ""))
    )
    try:
        return KINDS[key]
    except KeyError:
        raise DeployConfigError(f"OpenRL does not manage {key[1]!r} of {key[0]!r}") from None


class KubeApi(Protocol):
    def get(self, key: tuple[str, str], name: str, namespace: Optional[str] = None) -> Optional[Obj]: ...

    def list(self, key: tuple[str, str], namespace: Optional[str] = None, label_selector: str = "") -> list[Obj]: ...

    def create(self, obj: Obj) -> Obj: ...

    def patch(self, key: tuple[str, str], name: str, patch: Obj, namespace: Optional[str] = None) -> Obj: ...

    def delete(self, key: tuple[str, str], name: str, namespace: Optional[str] = None) -> bool: ...


class KubernetesApi:
    """`KubeApi` over `kubernetes.client.ApiClient`."""

    def __init__(self, api_client) -> None:
        self.client = api_client

    @classmethod
    def connect(cls, kubeconfig: Optional[str] = None, context: Optional[str] = None) -> "KubernetesApi":
        """In-cluster credentials when running in a pod, else the kubeconfig; neither is a DeployConfigError."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config(config_file=kubeconfig, context=context)
            except (config.ConfigException, FileNotFoundError, OSError) as exc:
                raise DeployConfigError(
                    f"no cluster credentials: not in a pod, and no usable kubeconfig ({exc}); "
                    "set KUBECONFIG or pass --kubeconfig, or use --dry-run"
                ) from None
        return cls(client.ApiClient())

    @classmethod
    def at(cls, host: str, token: Optional[str] = None) -> "KubernetesApi":
        from kubernetes import client

        configuration = client.Configuration(host=host)
        if token:
            configuration.api_key = {"BearerToken": token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return cls(client.ApiClient(configuration))

    def _call(
        self, method: str, path: str, body: Optional[Obj] = None, query=None, content_type: str = "application/json"
    ):
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, headers, body, _ = self.client.param_serialize(
            method, path, query_params=query, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            response = self.client.call_api(method, url, header_params=headers, body=body)
            response.read()
            return self.client.response_deserialize(response, {"2XX": "object"}).data
        except ApiException as exc:
            raise ClusterError(f"{method} {path}: {exc.status} {_reason(exc)}", exc.status) from None

    def get(self, key, name, namespace=None):
        try:
            return self._call("GET", KINDS[key].path(namespace, name))
        except ClusterError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, key, namespace=None, label_selector=""):
        kind = KINDS[key]
        path = kind.path(namespace) if kind.namespaced and namespace else _cluster_wide(kind)
        body = self._call("GET", path, query=[("labelSelector", label_selector)] if label_selector else None)
        # The API server has filtered already; filtering again costs nothing and keeps the
        # answer right on an API-shaped server that ignores selectors (the test emulator).
        return [
            o for o in body.get("items") or [] if selects(label_selector, o.get("metadata", {}).get("labels") or {})
        ]

    def create(self, obj):
        kind = kind_of(obj)
        return self._call("POST", kind.path(obj["metadata"].get("namespace")), body=obj)

    def patch(self, key, name, patch, namespace=None):
        return self._call(
            "PATCH", KINDS[key].path(namespace, name), body=patch, content_type="application/merge-patch+json"
        )

    def delete(self, key, name, namespace=None):
        try:
            self._call("DELETE", KINDS[key].path(namespace, name), body={"propagationPolicy": "Foreground"})
            return True
        except ClusterError as exc:
            if exc.status == 404:
                return False
            raise


def selects(selector: str, labels: dict[str, str]) -> bool:
    """An equality-based label selector (`a=b,c!=d,e,!f`) against a label map."""
    for term in filter(None, (part.strip() for part in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.strip().rstrip("=")) != value.strip().lstrip("="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _cluster_wide(kind: Kind) -> str:
    group, _, version = kind.api_version.rpartition("/")
    return (f"/apis/{group}/{version}" if group else f"/api/{version}") + f"/{kind.plural}"


def _reason(exc) -> str:
    import json

    try:
        return json.loads(exc.body).get("message") or exc.reason
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)


def contains(live: Any, desired: Any) -> bool:
    """Whether `live` already says everything `desired` says (the server may add defaults).

    Dicts: every desired key present with a contained value. Lists: same length, item by
    item contained (the server adds defaults inside list items, e.g. a container's
    terminationMessagePath). Scalars: equal.
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    return live == desired
