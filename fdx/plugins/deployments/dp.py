"""The ``dp`` deployment: ``--scheduler dp --data-parallel-size N`` runs N
engine replicas behind the one API process, as FastDeploy runs one engine
per dp rank.

Each replica is a whole engine -- its own batch policy
(``--dp-local-scheduler``, ``v1`` by default, or ``v0``), KV cache and
``--num-threads`` compute threads (a ``--tensor-parallel-size`` group of
its own, too) -- with its own pair of IPC channels in ``RUN_DIR/dp<rank>/``.
The launcher supervises and restarts each one as it does a single engine;
the API process's :class:`~fdx.plugins.deployments.dp_replicas.ReplicaSet`
routes every request to one replica (:mod:`fdx.deploy.affinity`) and fans
control calls out to all of them.  Across machines (``--dp-backend
redis``) the node's replica set joins the Redis global queue
(:mod:`fdx.plugins.deployments.dp_global_queue`).  See docs/DP.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

from fdx.core.errors import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.ipc import IpcPaths
from fdx.deploy.deployment import Deployment, EngineProcess

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register
    from fdx.deploy.engine_link import FrontendSide
    from fdx.deploy.frontend import EngineFrontend


def dp_size(config: EngineConfig) -> int:
    """How many engine processes ``fdx serve`` runs for ``config``."""
    return config.data_parallel_size if config.scheduler == "dp" else 1


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config replica ``rank``'s engine runs: the local batch policy,
    one replica, its rank."""
    if config.scheduler != "dp":
        return config
    return config.replace(scheduler=config.dp_local_scheduler, data_parallel_size=1, dp_rank=rank, dp_backend="local")


def replica_paths(paths: IpcPaths, config: EngineConfig) -> list[IpcPaths]:
    """The IPC channel pair of every engine: ``RUN_DIR`` itself without
    dp, else one subdirectory ``RUN_DIR/dp<rank>`` per replica (created
    here; the API process binds the sockets in it)."""
    if config.scheduler != "dp":
        return [paths]
    out = []
    for rank in range(dp_size(config)):
        d = os.path.join(paths.dir, f"dp{rank}")
        os.makedirs(d, mode=0o700, exist_ok=True)
        out.append(IpcPaths(d))
    return out


class DPDeployment(Deployment):
    def __init__(self, config: EngineConfig) -> None:
        if config.scheduler != "dp":
            raise ConfigError("--deployment dp needs --scheduler dp (and --data-parallel-size N)")
        super().__init__(config)

    def engines(self, paths: IpcPaths) -> list[EngineProcess]:
        return [EngineProcess(f"dp replica {rank} engine", rp, replica_config(self.config, rank))
                for rank, rp in enumerate(replica_paths(paths, self.config))]

    def frontend(self, sides: Sequence[FrontendSide], hook: Any) -> EngineFrontend:
        from fdx.plugins.deployments.dp_replicas import ReplicaSet
        from fdx.server.metrics import Metrics

        config = self.config
        replicas = ReplicaSet(config, [sd.paths for sd in sides], hook=hook, sides=list(sides))
        replicas.metrics = Metrics(config.model_name, lambda: replicas.stats, replicas.replica_stats)
        if config.dp_backend != "redis":
            return replicas
        try:  # the node joins the Redis global queue
            from fdx.plugins.deployments.dp_global_queue import GlobalQueueClient
        except ImportError as exc:
            raise ConfigError(f"--dp-backend redis needs the redis package (pip install 'fdx[redis]'): {exc}") from None
        return GlobalQueueClient(config, replicas)  # type: ignore[return-value]


@hookimpl
def fdx_register_deployments(register: Register) -> None:
    register("dp", DPDeployment, description="--data-parallel-size engine replicas behind one API server "
                                             "(prefix-affine, least-loaded routing; --dp-backend redis across nodes)")
