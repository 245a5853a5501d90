"""The ``deployment`` plugin kind: how ``fdx serve`` lays out its processes.

A deployment (``fdx_register_deployments``, chosen with ``--deployment``;
by default ``single``, ``dp`` under ``--scheduler dp``, ``splitwise`` with
``--num-prefill``/``--num-decode``, ``tp-node`` with ``--node-rank K > 0``;
``dp+splitwise`` only by name) declares:

* :meth:`Deployment.engines` -- the engine processes to run, each with its
  own IPC channel pair and config.  The launcher (:mod:`fdx.deploy.launcher`)
  starts, supervises and restarts each one and knows no deployment by name;
  the API process binds each one's sockets;
* :meth:`Deployment.frontend` -- the one object behind
  :class:`~fdx.deploy.frontend.EngineFrontend` through which the API
  process reaches those engines (routing, fan-out of control calls, health);
* :meth:`Deployment.run` -- optionally, the whole foreground instead: a
  deployment of several ``fdx serve`` instances and a router (the managed
  splitwise topology) returns ``fdx serve``'s exit code from it.

Built-ins live in ``fdx/plugins/deployments/`` and register through the same
hook as a third party's.  Threading contract: a deployment object is made
once per process (the launcher's, the API process's); :meth:`frontend` is
called in the API process before its event loop runs.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Sequence

import attrs

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.ipc import IpcPaths
    from fdx.deploy.engine_link import FrontendSide
    from fdx.deploy.frontend import EngineFrontend


@attrs.frozen
class EngineProcess:
    """One engine process a deployment needs."""

    #: how logs and errors name it (``engine``, ``dp replica 1 engine``)
    name: str
    #: its IPC channel pair (a directory holding ``in.sock`` / ``out.sock``)
    paths: IpcPaths
    #: the config its engine runs
    config: EngineConfig


class Deployment(abc.ABC):
    """See the module docstring.  ``config`` is ``fdx serve``'s config."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def run(self) -> int | None:
        """Run the whole ``fdx serve`` foreground and return its exit code,
        or ``None`` (the default) for the launcher to run :meth:`engines`
        beside one API process."""
        return None

    @abc.abstractmethod
    def engines(self, paths: IpcPaths) -> list[EngineProcess]:
        """The engine processes, their channel pairs under the run directory ``paths``
        (create any subdirectory here: both the launcher and the API process call it)."""

    @abc.abstractmethod
    def frontend(self, sides: Sequence[FrontendSide], hook: Any) -> EngineFrontend:
        """The API process's front end over ``sides`` (the bound channel of each of
        :meth:`engines`, in order); ``hook`` is the plugin manager's hook relay."""


class ForegroundDeployment(Deployment):
    """A deployment whose :meth:`run` owns the whole foreground: the launcher
    never asks it for engines or a front end."""

    @abc.abstractmethod
    def run(self) -> int | None: ...

    def engines(self, paths: IpcPaths) -> list[EngineProcess]:
        raise NotImplementedError

    def frontend(self, sides: Sequence[FrontendSide], hook: Any) -> EngineFrontend:
        raise NotImplementedError


def deployment_name(config: EngineConfig) -> str:
    """``--deployment``, else what the flags imply: ``tp-node`` on a host of
    ``--nnodes`` other than node 0, ``splitwise`` for the managed topology,
    ``dp`` under ``--scheduler dp``, else ``single``."""
    if config.deployment:
        return config.deployment
    if config.node_rank > 0:
        return "tp-node"
    if config.scheduler == "splitwise" and (config.num_prefill or config.num_decode) and not config.splitwise_role:
        return "splitwise"
    return "dp" if config.scheduler == "dp" else "single"


def create_deployment(config: EngineConfig, plugins: Any) -> Deployment:
    return plugins.create("deployment", deployment_name(config), config=config)  # type: ignore[no-any-return]
