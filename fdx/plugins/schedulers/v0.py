"""Registers the ``v0`` scheduler: FastDeploy's older static-slot policy
(admission with an output-block reserve, seed chunk plan, no preemption)."""

from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import hookimpl


@hookimpl
def fdx_register_schedulers(register: Any) -> None:
    def factory(config: Any, kv: Any) -> Any:
        from fdx.plugins.schedulers._v0impl import V0Scheduler

        return V0Scheduler(config, kv)

    register("v0", factory, description="static slots, seed chunk plan, output-block reserve, no preemption")
