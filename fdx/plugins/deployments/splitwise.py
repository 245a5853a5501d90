"""The ``splitwise`` deployment: ``--scheduler splitwise --num-prefill N
--num-decode M`` runs N prefill and M decode instances (each an ``fdx
serve`` with its role, a ``single`` deployment) and the router in front, as
children of this ``fdx serve`` (:mod:`fdx.router.topology`, docs/SPLITWISE.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fdx.core.errors import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.deploy.deployment import ForegroundDeployment

if TYPE_CHECKING:
    from fdx.core.hookspecs import Register


class SplitwiseDeployment(ForegroundDeployment):
    def run(self) -> int | None:
        from fdx.router.topology import run_topology

        if self.config.scheduler != "splitwise" or not (self.config.num_prefill and self.config.num_decode):
            raise ConfigError("--deployment splitwise needs --scheduler splitwise --num-prefill N --num-decode M")
        return run_topology(self.config)


@hookimpl
def fdx_register_deployments(register: Register) -> None:
    register("splitwise", SplitwiseDeployment,
             description="--num-prefill prefill and --num-decode decode instances behind fdx's router")
