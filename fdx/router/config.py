""":class:`RouterConfig`: everything ``fdx router`` needs, frozen and
validated (a bad flag is a one-line :class:`ConfigError`).  Its own module
so the command (:mod:`fdx.router.main`) and the app (:mod:`fdx.router.app`)
both import it, and not each other."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import attrs

from fdx.core.errors import ConfigError


def _urls(inst: Any, att: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise ConfigError(f"--{att.name} needs at least one URL")
    for u in value:
        parts = urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--{att.name} {u!r}: expected a base URL like http://127.0.0.1:8001")


def _positive(inst: Any, att: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"--{att.name.replace('_', '-')} must be > 0, got {value}")


@attrs.frozen(kw_only=True)
class RouterConfig:
    """Everything ``fdx router`` needs."""

    prefill: tuple[str, ...] = attrs.field(converter=tuple, validator=_urls)
    decode: tuple[str, ...] = attrs.field(converter=tuple, validator=_urls)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    #: the instances' ``--control-api-key`` (``None``: ``api_key``), checked before a control call fans out
    control_api_key: str | None = None
    #: seconds between two /health probes of every instance
    probe_interval: float = attrs.field(default=1.0, validator=_positive)
    #: seconds a probe (or an info / metrics read) may take
    probe_timeout: float = attrs.field(default=3.0, validator=_positive)
    #: seconds to connect to an instance before it counts as unreachable
    connect_timeout: float = attrs.field(default=3.0, validator=_positive)
    max_request_bytes: int = attrs.field(default=4 << 20, validator=_positive)
    log_level: str = "info"
    #: OTLP/HTTP endpoint of the router's spans (``None``: tracing off; fdx.tracing)
    otlp_traces_endpoint: str | None = None
    #: where the deployment's control state is kept (fdx.router.state): read at start, written on every
    #: change, so a restarted router still has it (``None``: in memory only)
    state_file: str | None = None

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be a TCP port (0-65535), got {self.port}")
        if self.otlp_traces_endpoint:
            from fdx.tracing import check_endpoint

            check_endpoint(self.otlp_traces_endpoint)
        urls = [u.rstrip("/") for u in (*self.prefill, *self.decode)]
        if len(set(urls)) != len(urls):
            raise ConfigError("an instance URL is given twice")
