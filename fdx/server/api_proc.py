"""The API-server process: ``python -m fdx.server.api_proc --config-fd FD RUN_DIR PARENT_PID``.

The config JSON (API key included) arrives on the inherited pipe FD, so it
never shows in ``ps``.

Loads the plugins, asks the deployment (``--deployment``,
:mod:`fdx.deploy.deployment`) for its engine processes and binds each one's
ZMQ sockets before any heavy import, so the launcher can start the engines
as soon as the socket files exist; the deployment's front end
(:class:`fdx.deploy.frontend.EngineFrontend`) then serves the app.  It runs
the FastAPI app under uvicorn.  It reports to the launcher through files
in the run directory (:class:`fdx.deploy.status_board.StatusBoard`); it
exits when told (SIGTERM/SIGINT, handled by uvicorn: the lifespan shutdown
sends ``Shutdown`` to the engine) or when the launcher disappears.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from typing import Any


def main() -> None:
    from fdx.core.ipc import IpcPaths, child_args
    from fdx.deploy.engine_link import FrontendSide

    from fdx.config import make_config
    from fdx.core.plugins import get_plugins
    from fdx.deploy.deployment import create_deployment
    from fdx.deploy.status_board import StatusBoard, watch_parent
    from fdx.logs import setup_logging

    values, run_dir, parent_pid = child_args(sys.argv[1:])
    config = make_config(**values)
    paths = IpcPaths(run_dir)
    setup_logging(config.log_level, process="api")
    board = StatusBoard(run_dir)
    try:
        plugins = get_plugins(config.disable_plugins)
        deployment = create_deployment(config, plugins)
        # bind now: the launcher starts the engines once every socket exists (one channel pair each)
        sides = [FrontendSide(e.paths) for e in deployment.engines(paths)]
    except Exception as exc:  # noqa: BLE001
        board.failed(f"{exc}")
        sys.exit(1)

    import prometheus_client
    import uvicorn

    from fdx.server.app import create_app
    from fdx.server.sse import ServerSend

    prometheus_client.disable_created_metrics()  # no *_created series (as vLLM)
    try:
        client = deployment.frontend(sides, plugins.hook)
    except Exception as exc:  # noqa: BLE001
        board.failed(f"{exc}")
        for sd in sides:
            sd.close()
        sys.exit(1)

    def load_tokenizer() -> tuple[Any, Any]:
        from fdx.model.loader import load_tokenizer as load

        tok = load(config.model)
        proc = plugins.create("token_processor", config.token_processor, tokenizer=tok, config=config)
        return tok, proc

    def on_serving() -> None:
        # what start-up built (the app, the tokenizer, the plugins) lives as long as
        # the process: frozen, the cyclic GC no longer walks it on every collection
        gc.collect()
        gc.freeze()
        board.ready({"engine_pid": client.engine_pid, "engine_pids": [e.pid for e in client.engines()],
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
        async def main_loop(self) -> None:
            # uvicorn's loop wakes every 0.1 s (an idle cost paid per second of
            # streaming): every 0.5 s is enough for its date header (refreshed
            # each tick) and for noticing should_exit (a signal, the parent gone)
            import asyncio

            while not await self.on_tick(0):
                await asyncio.sleep(0.5)

        async def shutdown(self, sockets: Any = None) -> None:
            # end open streams at once (503 event) instead of waiting out the grace period
            client.fail_pending("request aborted: server shutting down")
            await super().shutdown(sockets)

    server = _Server(
        uvicorn.Config(
            ServerSend(app),
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
    if getattr(server, "parent_gone", False):
        # the launcher died without its cleanup (SIGKILL, OOM kill): the run
        # directory (socket files, status and control-state files) is left to
        # this process; the engines exit on their own (their channel closes,
        # their parent check) and a write of theirs into it is best-effort
        paths.cleanup()


if __name__ == "__main__":
    main()
