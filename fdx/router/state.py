"""The deployment's control state, kept by ``fdx router`` and given to every
instance that comes (back) up.

An instance whose whole process died and was started again by the topology
(:mod:`fdx.router.topology`) has a new engine with nothing of its
predecessor's: it would serve unpaused, awake and on the served model's
weights even though the deployment was paused.  So the router keeps what
the deployment should be (:class:`DesiredState`: paused or not, the sleep
tags, the path and version of the last update_weights) and:

* **records** it from the control calls that succeeded on every instance
  that was up (:meth:`ControlState.record`; a partial failure changes
  nothing).  Until the first such call it is unknown and nothing is
  applied: the instances are taken as they are (a router that never saw
  the deployment paused does not resume it).  With ``--state-file`` (the
  topology gives its router one) it is written there on every change and
  read at start, so a restarted router keeps it;
* **applies** it (:meth:`ControlState.apply`) to an instance that comes up
  (a down -> up transition, or a new engine pid), before the router routes
  anything to it, in the order the engine's rules allow
  (:mod:`fdx.engine_control`: update_weights needs a paused, awake engine;
  sleep pauses; resume is refused while something sleeps): its weights
  first (wake the weights, pause, update_weights) unless its ``/health``
  already names that version, then the sleep tags (sleep the missing ones,
  wake the extra ones), then pause or resume; then it reads the
  instance's ``/v1/is_paused`` back and checks it.  A failure keeps the
  instance out of rotation, the reason in the router's ``/health``
  (``reason``, ``control_state_error``), and is tried again after
  :data:`RETRY_S`; a later control call through the router that changes
  the state is what the retry then applies.

Stateful calls and the applications hold one lock
(:attr:`ControlState.lock`), so an instance never comes up between a call's
fan-out and its recording with the state from before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Mapping

import aiohttp
import attrs

from fdx.engine_control import SLEEP_TAGS, STATEFUL
from fdx.server.control import MAX_TIMEOUT, TIMEOUTS

log = logging.getLogger("fdx.router")

#: seconds before an instance whose state could not be applied is tried again
RETRY_S = 5.0
#: seconds added to a method's timeout for its reply to arrive
MARGIN_S = 10.0


@attrs.frozen
class Weights:
    """The checkpoint of the last successful update_weights (``path`` as the
    client gave it: each instance resolves it in its ``--allowed-weights-dir``)."""

    path: str
    version: str


@attrs.frozen
class DesiredState:
    """What every instance of the deployment should be."""

    paused: bool = False
    sleeping: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    #: ``None``: the served model's own weights (no update_weights yet)
    weights: Weights | None = None

    def describe(self) -> dict[str, Any]:
        return {"is_paused": self.paused, "sleeping": sorted(self.sleeping),
                "weights": None if self.weights is None else attrs.asdict(self.weights)}

    def summary(self) -> str:
        parts = [("asleep (" + ",".join(sorted(self.sleeping)) + ")") if self.sleeping else
                 "paused" if self.paused else "serving"]
        if self.weights is not None:
            parts.append(f"weights {self.weights.version}")
        return ", ".join(parts)


def _tags(value: Any) -> list[str] | None:
    """``tags`` as the instances parse it (a comma-separated string or a
    list; vLLM's ``weights`` is ``weight``); ``None``: not given."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    out = ["weight" if str(t).strip() == "weights" else str(t).strip() for t in items]
    return [t for t in out if t]


def next_state(old: DesiredState, method: str, args: Mapping[str, Any], result: Mapping[str, Any]) -> DesiredState:
    """The state after control ``method`` (``args``: its query and body;
    ``result``: the merged reply) succeeded everywhere -- the engine's own
    rules (:class:`fdx.engine_control.ControlPlane`)."""
    if method == "pause":
        return attrs.evolve(old, paused=True)
    if method == "resume":
        return attrs.evolve(old, paused=False, sleeping=())
    if method == "sleep":
        tags = _tags(args.get("tags")) or list(SLEEP_TAGS)
        return attrs.evolve(old, paused=True, sleeping=old.sleeping | set(tags))
    if method == "wakeup":
        tags = _tags(args.get("tags"))
        left = old.sleeping - set(tags if tags is not None else old.sleeping)
        return attrs.evolve(old, sleeping=left, paused=old.paused if left else False)
    if method == "update_weights":
        path = result.get("path") if isinstance(result.get("path"), str) else args.get("path")
        version = result.get("version", args.get("version"))
        if not isinstance(path, str) or not path:
            return old
        return attrs.evolve(old, paused=True, weights=Weights(path, path if version in (None, "") else str(version)))
    return old


class ControlState:
    """The router's :class:`DesiredState` (``None`` until a stateful call
    succeeded), recorded from control calls and applied to instances."""

    def __init__(self, headers: dict[str, str] | None = None, path: str | None = None) -> None:
        #: the headers of the router's own control calls (the control key)
        self.headers = dict(headers or {})
        self.lock = asyncio.Lock()
        #: where it is kept (``--state-file``; ``None``: in memory only)
        self.path = path
        self.desired: DesiredState | None = self._load()

    def _load(self) -> DesiredState | None:
        if self.path is None or not os.path.exists(self.path):
            return None
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            w = data.get("weights")
            state = DesiredState(bool(data["is_paused"]), frozenset(str(t) for t in data.get("sleeping") or ()),
                                 None if not w else Weights(str(w["path"]), str(w["version"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error("cannot read the control state in %s (%s): starting without one", self.path, exc)
            return None
        log.info("the deployment's control state (from %s): %s", self.path, state.summary())
        return state

    def _save(self) -> None:
        if self.path is None or self.desired is None:
            return
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.desired.describe(), f)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("cannot write the control state to %s: %s", self.path, exc)

    @staticmethod
    def stateful(method: str) -> bool:
        return method in STATEFUL

    def record(self, method: str, args: Mapping[str, Any], result: Mapping[str, Any]) -> None:
        """Control ``method`` succeeded on every instance that was up."""
        if not self.stateful(method):
            return
        new = next_state(self.desired or DesiredState(), method, args, result)
        if new != self.desired:
            log.info("the deployment's control state is now: %s", new.summary())
            self.desired = new
            self._save()

    def describe(self) -> dict[str, Any] | None:
        return None if self.desired is None else self.desired.describe()

    # -- applying it to an instance ------------------------------------------

    async def apply(self, session: aiohttp.ClientSession, url: str, name: str,
                    health: Mapping[str, Any]) -> str | None:
        """Make the instance at ``url`` (``name``: how the log calls it)
        match the desired state (``health``: its ``/health`` just read).
        ``None`` when it does (or nothing is known yet), else why not."""
        want = self.desired
        if want is None:
            return None
        try:
            await self._apply(_Target(session, url), name, want, health)
        except _Failed as exc:
            return f"could not give it the deployment's control state ({want.summary()}): {exc}"
        return None

    async def _apply(self, inst: _Target, name: str, want: DesiredState, health: Mapping[str, Any]) -> None:
        now = await self._call(inst, "GET", "/v1/is_paused", "is_paused")
        paused, sleeping = bool(now.get("is_paused")), set(now.get("sleeping") or ())
        steps: list[str] = []
        if want.weights is not None and health.get("weights_version") != want.weights.version:
            if "weight" in sleeping:
                now = await self._call(inst, "POST", "/v1/wakeup", "wakeup", {"tags": ["weight"]})
                sleeping.discard("weight")
                paused = bool(now.get("is_paused"))
                steps.append("wakeup weight")
            if not paused:
                await self._call(inst, "POST", "/v1/pause", "pause")
                paused = True
                steps.append("pause")
            await self._call(inst, "POST", "/v1/update_weights", "update_weights",
                             {"path": want.weights.path, "version": want.weights.version})
            steps.append(f"update_weights {want.weights.version}")
        if want.sleeping - sleeping:
            await self._call(inst, "POST", "/v1/sleep", "sleep", {"tags": sorted(want.sleeping - sleeping)})
            paused = True
            steps.append("sleep " + ",".join(sorted(want.sleeping - sleeping)))
        if sleeping - want.sleeping:
            now = await self._call(inst, "POST", "/v1/wakeup", "wakeup", {"tags": sorted(sleeping - want.sleeping)})
            paused = bool(now.get("is_paused"))
            steps.append("wakeup " + ",".join(sorted(sleeping - want.sleeping)))
        if want.paused and not paused:
            await self._call(inst, "POST", "/v1/pause", "pause")
            steps.append("pause")
        elif not want.paused and paused:
            await self._call(inst, "POST", "/v1/resume", "resume")
            steps.append("resume")
        got = await self._call(inst, "GET", "/v1/is_paused", "is_paused")
        is_paused, asleep = bool(got.get("is_paused")), sorted(got.get("sleeping") or ())
        if is_paused != want.paused or set(asleep) != set(want.sleeping):
            raise _Failed(f"it reports is_paused={is_paused} sleeping={asleep} after the calls")
        if steps:
            log.warning("%s (%s) came up: gave it the deployment's control state (%s): %s", name, inst.url,
                        want.summary(), ", ".join(steps))

    async def _call(self, inst: _Target, verb: str, path: str, method: str,
                    body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One control call to ``inst``; its ``result``, or :class:`_Failed`."""
        timeout = aiohttp.ClientTimeout(total=min(TIMEOUTS.get(method, 60.0), MAX_TIMEOUT) + MARGIN_S)
        headers = {**self.headers, **({"content-type": "application/json"} if body is not None else {})}
        try:
            async with inst.session.request(verb, inst.url + path, headers=headers, timeout=timeout,
                                            data=json.dumps(body) if body is not None else None) as r:
                status, raw = r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _Failed(f"{method}: {' '.join(str(exc).split()) or type(exc).__name__}") from None
        try:
            reply = json.loads(raw) if raw.strip() else {}
        except ValueError:
            reply = {}
        if status != 200:
            msg = reply.get("message") if isinstance(reply, dict) else None
            raise _Failed(f"{method} answered {status}" + (f": {msg}" if msg else ""))
        res = reply.get("result") if isinstance(reply, dict) else None
        return res if isinstance(res, dict) else {}


@attrs.frozen
class _Target:
    session: aiohttp.ClientSession
    url: str


class _Failed(Exception):
    pass


__all__ = ["ControlState", "DesiredState", "RETRY_S", "Weights", "next_state"]
