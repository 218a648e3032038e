"""What `openrl deploy` and the scheduler refuse, and what the cluster refused them."""

from __future__ import annotations

from openrl_core.errors import OpenRLError, UserError


class DeployConfigError(UserError):
    """The deployment asked for is wrong (unknown base model, no image, no such overlay, no
    credentials); raised before anything is applied, naming what is wrong."""


class ClusterError(OpenRLError, RuntimeError):
    """The Kubernetes API refused or failed a call; carries the HTTP status and the API's reason."""

    def __init__(self, detail: str, status: int | None = None) -> None:
        super().__init__(detail)
        self.status = status


class NotReady(ClusterError):
    """A resource did not become Ready in time; the detail is its last condition's reason and message."""
