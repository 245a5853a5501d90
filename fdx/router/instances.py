"""The prefill (P) and decode (D) instances behind ``fdx router``, and which one takes a request.

* Each :class:`Instance` is one ``fdx serve`` base URL with the role it was
  given on the command line.  Its ``/v1/splitwise/info`` is read when it
  comes up (at start and on every recovery): a splitwise instance must
  report the role it was given (else it stays out of rotation, the reason
  in ``/health``); an instance without that route (404: an ordinary, mixed
  ``fdx serve``) serves whole requests: a mixed D gets the client's body
  unchanged, a mixed P only the ``max_tokens == 1`` requests.
* **Up/down**: :meth:`InstancePool.probe_loop` GETs every instance's
  ``/health`` each ``probe_interval`` seconds.  A refused connection, or a
  non-200 answer, marks it down at once; a probe timing out
  ``probe_failures`` times in a row does too.  The proxy marks an instance
  down as soon as it cannot connect to it.  Marking down cuts the
  :class:`Flight` s that depend on it (its own requests, and the handoffs
  still waiting on a P), so nothing waits on a dead instance; a 200 again
  brings it back (its info re-read; a P whose engine pid changed has an
  empty prefix cache, so its affinity entries are dropped).  Before it is
  routed to again (and whenever its engine pid changes: counted in
  ``restarts``) it is given the deployment's control state
  (:mod:`fdx.router.state`); failing that it stays down, the reason shown,
  and is tried again after :data:`fdx.router.state.RETRY_S`.
* **Load**: the router counts what it has in flight on each instance.  P:
  the weight of the prompts whose handoff it has not finished yet (until
  D's response headers arrive, which D sends with the first token); a
  prompt's weight is its UTF-8 bytes (about 4 per token), or its token ids.
  D: its requests in flight.  P is picked by
  :class:`fdx.deploy.affinity.PrefixAffinityRouter` over the same units
  (the prompt's bytes or ids stand in for tokens: blocks of
  ``affinity_block_tokens`` x 4 bytes; sticky unless much busier), D by
  least requests in flight (ties: the one given fewest).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Sequence

import aiohttp
import anyio
import attrs

from fdx.deploy.affinity import Choice, PrefixAffinityRouter
from fdx.router.state import RETRY_S, ControlState

log = logging.getLogger("fdx.router")

ROLES = ("prefill", "decode")
#: prompt bytes per estimated token (affinity blocks and P's load)
BYTES_PER_TOKEN = 4
#: an instance's reason while the router gives it the deployment's control state
APPLYING = "giving it the deployment's control state (pause, sleep, weights) before routing to it"


@attrs.define(eq=False)
class Instance:
    """One ``fdx serve`` behind the router."""

    url: str
    role: str
    rank: int
    up: bool = False
    reason: str = "not probed yet"
    #: its ``/v1/splitwise/info`` (``None``: not read yet, or not a splitwise instance)
    info: dict[str, Any] | None = None
    splitwise: bool = False
    engine_pid: int | None = None
    misconfigured: str | None = None
    probe_failures: int = 0
    #: requests routed to it (for a P: prompts it was picked to prefill)
    given: int = 0
    flights: set[Flight] = attrs.field(factory=set)
    #: its ``/health``'s ``engines`` (name, pid, state, rank_pids), as last read
    engines: list[dict[str, Any]] = attrs.field(factory=list)
    #: times a new engine pid was seen (its engine, or the whole instance, was started again)
    restarts: int = 0
    #: the deployment's control state is being given to it (:mod:`fdx.router.state`)
    applying: bool = False
    #: why that failed the last time (``None``: it did not)
    control_state_error: str | None = None
    #: when to try again after such a failure (``time.monotonic()``)
    retry_at: float = 0.0

    @property
    def kv_addr(self) -> str | None:
        return (self.info or {}).get("kv_addr")

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def engine_health(self) -> list[dict[str, Any]]:
        """Its engines as its ``/health`` last listed them, ``unavailable``
        while the instance is down."""
        return [{"name": str(e.get("name", "engine")), "pid": e.get("pid"),
                 "state": e.get("state") if self.up else "unavailable", "rank_pids": e.get("rank_pids") or []}
                for e in self.engines if isinstance(e, dict)]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.url, "role": self.role, "up": self.up,
                               "splitwise": self.splitwise, "in_flight": self.in_flight}
        if self.info:
            out["kv_connector"] = self.info.get("kv_connector")
            out["kv_addr"] = self.info.get("kv_addr")
        if self.engine_pid is not None:
            out["engine_pid"] = self.engine_pid
        out["given"] = self.given
        out["restarts"] = self.restarts
        out["engines"] = self.engine_health()
        if self.control_state_error is not None:
            out["control_state_error"] = self.control_state_error
        if not self.up:
            out["reason"] = self.misconfigured or self.reason
        return out


@attrs.define(eq=False)
class Flight:
    """One request in flight through the router: the instance its HTTP
    request goes to (``target``), the P doing its prefill for D (``prefill``,
    ``None`` for a request served whole), and the prompt's weight (its
    bytes, or token ids: P's load)."""

    target: Instance
    prefill: Instance | None
    weight: int
    #: D's response headers arrived (D has the KV and the first token): P's part is over
    handed_off: bool = False
    #: why the router cut it (an instance it depends on went down)
    failure: str | None = None
    failed: Instance | None = None
    #: the connection was lost before any answer (not refused, not cut)
    lost: bool = False
    scope: anyio.CancelScope | None = None

    def cut(self, inst: Instance, reason: str) -> None:
        if self.failure is None:
            self.failure, self.failed = reason, inst
        if self.scope is not None:
            self.scope.cancel()


class InstancePool:
    """The instances, their health, their load, and the picks."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, probe_interval: float = 1.0,
                 probe_timeout: float = 3.0, probe_failures: int = 2, affinity_block_tokens: int = 16,
                 headers: dict[str, str] | None = None, state: ControlState | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one --prefill and one --decode instance")
        self.prefill = [Instance(u.rstrip("/"), "prefill", r) for r, u in enumerate(prefill)]
        self.decode = [Instance(u.rstrip("/"), "decode", r) for r, u in enumerate(decode)]
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.max_probe_failures = probe_failures
        self.headers = headers or {}
        self.affinity = PrefixAffinityRouter(len(self.prefill), affinity_block_tokens * BYTES_PER_TOKEN,
                                             slack_tokens=2048 * BYTES_PER_TOKEN)
        self.session: aiohttp.ClientSession | None = None
        #: the deployment's control state, given to an instance that comes up (``None``: none kept)
        self.state = state
        self.on_change: list[Any] = []  # callbacks (inst) on up/down
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode

    # -- health ------------------------------------------------------------

    async def probe(self, inst: Instance) -> None:
        """One ``/health`` look at ``inst`` (and its info when it comes up)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout)
        try:
            async with self.session.get(inst.url + "/health", timeout=timeout, headers=self.headers) as r:
                status = r.status
                body = await r.read()
        except (aiohttp.ClientConnectorError, ConnectionError) as exc:
            self.mark_down(inst, f"unreachable: {_one_line(exc)}")
            return
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            inst.probe_failures += 1
            if inst.probe_failures >= self.max_probe_failures:
                self.mark_down(inst, f"no /health answer ({inst.probe_failures} probes): {_one_line(exc) or 'timeout'}")
            return
        inst.probe_failures = 0
        data = _json(body)
        if isinstance(data.get("engines"), list):
            inst.engines = data["engines"]
        if status != 200:
            msg = ((data.get("error") or {}).get("message") if isinstance(data.get("error"), dict) else None)
            self.mark_down(inst, f"/health answered {status}" + (f": {msg}" if msg else ""))
            return
        pid = data.get("engine_pid")
        restarted = inst.engine_pid is not None and pid is not None and pid != inst.engine_pid
        if restarted:
            inst.restarts += 1
            if inst.role == "prefill":  # a new engine: an empty prefix cache
                self.affinity.replica_restarted(inst.rank)
            if inst.up:
                self.mark_down(inst, f"its engine restarted (pid {inst.engine_pid} -> {pid})")
            inst.engine_pid = pid  # counted once
        if inst.applying or (not inst.up and time.monotonic() < inst.retry_at and not restarted):
            return
        if not inst.up or inst.info is None and inst.splitwise:
            if not await self._read_info(inst):
                return
            inst.engine_pid = pid
            self._bring_up(inst, data)
        else:
            inst.engine_pid = pid

    def _bring_up(self, inst: Instance, health: dict[str, Any]) -> None:
        """Give ``inst`` the deployment's control state (:mod:`fdx.router.state`),
        then route to it; a failure keeps it down, the reason shown."""
        if self.state is None:
            self._mark_up(inst)
            return
        inst.applying = True
        task = asyncio.get_running_loop().create_task(self._apply_then_up(inst, health))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _apply_then_up(self, inst: Instance, health: dict[str, Any]) -> None:
        assert self.state is not None
        try:
            async with self.state.lock:  # no stateful control call in between
                inst.reason = APPLYING
                assert self.session is not None
                try:
                    failure = await self.state.apply(self.session, inst.url, f"{inst.role}{inst.rank}", health)
                except Exception as exc:  # noqa: BLE001 - shown in /health, tried again
                    log.exception("giving %s its control state failed", inst.url)
                    failure = f"could not give it the deployment's control state: {_one_line(exc)}"
                if failure is None and inst.reason == APPLYING:  # (not marked down meanwhile)
                    inst.control_state_error = None
                    self._mark_up(inst)
                    return
        finally:
            inst.applying = False
        if failure is not None:
            inst.retry_at = time.monotonic() + RETRY_S
            if failure != inst.control_state_error:
                log.error("%s instance %s stays out of rotation: %s", inst.role, inst.url, failure)
            inst.control_state_error = failure
            self.mark_down(inst, failure)

    async def _read_info(self, inst: Instance) -> bool:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout)
        try:
            async with self.session.get(inst.url + "/v1/splitwise/info", timeout=timeout,
                                        headers=self.headers) as r:
                status, body = r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            self.mark_down(inst, f"cannot read /v1/splitwise/info: {_one_line(exc) or 'timeout'}")
            return False
        if status == 404:
            if inst.splitwise or inst.info is None:
                log.warning("%s instance %s has no /v1/splitwise/info (not a splitwise instance): it serves "
                            "requests whole", inst.role, inst.url)
            inst.splitwise, inst.info, inst.misconfigured = False, None, None
            return True
        info = _json(body)
        if status != 200 or not isinstance(info.get("role"), str):
            self.mark_down(inst, f"/v1/splitwise/info answered {status}")
            return False
        if info["role"] != inst.role:
            inst.misconfigured = (f"it is a {info['role']} instance (its /v1/splitwise/info), given as "
                                  f"--{inst.role}")
            if inst.up or inst.reason != inst.misconfigured:
                log.error("%s: %s; not routing to it", inst.url, inst.misconfigured)
            self.mark_down(inst, inst.misconfigured)
            return False
        layout = info.get("kv_layout")
        others = {repr(sorted(i.info["kv_layout"].items())) for i in self.prefill + self.decode
                  if i is not inst and i.info and isinstance(i.info.get("kv_layout"), dict)}
        if isinstance(layout, dict) and others and repr(sorted(layout.items())) not in others:
            # P's KV blocks are written into D's pool byte for byte: the layouts must match
            inst.misconfigured = (f"its KV layout {layout} differs from the other instances' "
                                  f"({', '.join(sorted(others))}): P and D need the same block size and "
                                  "tensor-parallel size")
            if inst.up or inst.reason != inst.misconfigured:
                log.error("%s: %s; not routing to it", inst.url, inst.misconfigured)
            self.mark_down(inst, inst.misconfigured)
            return False
        inst.splitwise, inst.info, inst.misconfigured = True, info, None
        return True

    def _mark_up(self, inst: Instance) -> None:
        inst.up, inst.reason, inst.probe_failures = True, "", 0
        log.info("%s instance %s is up (%s)", inst.role, inst.url,
                 f"kv_connector {inst.info.get('kv_connector')}, kv_addr {inst.kv_addr}" if inst.info
                 else "not splitwise: serves requests whole")
        for cb in self.on_change:
            cb(inst)

    def mark_down(self, inst: Instance, reason: str) -> None:
        """``inst`` is down: stop routing to it and cut the flights that
        depend on it (its own requests; for a P, the handoffs not done)."""
        was_up = inst.up
        inst.up, inst.reason = False, reason
        if was_up:
            log.error("%s instance %s is down: %s", inst.role, inst.url, reason)
            for cb in self.on_change:
                cb(inst)
        for f in list(inst.flights):
            if f.target is inst or not f.handed_off:
                f.cut(inst, f"the {inst.role} instance {inst.url} is down: {reason}")

    def suspect(self, inst: Instance) -> None:
        """Probe ``inst`` now (a stream from it broke)."""
        task = asyncio.get_running_loop().create_task(self.probe(inst))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i) for i in self.instances), return_exceptions=True)

    async def probe_loop(self) -> None:
        while True:
            t0 = time.monotonic()
            await self.probe_all()
            await asyncio.sleep(max(0.05, self.probe_interval - (time.monotonic() - t0)))

    # -- picks ---------------------------------------------------------------

    def up(self, role: str) -> list[Instance]:
        return [i for i in (self.prefill if role == "prefill" else self.decode) if i.up]

    def pick_decode(self, exclude: set[Instance] = frozenset()) -> Instance | None:  # type: ignore[assignment]
        live = [i for i in self.decode if i.up and i not in exclude]
        if not live:
            return None
        return min(live, key=lambda i: (i.in_flight, i.given, i.rank))

    def pick_prefill(self, key: Sequence[int], *, splitwise: bool,
                     exclude: set[Instance] = frozenset()) -> tuple[Instance, Choice] | None:  # type: ignore[assignment]
        """The P for a prompt (``key``: its bytes or token ids); with
        ``splitwise``, only instances that take handoffs (a kv_addr)."""
        loads = {i.rank: self.prefill_load(i) for i in self.prefill
                 if i.up and i not in exclude and (not splitwise or (i.splitwise and i.kv_addr))}
        if not loads:
            return None
        choice = self.affinity.choose(key, loads)
        return self.prefill[choice.rank], choice

    @staticmethod
    def prefill_load(inst: Instance) -> int:
        return sum(f.weight for f in inst.flights if not f.handed_off or f.target is inst)

    def begin(self, flight: Flight) -> None:
        flight.target.flights.add(flight)
        flight.target.given += 1
        if flight.prefill is not None:
            flight.prefill.flights.add(flight)
            flight.prefill.given += 1

    def handed_off(self, flight: Flight) -> None:
        flight.handed_off = True
        if flight.prefill is not None:
            flight.prefill.flights.discard(flight)

    def end(self, flight: Flight) -> None:
        flight.target.flights.discard(flight)
        if flight.prefill is not None:
            flight.prefill.flights.discard(flight)
        flight.scope = None


def _json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
