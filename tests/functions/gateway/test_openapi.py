"""The OpenAPI description against the app: every route documented (and nothing else), no
FastAPI 422 left, bodies and keys as the routes take them (every route's documented JSON body
against real requests to it), 405s with `Allow`. The statuses: test_openapi_statuses.py.
Whether each claim holds on generated input is test_api_fuzz.py's job."""

from __future__ import annotations

from typing import Optional

from jsonschema import Draft202012Validator

from functions.gateway.openapi_routes import ROUTES
from tests.functions.gateway.rest_rig import ALICE, rest  # noqa: F401  (fixture)
from tests.functions.gateway.route_requests import WAITS_FOR_A_WORKER, every_request, quick_rest, send  # noqa: F401  (fixture)
from tests.functions.gateway.test_tenant_isolation import app_routes


def operations(spec: dict):
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            yield method.upper(), path, operation


def test_every_route_has_its_documentation_and_nothing_else_does(rest):
    assert app_routes(rest.client.app) == set(ROUTES)


def test_the_description_is_served_without_a_key_and_tells_bodies_statuses_and_keys(rest):
    response = rest.client.get("/openapi.json")
    assert response.status_code == 200
    spec = response.json()
    for method, path, operation in operations(spec):
        statuses = set(operation["responses"])
        assert "422" not in statuses, (method, path)  # refusals are 400s with a detail
        assert "413" in statuses, (method, path)
        keyed = bool(operation["security"])
        assert ("401" in statuses) == keyed, (method, path)
        for status, answer in operation["responses"].items():
            if status.startswith("4"):
                schema = answer["content"]["application/json"]["schema"]
                assert schema.get("$ref", "").endswith(("ErrorBody", "TryAgainResponse")) or "properties" in schema, (
                    method,
                    path,
                    status,
                )
    paths = spec["paths"]
    fb = paths["/api/v1/forward_backward"]["post"]["requestBody"]
    assert fb["required"] and set(fb["content"]) == {"application/json", "application/x-protobuf"}
    create_model = paths["/api/v1/create_model"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"session_id", "model_seq_id", "base_model"} <= set(create_model["required"])
    assert create_model["properties"]["base_model"]["enum"] == ["openrl/tiny-qwen3"]  # the served models
    assert paths["/v1/completions"]["post"]["security"] == [{"Bearer": []}, {"ApiKey": []}]
    assert paths["/v1/completions"]["post"]["responses"]["404"]["content"]["application/json"]["schema"][
        "$ref"
    ].endswith("OpenAIErrorBody")
    audit = paths["/api/v1/audit"]["get"]
    assert audit["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("AuditLogResponse")
    assert {p["name"]: p["required"] for p in paths["/api/v1/billing/usage/events"]["get"]["parameters"]} == {
        "starting_on": True,
        "ending_before": True,
    }
    assert set(paths["/api/v1/retrieve_future"]["post"]["responses"]["200"]["content"]) == {
        "application/json",
        "application/x-protobuf",
    }


def test_a_405_says_which_methods_the_path_takes(rest):
    for method, path, allow in (
        (
            "PATCH",
            "/api/v1/training_runs/s:train:0/checkpoints/weights/w",
            "DELETE, GET, POST, PUT",
        ),  # routes in two routers
        ("OPTIONS", "/api/openrl/v1/checkpoints", "DELETE, GET"),
        ("GET", "/api/v1/sessions/search", None),  # a session named "search": a lookup, not a 405
        ("DELETE", "/api/v1/sessions/search", "POST"),  # the literal path is its own resource
        ("PUT", "/v1/models/x", "GET"),
    ):
        response = rest.request(method, path)
        if allow is None:
            assert response.status_code == 404, response.text
            continue
        assert response.status_code == 405 and response.headers["allow"] == allow, (method, path, response.headers)


def body_validator(spec: dict, method: str, path: str) -> Optional[Draft202012Validator]:
    operation = spec["paths"].get(path, {}).get(method.lower(), {})  # the dashboard's files are not described
    content = operation.get("requestBody", {}).get("content", {})
    schema = content.get("application/json", {}).get("schema")
    if schema is None:
        return None
    # the components travel along, so that the description's own $refs resolve
    return Draft202012Validator({**schema, "components": spec["components"]})


def required_fields(validator: Draft202012Validator, spec: dict) -> list[str]:
    schema = validator.schema
    if "$ref" in schema:
        schema = {**spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], **schema}
    return list(schema.get("required", ()))


def test_every_documented_request_body_is_what_the_route_takes(quick_rest):
    """For each route's real requests (route_requests.py, as the owner): the body is valid by
    the description; leaving out a field the description requires is a 400 that names it;
    an unknown field is taken exactly when the description allows one (not tried on the
    OpenAI routes, whose accepted requests wait for a sampler this rig does not run)."""
    rig = quick_rest
    spec = rig.client.get("/openapi.json").json()
    checked: set[tuple[str, str]] = set()
    for route, key, method, path, body in every_request(rig):
        validator = body_validator(spec, *route)
        if key != ALICE or validator is None or not isinstance(body, dict):
            continue
        errors = [error.message for error in validator.iter_errors(body)]
        assert not errors, (route, body, errors)
        for name in required_fields(validator, spec):
            without = {field: value for field, value in body.items() if field != name}
            assert not validator.is_valid(without), (route, name)
            answer = send(rig, key, method, path, without)
            assert answer.status_code == 400 and name in answer.text, (route, name, answer.status_code, answer.text)
        checked.add(route)
        if route in WAITS_FOR_A_WORKER:
            continue  # a body it takes waits for a sampler this rig does not run
        extra = {**body, "zz_unknown": 1}
        answer = send(rig, key, method, path, extra)
        assert (answer.status_code != 400) == validator.is_valid(extra), (route, answer.status_code, answer.text)
    bodies = {
        (method.upper(), path)
        for path, item in spec["paths"].items()
        for method, op in item.items()
        if "requestBody" in op
    }
    for route in sorted(bodies):  # the description's own examples are valid by it
        example = (
            spec["paths"][route[1]][route[0].lower()]["requestBody"]["content"]
            .get("application/json", {})
            .get("example")
        )
        assert example is None or not list(body_validator(spec, *route).iter_errors(example)), route
    assert bodies == checked, sorted(bodies ^ checked)  # every documented body was checked
