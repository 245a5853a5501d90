"""The ``dp`` scheduler (registered here): data-parallel engine replicas.

``fdx serve --scheduler dp --data-parallel-size N`` runs N engine processes
behind the one API process, as FastDeploy runs one engine per dp rank.
Each replica is a whole engine -- its own batch policy
(``--dp-local-scheduler``, ``v1`` by default, or ``v0``), KV cache and
``--num-threads`` compute threads.

The processes and the front end are the ``dp`` deployment's
(:mod:`fdx.plugins.deployments.dp`).  Inside one engine, the registered
factory returns the local batch policy, so an engine (or ``fdx.LLM``) given
``scheduler="dp"`` behaves as a single replica.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fdx.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register


def _local_policy(config: EngineConfig, kv: Any) -> Any:
    """Inside one engine, ``dp`` is the replica's local batch policy."""
    from fdx.core.plugins import get_plugins

    return get_plugins(config.disable_plugins).create("scheduler", config.dp_local_scheduler, config=config, kv=kv)


@hookimpl
def fdx_register_schedulers(register: Register) -> None:
    register("dp", _local_policy,
             description="data parallel: --data-parallel-size engine replicas, each running "
                         "--dp-local-scheduler (v1|v0); prefix-affine, least-loaded routing")
