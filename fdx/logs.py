"""Structured logging: ``key=value`` text by default, JSON lines with
``FDX_LOG_FORMAT=json``.  Every record names its process role."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any


class _JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "proc": self.process,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class _TextFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        t = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{t} {record.levelname:<7} [{self.process}:{record.process}] {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "info", process: str = "main") -> None:
    """Configure the root ``fdx`` logger for this process (idempotent)."""
    fmt = _JsonFormatter(process) if os.environ.get("FDX_LOG_FORMAT") == "json" else _TextFormatter(process)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(fmt)
    root = logging.getLogger("fdx")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class StatsLogger:
    """A periodic one-line log of throughput and queue state."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last_t = time.monotonic()
        self.last_steps = 0
        self.last_tokens = 0
        self.last_generated = 0

    def maybe_log(self, stats: Any) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self.last_t < self.interval:
            return
        dt = now - self.last_t
        logging.getLogger("fdx.engine").info(
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


def import_paddle_quietly() -> None:
    """``import paddle`` with its start-up chatter routed into fdx's log at
    debug: it prints "WARNING: OMP_NUM_THREADS set to N, not 1 ..." to stderr
    whenever OMP_NUM_THREADS > 1 (fdx sets it on purpose: MKL's threads) and
    warns "No ccache found" (its extension builder, loaded on import).  A
    second call is a no-op (Paddle is imported once)."""
    if "paddle" in sys.modules:
        return
    import contextlib
    import io
    import warnings

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import paddle  # noqa: F401
    log = logging.getLogger("fdx.paddle")
    for line in out.getvalue().splitlines():
        if line.strip():
            log.debug("paddle: %s", line.strip())
    for w in caught:
        log.debug("paddle: %s", w.message)
