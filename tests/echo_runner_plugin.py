"""A model-runner plugin for tests, as a third-party package would ship one.

* ``echo`` -- :class:`fdx.testing.EchoRunner`: each request's output repeats
  its prompt, so a test knows every token a real ``fdx serve`` must return;
* ``poison-echo`` -- the same, but its ``execute`` raises for any batch that
  holds a request whose prompt contains the token id in the environment
  variable :data:`POISON_ENV` (a runner bug triggered by one request).

A real ``fdx serve`` finds it through :func:`write_entry_point` (a
``.dist-info`` with an ``fdx.plugins`` entry point on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ModelOutput, ScheduledBatch
from fdx.testing import EchoRunner

POISON_ENV = "FDX_TEST_POISON_TOKEN"


class PoisonEchoRunner(EchoRunner):
    def __init__(self, config: Any, device: Any = None) -> None:
        super().__init__(config, device)
        self.poison = int(os.environ.get(POISON_ENV, "-1"))

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        for seq in batch.seqs:
            if self.poison in seq.request.prompt_token_ids:
                raise ValueError(f"runner bug triggered by token {self.poison}")
        return super().execute(batch)


@hookimpl
def fdx_register_model_runners(register: Any) -> None:
    register("echo", EchoRunner, description="test: repeats the prompt")
    register("poison-echo", PoisonEchoRunner, description="test: repeats the prompt, fails on a marked token")


def write_entry_point(directory: str) -> str:
    """A ``.dist-info`` in ``directory`` declaring this module as the
    ``fdx.plugins`` entry point ``echo_runner``; returns the ``PYTHONPATH`` that finds both."""
    from serverutil import write_plugin_entry_point

    return write_plugin_entry_point(directory, "fdx-echo-runner", "echo_runner", "echo_runner_plugin")
