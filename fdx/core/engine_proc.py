"""The engine process: an :class:`Engine` behind the ZMQ channels.

Loop: drain input messages -> ``engine.step()`` -> send one OutputBatch.
When there is no work it blocks in ``poll`` (no busy spin).  A heartbeat
thread sends :class:`Heartbeat` every ``heartbeat_interval`` seconds so the
front end can tell a dead or frozen engine from a busy one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from fdx.core.config import EngineConfig
from fdx.core.errors import FdxError
from fdx.core.ipc import EngineSide, IpcPaths, pid_alive
from fdx.core.logs import setup_logging
from fdx.core.messages import (
    AbortRequest,
    AddRequest,
    ControlReply,
    ControlRequest,
    EngineFailed,
    EngineReady,
    Heartbeat,
    OutputBatch,
    Shutdown,
    encode,
)

log = logging.getLogger("fdx.engine")


class _Beat(threading.Thread):
    """Sends heartbeats on its own socket (ZMQ sockets are per thread)."""

    def __init__(self, paths: IpcPaths, interval: float, get_stats) -> None:  # type: ignore[no-untyped-def]
        super().__init__(daemon=True, name="fdx-heartbeat")
        self.paths, self.interval, self.get_stats = paths, interval, get_stats
        self.stop = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.paths.output_addr)
        while not self.stop.wait(self.interval):
            try:
                sock.send(encode(Heartbeat(time.time(), self.get_stats())), zmq.NOBLOCK)
            except Exception:  # noqa: BLE001 - stats may be mid-update; next beat will do
                pass
        sock.close(0)


def run_engine(config: EngineConfig, paths: IpcPaths, parent_pid: int | None = None) -> int:
    """Entry point of the engine process.  Returns the exit code."""
    setup_logging(config.log_level, process="engine")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    side = EngineSide(paths)
    try:
        from fdx.core.engine import Engine

        engine = Engine(config)
    except FdxError as exc:
        side.send(EngineFailed(str(exc), exc.details or ""))
        log.error("engine failed to start: %s", exc)
        side.close()
        return 1
    except Exception as exc:  # noqa: BLE001
        side.send(EngineFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        log.exception("engine failed to start")
        side.close()
        return 1

    stats_cache = [engine.stats()]
    beat = _Beat(paths, config.heartbeat_interval, lambda: stats_cache[0])
    beat.start()
    side.send(
        EngineReady(
            os.getpid(),
            engine.kv.num_blocks,
            engine.max_model_len,
            config.model_name,
            engine.runner.weights_version,
        )
    )
    log.info("engine ready: %d KV blocks of %d tokens", engine.kv.num_blocks, config.block_size)
    logger = StatsLogger(config.log_stats_interval)
    try:
        while True:
            timeout = 0 if engine.has_work() else config.heartbeat_interval * 1000
            if side.poll(timeout):
                while (msg := side.recv_nowait()) is not None:
                    if isinstance(msg, AddRequest):
                        engine.add_request(msg)
                    elif isinstance(msg, AbortRequest):
                        engine.abort(msg.request_ids, msg.reason)
                    elif isinstance(msg, ControlRequest):
                        reply = _control(engine, msg)
                        # the front end sees the new state (paused, weights
                        # version, blocks) before the reply, and the
                        # heartbeat never re-sends the old one after it
                        stats_cache[0] = engine.stats()
                        side.send(OutputBatch((), stats_cache[0]))
                        side.send(reply)
                    elif isinstance(msg, Shutdown):
                        log.info("engine shutting down: %s", msg.reason or "requested")
                        return 0
            if engine.has_work():
                outputs = engine.step()
                stats = engine.stats()
                stats_cache[0] = stats
                if outputs:
                    side.send(OutputBatch(tuple(outputs), stats))
                logger.maybe_log(stats)
            else:
                stats_cache[0] = engine.stats()
            if parent_pid is not None and not pid_alive(parent_pid):
                log.error("parent process %d is gone; engine exiting", parent_pid)
                return 1
    except Exception as exc:  # noqa: BLE001
        log.exception("engine crashed")
        try:
            side.send(EngineFailed(f"engine crashed: {type(exc).__name__}: {exc}", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        return 1
    finally:
        beat.stop.set()
        engine.close()
        side.close()


def _control(engine: object, msg: ControlRequest) -> ControlReply:
    from fdx.core.engine import ControlError

    try:
        result = engine.control(msg.method, dict(msg.args))  # type: ignore[attr-defined]
        return ControlReply(msg.call_id, 200, result)
    except ControlError as exc:
        return ControlReply(msg.call_id, exc.code, None, str(exc))


class StatsLogger:
    """A periodic one-line log of throughput and queue state."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last_t = time.monotonic()
        self.last_steps = 0
        self.last_tokens = 0
        self.last_generated = 0

    def maybe_log(self, stats) -> None:  # type: ignore[no-untyped-def]
        now = time.monotonic()
        if self.interval <= 0 or now - self.last_t < self.interval:
            return
        dt = now - self.last_t
        log.info(
            "steps/s=%.1f tokens/s=%.1f gen_tokens/s=%.1f running=%d waiting=%d kv_usage=%.1f%% "
            "prefix_hit=%d/%d preemptions=%d",
            (stats.steps - self.last_steps) / dt,
            (stats.num_batched_tokens - self.last_tokens) / dt,
            (stats.num_generated_tokens - self.last_generated) / dt,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_usage,
            stats.prefix_hits,
            stats.prefix_queries,
            stats.num_preemptions,
        )
        self.last_t, self.last_steps = now, stats.steps
        self.last_tokens, self.last_generated = stats.num_batched_tokens, stats.num_generated_tokens


def main() -> None:
    """``python -m fdx.core.engine_proc CONFIG_JSON RUN_DIR PARENT_PID``"""
    import json

    from fdx.core.config import make_config

    cfg = make_config(**json.loads(sys.argv[1]))
    sys.exit(run_engine(cfg, IpcPaths(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None))


if __name__ == "__main__":
    main()
