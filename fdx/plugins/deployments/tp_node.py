"""The ``tp-node`` deployment: ``fdx serve --nnodes N --node-rank K`` with
K > 0 (the default there).  No API server and no engine: the node agent
(:mod:`fdx.parallel.node`) starts this host's tensor-parallel ranks whenever
rank 0's group (node 0's engine) asks, and again after every restart."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fdx.core.errors import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.deploy.deployment import ForegroundDeployment

if TYPE_CHECKING:
    from fdx.core.hookspecs import Register


class TPNodeDeployment(ForegroundDeployment):
    def run(self) -> int | None:
        from fdx.parallel.node import run_node_agent

        if self.config.nnodes < 2 or self.config.node_rank < 1:
            raise ConfigError("--deployment tp-node needs --nnodes N --node-rank K (K >= 1); node 0 serves the API")
        return run_node_agent(self.config)


@hookimpl
def fdx_register_deployments(register: Register) -> None:
    register("tp-node", TPNodeDeployment,
             description="--nnodes N --node-rank K>0: this host's tensor-parallel ranks, for node 0's engine")
