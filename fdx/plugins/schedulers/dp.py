"""The ``dp`` scheduler (registered here): data-parallel engine replicas.

``fdx serve --scheduler dp --data-parallel-size N`` runs N engine processes
behind the one API process, as FastDeploy runs one engine per dp rank.
Each replica is a whole engine -- its own batch policy
(``--dp-local-scheduler``, ``v1`` by default, or ``v0``), KV cache and
``--num-threads`` compute threads -- with its own pair of IPC channels in
``RUN_DIR/dp<rank>/`` (:func:`replica_paths`).  The launcher supervises and
restarts each one as it does a single engine; the API process routes every
request to one replica (:mod:`fdx.server.dp_router`) and fans control calls
out to all of them (:mod:`fdx.server.dp_client`).

This module holds the topology: :func:`dp_size` (how many engines the
launcher starts), :func:`replica_config` (the config one replica's engine
gets) and :func:`replica_paths`.  Inside one engine, the registered
factory returns the local batch policy, so an engine (or ``fdx.LLM``) given
``scheduler="dp"`` behaves as a single replica.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fdx.core.hookspecs import hookimpl
from fdx.core.ipc import IpcPaths

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register


def dp_size(config: EngineConfig) -> int:
    """How many engine processes ``fdx serve`` runs for ``config``."""
    return config.data_parallel_size if config.scheduler == "dp" else 1


def is_dp(config: EngineConfig) -> bool:
    """Whether the API process talks to replicas (``--scheduler dp``)."""
    return config.scheduler == "dp"


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config replica ``rank``'s engine runs: the local batch policy,
    one replica, its rank."""
    if not is_dp(config):
        return config
    return config.replace(scheduler=config.dp_local_scheduler, data_parallel_size=1, dp_rank=rank, dp_backend="local")


def replica_paths(paths: IpcPaths, config: EngineConfig) -> list[IpcPaths]:
    """The IPC channel pair of every engine: ``RUN_DIR`` itself without
    dp, else one subdirectory ``RUN_DIR/dp<rank>`` per replica (created
    here; the API process binds the sockets in it)."""
    if not is_dp(config):
        return [paths]
    out = []
    for rank in range(dp_size(config)):
        d = os.path.join(paths.dir, f"dp{rank}")
        os.makedirs(d, mode=0o700, exist_ok=True)
        out.append(IpcPaths(d))
    return out


def _local_policy(config: EngineConfig, kv: Any) -> Any:
    """Inside one engine, ``dp`` is the replica's local batch policy."""
    from fdx.core.plugins import get_plugins

    return get_plugins(config.disable_plugins).create("scheduler", config.dp_local_scheduler, config=config, kv=kv)


@hookimpl
def fdx_register_schedulers(register: Register) -> None:
    register("dp", _local_policy,
             description="data parallel: --data-parallel-size engine replicas, each running "
                         "--dp-local-scheduler (v1|v0); prefix-affine, least-loaded routing")
