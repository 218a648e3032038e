"""The gateway's OpenAPI description, served at `/openapi.json`: what each route really takes
and answers, so that tools (and people) can call it from the description alone.

FastAPI describes what it parses itself. Most Tinker routes read their bodies by hand (to
deduplicate on the exact bytes, to take protobuf), so FastAPI sees no body there; every
error leaves as a 400/401/404/... `{"detail": ...}` (OpenAI's error object under `/v1/`),
never as FastAPI's 422. `describe(app)` starts from FastAPI's description and, route by
route from `openapi_routes.ROUTES`:

- declares the request body: the Tinker wire model the route validates against, with the
  route's own checks added as schema (`body_patch`), and `application/x-protobuf` where the
  route also takes protobuf;
- replaces the 422 with the statuses the route can answer, each with its error body: 400
  wherever there is input to get wrong, 401 wherever a key is needed, 413 everywhere (the
  body limit, `max_request_bytes`, stands in front of every route), 503 wherever the event
  store is read or written (unreachable: `errors.py`), 507 wherever events are recorded (a
  payload over `inline_payload_limit` goes to the blob store: `StorageFull` when its disk
  is full), and the route's own;
- constrains hand-checked parameters (page limits, `tinker://` paths) as the route does;
- adds the non-JSON answers (protobuf results, tar archives, NDJSON, server-sent events);
- names the key each route needs (`X-API-Key`; also `Authorization: Bearer` under `/v1/`).

A 405 (a method the path does not take) is answered with an `Allow` header by `errors.py`.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from functions.gateway.openapi_bodies import PROTOBUF, Served, patch_components
from functions.gateway.openapi_routes import ROUTES, Doc
from openrl_core.wire.base import TryAgainResponse

REF = "#/components/schemas/{model}"
ERROR = {"$ref": "#/components/schemas/ErrorBody"}
OPENAI_ERROR = {"$ref": "#/components/schemas/OpenAIErrorBody"}
ERROR_SCHEMAS = {
    "ErrorBody": {
        "type": "object",
        "description": "What was wrong, in one sentence.",
        "required": ["detail"],
        "properties": {"detail": {"type": "string", "minLength": 1}},
    },
    "OpenAIErrorBody": {
        "type": "object",
        "description": "OpenAI's error object (the /v1/ routes).",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
}
REASONS = {
    400: "Bad input: the detail names what is wrong",
    401: "Missing or unknown API key",
    403: "The download link's signature does not match",
    404: "No such object for this caller (another tenant's answers the same), or a feature not offered",
    408: "Not finished within the long-poll window: poll again (the try_again body)",
    409: "Conflicts with what was already done (a reused seq_id with another body, an already cancelled run)",
    410: "Gone: a cancelled run, a finished session's sample, an expired link or a deleted file",
    413: "The body is over the server's max_request_bytes limit (or the route's own, stated in the detail)",
    429: "Over one of the tenant's quotas (the detail names it and its setting): nothing was stored; retry after the "
    "Retry-After header's seconds, with the same seq_id",
    500: "The sampler failed the sample for a server-side reason",
    503: "The event store is unreachable (its database down or restarting): nothing was stored; retry after the "
    "Retry-After header's seconds (a sequenced request with the same seq_id)",
    507: "The data disk is full: an event's payload or a blob could not be stored (nothing was kept); retry once space is freed",
}
RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer", "minimum": 0}}
}
SECURITY_SCHEMES = {
    "ApiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key", "description": "a tenant's key (tml-...)"},
    "Bearer": {
        "type": "http",
        "scheme": "bearer",
        "description": "the same key, as OpenAI clients send it (/v1/ routes)",
    },
}
HTTP_METHODS = ("get", "put", "post", "delete", "patch", "options", "head", "trace")


class DescriptionError(RuntimeError):
    """The routes and their documentation disagree (raised when the description is built)."""


def describe(app: FastAPI) -> dict[str, Any]:
    spec = _fastapi_description(app)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    components.update(ERROR_SCHEMAS)
    spec["components"]["securitySchemes"] = SECURITY_SCHEMES
    # The models this server serves: a base_model outside them is a 400, so it is an enum here;
    # token ids at or above the smallest vocabulary among them are refused for some model.
    models = app.state.ctx.models
    names = sorted(models.catalog.names())
    served = Served(names, min(models.files(name).vocab_size for name in names))
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            if method not in HTTP_METHODS:
                continue
            doc = ROUTES.get((method.upper(), path))
            if doc is None:
                raise DescriptionError(f"{method.upper()} {path} has no entry in openapi_routes.ROUTES")
            _document(operation, doc, components, served)
    patch_components(components, served)
    return spec


def install(app: FastAPI) -> None:
    """Serve `describe(app)` at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _fastapi_description(app: FastAPI) -> dict[str, Any]:
    from fastapi.openapi.utils import get_openapi

    return get_openapi(title=app.title, version=app.version, routes=app.routes, description=__doc__.split("\n\n")[0])


def _document(operation: dict, doc: Doc, components: dict, served: Served) -> None:
    operation["security"] = (
        ([{"Bearer": []}, {"ApiKey": []}] if doc.openai else [{"ApiKey": []}]) if doc.authenticated else []
    )
    _parameters(operation, doc)
    _request_body(operation, doc, components, served)
    _responses(operation, doc, components)


def _parameters(operation: dict, doc: Doc) -> None:
    known = {parameter["name"]: parameter for parameter in operation.get("parameters", [])}
    for name, schema in doc.params.items():
        if name not in known:
            raise DescriptionError(
                f"{operation.get('operationId')}: documents parameter {name!r}, which the route does not take"
            )
        default = known[name].get("schema", {}).get("default")
        known[name]["schema"] = {**schema, **({"default": default} if default is not None else {})}
    for parameter in operation.get("parameters", []):
        if parameter["in"] == "path":
            # A path segment is never empty: an empty one is another route (or none).
            parameter["schema"].setdefault("minLength", 1)


def _model_schema(model: type[BaseModel], components: dict) -> dict:
    schema = model.model_json_schema(ref_template=REF, mode="validation")
    for name, definition in schema.pop("$defs", {}).items():
        if name in components and components[name] != definition:
            # Same name, different shape: keep FastAPI's and give this one its own name.
            raise DescriptionError(f"two different schemas are both named {name!r}")
        components[name] = definition
    return schema


def _request_body(operation: dict, doc: Doc, components: dict, served: Served) -> None:
    content: dict[str, Any] = {}
    if doc.body is not None:
        content["application/json"] = {"schema": _model_schema(doc.body, components)}
    elif doc.body_schema is not None:
        content["application/json"] = {"schema": doc.body_schema()}
    elif "requestBody" in operation:
        content = operation["requestBody"]["content"]
    if doc.body_patch is not None:
        schema = content["application/json"]["schema"]
        if "$ref" in schema:  # patch a copy: the component may serve other routes unchanged
            schema = copy.deepcopy(components[schema["$ref"].rsplit("/", 1)[1]])
        doc.body_patch(schema, served)
        content["application/json"]["schema"] = schema
    if doc.example is not None:
        content["application/json"]["example"] = doc.example
    if doc.protobuf_body:
        content[PROTOBUF] = {"schema": {"type": "string", "format": "binary"}}
    if content:
        operation["requestBody"] = {"required": doc.body_required, "content": content}


def _takes_input(operation: dict) -> bool:
    return bool(operation.get("parameters")) or "requestBody" in operation


def _responses(operation: dict, doc: Doc, components: dict) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    if doc.never_ok:
        for code in [code for code in responses if code.startswith("2")]:
            del responses[code]
    ok = next((code for code in responses if code.startswith("2")), "200")
    answer = responses.setdefault(ok, {"description": "Successful Response"}) if not doc.never_ok else {}
    if doc.ok_schema is not None:
        answer["content"] = {"application/json": {"schema": _model_schema(doc.ok_schema, components)}}
    if doc.ok_not_json:
        answer["content"] = {}
    for media_type, schema in doc.ok_content.items():
        answer.setdefault("content", {})[media_type] = {"schema": schema}
    statuses = {413, *doc.errors}
    if _takes_input(operation):
        statuses.add(400)
    if doc.authenticated:
        statuses.add(401)
    if doc.store:
        statuses.add(503)
    if doc.records:
        statuses.add(507)
    for status in sorted(statuses):
        responses[str(status)] = _error_response(status, doc, components)


def _error_response(status: int, doc: Doc, components: dict) -> dict:
    if status == 408:
        schema = _model_schema(TryAgainResponse, components)
    else:
        schema = OPENAI_ERROR if doc.openai else ERROR
    response = {"description": REASONS[status], "content": {"application/json": {"schema": schema}}}
    if status in (429, 503):
        response["headers"] = RETRY_AFTER
    return response
