"""Registers the ``v1`` scheduler (default): token budget, chunked prefill,
prefix caching, preemption by recompute."""

from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import hookimpl


@hookimpl
def fdx_register_schedulers(register: Any) -> None:
    def factory(config: Any, kv: Any) -> Any:
        from fdx.plugins.schedulers._v1impl import V1Scheduler

        return V1Scheduler(config, kv)

    register("v1", factory, description="token budget, chunked prefill, prefix cache, preemption by recompute")
