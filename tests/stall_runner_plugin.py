"""A model-runner plugin for the supervisor tests: ``stall-cpu`` is fdx's
real Paddle runner, except that a step holding a request whose prompt
contains the token id in :data:`STALL_ENV` sleeps for an hour -- a hung
step while the engine's heartbeat thread keeps beating (``time.sleep``
releases the GIL), as a deadlocked kernel or a stuck device call would.

A real ``fdx serve`` finds it through :func:`write_entry_point` (a
``.dist-info`` with an ``fdx.plugins`` entry point on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from fdx.core.hookspecs import hookimpl

STALL_ENV = "FDX_TEST_STALL_TOKEN"


def create(config: Any, device: Any) -> Any:
    from fdx.model.runner import PaddleModelRunner

    stall = int(os.environ.get(STALL_ENV, "-1"))

    class StallRunner(PaddleModelRunner):  # type: ignore[misc, valid-type]
        def execute(self, batch: Any) -> Any:
            if any(stall in seq.request.prompt_token_ids for seq in batch.seqs):
                time.sleep(3600)
            return super().execute(batch)

    return StallRunner(config, device)


@hookimpl
def fdx_register_model_runners(register: Any) -> None:
    register("stall-cpu", create, description="test: the cpu runner, hanging on a marked token")


def write_entry_point(directory: str) -> str:
    """Write a ``.dist-info`` declaring this module as the ``fdx.plugins``
    entry point ``stall_runner``; returns the ``PYTHONPATH`` that finds both."""
    info = os.path.join(directory, "fdx_stall_runner-0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: fdx-stall-runner\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[fdx.plugins]\nstall_runner = stall_runner_plugin\n")
    here = os.path.dirname(os.path.abspath(__file__))
    return os.pathsep.join(p for p in (directory, here, os.environ.get("PYTHONPATH", "")) if p)
