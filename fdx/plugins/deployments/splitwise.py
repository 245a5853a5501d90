"""The ``splitwise`` deployment: ``--scheduler splitwise --num-prefill N
--num-decode M`` runs N prefill and M decode instances (each an ``fdx
serve`` with its role, a ``single`` deployment) and the router in front, as
children of this ``fdx serve`` (:mod:`fdx.router.topology`, docs/SPLITWISE.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from fdx.core.errors import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.deploy.deployment import Deployment, EngineProcess

if TYPE_CHECKING:
    from fdx.core.hookspecs import Register
    from fdx.core.ipc import FrontendSide, IpcPaths
    from fdx.deploy.frontend import EngineFrontend


class SplitwiseDeployment(Deployment):
    def run(self) -> int | None:
        from fdx.router.topology import run_topology

        if self.config.scheduler != "splitwise" or not (self.config.num_prefill and self.config.num_decode):
            raise ConfigError("--deployment splitwise needs --scheduler splitwise --num-prefill N --num-decode M")
        return run_topology(self.config)

    def engines(self, paths: IpcPaths) -> list[EngineProcess]:  # run() owns the foreground
        raise NotImplementedError

    def frontend(self, sides: Sequence[FrontendSide], hook: Any) -> EngineFrontend:
        raise NotImplementedError


@hookimpl
def fdx_register_deployments(register: Register) -> None:
    register("splitwise", SplitwiseDeployment,
             description="--num-prefill prefill and --num-decode decode instances behind fdx's router")
