"""The API process's side of ``--scheduler dp``: N engine replicas as one client.

:class:`ReplicaSet` holds one :class:`~fdx.deploy.engine_client.EngineClient` per
replica (each over its own channel pair in ``RUN_DIR/dp<rank>/``, with its
own liveness watch) and offers the same surface as a single
``EngineClient``, so the app, the endpoints and the control routes do not
know how many engines there are.  Invariants:

* a request is sent to exactly one replica, chosen by
  :class:`~fdx.deploy.affinity.PrefixAffinityRouter` among the replicas
  that serve now; each replica client keeps its own guarantees (one
  terminal item per handle, hooks and metrics once);
* a replica that dies or hangs holding requests none of whose tokens has
  reached the client hands them to another serving replica (same handle,
  same sink: the client sees one answer); the ones that already streamed
  tokens end with a 503 error event;
* the set serves while at least one replica serves: a replica that dies
  ends only its own requests (503 error events), the others go on, and the
  launcher restarts it; ``/health`` is 503 only when none serves;
* control calls go to every replica at once and their replies are merged
  (:func:`merge_replies`); ``abort_requests`` by id goes to the replicas
  holding those ids; a replica that is down is skipped and listed under
  ``unavailable`` in the merged result (all down: 503); a replica's 4xx/5xx
  fails the call with that code, naming the replica;
* ``pause`` / ``resume`` are remembered: a replica that restarts while the
  set is paused is paused again as soon as it is ready.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterable

import attrs

from fdx.config import EngineConfig
from fdx.core.ipc import IpcPaths
from fdx.deploy.engine_link import FrontendSide
from fdx.core.messages import EngineReady, EngineStats, SamplingParams
from fdx.deploy.engine_client import EngineClient
from fdx.deploy.frontend import ControlCallError, EngineHealth, EngineUnavailable, RequestHandle, Sink
from fdx.core.errors import RequestError
from fdx.deploy.affinity import PrefixAffinityRouter

log = logging.getLogger("fdx.server")

_SUMMED = tuple(f.name for f in attrs.fields(EngineStats)
                if isinstance(f.default, int) and not isinstance(f.default, bool))


def total_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one: counts summed, paused only when all are,
    the weights version of the first."""
    if not stats:
        return EngineStats()
    sums = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED}
    experts: dict[tuple[int, str], int] = {}
    for s in stats:
        for e, rank, n in s.expert_tokens:
            experts[(e, rank)] = experts.get((e, rank), 0) + n
    return EngineStats(**sums, is_paused=all(s.is_paused for s in stats), weights_version=stats[0].weights_version,
                       expert_tokens=tuple((e, rank, n) for (e, rank), n in sorted(experts.items())))


def _union(results: list[dict[str, Any]], key: str) -> list[Any]:
    out: list[Any] = []
    for r in results:
        for v in r.get(key) or ():
            if v not in out:
                out.append(v)
    return sorted(out) if all(isinstance(v, str) for v in out) else out


def merge_replies(method: str, results: dict[int, Any]) -> Any:
    """One reply from the replicas' results (rank -> result dict)."""
    rs = [results[r] for r in sorted(results)]
    if not rs:
        return {}
    if not all(isinstance(r, dict) for r in rs):
        return rs[0] if all(r == rs[0] for r in rs) else {"replicas": rs}
    per = [{"dp_rank": rank, **results[rank]} for rank in sorted(results)]
    if method == "pause":
        return {"is_paused": True, "num_aborted": sum(r.get("num_aborted", 0) for r in rs), "replicas": per}
    if method == "resume":
        return {"is_paused": False, "replicas": per}
    if method == "is_paused":
        return {"is_paused": all(r.get("is_paused") for r in rs), "sleeping": _union(rs, "sleeping"),
                "replicas": per}
    if method == "sleep":
        return {"sleeping": _union(rs, "sleeping"), "released": _union(rs, "released"),
                "rss_before": sum(r.get("rss_before") or 0 for r in rs),
                "rss_after": sum(r.get("rss_after") or 0 for r in rs), "replicas": per}
    if method == "wakeup":
        return {"restored": _union(rs, "restored"), "sleeping": _union(rs, "sleeping"),
                "is_paused": all(r.get("is_paused") for r in rs), "replicas": per}
    if method == "update_weights":
        return {**rs[0], "replicas": per}
    if method == "abort_requests":
        aborted = [a for r in rs for a in r.get("aborted") or ()]
        done = {a.get("request_id") for a in aborted}
        not_found = [i for i in _union(rs, "not_found") if i not in done]
        return {"aborted": aborted, "not_found": not_found}
    if all(r == rs[0] for r in rs):
        return rs[0]
    return {"replicas": per}


class _RankMetrics:
    """A replica client's view of the shared metrics: everything goes to
    the totals, crashes and restarts also to the replica's own series."""

    def __init__(self, metrics: Any, rank: int) -> None:
        self._m = metrics
        self._rank = rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)

    def engine_crashed(self, reason: str, message: str) -> None:
        self._m.engine_crashed(reason, message, dp_rank=self._rank)

    def engine_restarted(self) -> None:
        self._m.engine_restarted(dp_rank=self._rank)


class ReplicaSet:
    """``EngineClient``'s surface over the dp replicas (see the module doc)."""

    def __init__(self, config: EngineConfig, paths: list[IpcPaths], hook: Any = None,
                 sides: list[FrontendSide] | None = None) -> None:
        self.config = config
        self.replicas = [EngineClient(config, p, hook=hook, side=sides[r] if sides else None)
                         for r, p in enumerate(paths)]
        self.router = PrefixAffinityRouter(len(paths), config.block_size)
        self.on_failure: list[Callable[[str, bool], None]] = []
        self.on_ready: list[Callable[[EngineReady], None]] = []
        self._metrics: Any = None
        self._ever_ready: set[int] = set()
        self._paused = False  # the engines' paused state after the last pause/resume/sleep/wakeup that succeeded
        self._tasks: set[asyncio.Task[Any]] = set()
        for rank, c in enumerate(self.replicas):
            c.on_ready.append(lambda msg, rank=rank: self._replica_ready(rank, msg))
            c.on_failure.append(lambda reason, was_ready, rank=rank: self._replica_failed(rank, reason, was_ready))
            c.reroute = lambda h, rank=rank: self._reroute(rank, h)

    # -- the EngineClient surface ------------------------------------------

    @property
    def metrics(self) -> Any:
        return self._metrics

    @metrics.setter
    def metrics(self, m: Any) -> None:
        self._metrics = m
        for rank, c in enumerate(self.replicas):
            c.metrics = None if m is None else _RankMetrics(m, rank)

    async def start(self) -> None:
        for c in self.replicas:
            await c.start()

    async def close(self, shutdown_engine: bool = True, reason: str = "server shutting down") -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(c.close(shutdown_engine, reason) for c in self.replicas), return_exceptions=True)

    def serving(self) -> list[int]:
        """Ranks that take requests now."""
        return [r for r, c in enumerate(self.replicas) if c.unavailable_reason() is None]

    @property
    def alive(self) -> bool:
        return len(self._ever_ready) == len(self.replicas) and bool(self.serving())

    @property
    def failed(self) -> str | None:
        if self.serving() or all(c.failed is None for c in self.replicas):
            return None
        return "; ".join(f"dp replica {r}: {c.failed}" for r, c in enumerate(self.replicas) if c.failed)

    def unavailable_reason(self) -> str | None:
        if len(self._ever_ready) < len(self.replicas):
            waiting = [r for r in range(len(self.replicas)) if r not in self._ever_ready]
            failed = [f"dp replica {r}: {self.replicas[r].failed}" for r in waiting if self.replicas[r].failed]
            return "; ".join(failed) if failed else "engine is starting"
        if self.serving():
            return None
        return "; ".join(f"dp replica {r}: {c.unavailable_reason()}" for r, c in enumerate(self.replicas))

    def check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(reason)

    def _first(self) -> EngineClient:
        live = self.serving()
        return self.replicas[live[0] if live else 0]

    @property
    def engine(self) -> EngineReady | None:
        return self._first().engine

    @property
    def engine_pid(self) -> int | None:
        e = self.engine
        return e.pid if e else None

    @property
    def engine_pids(self) -> list[int | None]:
        return [c.engine_pid for c in self.replicas]

    def engines(self) -> list[EngineHealth]:
        return [h for r, c in enumerate(self.replicas) for h in c.engines(f"dp replica {r}")]

    @property
    def max_model_len(self) -> int:
        return self._first().max_model_len

    @property
    def weights_version(self) -> str:
        return self._first().weights_version

    @property
    def stats(self) -> EngineStats:
        return total_stats([c.stats for c in self.replicas])

    def replica_stats(self) -> list[tuple[int, EngineStats, bool]]:
        """``(rank, stats, serving)`` of every replica, for ``/metrics``."""
        return [(r, c.stats, c.unavailable_reason() is None) for r, c in enumerate(self.replicas)]

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.replicas)

    @property
    def num_live(self) -> int:
        return sum(c.num_live for c in self.replicas)

    def live_requests(self) -> dict[str, RequestHandle]:
        out: dict[str, RequestHandle] = {}
        for c in self.replicas:
            out.update(c.live_requests())
        return out

    @property
    def _live(self) -> dict[str, RequestHandle]:  # read by fdx.deploy.request_ids
        return self.live_requests()

    def num_waiting(self) -> int:
        return sum(c.num_waiting() for c in self.replicas)

    def load(self, rank: int) -> int:
        """Tokens replica ``rank`` holds or still has to run for this API's
        requests on it (see :mod:`fdx.deploy.affinity`)."""
        return sum(max(0, h.num_prompt_tokens - h.num_cached_tokens) + h.num_output_tokens
                   for h in self.replicas[rank]._live.values())

    def owner(self, request_id: str) -> int | None:
        for r, c in enumerate(self.replicas):
            if request_id in c._live:
                return r
        return None

    def submit(self, request_id: str, prompt_token_ids: Iterable[int], params: SamplingParams, arrival: float,
               sink: Sink | None = None, tag: Any = None, trace_context: str = "") -> RequestHandle:
        self.check_available()
        if self.owner(request_id) is not None:
            raise RequestError(f"duplicate request id {request_id!r}", 400, param="request_id")
        ids = tuple(prompt_token_ids)
        loads = {r: self.load(r) for r in self.serving()}
        last: EngineUnavailable | None = None
        while loads:
            choice = self.router.choose(ids, loads)
            try:
                h = self.replicas[choice.rank].submit(request_id, ids, params, arrival, sink, tag,
                                                      trace_context=trace_context)
            except EngineUnavailable as exc:  # went down just now: the next one
                last = exc
                loads.pop(choice.rank)
                continue
            h.dp_rank = choice.rank
            routed = getattr(self._metrics, "dp_routed", None)
            if routed is not None:
                routed(choice.rank, choice.reason)
            return h
        raise last or EngineUnavailable("engine unavailable: no dp replica serves")

    def _by_owner(self, handles: Iterable[RequestHandle]) -> dict[int, list[RequestHandle]]:
        out: dict[int, list[RequestHandle]] = {}
        for h in handles:
            if h.done:
                continue
            r = self.owner(h.request_id)
            if r is not None:
                out.setdefault(r, []).append(h)
        return out

    def finish(self, handle: RequestHandle, reason: str = "stop") -> None:
        for r, hs in self._by_owner([handle]).items():
            self.replicas[r].finish(hs[0], reason)

    def abort(self, handles: Iterable[RequestHandle], reason: str = "client disconnected") -> None:
        for r, hs in self._by_owner(handles).items():
            self.replicas[r].abort(hs, reason)

    def fail_pending(self, message: str) -> None:
        for c in self.replicas:
            c.fail_pending(message)

    async def call(self, method: str, args: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        """Run ``method`` on every serving replica (``abort_requests`` by id:
        on those holding the ids, else on all) and merge the replies."""
        self.check_available()
        args = dict(args or {})
        ranks = self.serving()
        if method == "abort_requests" and not args.get("abort_all"):
            ranks = self._abort_targets(args, ranks)
        replies = await asyncio.gather(*(self.replicas[r].call(method, args, timeout) for r in ranks),
                                       return_exceptions=True)
        results: dict[int, Any] = {}
        down: list[int] = [r for r in range(len(self.replicas)) if r not in ranks and method != "abort_requests"]
        for rank, rep in zip(ranks, replies):
            if isinstance(rep, EngineUnavailable):
                down.append(rank)
            elif isinstance(rep, RequestError):
                raise ControlCallError(f"dp replica {rank}: {rep}", rep.code) from None
            elif isinstance(rep, BaseException):
                raise rep
            else:
                results[rank] = rep
        if not results and ranks:
            raise EngineUnavailable("engine unavailable: no dp replica answered")
        merged = merge_replies(method, results)
        if method in ("pause", "resume", "sleep"):  # sleep pauses the engines too
            self._paused = method != "resume"
        elif method == "wakeup" and isinstance(merged, dict):  # resumed once nothing is left asleep
            self._paused = bool(merged.get("is_paused"))
        if down and isinstance(merged, dict):
            merged = {**merged, "unavailable": sorted(down)}
        return merged

    def _abort_targets(self, args: dict[str, Any], ranks: list[int]) -> list[int]:
        ids = args.get("req_ids") or []
        ids = [ids] if isinstance(ids, str) else list(ids)
        owners = {self.owner(i) for i in ids}
        if None in owners or not owners:
            return ranks  # an id only an engine knows: ask them all
        return [r for r in ranks if r in owners]

    # -- replica events ------------------------------------------------------

    def _reroute(self, dead: int, h: RequestHandle) -> bool:
        """Replica ``dead`` went down holding ``h``, none of whose tokens
        reached the client: send it to another serving replica."""
        loads = {r: self.load(r) for r in self.serving() if r != dead}
        while loads:
            choice = self.router.choose(h.prompt, loads)
            try:
                self.replicas[choice.rank].adopt(h)
                h.dp_rank = choice.rank
            except EngineUnavailable:
                loads.pop(choice.rank)
                continue
            log.warning("request %s moved from dp replica %d (down) to %d before any token", h.request_id, dead,
                        choice.rank)
            routed = getattr(self._metrics, "dp_routed", None)
            if routed is not None:
                routed(choice.rank, "rerouted")
            return True
        return False

    def _replica_ready(self, rank: int, msg: EngineReady) -> None:
        first = rank not in self._ever_ready
        self._ever_ready.add(rank)
        if not first:
            self.router.replica_restarted(rank)
            if self._paused:
                self._spawn(self._repause(rank))
        for cb in self.on_ready:
            cb(msg)

    async def _repause(self, rank: int) -> None:
        try:
            await self.replicas[rank].call("pause", {}, 30.0)
            log.info("dp replica %d restarted while the set is paused: paused it", rank)
        except Exception as exc:  # noqa: BLE001
            log.error("could not pause restarted dp replica %d: %s", rank, exc)

    def _spawn(self, coro: Any) -> None:
        spawn_tracked(self._tasks, coro)

    def _replica_failed(self, rank: int, reason: str, was_ready: bool) -> None:
        log.error("dp replica %d is unavailable: %s", rank, reason)
        for cb in self.on_failure:
            try:
                cb(f"dp replica {rank}: {reason}", was_ready)
            except Exception:  # noqa: BLE001
                log.exception("failure callback failed")


def spawn_tracked(tasks: set[Any], coro: Any) -> None:
    """Run ``coro`` as a task of the running loop, held in ``tasks`` until it
    ends (so it is not garbage-collected); without a running loop (shutting
    down) the coroutine is closed instead."""
    try:
        t = asyncio.get_running_loop().create_task(coro)
    except RuntimeError:
        coro.close()
        return
    tasks.add(t)
    t.add_done_callback(tasks.discard)
