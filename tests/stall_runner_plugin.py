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
    """A ``.dist-info`` in ``directory`` declaring this module as the
    ``fdx.plugins`` entry point ``stall_runner``; returns the ``PYTHONPATH`` that finds both."""
    from serverutil import write_plugin_entry_point

    return write_plugin_entry_point(directory, "fdx-stall-runner", "stall_runner", "stall_runner_plugin")
