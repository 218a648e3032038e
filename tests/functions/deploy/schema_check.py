"""Strict validation of a rendered manifest against the published schema of its kind.

Core kinds go through PyPI `kubernetes-validate` in strict mode (its bundled Kubernetes
OpenAPI schemas: unknown fields and wrong types fail). Knative Service, KafkaSource and
Strimzi KafkaTopic go through the schemas in ./schemas (each file says where it comes
from), made strict the way `kubectl apply --validate=strict` treats a structural schema: an
object with declared properties accepts no other fields unless the schema marks it
x-kubernetes-preserve-unknown-fields. Their metadata is checked as an ObjectMeta subset.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

KUBERNETES_VERSION = "1.32.0"
SCHEMAS = Path(__file__).parent / "schemas"
CUSTOM = {
    ("serving.knative.dev/v1", "Service"): "knative-serving-service-v1.yaml",
    ("sources.knative.dev/v1beta1", "KafkaSource"): "kafkasource-v1beta1.yaml",
    ("kafka.strimzi.io/v1beta2", "KafkaTopic"): "strimzi-kafkatopic-v1beta2.yaml",
}
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": {
            "type": "object",
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE.pattern},
        },
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def strict(schema: Any) -> Any:
    """Closes every object schema that declares properties (in place; anchors share nodes)."""
    if isinstance(schema, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return schema
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for key in ("properties",):
            for child in (schema.get(key) or {}).values():
                strict(child)
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), dict):
                strict(schema[key])
        for child in schema.get("anyOf") or []:
            strict(child)
    return schema


@lru_cache(maxsize=None)
def _validator(file: str) -> jsonschema.Draft7Validator:
    schema = strict(yaml.safe_load((SCHEMAS / file).read_text()))
    return jsonschema.Draft7Validator(schema)


def problems(obj: dict) -> list[str]:
    """Every way `obj` breaks its kind's schema; empty when it validates."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    where = f"{key[1]} {obj.get('metadata', {}).get('name')}"
    if key in CUSTOM:
        found = [
            f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in _validator(CUSTOM[key]).iter_errors(obj)
        ]
        meta = jsonschema.Draft7Validator(OBJECT_META)
        found += [
            f"{where}: metadata.{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in meta.iter_errors(obj.get("metadata"))
        ]
        return found
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{where}: no published schema for {key} in Kubernetes {KUBERNETES_VERSION}"]
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return [
        f"{where}: label {k}={v!r} is not a label value"
        for k, v in labels.items()
        if len(v) > 63 or not LABEL_VALUE.match(v)
    ]
