"""The ``dp+splitwise`` deployment: disaggregated serving with data
parallelism.  ``fdx serve --deployment dp+splitwise --data-parallel-size N``
runs N prefill and N decode instances (``--num-prefill``/``--num-decode``
set either count apart) and the router in front, on one machine.

As in FastDeploy's and vLLM's disaggregated deployments with data
parallelism, every data-parallel rank of a role is an instance of its own
(its own API and engine processes, KV cache and KV connector, an ``fdx
serve --splitwise-role ...`` with ``dp_rank`` k), so the router sees 2N
instances: it spreads prompts over the prefill ranks (prefix-affine,
least-loaded) and requests over the decode ranks (least in flight), fans
control calls out to every instance (:mod:`fdx.router.control`) and lists
every engine in ``/health``.  The processes are the managed splitwise
topology's (:mod:`fdx.router.topology`): this module only checks the flags
and sets the counts.  See docs/PARALLELISM.md and docs/SPLITWISE.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fdx.core.hookspecs import hookimpl
from fdx.deploy.deployment import ForegroundDeployment

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register


class DPSplitwiseDeployment(ForegroundDeployment):
    def __init__(self, config: EngineConfig) -> None:
        from fdx.config import DP_SPLITWISE, dp_splitwise_counts

        # replace() checks the flags again (fdx.config: one-line errors naming the choices)
        p, d = dp_splitwise_counts(config)
        super().__init__(config.replace(deployment=DP_SPLITWISE, num_prefill=p, num_decode=d))

    def run(self) -> int | None:
        from fdx.router.topology import run_topology

        return run_topology(self.config)


@hookimpl
def fdx_register_deployments(register: Register) -> None:
    register("dp+splitwise", DPSplitwiseDeployment,
             description="--data-parallel-size prefill and decode instances (or --num-prefill/--num-decode) "
                         "behind fdx's router, each rank an instance")
