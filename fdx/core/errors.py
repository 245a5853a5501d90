"""Exceptions that fdx turns into one-line CLI messages or HTTP error envelopes."""

from __future__ import annotations


class FdxError(Exception):
    """Base class.  ``str(exc)`` is a one-line message fit for the CLI;
    ``details`` (a traceback, say) is printed below it when present."""

    def __init__(self, message: str, *, details: str | None = None) -> None:
        super().__init__(message)
        self.details = details


class PluginError(FdxError):
    """A plugin failed to load, a name is unknown, or a name is duplicated."""


class ConfigError(FdxError):
    """A configuration value is invalid; the message names the flag."""


class ModelLoadError(FdxError):
    """A model file is missing, corrupt or of an unsupported architecture."""


class EngineDeadError(FdxError):
    """The engine process died or stopped answering."""


class RequestError(FdxError):
    """A request was rejected or failed; ``code`` is the HTTP status."""

    def __init__(self, message: str, code: int = 400, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class ControlError(FdxError):
    """A control method failed; ``code`` is 400 (bad call) or 500."""

    def __init__(self, message: str, code: int = 500) -> None:
        super().__init__(message)
        self.code = code
