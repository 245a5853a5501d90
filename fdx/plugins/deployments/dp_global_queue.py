"""The dp global queue across machines: ``--dp-backend redis`` (FastDeploy's global scheduler).

Every node runs ``fdx serve --scheduler dp --dp-backend redis --redis-url
redis://HOST:PORT`` (N local replicas allowed).  In each API process a
:class:`GlobalQueueClient` wraps the node's :class:`~fdx.plugins.deployments.dp_replicas.ReplicaSet`
and offers the same surface to the app, playing two parts:

* **origin** (the API holding the client connection): every accepted
  engine request goes into Redis (:data:`ENQUEUE`, which puts it on the
  queue of the instance holding its prompt prefix, unless much busier,
  else of the least-loaded one) and waits there; its outputs come back on
  this origin's output list, one ``RPUSH`` per step batch, and go to the
  request's sink;
* **instance** (the node's replicas as one worker): it registers itself,
  heartbeats (a key with a TTL) and publishes its load in a ZSET; while it
  holds fewer than ``--dp-capacity`` requests it pulls from its own queue,
  and steals from the busiest queue when its own is empty (:data:`PICK`,
  one atomic Lua script: a request is taken by exactly one instance); it
  runs them on its replicas and pushes their outputs to each origin's list
  (outputs of its own requests go straight to the sink, no Redis).

Invariants:

* each handle gets exactly one terminal item: outputs carry the request's
  key, which names one attempt; outputs of an older attempt are dropped;
* each pick is a lease with a fencing token, renewed by the owner every
  heartbeat (:data:`RENEW`); an owner silent past ``--heartbeat-timeout``
  loses it: the origin reclaims the request (:data:`RECLAIM`) and queues
  it again, once (a new attempt); the stale owner's renewal then reports
  the loss (it aborts the request) and its pushes are fenced
  (:data:`PUSH`), so its late outputs never reach the client;
* a request whose lease was lost or whose replica failed is queued again
  from the start when none of its tokens reached the sink, else as its
  continuation (prompt + the tokens streamed) where :func:`continuable`,
  else it ends with a 503 error event;
* control calls (pause, ...) act on every node, through the nodes' ``ctl``
  lists, each answering on the call's reply list within the call's timeout;
  one that changes state and succeeds everywhere is recorded as the
  cluster's desired state (``P:state``, with a revision: :data:`RECORD`); a
  node that starts, restarts or missed the call applies the newest revision
  before it takes work (:meth:`GlobalQueueClient._sync_state`); a node runs
  the calls that change state, and that applying, one at a time, and never
  applies a revision older than a call it ran (:meth:`_call_local`);
* a request nobody picks up within ``--dp-request-ttl`` seconds ends with
  a 503 saying so (the origin's timer; the pick script also drops expired
  entries), so nothing stays queued forever;
* Redis unreachable: new requests get a 503 naming Redis; requests running
  on this node finish (their outputs need no Redis); outputs of requests of
  other nodes are kept and pushed when Redis answers again (for at most
  :data:`OUTAGE_S`); requests queued in a Redis that lost its data are
  queued again; everything resumes without a restart.

Redis keys (``P`` = ``fdx:<--dp-cluster>``): see docs/DP.md.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Iterable

import attrs

from fdx.config import EngineConfig
from fdx.core.errors import RequestError
from fdx.core.messages import AbortRequest, AddRequest, OutputBatch, RequestOutput, SamplingParams, decode, encode
from fdx.deploy.engine_client import wire_error
from fdx.deploy.frontend import ControlCallError, EngineUnavailable, RequestHandle, Sink
from fdx.deploy.affinity import prefix_hashes
from fdx.plugins.deployments.dp_replicas import merge_replies, spawn_tracked

log = logging.getLogger("fdx.server")

#: the queue of requests no live instance was there to take (any instance steals from it)
ANY = "_any"
#: how long a remote request's outputs are kept (worker) or waited for (origin) while Redis is away
OUTAGE_S = 30.0
PICK_BATCH = 8
WAKE_WAIT_S = 0.25
#: outputs this instance pushed are kept this long, to push again if Redis
#: restarted empty before their origin read them (the origin drops what it has)
REPLAY_S = 10.0
#: a picked request's hash lives at most this long (the origin deletes it when the request ends)
PICKED_TTL_MS = 3_600_000
#: a queued request younger than this is left to its instance (no stealing yet)
STEAL_AFTER_MS = 100
#: prefix affinity across instances: the instance given a prompt's prefix
#: keeps getting it unless its load ((held + queued) / capacity) exceeds
#: the least load by more than this
AFFINITY_SLACK = 1.0
#: prompt prefix blocks hashed for the cross-instance affinity
AFFINITY_BLOCKS = 64

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

#: ARGV: prefix, key, origin, AddRequest bytes, ttl_ms, slack, prefix hashes
#: (shortest first).  Puts the request on the queue of the live instance
#: that was given its longest recorded prompt prefix (``P:prefix:<hash>``),
#: unless that one's load exceeds the least load by more than ``slack``;
#: else on the least-loaded live instance's (load: (held + queued) /
#: capacity; ties: the origin itself); on ``_any`` when none serves.
#: Records the prefix hashes -> target.  Returns the target, or false when
#: the key exists (a duplicate request id).
ENQUEUE = _NOW + """
local P, key, origin, blob, ttl, slack = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local hk = P .. ':req:' .. key
if redis.call('EXISTS', hk) == 1 then return false end
local best, bestload = nil, nil
local loads = {}
local m = redis.call('ZRANGE', P .. ':instances', 0, -1, 'WITHSCORES')
for i = 1, #m, 2 do
  local id = m[i]
  local cap = tonumber(redis.call('HGET', P .. ':capacity', id) or '0')
  if cap > 0 and redis.call('EXISTS', P .. ':instance:' .. id) == 1 then
    local load = (tonumber(m[i + 1]) + redis.call('LLEN', P .. ':queue:' .. id)) / cap
    loads[id] = load
    if best == nil or load < bestload or (load == bestload and id == origin) then best, bestload = id, load end
  end
end
local target = best or '""" + ANY + """'
if best then
  for i = #ARGV, 7, -1 do
    local inst = redis.call('GET', P .. ':prefix:' .. ARGV[i])
    if inst and loads[inst] ~= nil then
      if loads[inst] - bestload <= slack then target = inst end
      break
    end
  end
  for i = 7, #ARGV do redis.call('SET', P .. ':prefix:' .. ARGV[i], target, 'PX', 600000) end
end
redis.call('HSET', hk, 'add', blob, 'origin', origin, 'deadline', now + ttl, 'enq', now)
redis.call('PEXPIRE', hk, ttl + 60000)
redis.call('RPUSH', P .. ':queue:' .. target, key)
redis.call('PEXPIRE', P .. ':queue:' .. target, ttl + 60000)
if best then
  local wk = P .. ':wake:' .. target
  redis.call('RPUSH', wk, '1'); redis.call('LTRIM', wk, -4, -1); redis.call('PEXPIRE', wk, 60000)
end
return target
"""

#: ARGV: prefix, me, n, picked_ttl_ms, steal_after_ms, lease_ms.  Takes up to n
#: requests from my queue; when it is empty, steals from the longest other
#: queue (``_any`` included; at most half of another instance's queue; only
#: entries queued at least ``steal_after_ms`` ago, so that an instance about
#: to take its own fresh work keeps it, and its prefix cache).  Entries whose hash
#: is gone (aborted, lost) are skipped, expired ones dropped.  Marks each
#: taken request's hash ``owner = me``, ``fence`` = a new fencing token (one
#: counter for the cluster: every lease's token is greater than every older
#: one's) and ``lease`` = now + lease_ms, and adds it to my processing set.
#: Returns a flat list: the epoch of Redis's data (set here when missing),
#: then key, origin, AddRequest bytes, fence, ...
PICK = _NOW + """
local P, me, n, keep, age, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6])
local epoch = redis.call('GET', P .. ':epoch')
if not epoch then epoch = 'lua-' .. now .. '-' .. me; redis.call('SET', P .. ':epoch', epoch) end
local out = {epoch}
local function take(q, limit, min_age)
  local got = 0
  while got < limit do
    local key = redis.call('LPOP', q)
    if not key then return end
    local hk = P .. ':req:' .. key
    local f = redis.call('HMGET', hk, 'add', 'origin', 'deadline', 'enq')
    if f[1] and min_age > 0 and now - tonumber(f[4] or '0') < min_age then
      redis.call('LPUSH', q, key)  -- too fresh to steal: its instance takes it
      return
    end
    if f[1] then
      if tonumber(f[3]) < now then
        redis.call('DEL', hk)
      else
        local fence = redis.call('INCR', P .. ':fence')
        redis.call('HSET', hk, 'owner', me, 'fence', fence, 'lease', now + lease)
        redis.call('PEXPIRE', hk, keep)
        redis.call('SADD', P .. ':processing:' .. me, key)
        table.insert(out, key); table.insert(out, f[2]); table.insert(out, f[1]); table.insert(out, fence)
        got = got + 1
      end
    end
  end
end
take(P .. ':queue:' .. me, n, 0)
if #out == 1 then
  local best, bestlen = nil, 0
  local cands = redis.call('ZRANGE', P .. ':instances', 0, -1)
  table.insert(cands, '""" + ANY + """')
  for _, id in ipairs(cands) do
    if id ~= me then
      local l = redis.call('LLEN', P .. ':queue:' .. id)
      if l > bestlen then best, bestlen = id, l end
    end
  end
  if best then
    local limit = n
    if best ~= '""" + ANY + """' then limit = math.min(n, math.max(1, math.floor(bestlen / 2))) end
    take(P .. ':queue:' .. best, limit, age)
  end
end
return out
"""

#: ARGV: prefix, id, force.  Takes instance ``id`` out of the load ZSET and
#: moves its queue to ``_any``: when forced (it pauses or stops) or when
#: its heartbeat key has expired (it died).  Without an id: every dead
#: instance in the ZSET.  Returns how many queued requests moved.
RELEASE = """
local P, only, force = ARGV[1], ARGV[2], ARGV[3] == '1'
local ids = {}
if only ~= '' then ids = {only} else ids = redis.call('ZRANGE', P .. ':instances', 0, -1) end
local moved = 0
for _, id in ipairs(ids) do
  if force or redis.call('EXISTS', P .. ':instance:' .. id) == 0 then
    redis.call('ZREM', P .. ':instances', id)
    redis.call('HDEL', P .. ':capacity', id)
    while redis.call('LMOVE', P .. ':queue:' .. id, P .. ':queue:""" + ANY + """', 'LEFT', 'RIGHT') do
      moved = moved + 1
    end
    if not force then redis.call('DEL', P .. ':processing:' .. id) end
  end
end
return moved
"""

#: ARGV: prefix, key, AbortRequest bytes, known owner ('' if none).  Deletes
#: the request (a queued entry is then skipped by PICK) and, when an
#: instance holds it, sends it the abort.  Returns the owner or false.
ABORT = """
local P, key, blob, known = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local hk = P .. ':req:' .. key
local owner = redis.call('HGET', hk, 'owner') or known
redis.call('DEL', hk)
if owner and owner ~= '' then
  redis.call('RPUSH', P .. ':ctl:' .. owner, blob); redis.call('PEXPIRE', P .. ':ctl:' .. owner, 60000)
  redis.call('RPUSH', P .. ':wake:' .. owner, '1'); redis.call('LTRIM', P .. ':wake:' .. owner, -4, -1)
  return owner
end
return false
"""

#: The fence check of one held request (key, fence, epoch at the pick):
#: ``true`` while its hash says this instance (``me``) holds it with this
#: fence; when the hash is gone and Redis's data is not the one of the pick
#: (it restarted empty), the hash is written again as held by ``me`` (the
#: origin waits a lease for that before it queues the request again); else
#: ``false``: the lease was lost (reclaimed, aborted or ended by the origin).
_HOLDS = """
local function holds(P, me, key, fence, ep, origin, epoch, lease_end)
  local hk = P .. ':req:' .. key
  local f = redis.call('HMGET', hk, 'owner', 'fence')
  if f[1] == me and f[2] == fence then return true end
  if redis.call('EXISTS', hk) == 0 and epoch ~= ep then
    redis.call('HSET', hk, 'origin', origin, 'owner', me, 'fence', fence, 'lease', lease_end)
    redis.call('PEXPIRE', hk, 60000)
    return true
  end
  return false
end
"""

#: ARGV: prefix, me, lease_ms, picked_ttl_ms, then key, fence, epoch,
#: origin for each request this instance holds.  Each heartbeat (and
#: before a picked batch is admitted): extends the lease of each request
#: still held (see ``_HOLDS``).  Returns the keys whose lease was lost: the
#: instance aborts them at once, and their outputs are never pushed.
RENEW = _NOW + _HOLDS + """
local P, me, lease, keep = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local epoch = redis.call('GET', P .. ':epoch')
local lost = {}
for i = 5, #ARGV, 4 do
  if holds(P, me, ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], epoch, now + lease) then
    local hk = P .. ':req:' .. ARGV[i]
    redis.call('HSET', hk, 'lease', now + lease); redis.call('PEXPIRE', hk, keep)
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

#: ARGV: prefix, me, out list, lease_ms, number of requests k, then k x (key, fence,
#: epoch, origin), then the output entries.  The fenced push: when every
#: request of the entries is still held by ``me`` (``_HOLDS``), RPUSHes the
#: entries and returns an empty list; else pushes nothing and returns the
#: keys no longer held (the instance drops their outputs and pushes the rest).
PUSH = _NOW + _HOLDS + """
local P, me, out, lease, k = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local epoch = redis.call('GET', P .. ':epoch')
local stale = {}
for i = 6, 5 + 4 * k, 4 do
  if not holds(P, me, ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], epoch, now + lease) then
    table.insert(stale, ARGV[i])
  end
end
if #stale > 0 then return stale end
redis.call('RPUSH', out, unpack(ARGV, 6 + 4 * k))
redis.call('PEXPIRE', out, 120000)
return stale
"""

#: ARGV: prefix, keys.  The origin's view of its requests, two items per
#: key: ``held, owner`` while an instance's lease on it runs, ``missing, ''``
#: when its hash is gone, ``queued, ''`` when nobody took it; when the lease
#: has run out the hash is deleted (the lease and its fence are void: the old
#: owner's renewal and pushes fail) and it gives ``reclaimed, owner``: the
#: origin queues the request again, once.
RECLAIM = _NOW + """
local res = {}
for i = 2, #ARGV do
  local hk = ARGV[1] .. ':req:' .. ARGV[i]
  local f = redis.call('HMGET', hk, 'owner', 'lease', 'origin')
  if not f[3] then table.insert(res, 'missing'); table.insert(res, '')
  elseif not f[1] then table.insert(res, 'queued'); table.insert(res, '')
  elseif tonumber(f[2] or '0') >= now then table.insert(res, 'held'); table.insert(res, f[1])
  else redis.call('DEL', hk); table.insert(res, 'reclaimed'); table.insert(res, f[1]) end
end
return res
"""

#: ARGV: prefix, key.  The TTL ran out at the origin: delete the request if
#: no instance took it.  Returns the owner (then it runs) or false (deleted).
EXPIRE = """
local hk = ARGV[1] .. ':req:' .. ARGV[2]
local owner = redis.call('HGET', hk, 'owner')
if owner then return owner end
redis.call('DEL', hk)
return false
"""


#: ARGV: prefix, the caller's newest known revision, the changed fields
#: (JSON).  Merges them into the cluster's desired state ``P:state`` and
#: gives it a new revision, greater than both the stored one and the
#: caller's (a Redis that lost its data does not restart the count below
#: what the nodes applied).  Returns the new revision.
RECORD = """
local k = ARGV[1] .. ':state'
local cur = redis.call('GET', k)
local s = {}
if cur then s = cjson.decode(cur) end
for f, v in pairs(cjson.decode(ARGV[3])) do s[f] = v end
s['rev'] = math.max(tonumber(s['rev'] or 0), tonumber(ARGV[2])) + 1
redis.call('SET', k, cjson.encode(s))
return s['rev']
"""

#: the control calls that change a node's state, recorded in ``P:state``
STATEFUL = frozenset({"pause", "resume", "sleep", "wakeup", "update_weights"})
#: how long applying the cluster's state may take, each control call
STATE_CALL_S = 300.0


def state_fields(method: str, args: dict[str, Any], merged: Any) -> dict[str, Any]:
    """The fields of the cluster's desired state that a successful control
    call changed (from its merged reply: sleep pauses, wakeup resumes once
    nothing is left asleep)."""
    rep = merged if isinstance(merged, dict) else {}
    if method in ("pause", "resume"):
        return {"paused": method == "pause"}
    if method == "sleep":
        return {"paused": True, "sleeping": sorted(rep.get("sleeping") or ())}
    if method == "wakeup":
        return {"paused": bool(rep.get("is_paused")), "sleeping": sorted(rep.get("sleeping") or ())}
    if method == "update_weights":
        return {"weights": {"path": args.get("path"), "version": args.get("version")}}
    return {}


def state_steps(want: dict[str, Any], paused: bool, sleeping: Iterable[str],
                version: str | None) -> list[tuple[str, dict[str, Any]]]:
    """The local control calls that bring a node (``paused``, ``sleeping``
    tags, weights ``version``) to the desired state ``want``, in order:
    weights first (paused and awake), then sleep, then pause or resume."""
    steps: list[tuple[str, dict[str, Any]]] = []
    asleep = set(sleeping)
    weights = want.get("weights") or {}
    if weights.get("path") and str(weights.get("version")) != str(version):
        if asleep:  # wakeup resumes too
            steps.append(("wakeup", {}))
            asleep, paused = set(), False
        if not paused:
            steps.append(("pause", {}))
            paused = True
        steps.append(("update_weights", {"path": weights["path"], "version": weights.get("version")}))
    target = set(want.get("sleeping") or ())  # cjson writes an empty list as {}
    if target - asleep:
        steps.append(("sleep", {"tags": sorted(target - asleep)}))
        paused = True
    elif asleep and not target:
        steps.append(("wakeup", {}))
        paused = False
    if bool(want.get("paused")) != paused and not target:
        steps.append(("pause" if want.get("paused") else "resume", {}))
    return steps


@attrs.define(eq=False)
class Remote:
    """One engine request of this origin, somewhere in the cluster."""

    handle: RequestHandle
    add: AddRequest  # with request_id = the current attempt's key
    deadline: float  # time.monotonic() by which an instance must have taken it
    attempt: int = 0
    owner: str | None = None  # the instance that took the current attempt
    enqueued: bool = False  # the current attempt is in Redis
    delivered: bool = False  # a token of it reached the sink
    owner_missing_since: float | None = None  # the request's hash was first seen missing then
    sending: bool = False  # an ENQUEUE of the current attempt is under way
    prefix_hashes: tuple[str, ...] = ()  # the prompt's prefix chain hashes (cross-instance affinity)
    done: bool = False
    tokens_seen: int = 0  # output tokens that reached the sink (all attempts)
    output_ids: list[int] = attrs.field(factory=list)  # those tokens (a continuation's prompt ends with them)
    base: int = 0  # output tokens of earlier attempts: the current one continues after them

    @property
    def key(self) -> str:
        return self.add.request_id


@attrs.define(eq=False)
class Work:
    """One request this instance took from the queue."""

    key: str
    origin: str
    fence: str = ""  # the lease's fencing token (PICK)
    epoch: str = ""  # the Redis data's incarnation at the pick
    handle: RequestHandle | None = None

    @property
    def lease(self) -> tuple[str, str, str, str]:
        """The fence check's arguments (``_HOLDS``)."""
        return (self.key, self.fence, self.epoch, self.origin)


#: an output batch an instance keeps for its origin: (time.monotonic(), the
#: ``Work.lease`` of each request in it, the outputs)
Entry = tuple[float, tuple[tuple[str, str, str, str], ...], tuple[RequestOutput, ...]]


#: the head of a control call sent to another node's ``ctl`` list (JSON follows)
CONTROL_TAG = b"control\n"


def merge_node_replies(method: str, replies: dict[str, dict[str, Any]]) -> Any:
    """One reply from the nodes' (instance id -> ``ok``, ``result`` |
    ``error``, ``code``): merged as the replicas' are, each listed under
    ``nodes``; any failed node fails the call (a :class:`ControlCallError`
    with its code, naming every failed node and those that succeeded)."""
    ok = {i: rep["result"] for i, rep in replies.items() if rep.get("ok")}
    bad = {i: rep for i, rep in replies.items() if not rep.get("ok")}
    if bad:
        worst = max(int(rep.get("code") or 500) for rep in bad.values())
        raise ControlCallError("; ".join(f"dp node {i}: {rep.get('error')}" for i, rep in sorted(bad.items()))
                               + f" (succeeded on: {', '.join(sorted(ok)) or 'none'})", worst)
    ids = list(replies)
    merged = merge_replies(method, {n: ok[i] for n, i in enumerate(ids)})
    if isinstance(merged, dict):
        merged = {k: v for k, v in merged.items() if k != "replicas"}
        merged["nodes"] = [{"instance": i, **(ok[i] if isinstance(ok[i], dict) else {"result": ok[i]})}
                           for i in ids]
    return merged


def continuable(p: SamplingParams, done: int) -> bool:
    """Whether a request that streamed ``done`` tokens can go on elsewhere
    as a new request (its prompt plus those tokens, for the tokens left)
    sampling as it would have: no seed (a seeded stream would restart), no
    penalties over the output so far, no beam search, grammar or prompt
    logprobs (their state is not carried over), and tokens left to make."""
    return (p.seed is None and not p.presence_penalty and not p.frequency_penalty and p.repetition_penalty == 1.0
            and not p.beam_width and p.structured is None and p.prompt_logprobs is None and done < p.max_tokens)


def _is_connection_error(exc: BaseException) -> bool:
    import redis.exceptions

    return isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError))


def request_key(request_id: str, attempt: int) -> str:
    """The Redis key of an attempt (the id the running engine sees)."""
    return request_id if attempt == 0 else f"{request_id}#retry{attempt}"


def instance_id(config: EngineConfig) -> str:
    """This API process's instance id: ``--dp-instance-name`` (default
    ``HOST:PORT``) plus an incarnation suffix, so that a restarted node is
    a new instance (the old one's requests are not believed held)."""
    name = config.dp_instance_name or f"{socket.gethostname()}:{config.port}"
    return f"{name}~{uuid.uuid4().hex[:8]}"


class QueueCollector:
    """``/metrics`` of the global queue, on the node's registry:
    ``fdx:dp_global_queue_up``, this API's requests by where they are
    (``queued``, ``here``: run by this node, ``remote``), the requests this
    instance holds for any origin, and counters of re-queued requests,
    requests ended by an instance failure, TTL expiries and leases."""

    def __init__(self, q: GlobalQueueClient, model: str) -> None:
        self.q = q
        self.model = model

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        q, lab = self.q, ["model_name"]
        up = GaugeMetricFamily("fdx:dp_global_queue_up", "1 while the dp global queue's Redis answers.", labels=lab)
        up.add_metric([self.model], 0.0 if q.redis_error else 1.0)
        yield up
        where = GaugeMetricFamily("fdx:dp_global_queue_requests", "This API's engine requests by where they are: "
                                  "queued in Redis, run here, or run by another instance.", labels=lab + ["where"])
        counts = {"queued": 0, "here": 0, "remote": 0}
        for r in q.pending.values():
            counts["queued" if r.owner is None else "here" if r.owner == q.id else "remote"] += 1
        for k, v in counts.items():
            where.add_metric([self.model, k], float(v))
        yield where
        held = GaugeMetricFamily("fdx:dp_global_queue_held", "Requests this instance took from the queue (any "
                                 "origin) and still runs.", labels=lab)
        held.add_metric([self.model], float(len(q.work)))
        yield held
        for name, doc, value in (
                ("requeued", "Requests queued again (their instance or replica failed before a token).", q.requeued),
                ("instance_failures", "Requests ended with an error event because their instance or replica "
                                      "failed after streaming.", q.instance_failures),
                ("ttl_expired", "Requests no instance picked up within --dp-request-ttl.", q.ttl_expired),
                ("leases_reclaimed", "This API's requests whose instance's lease ran out (silent past "
                                     "--heartbeat-timeout), queued again.", q.leases_reclaimed),
                ("leases_lost", "Requests this instance aborted because it lost their lease.", q.leases_lost),
                ("stale_outputs_dropped", "Outputs this instance dropped, not pushed: their lease was lost.",
                 q.stale_dropped)):
            c = CounterMetricFamily(f"fdx:dp_global_queue_{name}", doc, labels=lab)
            c.add_metric([self.model], float(value))
            yield c


class GlobalQueueClient:
    """``EngineClient``'s surface over the Redis global queue and this
    node's replicas (see the module doc)."""

    def __init__(self, config: EngineConfig, replicas: Any) -> None:
        import redis.asyncio as aioredis
        from redis.backoff import NoBackoff
        from redis.asyncio.retry import Retry  # the asyncio client's own (a sync one is converted, with a warning)

        self.config = config
        self.replicas = replicas
        self.id = instance_id(config)
        self.prefix = f"fdx:{config.dp_cluster}"
        self.capacity = (config.dp_capacity if config.dp_capacity is not None
                         else config.max_num_seqs * config.data_parallel_size)
        self.ttl = config.dp_request_ttl
        factory = aioredis.Redis.from_url
        common = dict(socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 1), health_check_interval=5)
        self.r = factory(config.redis_url, socket_timeout=2.0, **common)
        # blocking reads each on their own connection
        self.r_out = factory(config.redis_url, socket_timeout=WAKE_WAIT_S + 3.0, **common)
        self.r_wake = factory(config.redis_url, socket_timeout=WAKE_WAIT_S + 3.0, **common)
        self._enqueue = self.r.register_script(ENQUEUE)
        self._pick = self.r.register_script(PICK)
        self._release = self.r.register_script(RELEASE)
        self._abort = self.r.register_script(ABORT)
        self._expire = self.r.register_script(EXPIRE)
        self._renew = self.r.register_script(RENEW)
        self._push = self.r.register_script(PUSH)
        self._reclaim = self.r.register_script(RECLAIM)
        self._record = self.r.register_script(RECORD)
        self.state_rev = 0  # the newest revision of the cluster's state applied here
        self.state_error: str | None = None  # applying it failed (in /health)
        self._state_known = False  # read at least once since the start: no work before
        self._state_task: asyncio.Task[Any] | None = None
        self._state_lock = asyncio.Lock()  # stateful control calls and applying the state: one at a time
        self.lease_ms = int(config.heartbeat_timeout * 1000)
        self.redis_error: str | None = "not connected yet"
        self._down_since: float | None = time.monotonic()
        self.pending: dict[str, Remote] = {}  # by the API's request id
        self.by_key: dict[str, Remote] = {}
        self.work: dict[str, Work] = {}
        self._wsink = Sink()
        # origin -> output batches waiting for Redis: (when, the leases of their requests, the outputs)
        self._unsent: dict[str, list[Entry]] = {}
        self._sent: dict[str, collections.deque[Entry]] = {}  # origin -> pushed in the last REPLAY_S
        self._epoch: bytes | None = None  # the Redis data's incarnation (a key that a restart without data loses)
        self._epoch_unsure = True  # connections were reset since the epoch was last read
        self._flush_lock = asyncio.Lock()  # one push at a time: outputs stay in order
        self._ended: list[str] = []  # origin: keys of ended requests, their hashes to delete
        self._finished: list[str] = []  # instance: keys of picked requests that ended, to drop from processing
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.on_failure = replicas.on_failure
        self.on_ready = replicas.on_ready
        self.requeued = self.instance_failures = self.ttl_expired = self.leases_lost = self.stale_dropped = 0
        self.leases_reclaimed = 0
        registry = getattr(replicas.metrics, "registry", None)
        if registry is not None:
            registry.register(QueueCollector(self, config.model_name))

    # -- the EngineClient surface (the rest is the replicas') ----------------

    def __getattr__(self, name: str) -> Any:
        return getattr(self.replicas, name)

    @property
    def metrics(self) -> Any:
        return self.replicas.metrics

    @metrics.setter
    def metrics(self, m: Any) -> None:
        self.replicas.metrics = m

    @property
    def alive(self) -> bool:
        return bool(self.replicas.alive)

    async def start(self) -> None:
        await self.replicas.start()
        loop = asyncio.get_running_loop()
        for coro in (self._heartbeat_loop(), self._output_loop(), self._worker_loop(), self._forward_loop(),
                     self._reconcile_loop()):
            t = loop.create_task(coro)
            self._tasks.add(t)

    async def close(self, shutdown_engine: bool = True, reason: str = "server shutting down") -> None:
        if self._closed:
            return
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_remote(f"request aborted: {reason}")
        try:  # leave the cluster at once: our queue to the others, our key gone
            await asyncio.wait_for(self._leave(), 2.0)
        except Exception:  # noqa: BLE001 - Redis away: the key expires by itself
            pass
        await self.replicas.close(shutdown_engine, reason)
        for c in (self.r, self.r_out, self.r_wake):
            try:
                await c.aclose()
            except Exception:  # noqa: BLE001
                pass

    async def _leave(self) -> None:
        await self._release(args=[self.prefix, self.id, "1"])
        await self.r.delete(self._k("instance", self.id))

    def unavailable_reason(self) -> str | None:
        reason = self.replicas.unavailable_reason()
        if reason is not None:
            return reason
        if self.state_error is not None:
            return self.state_error
        if self.redis_error is not None:
            return (f"the dp global queue is unavailable: Redis at {self.config.redis_url} does not answer "
                    f"({self.redis_error}); new requests are refused until it is back")
        return None

    def check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(reason)

    @property
    def num_live(self) -> int:
        return len(self.pending)

    def live_requests(self) -> dict[str, RequestHandle]:
        return {rid: r.handle for rid, r in self.pending.items()}

    @property
    def _live(self) -> dict[str, RequestHandle]:  # read by fdx.deploy.request_ids
        return self.live_requests()

    def num_waiting(self) -> int:
        return sum(1 for r in self.pending.values() if r.handle.first_token_time is None)

    def submit(self, request_id: str, prompt_token_ids: Iterable[int], params: SamplingParams, arrival: float,
               sink: Sink | None = None, tag: Any = None, trace_context: str = "") -> RequestHandle:
        self.check_available()
        if self._closed:
            raise EngineUnavailable("server shutting down")
        if request_id in self.pending:
            raise RequestError(f"duplicate request id {request_id!r}", 400, param="request_id")
        ids = tuple(prompt_token_ids)
        add = AddRequest(request_id, ids, params, arrival, trace_context=trace_context)
        try:
            encode(add)
        except Exception:  # noqa: BLE001 - a value msgpack cannot carry
            raise wire_error(add) from None
        h = RequestHandle(request_id, len(ids), params, arrival, sink if sink is not None else Sink(), tag,
                          prompt=ids, trace_context=trace_context)
        r = Remote(h, add, time.monotonic() + self.ttl,
                   prefix_hashes=tuple(f"{x & 0xFFFFFFFFFFFFFFFF:016x}"
                                       for x in prefix_hashes(ids, self.config.block_size, AFFINITY_BLOCKS)))
        self.pending[request_id] = r
        self.by_key[r.key] = r
        self._spawn(self._send(r))
        return h

    def finish(self, handle: RequestHandle, reason: str = "stop") -> None:
        self._drop([handle], "stop string")

    def abort(self, handles: Iterable[RequestHandle], reason: str = "client disconnected") -> None:
        self._drop(handles, reason)

    def fail_pending(self, message: str) -> None:
        self._fail_remote(message)
        self.replicas.fail_pending(message)

    async def call(self, method: str, args: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        """Control methods act on every node of the cluster (every instance
        whose heartbeat key is live), each on all its replicas: this node's
        at once, the others' through their ``ctl`` lists, each answering on
        the call's reply list.  The reply merges them (as the replicas'
        replies are merged) and lists each node under ``nodes``.  A node that
        fails, or does not answer within ``timeout``, fails the call with its
        code (504 for the timeout), the message naming it and the nodes that
        did succeed (they keep their new state: retry the call).  A paused
        node takes no work from the queue (it leaves the load ZSET).
        ``abort_requests`` aborts this API's requests, wherever in the
        cluster they run."""
        if method == "abort_requests":
            self.check_available()
            return self._abort_requests(args or {})
        peers: list[str] = []
        call_id = uuid.uuid4().hex
        unreached = self.redis_error
        if unreached is None:
            try:
                peers = await self._send_control(call_id, method, args or {}, timeout)
            except Exception as exc:  # noqa: BLE001 - reported below, never hidden
                self._redis_failed(exc)
                unreached = str(exc) or type(exc).__name__
        local, remote = await asyncio.gather(self._call_local(method, args, timeout),
                                             self._control_replies(call_id, peers, timeout), return_exceptions=True)
        if isinstance(remote, BaseException):
            remote = {p: {"ok": False, "code": 503, "error": f"its reply was lost: {remote}"} for p in peers}
        if unreached is not None:  # the call ran here only
            remote = {"(the other nodes)": {"ok": False, "code": 503, "error": (
                f"not reached: Redis at {self.config.redis_url} does not answer ({unreached})")}}
        elif isinstance(local, BaseException) and not peers:
            raise local
        replies = {self.id: ({"ok": True, "result": local} if not isinstance(local, BaseException) else
                             {"ok": False, "code": getattr(local, "code", 500), "error": str(local)}), **remote}
        merged = merge_node_replies(method, replies)
        if method in STATEFUL:  # every node did it: the state a node starting later must take
            fields = state_fields(method, args or {}, merged)
            try:
                rev = int(await self._record(args=[self.prefix, self.state_rev, json.dumps(fields)]))
                self.state_rev = max(self.state_rev, rev)
            except Exception as exc:  # noqa: BLE001 - the call succeeded; a later node will not learn it
                self._redis_failed(exc)
                log.error("dp cluster state not recorded after %s (nodes starting later will not apply it): %s",
                          method, exc)
        return merged

    async def _send_control(self, call_id: str, method: str, args: dict[str, Any], timeout: float) -> list[str]:
        """Push control call ``call_id`` on every other node's ``ctl`` list
        (each gets a little less than ``timeout``, so that its reply is in
        time); returns those nodes."""
        peers = await self._peers()
        blob = CONTROL_TAG + json.dumps({"call_id": call_id, "method": method, "args": args,
                                         "timeout": max(0.5, 0.9 * timeout)}).encode()
        pipe = self.r.pipeline(transaction=False)
        for p in peers:
            pipe.rpush(self._k("ctl", p), blob)
            pipe.pexpire(self._k("ctl", p), 60_000)
            pipe.rpush(self._k("wake", p), "1")
        await pipe.execute()
        return peers

    async def _peers(self) -> list[str]:
        """The other instances of the cluster whose heartbeat key is live."""
        head = len(self._k("instance", ""))
        ids = {k.decode()[head:] async for k in self.r.scan_iter(match=self._k("instance", "*"), count=1000)}
        ids.discard(self.id)
        return sorted(ids)

    async def _control_replies(self, call_id: str, peers: list[str], timeout: float) -> dict[str, dict[str, Any]]:
        """The peers' replies to control call ``call_id``, waited for at most
        ``timeout`` seconds (polling the reply list); a peer with none by
        then is a 504 naming it."""
        got: dict[str, dict[str, Any]] = {}
        key = self._k("reply", call_id)
        deadline = time.monotonic() + timeout
        while peers and len(got) < len(peers) and time.monotonic() < deadline:
            for blob in await self.r.lpop(key, len(peers)) or ():
                rep = json.loads(blob)
                got[rep.pop("instance")] = rep
            if len(got) < len(peers):
                await asyncio.sleep(0.05)
        for p in peers:
            got.setdefault(p, {"ok": False, "code": 504,
                               "error": f"no reply within {timeout:g}s (the node is stopped, hung or gone)"})
        return got

    async def _call_local(self, method: str, args: dict[str, Any] | None, timeout: float) -> Any:
        """Run a control call on this node's replicas.  One that changes
        state waits for any other (and for :meth:`_apply_state`), and once it
        succeeded every revision recorded before it began counts as applied:
        the call's own revision is recorded later (after every node
        answered), and an older one must not undo it (a heartbeat that read
        it just before would otherwise resume a node just paused)."""
        if method not in STATEFUL:
            return await self._run_local(method, args, timeout)
        async with self._state_lock:
            before = await self._recorded_rev()
            result = await self._run_local(method, args, timeout)
            self.state_rev = max(self.state_rev, before)
            return result

    async def _recorded_rev(self) -> int:
        """The revision of the cluster's state in Redis now (this node's own
        when Redis does not answer)."""
        try:
            got = await self.r.get(self._k("state"))
        except Exception as exc:  # noqa: BLE001 - the call goes on; Redis's state is read again later
            self._redis_failed(exc)
            return self.state_rev
        return int((json.loads(got) if got else {}).get("rev") or 0)

    async def _run_local(self, method: str, args: dict[str, Any] | None, timeout: float) -> Any:
        result = await self.replicas.call(method, args, timeout)
        if method == "pause":
            try:
                await self._release(args=[self.prefix, self.id, "1"])
            except Exception as exc:  # noqa: BLE001
                self._redis_failed(exc)
        return result

    async def _serve_control(self, blob: bytes) -> None:
        """Run a control call another node sent to this one; reply on its list."""
        msg = json.loads(blob[len(CONTROL_TAG):])
        try:
            rep = {"ok": True, "result": await self._call_local(msg["method"], msg["args"], msg["timeout"])}
        except Exception as exc:  # noqa: BLE001 - reported to the caller, never dropped
            rep = {"ok": False, "code": getattr(exc, "code", 500), "error": str(exc) or type(exc).__name__}
        key = self._k("reply", msg["call_id"])
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(key, json.dumps({"instance": self.id, **rep}, default=str))
        pipe.pexpire(key, 60_000)
        await pipe.execute()

    def _abort_requests(self, args: dict[str, Any]) -> dict[str, Any]:
        if args.get("abort_all"):
            ids = list(self.pending)
        else:
            ids = args.get("req_ids") or []
            ids = [ids] if isinstance(ids, str) else list(ids)
        aborted, not_found = [], []
        for rid in ids:
            r = self.pending.get(rid)
            if r is None:
                not_found.append(rid)
                continue
            h = r.handle
            aborted.append({"request_id": rid, "output_token_count": h.num_output_tokens})
            key, owner = r.key, r.owner
            self._end(r, RequestOutput(key, (), finish_reason="abort", num_prompt_tokens=h.num_prompt_tokens,
                                       num_output_tokens=h.num_output_tokens))
            self._spawn(self._abort_remote(key, owner, "aborted by abort_requests"))
        return {"aborted": aborted, "not_found": not_found}

    @property
    def paused(self) -> bool:
        return bool(getattr(self.replicas, "_paused", False))

    # -- origin ----------------------------------------------------------------

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def _send(self, r: Remote) -> None:
        """Put the current attempt of ``r`` into Redis (a connection that
        Redis closed since its last use is retried once on a new one).  A new
        request that cannot go gets a 503; one queued again is retried by
        :meth:`_reconcile` until its TTL or the outage limit."""
        if r.done:
            return
        r.sending = True
        target: Any = None
        for attempt in (0, 1):
            try:
                target = await self._enqueue(args=[self.prefix, r.key, self.id, encode(r.add), int(self.ttl * 1000),
                                                   AFFINITY_SLACK, *r.prefix_hashes])
                break
            except Exception as exc:  # noqa: BLE001
                if attempt == 0 and _is_connection_error(exc):
                    await self._reset_connections()
                    continue
                self._redis_failed(exc)
                r.sending = False
                if r.attempt == 0:
                    self._end(r, EngineUnavailable(self.unavailable_reason() or f"cannot queue the request: {exc}"))
                return
        r.sending = False
        if r.done:  # ended meanwhile (client gone): take it out again
            await self._abort_remote(r.key, None, "client disconnected")
            return
        if target is None:
            self._end(r, RequestError(f"duplicate request id {r.handle.request_id!r} (in the dp global queue)", 400,
                                      param="request_id"))
            return
        r.enqueued = True

    def _drop(self, handles: Iterable[RequestHandle], reason: str) -> None:
        for h in handles:
            r = self.pending.get(h.request_id)
            if r is None or r.handle is not h or r.done:
                continue
            self._forget(r)
            self._spawn(self._abort_remote(r.key, r.owner, reason))

    async def _abort_remote(self, key: str, owner: str | None, reason: str) -> None:
        if owner == self.id or (owner is None and key in self.work):
            self._abort_local([key], reason)
        try:
            await self._abort(args=[self.prefix, key, encode(AbortRequest((key,), reason)), owner or ""])
        except Exception as exc:  # noqa: BLE001
            self._redis_failed(exc)

    def _forget(self, r: Remote) -> None:
        r.done = True
        r.handle.done = True
        self.pending.pop(r.handle.request_id, None)
        self.by_key.pop(r.key, None)

    def _end(self, r: Remote, item: Any) -> None:
        if r.done:
            return
        self._forget(r)
        self._ended.append(r.key)
        r.handle.sink.put_nowait((r.handle, item))

    def _retry_or_fail(self, r: Remote, why: str) -> None:
        """The attempt's instance or replica failed: queue it again when no
        token reached the sink; when some did, queue its continuation (the
        prompt plus the tokens streamed so far, for the tokens left) where
        that samples as the whole request would (:func:`continuable`), else
        end it with a 503 error event."""
        if r.done:
            return
        old = r.key
        self._ended.append(old)
        h = r.handle
        if r.delivered and not continuable(h.params, r.tokens_seen):
            self.instance_failures += 1
            self._end(r, EngineUnavailable(f"engine unavailable: {why}"))
            return
        if time.monotonic() > r.deadline and not r.delivered:
            self._expired(r)
            return
        self.requeued += 1
        self.by_key.pop(old, None)
        r.attempt += 1
        key = request_key(h.request_id, r.attempt)
        if r.delivered:
            k = r.tokens_seen
            r.base, r.deadline = k, time.monotonic() + self.ttl  # a continuation waits a whole TTL to be picked
            r.add = AddRequest(key, (*h.prompt, *r.output_ids), attrs.evolve(
                h.params, max_tokens=h.params.max_tokens - k, min_tokens=max(0, h.params.min_tokens - k)),
                r.add.arrival_time, trace_context=r.add.trace_context)
        else:
            r.add = attrs.evolve(r.add, request_id=key)
        r.owner, r.enqueued, r.owner_missing_since = None, False, None
        self.by_key[r.key] = r
        log.warning("request %s queued again (attempt %d) after %d token(s): %s", h.request_id, r.attempt,
                    r.tokens_seen, why)
        self._spawn(self._send(r))

    def _expired(self, r: Remote) -> None:
        self.ttl_expired += 1
        self._end(r, EngineUnavailable(self._ttl_message()))

    def _ttl_message(self) -> str:
        return (f"no dp instance picked the request up within --dp-request-ttl {self.ttl:g}s "
                "(all instances busy, paused or gone)")

    def _deliver(self, owner: str | None, outputs: Iterable[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            r = self.by_key.get(out.request_id)
            if r is None or r.done:
                continue  # an older attempt, or a request already ended here
            if r.base:  # a continuation: its counts as the whole request's
                out = attrs.evolve(out, num_output_tokens=out.num_output_tokens and out.num_output_tokens + r.base,
                                   num_prompt_tokens=max(0, out.num_prompt_tokens - r.base),
                                   num_cached_tokens=min(out.num_cached_tokens, r.handle.num_prompt_tokens))
            if owner is not None:
                r.owner = owner
            h = r.handle
            if out.finish_reason is not None and out.finish_reason not in ("stop", "length") and out.error_code == 503:
                self._retry_or_fail(r, out.error or "the dp instance failed")
                continue
            if out.new_token_ids and 0 < out.num_output_tokens <= r.tokens_seen:
                continue  # pushed again after a Redis restart, and already here
            if out.num_output_tokens and out.num_output_tokens != r.tokens_seen + len(out.new_token_ids):
                # outputs in between were lost (a Redis restart dropped the list): never a stream with a gap
                self.instance_failures += 1
                self._end(r, EngineUnavailable(f"engine unavailable: {r.tokens_seen} of the request's output tokens "
                                               f"reached this API, then {out.num_output_tokens}: the outputs in "
                                               "between were lost (Redis restarted?)"))
                continue
            r.tokens_seen += len(out.new_token_ids)
            r.output_ids.extend(out.new_token_ids)
            if out.new_token_ids:
                r.delivered = True
                if h.first_token_time is None:
                    h.first_token_time = now
                h.last_token_time = now
            h.num_output_tokens = max(h.num_output_tokens, out.num_output_tokens)
            h.num_cached_tokens = max(h.num_cached_tokens, out.num_cached_tokens)
            if out.finish_reason is not None:
                self._end(r, out)
            else:
                h.sink.put_nowait((h, out))

    async def _output_loop(self) -> None:
        """This origin's output list -> the sinks (one BLPOP, then the rest)."""
        key = self._k("out", self.id)
        while True:
            try:
                got = await self.r_out.blpop([key], timeout=1)
                if got is None:
                    continue
                blobs = [got[1]]
                more = await self.r_out.lpop(key, 256)
                blobs.extend(more or ())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._redis_failed(exc)
                await asyncio.sleep(0.2)
                continue
            for blob in blobs:
                try:
                    owner, _, data = blob.partition(b"\n")
                    msg = decode(data)
                    if isinstance(msg, OutputBatch):
                        self._deliver(owner.decode(), msg.outputs)
                except Exception:  # noqa: BLE001 - a garbled entry must not stop the loop
                    log.exception("cannot decode an entry of the dp output list")

    async def _reconcile_loop(self) -> None:
        """Each heartbeat: learn who holds each pending request, queue again
        what was lost or whose instance died, end what outlived the TTL."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            try:
                await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._redis_failed(exc)

    async def _reconcile(self) -> None:
        now = time.monotonic()
        if self._down_since is not None and now - self._down_since > OUTAGE_S:
            for r in list(self.pending.values()):
                if r.owner != self.id:
                    self._end(r, EngineUnavailable(f"engine unavailable: Redis at {self.config.redis_url} has been "
                                                   f"unreachable for over {OUTAGE_S:g}s"))
        if self._ended:
            keys, self._ended = self._ended, []
            try:
                await self.r.delete(*(self._k("req", k) for k in keys))
            except Exception:
                self._ended.extend(keys)
                raise
        for r in [r for r in self.pending.values() if not r.enqueued and not r.sending and r.attempt > 0]:
            if now > r.deadline:
                self._expired(r)
            else:
                self._spawn(self._send(r))
        rs = [r for r in self.pending.values() if r.enqueued and not r.done and r.owner != self.id]
        if not rs:
            return
        rows = await self._reclaim(args=[self.prefix, *(r.key for r in rs)])
        grace = self.config.heartbeat_timeout  # a Redis that restarted has lost the hashes until their owners renew
        for i, r in enumerate(rs):
            state, owner = rows[2 * i].decode(), rows[2 * i + 1].decode()
            if r.done or not r.enqueued:
                continue
            if state != "missing":
                r.owner_missing_since = None
            if state == "held":
                r.owner = owner
            elif state == "reclaimed":
                self.leases_reclaimed += 1
                self._retry_or_fail(r, f"dp instance {owner} was silent for over --heartbeat-timeout "
                                       f"{self.config.heartbeat_timeout:g}s and lost the request's lease")
            elif state == "missing":  # lost with a Redis restart, or dropped as expired: wait for its owner's renewal
                if r.owner_missing_since is None:
                    r.owner_missing_since = now
                elif now - r.owner_missing_since > grace:
                    self._retry_or_fail(r, "the request was lost by Redis")
            elif now > r.deadline:  # queued, nobody took it
                owner = await self._expire(args=[self.prefix, r.key])
                if owner is None:
                    self._expired(r)
                else:
                    r.owner = owner.decode() if isinstance(owner, bytes) else str(owner)

    def _fail_remote(self, message: str) -> None:
        for r in list(self.pending.values()):
            self._end(r, EngineUnavailable(message))

    # -- instance ----------------------------------------------------------------

    def _serving_locally(self) -> bool:
        return (self.capacity > 0 and not self.paused and self._state_known
                and self.state_error is None and self.replicas.unavailable_reason() is None
                and (self._state_task is None or self._state_task.done()))

    async def _sync_state(self) -> None:
        """Each heartbeat once the replicas serve: read the cluster's desired
        state (``P:state``); when its revision is newer than the one applied
        here (a node that started, restarted, or missed the call), bring the
        replicas to it through the local control path, in the background
        (no work is picked meanwhile).  An older revision is never applied."""
        if self.replicas.unavailable_reason() is not None or not (self._state_task is None or self._state_task.done()):
            return
        got = await self.r.get(self._k("state"))
        want = json.loads(got) if got else {}
        rev = int(want.get("rev") or 0)
        if rev <= self.state_rev:
            self._state_known = True
            return
        self._state_task = asyncio.get_running_loop().create_task(self._apply_state(want, rev))
        self._tasks.add(self._state_task)
        self._state_task.add_done_callback(self._tasks.discard)

    async def _apply_state(self, want: dict[str, Any], rev: int) -> None:
        async with self._state_lock:  # no control call meanwhile
            if rev <= self.state_rev:  # a control call ran here since it was read: it is older
                self._state_known = True
                return
            await self._apply_state_now(want, rev)

    async def _apply_state_now(self, want: dict[str, Any], rev: int) -> None:
        first = not self._state_known
        try:
            now = await self.replicas.call("is_paused", None, 30.0)
            steps = state_steps(want, self.paused or bool(now.get("is_paused")), now.get("sleeping") or (),
                                self.replicas.weights_version)
            for method, args in steps:
                await asyncio.wait_for(self._run_local(method, args, STATE_CALL_S), STATE_CALL_S + 5)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the log and /health, retried next heartbeat
            msg = (f"dp node {self.id} could not apply the cluster's control state (revision {rev}: "
                   f"{json.dumps({k: v for k, v in want.items() if k != 'rev'})}): {str(exc) or type(exc).__name__}")
            if msg != self.state_error:
                log.error("%s", msg)
            self.state_error = msg
            return
        self.state_rev, self.state_error, self._state_known = max(self.state_rev, rev), None, True
        if steps or first:
            log.warning("dp node %s applied the cluster's control state, revision %d: paused=%s sleeping=%s "
                        "weights=%s (%s)", self.id, rev, bool(want.get("paused")),
                        ",".join(want.get("sleeping") or ()) or "-", (want.get("weights") or {}).get("version", "-"),
                        ", ".join(m for m, _ in steps) or "already so")

    async def _heartbeat_loop(self) -> None:
        info = json.dumps({"url": f"http://{self.config.host}:{self.config.port}", "pid": os.getpid(),
                           "capacity": self.capacity, "replicas": self.config.data_parallel_size,
                           "started": time.time()})
        while True:
            for attempt in (0, 1):
                try:
                    await self._beat(info)
                    self._redis_ok()
                    if self._unsent or self._finished or self._epoch_unsure:  # nothing else may push them
                        await self._flush()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    if attempt == 0 and self.redis_error is None and _is_connection_error(exc):
                        await self._reset_connections()  # Redis restarted since the last beat: new connections
                        continue
                    self._redis_failed(exc)
            await asyncio.sleep(self.config.heartbeat_interval)

    async def _beat(self, info: str) -> None:
        """Register (the key's TTL is --heartbeat-timeout), publish the load,
        leave the ZSET while not taking work, reap dead instances."""
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self._k("instance", self.id), info, px=int(self.config.heartbeat_timeout * 1000))
        pipe.pexpire(self._k("out", self.id), 120_000)
        await pipe.execute()
        await self._sync_state()
        pipe = self.r.pipeline(transaction=False)
        serving = self._serving_locally()
        if serving:
            pipe.hset(self._k("capacity"), self.id, self.capacity)
            pipe.zadd(self._k("instances"), {self.id: len(self.work)})
        await pipe.execute()
        if not serving:
            await self._release(args=[self.prefix, self.id, "1"])
        await self._release(args=[self.prefix, "", "0"])  # reap the dead
        await self._renew_leases(list(self.work.values()))

    async def _renew_leases(self, ws: list[Work]) -> list[Work]:
        """Extend the leases of ``ws`` (``RENEW``); abort at once those whose
        lease was lost (reclaimed by their origin after this instance was
        silent past --heartbeat-timeout, or aborted): their outputs are never
        pushed.  Returns the ones still held."""
        if not ws:
            return []
        lost = set(await self._renew(args=[self.prefix, self.id, self.lease_ms, PICKED_TTL_MS,
                                           *(x for w in ws for x in w.lease)]))
        if lost:
            keys = [w.key for w in ws if w.key.encode() in lost]
            log.warning("dp instance %s lost the lease of %d request(s) (their origin queued them again): "
                        "aborted here", self.id, len(keys))
            self.leases_lost += len(keys)
            self._abort_local(keys, "lease lost")
        return [w for w in ws if w.key.encode() not in lost]

    def _redis_ok(self) -> None:
        if self.redis_error is not None:
            log.info("Redis at %s answers: the dp global queue serves", self.config.redis_url)
        self.redis_error = None
        self._down_since = None

    def _redis_failed(self, exc: BaseException) -> None:
        import redis.exceptions

        if not isinstance(exc, (redis.exceptions.RedisError, OSError, asyncio.TimeoutError)):
            log.error("dp global queue error: %r", exc)
            return
        if self.redis_error is None:
            log.error("Redis at %s is unavailable: %s", self.config.redis_url, exc)
            self._down_since = time.monotonic()
            self._spawn(self._reset_connections())  # none of the pooled ones is used again
        self.redis_error = str(exc) or type(exc).__name__

    async def _reset_connections(self) -> None:
        self._epoch_unsure = True
        for c in (self.r, self.r_out, self.r_wake):
            try:
                await c.connection_pool.disconnect(inuse_connections=False)
            except Exception:  # noqa: BLE001
                pass

    async def _worker_loop(self) -> None:
        """Pull while holding fewer than --dp-capacity requests; run the
        aborts sent to this instance; wait for a wake-up or a short time."""
        wake = self._k("wake", self.id)
        ctl = self._k("ctl", self.id)
        while True:
            try:
                picked = 0
                free = self.capacity - len(self.work)
                if free > 0 and self.redis_error is None and self._serving_locally():
                    rows = await self._pick(args=[self.prefix, self.id, min(free, PICK_BATCH), PICKED_TTL_MS,
                                                  STEAL_AFTER_MS, self.lease_ms])
                    epoch = rows[0].decode()
                    ws = [Work(rows[i].decode(), rows[i + 1].decode(), str(rows[i + 3]), epoch)
                          for i in range(1, len(rows), 4)]
                    blobs = {rows[i].decode(): rows[i + 2] for i in range(1, len(rows), 4)}
                    for w in ws:
                        self.work[w.key] = w
                    try:  # the fenced admission: only what is still ours right now
                        held = await self._renew_leases(ws)
                    except Exception as exc:  # noqa: BLE001 - Redis went away just now: run them
                        self._redis_failed(exc)
                        held = ws
                    for w in held:
                        self._run(w, blobs[w.key])
                        picked += 1
                aborts = await self.r.lpop(ctl, 64) if self.redis_error is None else None
                for blob in aborts or ():
                    if blob.startswith(CONTROL_TAG):
                        self._spawn(self._serve_control(blob))
                        continue
                    msg = decode(blob)
                    if isinstance(msg, AbortRequest):
                        self._abort_local(msg.request_ids, msg.reason)
                if not picked:
                    if self.redis_error is None:
                        await self.r_wake.blpop([wake], timeout=WAKE_WAIT_S)
                    else:
                        await asyncio.sleep(WAKE_WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._redis_failed(exc)
                await asyncio.sleep(WAKE_WAIT_S)

    def _run(self, w: Work, blob: bytes) -> None:
        """Run a picked request on this node's replicas."""
        key = w.key
        try:
            add = decode(blob)
            assert isinstance(add, AddRequest)
            w.handle = self.replicas.submit(key, add.prompt_token_ids, add.params, add.arrival_time, self._wsink,
                                            tag=w, trace_context=add.trace_context)
        except RequestError as exc:  # replicas down just now (503: queued again), or the request is bad
            self._forward(w, [RequestOutput(key, (), finish_reason="abort", error=str(exc), error_code=exc.code)])
        except Exception as exc:  # noqa: BLE001
            log.exception("cannot run request %s from the dp queue", key)
            self._forward(w, [RequestOutput(key, (), finish_reason="abort", error=f"internal error: {exc}",
                                            error_code=500)])

    def _abort_local(self, keys: Iterable[str], reason: str) -> None:
        hs = []
        for k in keys:
            w = self.work.pop(k, None)
            if w is not None:
                self._finished.append(k)
                if w.handle is not None:
                    hs.append(w.handle)
        if not hs:
            return
        if reason == "stop string":  # the origin matched a stop string: it finished normally
            for h in hs:
                self.replicas.finish(h, "stop")
        else:
            self.replicas.abort(hs, reason)

    async def _forward_loop(self) -> None:
        """The replicas' outputs of picked requests -> their origins: one
        RPUSH per origin per batch (this origin's own: straight to the sink)."""
        while True:
            items = [await self._wsink.get()]
            while not self._wsink.empty():
                items.append(self._wsink.get_nowait())
            per: dict[str, tuple[list[RequestOutput], dict[str, Work]]] = {}
            for h, x in items:
                w = h.tag
                if not isinstance(w, Work) or self.work.get(w.key) is not w:
                    continue
                if isinstance(x, RequestOutput):
                    out = x
                else:
                    code = x.code if isinstance(x, RequestError) else 500
                    out = RequestOutput(w.key, (), finish_reason="abort", error=str(x) or "engine failed",
                                        error_code=code)
                outs, ws = per.setdefault(w.origin, ([], {}))
                outs.append(out)
                ws[w.key] = w
                if out.finish_reason is not None:
                    self.work.pop(w.key, None)
            for origin, (outs, ws) in per.items():
                self._forward_to(origin, outs, ws)
            try:
                await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._redis_failed(exc)

    def _forward(self, w: Work, outs: list[RequestOutput]) -> None:
        if any(o.finish_reason is not None for o in outs):
            self.work.pop(w.key, None)
        self._forward_to(w.origin, outs, {w.key: w})
        self._spawn(self._flush_safe())

    def _forward_to(self, origin: str, outs: list[RequestOutput], ws: dict[str, Work]) -> None:
        for o in outs:
            if o.finish_reason is not None:
                self._finished.append(o.request_id)
        if origin == self.id:
            self._deliver(self.id, outs)
        else:
            leases = tuple(w.lease for w in ws.values())
            self._unsent.setdefault(origin, []).append((time.monotonic(), leases, tuple(outs)))

    async def _flush_safe(self) -> None:
        try:
            await self._flush()
        except Exception as exc:  # noqa: BLE001
            self._redis_failed(exc)

    async def _flush(self) -> None:
        """Push the outputs waiting for Redis (kept for :data:`OUTAGE_S`),
        and drop finished requests from this instance's processing set.
        Each push is fenced (``PUSH``): outputs of a request whose lease this
        instance lost are dropped, never pushed.  After a reconnect it first
        reads the epoch key: when Redis came back without its data, the
        outputs pushed in the last :data:`REPLAY_S` (perhaps never read by
        their origin) go again, ahead of the rest."""
        async with self._flush_lock:
            if self._epoch_unsure:
                await self._check_epoch()
            if not self._unsent and not self._finished:
                return
            now = time.monotonic()
            unsent, self._unsent = self._unsent, {}
            finished, self._finished = self._finished, []
            done: dict[str, list[Entry]] = {}
            try:
                for origin in list(unsent):
                    entries = [e for e in unsent[origin] if now - e[0] < OUTAGE_S]
                    done[origin] = await self._push_fenced(origin, entries)
                    del unsent[origin]
                if finished:
                    await self.r.srem(self._k("processing", self.id), *finished)
            except BaseException:
                for origin, entries in unsent.items():  # keep them, in order, ahead of newer ones
                    self._unsent[origin] = entries + self._unsent.get(origin, [])
                self._finished.extend(finished)
                raise
            for origin, entries in done.items():
                self._sent.setdefault(origin, collections.deque()).extend(entries)
            for origin, sent in list(self._sent.items()):  # oldest first: drop from the left what is too old
                while sent and now - sent[0][0] >= REPLAY_S:
                    sent.popleft()
                if not sent:
                    del self._sent[origin]

    async def _push_fenced(self, origin: str, entries: list[Entry]) -> list[Entry]:
        """One fenced ``PUSH`` of ``entries`` to ``origin``'s list; the
        outputs of requests no longer held are dropped and the rest pushed.
        Returns the entries pushed."""
        prefix = self.id.encode() + b"\n"
        while entries:
            leases = list({lease: None for e in entries for lease in e[1]})
            stale = await self._push(args=[self.prefix, self.id, self._k("out", origin), self.lease_ms, len(leases),
                                           *(x for lease in leases for x in lease),
                                           *(prefix + encode(OutputBatch(e[2])) for e in entries)])
            if not stale:
                return entries
            gone = {k.decode() for k in stale}
            self.stale_dropped += sum(1 for e in entries for o in e[2] if o.request_id in gone)
            self.leases_lost += sum(1 for k in gone if k in self.work)
            log.warning("dropped the outputs of %d request(s) whose lease this instance lost: %s", len(gone),
                        ", ".join(sorted(gone)))
            self._abort_local(gone, "lease lost")
            entries = [(t, tuple(x for x in ls if x[0] not in gone), tuple(o for o in outs if o.request_id not in gone))
                       for t, ls, outs in entries]
            entries = [e for e in entries if e[2]]
        return entries

    async def _check_epoch(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self._k("epoch"), uuid.uuid4().hex, nx=True)
        pipe.get(self._k("epoch"))
        _, epoch = await pipe.execute()
        if self._epoch is not None and epoch != self._epoch:
            now = time.monotonic()
            n = 0
            for origin, sent in self._sent.items():
                again = [e for e in sent if now - e[0] < REPLAY_S]
                n += len(again)
                self._unsent[origin] = again + self._unsent.get(origin, [])
            self._sent = {}
            log.warning("Redis at %s came back without its data: %d recent output batches pushed again",
                        self.config.redis_url, n)
        self._epoch, self._epoch_unsure = epoch, False

    def _spawn(self, coro: Any) -> None:
        spawn_tracked(self._tasks, coro)
