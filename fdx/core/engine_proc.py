"""The engine process: an :class:`Engine` behind the ZMQ channels.

Loop: drain input messages -> ``engine.step()`` -> send one OutputBatch.
When there is no work it blocks in ``poll`` (no busy spin).  A heartbeat
thread sends :class:`Heartbeat` every ``heartbeat_interval`` seconds with
the loop's :class:`Progress` (finished steps, seconds inside the current
step), so the front end can tell a dead, frozen or hung-in-a-step engine
from a busy one.  The config arrives on an inherited pipe (``--config-fd``).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import suppress
from typing import Any

import zmq

from fdx.config import EngineConfig
from fdx.core.errors import ControlError, FdxError
from fdx.core.ipc import ChannelClosed, EngineSide, IpcPaths, OutputWriter, child_args, pid_alive
from fdx.logs import StatsLogger, setup_logging
from fdx.core.messages import (
    AbortRequest,
    AddRequest,
    ControlReply,
    ControlRequest,
    EngineFailed,
    EngineReady,
    Heartbeat,
    OutputBatch,
    RequestOutput,
    Shutdown,
)

log = logging.getLogger("fdx.engine")


class Progress:
    """What the engine loop is doing, read by the heartbeat thread.

    ``busy_since`` is the ``time.monotonic()`` at which the loop entered its
    current unit of work (``None`` while it waits for input); ``steps``
    counts finished steps.  Plain attribute writes: atomic under the GIL."""

    def __init__(self) -> None:
        self.steps = 0
        self.busy_since: float | None = None

    def busy_s(self) -> float:
        since = self.busy_since  # read once: the loop may clear it meanwhile
        return 0.0 if since is None else max(0.0, time.monotonic() - since)


class HeartbeatThread(threading.Thread):
    """Sends heartbeats on its own connection of the output channel."""

    def __init__(self, paths: IpcPaths, interval: float, get_stats, progress: Progress) -> None:  # type: ignore[no-untyped-def]
        super().__init__(daemon=True, name="fdx-heartbeat")
        self.paths, self.interval, self.get_stats = paths, interval, get_stats
        self.progress = progress
        self.stop = threading.Event()

    def run(self) -> None:
        out = OutputWriter(self.paths.output_path, timeout=max(self.interval, 1.0))
        pid = os.getpid()
        while not self.stop.wait(self.interval):
            p = self.progress
            try:
                beat = Heartbeat(time.time(), self.get_stats(), pid=pid, steps=p.steps, busy_s=p.busy_s())
                out.send(beat)
            except Exception:  # noqa: BLE001 - stats may be mid-update, the channel closed: next beat will do
                pass
        out.close()


#: how often, at most, a step's OutputBatch carries the engine's stats (with a
#: finished request's output, always); heartbeats carry them too
STATS_EVERY_S = 0.05
#: how often the loop asks whether its parent still lives (a /proc read: ~40 us, 1% of a one-sequence step)
PARENT_CHECK_S = 0.2


def run_engine(config: EngineConfig, paths: IpcPaths, parent_pid: int | None = None) -> int:
    """Entry point of the engine process.  Returns the exit code."""
    setup_logging(config.log_level, process="engine")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    side = EngineSide(paths)
    try:
        from fdx.core.engine import Engine

        engine = Engine(config)
    except Exception as exc:  # noqa: BLE001 - an FdxError is its one line; anything else, its type and traceback
        ours = isinstance(exc, FdxError)
        message, details = (str(exc), exc.details or "") if ours else (f"{type(exc).__name__}: {exc}",  # type: ignore[attr-defined]
                                                                        traceback.format_exc())
        with suppress(ChannelClosed):
            side.send(EngineFailed(message, details, pid=os.getpid()))
        log.error("engine failed to start: %s", exc, exc_info=not ours)
        side.close()
        return 1

    from fdx.engine_control import restore_control_state

    restore_control_state(engine, paths.dir)
    if config.grammar_backend:  # its one-time warm-up (a tokenizer index, ~0.5 s under the GIL) beside the start
        threading.Thread(target=warm_grammar, args=(engine,), name="fdx-grammar-warm", daemon=True).start()
    for sock in engine.scheduler.pollables():  # e.g. a splitwise KV connector: its messages wake the loop
        side.poller.register(sock, zmq.POLLIN)
    # what start-up built (the model's Python side, the tokenizer, the plugins) lives as
    # long as the process: frozen, a full collection no longer walks it mid-decode
    gc.collect()
    gc.freeze()
    stats_cache = [engine.stats()]
    progress = Progress()
    beat = HeartbeatThread(paths, config.heartbeat_interval, lambda: stats_cache[0], progress)
    beat.start()
    ready = (os.getpid(), engine.kv.num_blocks, engine.max_model_len, config.model_name)
    logger = StatsLogger(config.log_stats_interval)
    stats_sent = parent_checked = 0.0
    try:
        side.send(EngineReady(*ready, engine.runner.weights_version, engine.runner.rank_pids))
        log.info("engine ready: %d KV blocks of %d tokens", engine.kv.num_blocks, config.block_size)
        while True:
            timeout = 0 if engine.has_work() else config.heartbeat_interval * 1000
            progress.busy_since = None
            if side.poll(timeout):
                progress.busy_since = time.monotonic()
                while (msg := side.recv_nowait()) is not None:
                    if not handle_input(engine, msg, side, stats_cache):
                        return 0
            if engine.has_work():
                progress.busy_since = time.monotonic()
                outputs = engine.step()
                progress.steps += 1
                stats = engine.stats()
                stats_cache[0] = stats
                if outputs:
                    # the stats ride along when a request ended, else at most every STATS_EVERY_S
                    # (decoding them costs the API process as much as a step's outputs)
                    now = time.monotonic()
                    with_stats = now - stats_sent >= STATS_EVERY_S or any(o.finish_reason is not None for o in outputs)
                    if with_stats:
                        stats_sent = now
                    side.send(OutputBatch(tuple(outputs), stats if with_stats else None))
                logger.maybe_log(stats)
            else:
                stats_cache[0] = engine.stats()
            if parent_pid is not None and (t := time.monotonic()) >= parent_checked + PARENT_CHECK_S:
                parent_checked = t
                if not pid_alive(parent_pid):
                    log.error("parent process %d is gone; engine exiting", parent_pid)
                    return 1
    except ChannelClosed as exc:  # the front end went away (or is shutting down): nobody to serve
        log.warning("%s; engine exiting", exc)
        return 1
    except Exception as exc:  # noqa: BLE001
        log.exception("engine crashed")
        with suppress(Exception):  # the front end may be gone already
            side.send(EngineFailed(f"engine crashed: {type(exc).__name__}: {exc}", traceback.format_exc(),
                                     pid=os.getpid()))
        return 1
    finally:
        beat.stop.set()
        engine.close()
        side.close()


def warm_grammar(engine: Any) -> None:
    try:
        engine.grammar_backend().warm()
    except Exception:  # noqa: BLE001 - a structured request will report it; serving goes on
        log.warning("grammar backend %r failed to warm up", engine.config.grammar_backend, exc_info=True)


def handle_input(engine: Any, msg: object, side: Any, stats_cache: list[Any]) -> bool:
    """Apply one input message to the engine; False for ``Shutdown``.

    A message the engine fails on is answered (an error output for an
    AddRequest, a 500 reply for a control call) and logged with its
    traceback; it never ends the loop."""
    if isinstance(msg, AddRequest):
        try:
            engine.add_request(msg)
        except Exception:  # noqa: BLE001 - one bad request fails alone
            log.exception("the engine could not take request %s", msg.request_id)
            with suppress(Exception):
                engine.abort((msg.request_id,), "failed to add")
            out = RequestOutput(msg.request_id, (), "error", error="the engine failed to take this request",
                                error_code=500)
            side.send(OutputBatch((out,), None))
    elif isinstance(msg, AbortRequest):
        try:
            engine.abort(msg.request_ids, msg.reason)
        except Exception:  # noqa: BLE001
            log.exception("aborting %d request(s) failed", len(msg.request_ids))
    elif isinstance(msg, ControlRequest):
        reply = _control(engine, msg)
        # the front end sees the new state (paused, weights version,
        # blocks) before the reply, and the heartbeat never re-sends the
        # old one after it
        stats_cache[0] = engine.stats()
        side.send(OutputBatch((), stats_cache[0]))
        side.send(reply)
    elif isinstance(msg, Shutdown):
        log.info("engine shutting down: %s", msg.reason or "requested")
        return False
    else:
        log.error("ignoring an unexpected %s on the input channel", type(msg).__name__)
    return True


def _control(engine: Any, msg: ControlRequest) -> ControlReply:
    try:
        result = engine.control(msg.method, dict(msg.args))
        return ControlReply(msg.call_id, 200, result)
    except ControlError as exc:
        return ControlReply(msg.call_id, exc.code, None, str(exc))
    except Exception:  # noqa: BLE001 - Engine.control wraps its own; this is the last guard
        log.exception("control method %s failed", msg.method)
        return ControlReply(msg.call_id, 500, None, f"control method {msg.method} failed")


def main() -> None:
    """``python -m fdx.core.engine_proc --config-fd FD RUN_DIR PARENT_PID``
    (the config JSON arrives on the inherited pipe FD, never in argv)."""
    from fdx.config import make_config

    values, run_dir, parent_pid = child_args(sys.argv[1:])
    sys.exit(run_engine(make_config(**values), IpcPaths(run_dir), parent_pid))


if __name__ == "__main__":
    main()
