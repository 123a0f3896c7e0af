"""The errors the serving engines hand to a request's consumer."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served."""


class ServerShuttingDownError(EngineDeadError):
    """The server is stopping: the requests still open are ended."""


class RequestFailedError(RuntimeError):
    """One request's processing raised; the engine serves the others on."""
