"""The Tinker endpoints this server does not offer, each refused with its reason.

Features of the hosted service that make no sense self-hosted: billing and storage usage,
the organisation audit log. Without these routes the SDK would get
FastAPI's bare `{"detail": "Not Found"}` (or a 405), which reads like a wrong base URL. Each
answers 404 (`NotOffered`) with a detail that names the feature and says why it is absent;
never a 5xx, which the SDK would retry for minutes. The caller must still authenticate, so
an unknown key stays a 401.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from functions.gateway.deps import get_tenant
from openrl_core.errors import NotOffered

router = APIRouter(prefix="/api/v1")

SELF_HOSTED = "a self-hosted OpenRL server"
REASONS = {
    "billing": f"billing usage is not offered by {SELF_HOSTED}: nothing is metered or billed",
    "storage": f"checkpoint storage usage is not offered by {SELF_HOSTED}: nothing is billed; "
    "RestClient.list_user_checkpoints lists every checkpoint with its size_bytes",
    "audit": f"the organisation audit log is not offered by {SELF_HOSTED}: it has no organisations; "
    "every request and result is an event in its event store (`openrl events tail`)",
}


def _refuse(feature: str):
    raise NotOffered(REASONS[feature])


@router.get("/billing/usage/events")
def billing_usage(tenant: str = Depends(get_tenant)) -> None:
    _refuse("billing")


@router.get("/billing/usage/checkpoints/current")
def checkpoint_storage_usage(tenant: str = Depends(get_tenant)) -> None:
    _refuse("storage")


@router.get("/audit")
def audit_log(tenant: str = Depends(get_tenant)) -> None:
    _refuse("audit")
