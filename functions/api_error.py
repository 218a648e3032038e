"""The error the shell commands over OpenRL's API raise: an HTTP status and the server's (or
the command's own) detail; `cli_runs.run` prints it and exits 1. Its own module so that the
commands' helpers (`runs_export`) raise it without importing the command table."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail
