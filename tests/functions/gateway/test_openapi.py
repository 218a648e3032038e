"""The OpenAPI description against the app: every route documented (and nothing else), no
FastAPI 422 left, bodies and keys as the routes take them, 405s with `Allow`. Whether each
claim holds on the wire is test_api_fuzz.py's job."""

from __future__ import annotations

from functions.gateway.openapi_routes import ROUTES
from tests.functions.gateway.rest_rig import rest  # noqa: F401  (fixture)
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
                assert schema.get("$ref", "").endswith(("ErrorBody", "TryAgainResponse")) or "properties" in schema, (method, path, status)
    paths = spec["paths"]
    fb = paths["/api/v1/forward_backward"]["post"]["requestBody"]
    assert fb["required"] and set(fb["content"]) == {"application/json", "application/x-protobuf"}
    create_model = paths["/api/v1/create_model"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"session_id", "model_seq_id", "base_model"} <= set(create_model["required"])
    assert create_model["properties"]["base_model"]["enum"] == ["openrl/tiny-qwen3"]  # the served models
    assert paths["/v1/completions"]["post"]["security"] == [{"Bearer": []}, {"ApiKey": []}]
    assert paths["/v1/completions"]["post"]["responses"]["404"]["content"]["application/json"]["schema"]["$ref"].endswith("OpenAIErrorBody")
    assert "200" not in paths["/api/v1/audit"]["get"]["responses"]  # a feature not offered never succeeds
    assert set(paths["/api/v1/retrieve_future"]["post"]["responses"]["200"]["content"]) == {"application/json", "application/x-protobuf"}


def test_a_405_says_which_methods_the_path_takes(rest):
    for method, path, allow in (
        ("PATCH", "/api/v1/training_runs/s:train:0/checkpoints/weights/w", "DELETE, GET, POST, PUT"),  # routes in two routers
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
