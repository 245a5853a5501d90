"""How a launched child (the API process, ``fdx router``) reports to the
process that started it, and notices when that one is gone: start-up
status as files in the run directory (:class:`StatusBoard`, read by
:mod:`fdx.deploy.launcher`) and :func:`watch_parent`."""

from __future__ import annotations

import json
import os
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
    (the launcher) is gone, so no orphan keeps serving; ``server.parent_gone``
    then says why it stopped (its run directory is nobody's to remove but
    its own: see fdx/server/api_proc.py)."""
    from fdx.core.ipc import pid_alive

    while not server.should_exit:
        if not pid_alive(parent_pid):
            server.parent_gone = True
            server.should_exit = True
            return
        time.sleep(1.0)
