"""One exception root for OpenRL; each subclass also inherits the builtin it replaces.

Every error carries a `category` (`user` or `server`) because a failed future reports it to
the SDK as `{error, category}`, and an HTTP status, because the gateway turns a synchronous
error into a `{"detail": …}` response with that status. A user error never becomes a 5xx.
"""

from __future__ import annotations

from typing import ClassVar, Literal

Category = Literal["user", "server", "unknown"]


class OpenRLError(Exception):
    category: ClassVar[Category] = "server"
    http_status: ClassVar[int] = 500

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class UserError(OpenRLError, ValueError):
    """The request itself is wrong; retrying it unchanged cannot succeed."""

    category = "user"
    http_status = 400


class InvalidRequest(UserError):
    http_status = 400


class Unauthorized(UserError, PermissionError):
    http_status = 401


class NotFound(UserError, LookupError):
    """Also what a tenant sees for another tenant's object: it must not learn it exists."""

    http_status = 404


class NotOffered(NotFound):
    """A feature of Tinker's hosted service that a self-hosted server has no use for (billing,
    projects). A 4xx, never a 5xx: the SDK retries 5xx answers for minutes."""


class Conflict(UserError):
    http_status = 409


class Gone(UserError):
    http_status = 410


class PayloadTooLarge(UserError):
    """A request body over a size limit; the detail names the limit."""

    http_status = 413


class ServerError(OpenRLError, RuntimeError):
    category = "server"
    http_status = 500


class StorageFull(ServerError):
    """The data disk (blobs, snapshots) has no room: nothing half-written was kept; the same
    request succeeds once space is freed. 507 Insufficient Storage, a server error."""

    http_status = 507
