"""Bad input on the REST routes (runs, checkpoints, exports, copies, sessions, downloads):
each case is a clear 4xx whose `detail` says what is wrong, never a 500 or an empty 400, and
nothing stored changes: no projection row and no event (a refused sequenced request records
only its `seq.skipped`, a 404 only its `access.lookup.refused` for the audit log). Another
tenant's objects answer exactly like missing ones."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from functions.gateway import downloads
from tests.functions.gateway.rest_rig import ALICE, BOB, assert_clear_4xx, rest  # noqa: F401  (fixture)

R = "/api/v1/training_runs/RID/checkpoints"

# (method, path, json body or None, query params or None, status, detail fragment)
CASES = {
    "list_training_runs": [
        ("GET", "/api/v1/training_runs", None, {"limit": 0}, 400, "limit must be between 1 and 1000"),
        ("GET", "/api/v1/training_runs", None, {"limit": 100000}, 400, "limit must be between"),
        ("GET", "/api/v1/training_runs", None, {"limit": "ten"}, 400, "limit"),
        ("GET", "/api/v1/training_runs", None, {"offset": -1}, 400, "offset must not be negative"),
        ("GET", "/api/v1/training_runs", None, {"access_scope": "everyone"}, 400, "access_scope must be"),
    ],
    "get_training_run": [
        ("GET", "/api/v1/training_runs/nope:train:0", None, None, 404, "unknown training run"),
        ("GET", "/api/v1/training_runs/BRID", None, None, 404, "unknown training run"),
        ("GET", "/api/v1/training_runs/RID", None, {"access_scope": "all"}, 400, "access_scope"),
    ],
    "list_checkpoints": [
        ("GET", R.replace("RID", "BRID"), None, None, 404, "unknown training run"),
        ("GET", R.replace("RID", "nope:train:0"), None, None, 404, "unknown training run"),
        ("GET", "/api/v1/checkpoints", None, {"limit": -5}, 400, "limit"),
        ("GET", "/api/v1/checkpoints", None, {"offset": "x"}, 400, "offset"),
    ],
    "delete_checkpoint": [
        ("DELETE", R + "/weights/missing", None, None, 404, "not found"),
        ("DELETE", R.replace("RID", "BRID") + "/weights/bobs", None, None, 404, "not found"),
        ("DELETE", R + "/weights", None, None, 400, "must be <kind>/<name>"),
        ("DELETE", R + "/weights/a/b/c", None, None, 400, "must be <kind>/<name>"),
        ("DELETE", R + "/optimizer/final", None, None, 400, "has kind 'optimizer'"),
        ("DELETE", R + "/weights/%2E%2E", None, None, 400, "checkpoint name '..'"),
        ("DELETE", R + "/weights/final/unknown-action", None, None, 404, "no route"),
        (
            "DELETE",
            "/api/v1/training_runs/not-a-run/checkpoints/weights/final",
            None,
            None,
            400,
            "malformed training run id",
        ),
        (
            "DELETE",
            "/api/v1/training_runs/..%2F..%2Fetc:train:0/checkpoints/weights/final",
            None,
            None,
            404,
            "Not Found",
        ),
    ],
    "publish": [
        ("POST", R + "/weights/missing/publish", None, None, 404, "not found"),
        ("POST", R.replace("RID", "BRID") + "/weights/bobs/publish", None, None, 404, "not found"),
        ("POST", R + "/weights/final", None, None, 404, "no route"),
        ("DELETE", R.replace("RID", "BRID") + "/weights/bobs/publish", None, None, 404, "not found"),
    ],
    "set_ttl": [
        ("PUT", R + "/weights/final/ttl", {"ttl_seconds": 10}, None, 400, "between 3600"),
        ("PUT", R + "/weights/final/ttl", {"ttl_seconds": 10**12}, None, 400, "between 3600"),
        ("PUT", R + "/weights/final/ttl", {"ttl_seconds": "soon"}, None, 400, "ttl_seconds"),
        ("PUT", R + "/weights/final/ttl", None, None, 400, "body"),
        ("PUT", R + "/weights/missing/ttl", {"ttl_seconds": 3600}, None, 404, "not found"),
        ("PUT", R.replace("RID", "BRID") + "/weights/bobs/ttl", {"ttl_seconds": 3600}, None, 404, "not found"),
        ("PUT", R + "/weights/expired/ttl", {"ttl_seconds": 3600}, None, 404, "not found"),
    ],
    "weights_info": [
        ("POST", "/api/v1/weights_info", {}, None, 400, "tinker_path"),
        (
            "POST",
            "/api/v1/weights_info",
            {"tinker_path": "/abs/path/weights/final"},
            None,
            400,
            "must start with tinker://",
        ),
        (
            "POST",
            "/api/v1/weights_info",
            {"tinker_path": "tinker:///etc/passwd"},
            None,
            400,
            "malformed training run id",
        ),
        (
            "POST",
            "/api/v1/weights_info",
            {"tinker_path": "tinker://RID/weights/../../etc"},
            None,
            400,
            "tinker://<run_id>/<kind>/<name>",
        ),
        ("POST", "/api/v1/weights_info", {"tinker_path": "tinker://RID/weights/.."}, None, 400, "checkpoint name"),
        (
            "POST",
            "/api/v1/weights_info",
            {"tinker_path": "tinker://RID/weights/final/extra"},
            None,
            400,
            "tinker://<run_id>/<kind>/<name>",
        ),
        ("POST", "/api/v1/weights_info", {"tinker_path": "tinker://RID/checkpoints/final"}, None, 400, "has kind"),
        ("POST", "/api/v1/weights_info", {"tinker_path": "tinker://RID/weights/missing"}, None, 404, "not found"),
        ("POST", "/api/v1/weights_info", {"tinker_path": "tinker://BRID/weights/bobs"}, None, 404, "not found"),
        ("POST", "/api/v1/weights_info", {"tinker_path": "tinker://RID/weights/expired"}, None, 404, "not found"),
    ],
    "copy_weights": [
        ("POST", "/api/v1/copy_weights", {"destination_project_id": "p"}, None, 400, "source_path"),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/final"},
            None,
            400,
            "needs a destination_project_id",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/final", "destination_project_id": "  "},
            None,
            400,
            "needs a destination_project_id",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/final", "session_id": "SID"},
            None,
            400,
            "together",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {
                "source_path": "tinker://RID/weights/final",
                "session_id": "SID",
                "model_seq_id": 3,
                "destination_project_id": "p",
            },
            None,
            400,
            "not both",
        ),  # fmt: skip
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/final", "destination_project_id": "p", "ttl_seconds": 5},
            None,
            400,
            "between 3600",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/final", "destination_project_id": "p", "weights_access_token": "tok"},
            None,
            400,
            "weights_access_token is not supported",
        ),  # fmt: skip
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/../x", "destination_project_id": "p"},
            None,
            400,
            "checkpoint path",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://BRID/weights/bobs", "destination_project_id": "p"},
            None,
            404,
            "not found",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/expired", "destination_project_id": "p"},
            None,
            404,
            "not found",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/final", "session_id": "BSID", "model_seq_id": 3},
            None,
            404,
            "unknown session_id",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/final", "session_id": "SID", "model_seq_id": 0},
            None,
            409,
            "already exists",
        ),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": "tinker://RID/weights/final", "session_id": "SID", "model_seq_id": -1},
            None,
            400,
            "model_seq_id",
        ),
    ],
    "save_weights_external": [
        (
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": "RID", "path": "x"},
            None,
            400,
            "needs the model's next seq_id",
        ),
        (
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": "nope:train:0", "seq_id": 9, "path": "x"},
            None,
            404,
            "unknown model_id",
        ),
        (
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": "BRID", "seq_id": 9, "path": "x"},
            None,
            404,
            "unknown model_id",
        ),
        ("POST", "/api/v1/save_weights_external", {"model_id": "RID", "seq_id": 0, "path": "x"}, None, 400, "seq_id"),
        (
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": "RID", "seq_id": 10, "path": "../x"},
            None,
            400,
            "checkpoint name",
        ),
        ("POST", "/api/v1/save_weights_external", {"model_id": "RID", "seq_id": 11}, None, 400, "needs a name"),
        (
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": "CRID", "seq_id": 1, "path": "x"},
            None,
            400,
            "holds a copy made by copy_weights",
        ),
        (
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": "RID", "seq_id": 12, "path": "x", "age_encryption_recipients": ["age1xyz"]},
            None,
            400,
            "age_encryption_recipients[0] ('age1xyz') is not an age recipient",
        ),  # fmt: skip
        (
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": "RID", "seq_id": 13, "path": "x", "age_encryption_recipients": []},
            None,
            400,
            "age_encryption_recipients is empty",
        ),  # fmt: skip
    ],
    "external_weights_urls": [
        ("GET", R + "/weights/final/external_weights_urls", None, None, 400, "only external_weights checkpoints"),
        ("GET", R + "/external_weights/missing/external_weights_urls", None, None, 404, "not found"),
        (
            "GET",
            R.replace("RID", "BRID") + "/external_weights/bobs/external_weights_urls",
            None,
            None,
            404,
            "not found",
        ),
        ("GET", R + "/external_weights/e/download", None, None, 404, "no route"),
        ("GET", R + "/external_weights/e", None, None, 404, "no route"),
    ],
    "sessions": [
        ("GET", "/api/v1/sessions", None, {"limit": 0}, 400, "limit"),
        ("GET", "/api/v1/sessions", None, {"access_scope": "x"}, 400, "access_scope"),
        ("GET", "/api/v1/sessions/nope", None, None, 404, "unknown session_id"),
        ("GET", "/api/v1/sessions/BSID", None, None, 404, "unknown session_id"),
    ],
    "downloads": [
        ("GET", "/api/v1/downloads/alice/SHA/adapter_config.json", None, None, 403, "lacks its expires and signature"),
        (
            "GET",
            "/api/v1/downloads/alice/SHA/adapter_config.json",
            None,
            {"expires": "soon", "signature": "ab"},
            403,
            "malformed",
        ),
        (
            "GET",
            "/api/v1/downloads/alice/SHA/adapter_config.json",
            None,
            {"expires": "9999999999", "signature": "ab" * 32},
            403,
            "signature does not match",
        ),
        ("GET", "/api/v1/downloads/bob/SHA/adapter_config.json", None, "SIGNED", 403, "signature does not match"),
        (
            "GET",
            "/api/v1/downloads/..%2F..%2Fetc/SHA/passwd",
            None,
            {"expires": "9999999999", "signature": "ab"},
            404,
            "Not Found",
        ),
    ],
}


def setup_objects(rest) -> dict[str, str]:
    session, bob_session = rest.session(), rest.session(key=BOB)
    run, bob_run = rest.model(session), rest.model(bob_session, key=BOB)
    rest.save(run, "final")
    rest.save(run, "s", kind="sampler_weights")
    export = rest.save(run, "e", kind="external_weights")
    rest.save(run, "expired", expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    rest.save(bob_run, "bobs", key=BOB, tenant="bob")
    rest.ok("POST", f"/api/v1/training_runs/{run}/checkpoints/weights/final/publish")
    copy = rest.ok(
        "POST",
        "/api/v1/copy_weights",
        {"source_path": f"tinker://{run}/weights/final", "session_id": session, "model_seq_id": 7},
    )
    copy_run = copy["tinker_path"][len("tinker://") :].split("/")[0]
    names = {"RID": run, "SID": session, "BRID": bob_run, "BSID": bob_session, "CRID": copy_run}
    return {**names, "SHA": export.files["adapter_config.json"].sha256}


def fill(text: str, names: dict[str, str]) -> str:
    for placeholder in ("BRID", "BSID", "CRID", "RID", "SID", "SHA"):  # RID is inside BRID and CRID
        text = text.replace(placeholder, names[placeholder])
    return text


@pytest.mark.parametrize("route", sorted(CASES))
def test_bad_input_is_refused_clearly_and_changes_nothing(rest, route):
    names = setup_objects(rest)
    for method, path, body, params, status, fragment in CASES[route]:
        if params == "SIGNED":  # a valid signature for alice's blob, presented under bob's name
            secret = downloads.server_secret(rest.runtime.settings)
            params = {
                "expires": "9999999999",
                "signature": downloads.signature(secret, "alice", names["SHA"], 9999999999),
            }
        before, events, refusals = rest.snapshot(), recorded(rest), rest.count_events("access.lookup.refused")
        content = fill(json.dumps(body), names) if body is not None else None
        headers = {"X-API-Key": ALICE, "Content-Type": "application/json"}
        response = rest.client.request(method, fill(path, names), content=content, params=params, headers=headers)
        case = f"{method} {path} {body} {params}"
        assert response.status_code == status, f"{case}: {response.status_code} {response.text}"
        detail = response.json().get("detail")
        assert isinstance(detail, str) and fragment in detail, f"{case}: {detail}"
        assert rest.snapshot() == before, case
        assert recorded(rest) == events, case
        # every refused lookup is on the audit trail (a path no route matches is not a lookup)
        assert rest.count_events("access.lookup.refused") == refusals + (status == 404 and detail != "Not Found"), case


def recorded(rest) -> int:
    """Events other than the records of a refusal."""
    return rest.count_events() - rest.count_events("seq.skipped") - rest.count_events("access.lookup.refused")


def test_every_rest_route_needs_an_api_key(rest):
    for method, path in [("GET", "/api/v1/training_runs"), ("GET", "/api/v1/training_runs/x:train:0"), ("GET", "/api/v1/checkpoints"),
                         ("GET", "/api/v1/training_runs/x:train:0/checkpoints"), ("DELETE", "/api/v1/training_runs/x:train:0/checkpoints/weights/a"),
                         ("POST", "/api/v1/weights_info"), ("POST", "/api/v1/copy_weights"), ("GET", "/api/v1/sessions"),
                         ("GET", "/api/v1/sessions/x"), ("POST", "/api/v1/save_weights_external"),
                         ("GET", "/api/v1/training_runs/x:train:0/checkpoints/external_weights/a/external_weights_urls")]:  # fmt: skip
        assert_clear_4xx(rest.request(method, path, key=None), 401, "missing X-API-Key")
        assert_clear_4xx(rest.request(method, path, key="tml-nobody"), 401, "unknown API key")
