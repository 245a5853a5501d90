"""The ``single`` deployment (the default): one engine process behind one
API process, reached through one :class:`~fdx.deploy.engine_client.EngineClient`.
A splitwise prefill or decode instance (``--splitwise-role``) is one too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from fdx.core.hookspecs import hookimpl
from fdx.deploy.deployment import Deployment, EngineProcess

if TYPE_CHECKING:
    from fdx.core.hookspecs import Register
    from fdx.core.ipc import IpcPaths
    from fdx.deploy.engine_link import FrontendSide
    from fdx.deploy.frontend import EngineFrontend


class SingleDeployment(Deployment):
    def engines(self, paths: IpcPaths) -> list[EngineProcess]:
        return [EngineProcess("engine", paths, self.config)]

    def frontend(self, sides: Sequence[FrontendSide], hook: Any) -> EngineFrontend:
        from fdx.deploy.engine_client import EngineClient

        [side] = sides
        return EngineClient(self.config, side.paths, hook=hook, side=side)


@hookimpl
def fdx_register_deployments(register: Register) -> None:
    register("single", SingleDeployment, description="one engine process behind the API server (the default)")
