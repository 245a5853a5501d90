"""A deployment plugin for tests, as a third-party package would ship one,
written only against fdx's public hooks and classes: ``round_robin`` runs
one engine per (pretend) NUMA node -- two engine replicas, each in its own
channel directory with one thread -- and sends requests to them in turn.

``GET /round_robin/replicas`` (added through ``fdx_add_routes``) reports,
per replica, the tokens its engine says it generated.  A real ``fdx serve
--deployment round_robin`` finds the plugin through :func:`write_entry_point`.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Iterable, Sequence

from fdx.core.hookspecs import Register, hookimpl
from fdx.core.ipc import IpcPaths
from fdx.deploy.deployment import Deployment, EngineProcess
from fdx.deploy.frontend import EngineHealth, RequestHandle

NODES = 2


class RoundRobin:
    """The front end: every :class:`~fdx.deploy.frontend.EngineFrontend`
    method over two engine clients; requests alternate, control calls go to both."""

    def __init__(self, clients: list[Any]) -> None:
        self.clients = clients
        self.config = clients[0].config
        self.on_ready: list[Any] = []
        self.on_failure: list[Any] = []
        for c in clients:  # one list of callbacks for both
            c.on_ready, c.on_failure = self.on_ready, self.on_failure
        self._next = itertools.cycle(range(len(clients)))
        self._owner: dict[str, Any] = {}
        self._metrics: Any = None

    @property
    def metrics(self) -> Any:
        return self._metrics

    @metrics.setter
    def metrics(self, m: Any) -> None:
        self._metrics = m
        for c in self.clients:
            c.metrics = m

    async def start(self) -> None:
        for c in self.clients:
            await c.start()

    async def close(self, shutdown_engine: bool = True, reason: str = "server shutting down") -> None:
        for c in self.clients:
            await c.close(shutdown_engine, reason)

    @property
    def alive(self) -> bool:
        return all(c.alive for c in self.clients)

    @property
    def failed(self) -> str | None:
        return next((c.failed for c in self.clients if c.failed), None)

    def unavailable_reason(self) -> str | None:
        return next((r for r in (c.unavailable_reason() for c in self.clients) if r), None)

    @property
    def engine(self) -> Any:
        return self.clients[0].engine

    @property
    def engine_pid(self) -> int | None:
        return self.clients[0].engine_pid

    def engines(self) -> list[EngineHealth]:
        return [h for i, c in enumerate(self.clients) for h in c.engines(f"numa node {i}")]

    @property
    def max_model_len(self) -> int:
        return min(c.max_model_len for c in self.clients)

    @property
    def weights_version(self) -> str:
        return self.clients[0].weights_version

    @property
    def stats(self) -> Any:
        return self.clients[0].stats

    def num_waiting(self) -> int:
        return sum(c.num_waiting() for c in self.clients)

    def submit(self, request_id: str, prompt_token_ids: Iterable[int], params: Any, arrival: float,
               sink: Any = None, tag: Any = None, **kw: Any) -> RequestHandle:
        client = self.clients[next(self._next)]
        handle = client.submit(request_id, prompt_token_ids, params, arrival, sink, tag, **kw)
        self._owner[handle.request_id] = client
        return handle

    def finish(self, handle: RequestHandle, reason: str = "stop") -> None:
        self._owner.pop(handle.request_id).finish(handle, reason)

    def abort(self, handles: Iterable[RequestHandle], reason: str = "client disconnected") -> None:
        for h in handles:
            owner = self._owner.pop(h.request_id, None)
            if owner is not None:
                owner.abort([h], reason)

    def fail_pending(self, message: str) -> None:
        for c in self.clients:
            c.fail_pending(message)

    async def call(self, method: str, args: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        results = [await c.call(method, args, timeout) for c in self.clients]
        return results[0]


class RoundRobinDeployment(Deployment):
    def engines(self, paths: IpcPaths) -> list[EngineProcess]:
        out = []
        for node in range(NODES):
            d = os.path.join(paths.dir, f"numa{node}")
            os.makedirs(d, mode=0o700, exist_ok=True)
            out.append(EngineProcess(f"numa node {node} engine", IpcPaths(d), self.config.replace(num_threads=1)))
        return out

    def frontend(self, sides: Sequence[Any], hook: Any) -> RoundRobin:
        from fdx.deploy.engine_client import EngineClient

        return RoundRobin([EngineClient(self.config, s.paths, hook=hook, side=s) for s in sides])


@hookimpl
def fdx_register_deployments(register: Register) -> None:
    register("round_robin", RoundRobinDeployment, description="test: one engine per NUMA node, round robin")


@hookimpl
def fdx_add_routes(app: Any, client: Any) -> None:
    if not isinstance(client, RoundRobin):
        return

    @app.get("/round_robin/replicas")
    async def replicas() -> dict[str, Any]:
        return {"generated": [c.stats.num_generated_tokens for c in client.clients],
                "pids": [c.engine_pid for c in client.clients]}


def write_entry_point(directory: str) -> str:
    """A ``.dist-info`` in ``directory`` declaring this module as the
    ``fdx.plugins`` entry point ``round_robin``; returns the ``PYTHONPATH`` that finds both."""
    from serverutil import write_plugin_entry_point

    return write_plugin_entry_point(directory, "fdx-round-robin", "round_robin", "round_robin_deployment")
