"""``fdx router --prefill URL [URL...] --decode URL [URL...] [--port 8000]``: the command and its config.

:class:`RouterConfig` is frozen and validated (a bad flag is one line on
stderr, exit 2).  :func:`run` serves the app of :mod:`fdx.router.app`
under uvicorn until SIGINT/SIGTERM (exit 0); flights still open then end
with a 503 error event.  The managed topology
(:mod:`fdx.router.topology`) starts it as ``python -m fdx.router
--config-fd FD NAME PARENT_PID``: the config JSON (API key included) comes on
an inherited pipe, never in argv, and the router exits when its parent
does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any, Sequence

import attrs

from fdx.core.errors import ConfigError
from fdx.deploy.status_board import watch_parent
from fdx.router.config import RouterConfig


def build_parser(prog: str = "fdx router") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible front end over splitwise prefill (P) "
                                "and decode (D) instances (docs/SPLITWISE.md)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="base URLs of the prefill instances")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="base URLs of the decode instances")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("FDX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and send it to the instances "
                        "(default $FDX_API_KEY)")
    p.add_argument("--control-api-key", default=os.environ.get("FDX_CONTROL_API_KEY"),
                   help="the key the control routes (sent to every instance) need, the instances' own "
                        "--control-api-key (default --api-key; $FDX_CONTROL_API_KEY)")
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between health probes (default 1)")
    p.add_argument("--probe-timeout", type=float, default=3.0, help="seconds a health probe may take (default 3)")
    p.add_argument("--connect-timeout", type=float, default=3.0,
                   help="seconds to connect to an instance before it counts as unreachable (default 3)")
    p.add_argument("--log-level", default="info", help="debug, info, warning, error")
    p.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export OpenTelemetry spans over OTLP/HTTP to URL (default: off; docs/TRACING.md)")
    p.add_argument("--state-file", metavar="PATH",
                   help="keep the deployment's control state (paused, asleep, weights version) in PATH, read at "
                        "start: a restarted router still gives it to restarted instances (default: in memory)")
    return p


def config_from_argv(argv: Sequence[str]) -> RouterConfig:
    args = build_parser().parse_args(list(argv))
    return RouterConfig(prefill=args.prefill, decode=args.decode, host=args.host, port=args.port,
                        api_key=args.api_key or None,
                        control_api_key=args.control_api_key or None, probe_interval=args.probe_interval,
                        probe_timeout=args.probe_timeout, connect_timeout=args.connect_timeout,
                        log_level=args.log_level, otlp_traces_endpoint=args.otlp_traces_endpoint,
                        state_file=args.state_file)


def config_json(config: RouterConfig) -> str:
    return json.dumps(attrs.asdict(config))


def run(config: RouterConfig, parent_pid: int | None = None) -> int:
    """Serve until a signal (0), or 1 when the port cannot be bound."""
    import uvicorn

    from fdx.logs import setup_logging
    from fdx.router.app import create_router_app

    setup_logging(config.log_level, process="router")
    import prometheus_client

    prometheus_client.disable_created_metrics()  # no *_created series (as the instances)
    app = create_router_app(config)
    pool = app.state.pool

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            for inst in pool.instances:
                for f in list(inst.flights):
                    f.cut(inst, "request aborted: the router is shutting down")
            await super().shutdown(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn would re-raise the signal after shutting down; a stop by signal is exit 0 here
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    level = config.log_level.lower()
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port,
                                    log_level="warning" if level in ("info", "warning") else level,
                                    access_log=level == "debug", timeout_graceful_shutdown=3, lifespan="on",
                                    timeout_keep_alive=30))
    if parent_pid is not None:
        threading.Thread(target=watch_parent, args=(parent_pid, server), daemon=True).start()
    import logging

    logging.getLogger("fdx.router").info("fdx router on http://%s:%d: prefill %s, decode %s", config.host,
                                         config.port, " ".join(config.prefill), " ".join(config.decode))
    try:
        server.run()
    except SystemExit as exc:
        if exc.code:
            print(f"fdx router: error: cannot serve on {config.host}:{config.port} (port in use?)", file=sys.stderr)
            return 1
    if not server.started:
        print(f"fdx router: error: cannot serve on {config.host}:{config.port} (port in use?)", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``fdx router ...`` (argv without the program name), or
    ``python -m fdx.router --config-fd FD NAME [PARENT_PID]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["--config-fd"]:
            from fdx.core.ipc import child_args

            values, _name, parent_pid = child_args(argv)
            return run(RouterConfig(**values), parent_pid)
        config = config_from_argv(argv)
    except ConfigError as exc:
        print(f"fdx router: error: {exc}", file=sys.stderr)
        return 2
    return run(config)


__all__ = ["RouterConfig", "build_parser", "config_json", "main", "run"]
