"""The API-server process: ``python -m fdx.server.api_proc --config-fd FD RUN_DIR PARENT_PID``.

The config JSON (API key included) arrives on the inherited pipe FD, so it
never shows in ``ps``.

Binds the ZMQ sockets first thing (before any heavy import), so the launcher
can start the engine as soon as the socket files exist; with ``--scheduler
dp``, one channel pair per replica in ``RUN_DIR/dp<rank>/``, served by a
:class:`fdx.server.dp_client.ReplicaSet` instead of one ``EngineClient``.  Then it runs the
FastAPI app under uvicorn.  It reports to the launcher through files in the
run directory (see :class:`StatusBoard`); it exits when told (SIGTERM/SIGINT,
handled by uvicorn: the lifespan shutdown sends ``Shutdown`` to the engine)
or when the launcher disappears.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

READY_FILE = "ready"
FAILED_FILE = "failed"


class StatusBoard:
    """Start-up status for the launcher, as files in the run directory.
    ``ready`` holds JSON (engine pid, url); ``failed`` a one-line message.
    Each is written at most once, atomically."""

    def __init__(self, run_dir: str) -> None:
        self.dir = run_dir
        self._lock = threading.Lock()
        self._written: set[str] = set()

    def _write(self, name: str, text: str) -> None:
        with self._lock:
            if name in self._written:
                return
            self._written.add(name)
            tmp = os.path.join(self.dir, f".{name}.tmp")
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, os.path.join(self.dir, name))
            except OSError:
                pass  # run dir removed: the launcher is shutting down

    def ready(self, info: dict[str, Any]) -> None:
        self._write(READY_FILE, json.dumps(info))

    def failed(self, message: str) -> None:
        if READY_FILE not in self._written:
            self._write(FAILED_FILE, " ".join(message.split()))


def watch_parent(parent_pid: int, server: Any) -> None:
    """Thread body: ask the uvicorn ``server`` to exit once ``parent_pid``
    (the launcher) is gone, so no orphan keeps serving."""
    from fdx.core.ipc import pid_alive

    while not server.should_exit:
        if not pid_alive(parent_pid):
            server.should_exit = True
            return
        time.sleep(1.0)


def main() -> None:
    from fdx.core.ipc import FrontendSide, IpcPaths, child_args

    from fdx.config import make_config
    from fdx.plugins.schedulers.dp import is_dp, replica_paths

    values, run_dir, parent_pid = child_args(sys.argv[1:])
    config = make_config(**values)
    paths = IpcPaths(run_dir)
    # bind now: the engines may connect any time after (one channel pair per dp replica)
    sides = [FrontendSide(p) for p in replica_paths(paths, config)]
    side = sides[0]

    import uvicorn

    from fdx.logs import setup_logging
    from fdx.core.plugins import get_plugins
    from fdx.server.app import create_app
    from fdx.server.client import EngineClient

    setup_logging(config.log_level, process="api")
    import prometheus_client

    prometheus_client.disable_created_metrics()  # no *_created series (as vLLM)
    board = StatusBoard(run_dir)
    try:
        plugins = get_plugins(config.disable_plugins)
    except Exception as exc:  # noqa: BLE001
        board.failed(f"{exc}")
        for sd in sides:
            sd.close()
        sys.exit(1)
    client: Any
    if is_dp(config):
        from fdx.server.dp_client import ReplicaSet
        from fdx.server.metrics import Metrics

        replicas = ReplicaSet(config, [sd.paths for sd in sides], hook=plugins.hook, sides=sides)
        replicas.metrics = Metrics(config.model_name, lambda: replicas.stats, replicas.replica_stats)
        client = replicas
        if config.dp_backend == "redis":  # the node joins the Redis global queue (fdx/server/dp_global_queue.py)
            try:
                from fdx.server.dp_global_queue import GlobalQueueClient

                client = GlobalQueueClient(config, replicas)
            except ImportError as exc:
                board.failed(f"--dp-backend redis needs the redis package (pip install 'fdx[redis]'): {exc}")
                sys.exit(1)
    else:
        client = EngineClient(config, paths, hook=plugins.hook, side=side)

    def load_tokenizer() -> tuple[Any, Any]:
        from fdx.model.loader import load_tokenizer as load

        tok = load(config.model)
        proc = plugins.create("token_processor", config.token_processor, tokenizer=tok, config=config)
        return tok, proc

    def on_serving() -> None:
        board.ready({"engine_pid": client.engine_pid, "engine_pids": getattr(client, "engine_pids", [client.engine_pid]),
                     "api_pid": os.getpid(),
                     "url": f"http://{config.host}:{config.port}"})

    client.on_failure.append(lambda reason, was_ready: None if was_ready else board.failed(reason))
    try:
        app = create_app(config, client, plugins=plugins, load_tokenizer=load_tokenizer,
                         on_startup_failure=board.failed, on_serving=on_serving)
    except Exception as exc:  # noqa: BLE001 - e.g. a plugin's fdx_add_routes failed
        board.failed(str(exc))
        for sd in sides:
            sd.close()
        sys.exit(1)
    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            # end open streams at once (503 event) instead of waiting out the grace period
            client.fail_pending("request aborted: server shutting down")
            await super().shutdown(sockets)

    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning" if config.log_level.lower() in ("info", "warning") else config.log_level.lower(),
            access_log=config.log_level.lower() == "debug",
            timeout_graceful_shutdown=3,
            lifespan="on",
            timeout_keep_alive=30,
        )
    )
    if parent_pid is not None:
        threading.Thread(target=watch_parent, args=(parent_pid, server), daemon=True).start()
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind the port
        if exc.code:
            board.failed(f"the API server could not start on {config.host}:{config.port} (port in use?)")
        raise
    if not server.started:
        board.failed(f"the API server could not start on {config.host}:{config.port} (port in use?)")
        sys.exit(1)


if __name__ == "__main__":
    main()
