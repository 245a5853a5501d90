"""The ``splitwise`` scheduler (registered here): prefill/decode
disaggregation across engine instances, FastDeploy's splitwise.

``fdx serve --scheduler splitwise --splitwise-role prefill|decode
--kv-connector zmq|mooncake``.  Each instance runs its own batch policy
(``--splitwise-local-scheduler``, ``v1`` by default) for the work it does,
and a KV connector (:class:`~fdx.core.interfaces.KVConnector`, listening at
the instance's ``kv_addr``) to the other role.  The handoff, decode-driven
as in FastDeploy (docs/SPLITWISE.md has the sequence and the failures):

1. D's front end gets a request with ``kv_transfer_params`` (the
   router's choice of P); D's engine queues it here.
2. D *preallocates* the prompt's blocks (its prefix cache applies: cached
   leading blocks are not transferred), FIFO, keeping one block per running
   request free, and sends P the job over the connector: an
   :class:`~fdx.core.messages.AddRequest` whose
   :class:`~fdx.core.messages.KVTransferParams` carry D's ``kv_addr``, its
   destination ``block_ids`` and ``num_cached_blocks``.
3. P's engine takes the job from its connector (not from its HTTP API),
   prefills it under its local policy (chunked, with P's prefix cache),
   samples the first token with the request's own sampling params, and --
   in the step that sampled it, before the blocks are freed -- sends D a
   :class:`~fdx.core.messages.RequestOutput` (the token, its logprob) with
   the KV of every prompt block from ``num_cached_blocks`` on, the last
   partial one included.  Then P frees its blocks (its prefix cache keeps
   the full ones).  P's jobs never reach P's own API.
4. D loads the KV into the preallocated blocks, registers the full ones in
   its prefix cache, appends the first token (a seeded sampler skips the
   draw P made) and inserts the request into its local policy as already
   prefilled: it computes no prompt token.  The first token is emitted at
   once (``ScheduledBatch.emitted``); a request that stops on it ends there
   without D decoding.
5. Abort on D (client gone, abort call, pause, timeout) frees D's blocks
   and sends P an :class:`~fdx.core.messages.AbortRequest`; P drops the job.
   A lost peer (the connector's liveness) ends the affected requests: on D
   with a 503 error, blocks freed; on P the jobs are dropped.  A handoff
   that takes longer than ``--splitwise-handoff-timeout`` fails with 503.

Requests without ``kv_transfer_params`` run on either role as on a mixed
instance (the router sends ``max_tokens=1`` requests to P that way); so
do, on D, requests asking for ``prompt_logprobs`` (they need the prompt's
logits) or a structured output (its grammar must constrain the first
token too, and P has no matcher).

Every method runs on the engine thread; the connector is polled from
:meth:`SplitwiseScheduler.schedule` (its sockets wake the engine loop
through :meth:`pollables`).  Metrics (``fdx:splitwise_*``) come from
:meth:`SplitwiseScheduler.splitwise_stats` through ``EngineStats``; the
``/v1/splitwise/info`` route and the metrics collector are added by this
module's ``fdx_add_routes``.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

import attrs
import zmq

from fdx.core.errors import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ModelOutput, ScheduledBatch, Scheduler
from fdx.core.kv_cache import cdiv
from fdx.core.messages import AbortRequest, AddRequest, KVTransferParams, RequestOutput, SplitwiseStats
from fdx.tracing import config_tracer, engine_span, monotonic_to_wall
from fdx.core.request import Request, Status

if TYPE_CHECKING:
    from fastapi import FastAPI

    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register
    from fdx.core.interfaces import KVConnector
    from fdx.core.kv_cache import KVCacheManager
    from fdx.deploy.frontend import EngineFrontend as EngineClient

log = logging.getLogger("fdx.splitwise")

#: upper bounds (seconds) of the handoff latency histogram
HANDOFF_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: how often pending handoffs are checked for lost peers and timeouts while nothing else happens
MAINTENANCE_INTERVAL = 0.25


@attrs.define
class Handoff:
    """D: a request whose prompt P computes, its blocks preallocated."""

    request: Request
    peer: str
    fresh: list[int]  # destination blocks: prompt blocks num_cached_blocks.. (what P sends)
    started: float
    deadline: float


@attrs.define
class Job:
    """P: a prompt computed for a decode instance."""

    request: Request  # P's own request (id ``<D's id>@<D's kv_addr>``)
    rid: str  # D's request id
    peer: str  # D's kv_addr
    num_cached_blocks: int
    started: float
    trace_context: str = ""  # D's AddRequest.trace_context (fdx.tracing)


class Latency:
    """Cumulative histogram of handoff seconds."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.buckets = [0] * len(HANDOFF_BUCKETS)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        for i in range(bisect.bisect_left(HANDOFF_BUCKETS, seconds), len(HANDOFF_BUCKETS)):
            self.buckets[i] += 1


def job_id(rid: str, decode_addr: str) -> str:
    """P's id of D's request ``rid`` (D's ids are unique only per D)."""
    return f"{rid}@{decode_addr}"


class SplitwiseScheduler(Scheduler):
    """One role of splitwise around a local batch policy (see module doc)."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, connector: KVConnector | None = None) -> None:
        super().__init__(config, kv)
        if config.splitwise_role not in ("prefill", "decode"):
            raise ConfigError("--scheduler splitwise needs --splitwise-role prefill or decode")
        if connector is None:
            raise ConfigError("--scheduler splitwise needs a KV connector (--kv-connector)")
        from fdx.core.plugins import get_plugins
        from fdx.plugins.schedulers.base import BaseScheduler

        self.local = get_plugins(config.disable_plugins).create("scheduler", config.splitwise_local_scheduler,
                                                                 config=config, kv=kv)
        if not isinstance(self.local, BaseScheduler):
            raise ConfigError(f"--splitwise-local-scheduler {config.splitwise_local_scheduler}: splitwise needs "
                              "a policy built on fdx.plugins.schedulers.base.BaseScheduler (v1, v0)")
        self.role = config.splitwise_role
        self.connector = connector
        self.runner = connector.runner
        self.timeout = config.splitwise_handoff_timeout
        # D
        self.queued: collections.deque[Request] = collections.deque()  # waiting for blocks
        self.handoffs: dict[str, Handoff] = {}
        self._blocked = False  # the queue head did not fit; retried once blocks may have come back
        # P
        self.jobs: dict[str, Job] = {}
        # both
        self._failed: list[Request] = []
        self._emitted: list[Request] = []
        self._next_maintenance = 0.0
        self.latency = Latency()
        self.num_failed_handoffs = 0
        self.kv_bytes = 0
        self.recomputed_prompt_tokens = 0
        if config.otlp_traces_endpoint:  # the exporter set up now, not on the first traced request's step
            config_tracer(config, "engine")

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        p = request.params
        if request.kv_transfer is not None and self.role == "decode" and (
                p.prompt_logprobs is not None or p.structured is not None or p.beam_width):
            # prompt logprobs need the prompt's logits, a grammar must constrain the first token too:
            # beam search forks the prompt's KV: such a request is computed here, whole, as on a mixed instance
            log.debug("splitwise %s: computed on the decode instance (%s)", request.request_id,
                      "prompt_logprobs" if p.prompt_logprobs is not None else
                      "beam search" if p.beam_width else "structured output")
            request.kv_transfer = None
        if request.kv_transfer is None:
            self.local.add_request(request)
            return
        request.status = Status.WAITING
        if self.role != "decode":
            self._fail(request, "kv_transfer_params is accepted only by a --splitwise-role decode instance", 400)
            return
        error = self.local.never_fits(request)
        if error is not None:
            self._fail(request, error, 400)
            return
        self.queued.append(request)
        self._blocked = False
        log.debug("splitwise %s: queued for preallocation (%d prompt tokens, prefill %s)", request.request_id,
                  request.num_prompt_tokens, request.kv_transfer.prefill_addr)

    def _fail(self, request: Request, error: str, code: int) -> None:
        """End ``request`` (out of every table) with an error, blocks freed;
        reported in the next batch."""
        self.kv.free(request)
        request.fail(error, code)
        self._failed.append(request)
        self._blocked = False

    # ------------------------------------------------------------------ the step

    def schedule(self) -> ScheduledBatch:
        self._pump()
        if self.role == "decode":
            self._preallocate()
        batch = self.local.schedule()
        if self.jobs and batch.failed:  # a job the local policy ended (never fits...): tell D
            keep = []
            for r in batch.failed:
                job = self.jobs.pop(r.request_id, None)
                if job is None:
                    keep.append(r)
                else:
                    self._reply_error(job, r.error or "prefill failed", r.error_code or 500)
            batch.failed = keep
        batch.failed.extend(self._failed)
        running = {id(s.request) for s in batch.seqs}  # inserted and decoded in this same step: sent with seqs
        batch.emitted.extend(r for r in self._emitted if id(r) not in running)
        self._failed, self._emitted = [], []
        return batch

    def update(self, batch: ScheduledBatch, output: ModelOutput) -> None:
        sent: list[Job] = []
        job_reqs = {id(j.request) for j in self.jobs.values()}
        if self.jobs:  # P: the first tokens, sent with the KV before the local policy frees the blocks
            toks = output.token_ids
            for i, seq in enumerate(batch.seqs):
                job = self.jobs.get(seq.request.request_id)
                if job is not None and seq.request.status is Status.RUNNING and int(toks[i]) >= 0:
                    lp = output.logprobs[i] if output.logprobs is not None else None
                    self._send_first_token(job, int(toks[i]), lp)
                    sent.append(job)
        elif self.role == "decode":
            for seq in batch.seqs:
                r = seq.request
                if r.kv_transfer is not None and r.num_computed_tokens < r.num_prompt_tokens:
                    self.recomputed_prompt_tokens += min(seq.num_new_tokens, r.num_prompt_tokens - r.num_computed_tokens)
        self.local.update(batch, output)
        self._blocked = False
        if job_reqs:  # P's jobs send nothing to P's own front end
            for job in sent:
                self.jobs.pop(job.request.request_id, None)
                if job.request.status is not Status.FINISHED:  # max_tokens=1 finishes it; be sure
                    self.local.abort([job.request.request_id])
            batch.seqs = [s for s in batch.seqs if id(s.request) not in job_reqs]

    # ------------------------------------------------------------------ connector

    def _pump(self) -> None:
        """Take what the connector received; end handoffs whose peer is
        lost or whose time is up."""
        conn = self.connector
        for peer, msg, kv in conn.recv():
            try:
                if isinstance(msg, RequestOutput) and self.role == "decode":
                    self._prefilled(peer, msg, kv)
                    continue
                if kv is not None:
                    conn.load(kv, ())
                if isinstance(msg, AddRequest) and self.role == "prefill" and msg.kv_transfer_params is not None:
                    self._take_job(peer, msg)
                elif isinstance(msg, AbortRequest) and self.role == "prefill":
                    ids = [job_id(rid, peer) for rid in msg.request_ids]
                    for i in ids:
                        self.jobs.pop(i, None)
                    if self.local.abort(ids):
                        log.debug("splitwise: %s aborted %s", peer, list(msg.request_ids))
                else:
                    log.warning("splitwise (%s): unexpected %s from %s ignored", self.role, type(msg).__name__, peer)
            except Exception:  # noqa: BLE001 - one bad message never ends the engine
                log.exception("splitwise: handling a %s from %s failed", type(msg).__name__, peer)
        now = time.monotonic()
        if now < self._next_maintenance:
            return
        self._next_maintenance = now + MAINTENANCE_INTERVAL
        for peer in conn.lost_peers():
            if self.role == "decode":
                for h in [h for h in self.handoffs.values() if h.peer == peer]:
                    self._end_handoff(h, f"prefill instance {peer} was lost during the KV handoff", 503)
            else:
                ids = [i for i, j in self.jobs.items() if j.peer == peer]
                for i in ids:
                    del self.jobs[i]
                if ids:
                    self.local.abort(ids)
                    log.warning("splitwise: decode instance %s lost; dropped %d prefill job(s)", peer, len(ids))
        for h in [h for h in self.handoffs.values() if now > h.deadline]:
            self._end_handoff(h, f"the KV handoff from prefill instance {h.peer} timed out after {self.timeout:g} s "
                                 "(--splitwise-handoff-timeout)", 503)
            self._send(h.peer, AbortRequest((h.request.request_id,), "handoff timeout"))

    def _send(self, peer: str, msg: Any, block_ids: Iterable[int] = ()) -> int | None:
        """Send through the connector; ``None`` (logged) when it fails."""
        try:
            return self.connector.send(peer, msg, list(block_ids))
        except Exception as exc:  # noqa: BLE001 - the peer is gone or unreachable: the caller decides
            log.warning("splitwise: sending %s to %s failed: %s", type(msg).__name__, peer, exc)
            return None

    # ------------------------------------------------------------------ D

    def _preallocate(self) -> None:
        """FIFO: blocks for each queued prompt, then the job to P."""
        kv = self.kv
        while self.queued and not self._blocked:
            req = self.queued[0]
            computed = kv.get_computed_blocks(req)
            n_cached = len(computed) * kv.block_size
            # keep one block per running request free, so preallocation never preempts decodes
            if not kv.allocate(req, req.num_prompt_tokens - n_cached, computed, watermark=self.local.num_running):
                self._blocked = True
                return
            self.queued.popleft()
            assert req.kv_transfer is not None
            peer = req.kv_transfer.prefill_addr
            fresh = req.block_ids[len(computed):]
            params = attrs.evolve(req.kv_transfer, decode_addr=self.connector.address, block_ids=tuple(fresh),
                                  num_cached_blocks=len(computed))
            job = AddRequest(req.request_id, tuple(req.prompt_token_ids), req.params, req.arrival_time, params,
                             req.trace_context)
            try:
                self.connector.send(peer, job)
            except Exception as exc:  # noqa: BLE001
                self.num_failed_handoffs += 1
                self._fail(req, f"prefill instance {peer} is unreachable: {exc}", 503)
                continue
            now = time.monotonic()
            req.first_scheduled_time = time.time()
            self.handoffs[req.request_id] = Handoff(req, peer, list(fresh), now, now + self.timeout)
            log.debug("splitwise %s: preallocated %d block(s) (%d cached), job sent to %s", req.request_id,
                      len(fresh), len(computed), peer)

    def _prefilled(self, peer: str, out: RequestOutput, kv: Any) -> None:
        """P's answer: insert the request as prefilled (or fail it)."""
        h = self.handoffs.get(out.request_id)
        if h is None or h.peer != peer:  # aborted (or timed out) meanwhile: its blocks are someone else's now
            self.connector.load(kv, ())
            log.debug("splitwise %s: late answer from %s dropped", out.request_id, peer)
            return
        req = h.request
        if out.error is not None or len(out.new_token_ids) != 1:
            self.connector.load(kv, ())
            code = out.error_code or 500
            self._end_handoff(h, f"prefill instance {peer}: {out.error or 'no first token'}", code)
            return
        try:
            nbytes = self.connector.load(kv, h.fresh) if h.fresh else 0
            if h.fresh and kv is None:
                raise ValueError("the prefill instance sent no KV")
        except Exception as exc:  # noqa: BLE001
            log.exception("splitwise %s: loading the KV from %s failed", req.request_id, peer)
            self._end_handoff(h, f"the KV transfer from prefill instance {peer} failed: {exc}", 500)
            return
        del self.handoffs[req.request_id]
        seconds = time.monotonic() - h.started
        self.latency.observe(seconds)
        self.kv_bytes += nbytes
        if req.trace_context:
            self._span("kv_transfer", req.trace_context, monotonic_to_wall(h.started), time.time(),
                       {"fdx.kv_transfer.direction": "receive", "fdx.kv_transfer.bytes": nbytes,
                        "fdx.kv_transfer.blocks": len(h.fresh), "fdx.kv_transfer.peer": peer,
                        "fdx.request_id": req.request_id})
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.commit(req)
        p = req.params
        if p.seed is not None:
            from fdx.model.sampler import GREEDY_EPS, sampler_state

            if p.temperature >= GREEDY_EPS:  # P drew this token's one uniform: D's generator moves past it
                gen = sampler_state(req).gen
                if gen is not None:
                    gen.random()
        lp = out.logprobs[0] if out.logprobs else None
        reason = req.append_token(out.new_token_ids[0], lp)
        self._emitted.append(req)
        self._blocked = False
        if reason is not None:
            req.status = Status.FINISHED
            self.kv.free(req)
        else:
            req.status = Status.RUNNING
            self.local.running.append(req)
            self.local.requests[req.request_id] = req
        log.debug("splitwise %s: KV from %s inserted (%d blocks, %d bytes, %.1f ms)%s", req.request_id, peer,
                  len(h.fresh), nbytes, 1000 * seconds, f"; finished on its first token ({reason})" if reason else "")

    def _end_handoff(self, h: Handoff, error: str, code: int) -> None:
        self.handoffs.pop(h.request.request_id, None)
        self.num_failed_handoffs += 1
        log.warning("splitwise %s: %s", h.request.request_id, error)
        self._fail(h.request, error, code)

    # ------------------------------------------------------------------ P

    def _take_job(self, peer: str, msg: AddRequest) -> None:
        params = msg.kv_transfer_params
        assert params is not None
        decode_addr = params.decode_addr or peer
        jid = job_id(msg.request_id, decode_addr)
        runner = self.runner
        req = Request(jid, list(msg.prompt_token_ids), attrs.evolve(msg.params, max_tokens=1),
                      runner.eos_token_ids if runner is not None else frozenset(),
                      runner.max_model_len if runner is not None else self.config.max_model_len or 2048,
                      time.time())
        job = Job(req, msg.request_id, decode_addr, params.num_cached_blocks, time.monotonic(), msg.trace_context)
        n_blocks = cdiv(req.num_prompt_tokens, self.kv.block_size)
        if jid in self.jobs or self.local.get(jid) is not None:
            self._reply_error(job, f"duplicate prefill job {msg.request_id!r}", 400)
            return
        if len(params.block_ids) != n_blocks - params.num_cached_blocks or params.num_cached_blocks < 0:
            self._reply_error(job, f"the job names {len(params.block_ids)} destination blocks for "
                                   f"{n_blocks - params.num_cached_blocks} prompt blocks "
                                   f"(block sizes differ? this instance's is {self.kv.block_size})", 400)
            return
        if runner is not None and not 0 <= min(req.prompt_token_ids, default=0) <= max(
                req.prompt_token_ids, default=0) < runner.vocab_size:
            self._reply_error(job, f"prompt token ids must be in [0, {runner.vocab_size})", 400)
            return
        self.jobs[jid] = job
        self.local.add_request(req)
        log.debug("splitwise %s: prefill job from %s (%d tokens, %d blocks to send)", msg.request_id, decode_addr,
                  req.num_prompt_tokens, len(params.block_ids))

    def _send_first_token(self, job: Job, token: int, logprob: Any) -> None:
        req = job.request
        n_blocks = cdiv(req.num_prompt_tokens, self.kv.block_size)
        src = req.block_ids[job.num_cached_blocks:n_blocks]
        out = RequestOutput(job.rid, (token,), None, req.num_prompt_tokens, req.num_cached_tokens, 1,
                            (logprob,) if logprob is not None else None)
        sent = time.time()
        nbytes = self._send(job.peer, out, src)
        if job.trace_context:
            rid = {"fdx.request_id": job.rid}
            self._span("prefill", job.trace_context, monotonic_to_wall(job.started), sent,
                       {**rid, "gen_ai.usage.input_tokens": req.num_prompt_tokens,
                        "fdx.cached_tokens": req.num_cached_tokens})
            self._span("kv_transfer", job.trace_context, sent, time.time(),
                       {**rid, "fdx.kv_transfer.direction": "send", "fdx.kv_transfer.bytes": nbytes or 0,
                        "fdx.kv_transfer.blocks": len(src), "fdx.kv_transfer.peer": job.peer})
        if nbytes is None:  # D hears of it (if it can hear at all), instead of waiting for its timeout
            self._reply_error(job, "the prefill instance could not send the KV (see its log)", 503)
            return
        seconds = time.monotonic() - job.started
        self.latency.observe(seconds)
        self.kv_bytes += nbytes
        log.debug("splitwise %s: prefilled, first token %d and %d KV blocks (%d bytes) sent to %s after %.1f ms",
                  job.rid, token, len(src), nbytes, job.peer, 1000 * seconds)

    def _span(self, name: str, trace_context: str, start: float, end: float, attributes: dict[str, Any]) -> None:
        """One engine-side span of a traced request (``--otlp-traces-endpoint``)."""
        engine_span(self.config, name, trace_context, start, end,
                    {"fdx.kv_connector": self.config.kv_connector or "", "fdx.splitwise.role": self.role,
                     **attributes})

    def _reply_error(self, job: Job, error: str, code: int) -> None:
        self.num_failed_handoffs += 1
        log.warning("splitwise %s (from %s): %s", job.rid, job.peer, error)
        self._send(job.peer, RequestOutput(job.rid, (), "error", job.request.num_prompt_tokens, error=error,
                                           error_code=code))

    # ------------------------------------------------------------------ removal

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        ids = set(request_ids)
        removed: list[Request] = []
        if self.queued and ids:
            keep = collections.deque()
            for r in self.queued:
                (removed if r.request_id in ids else keep).append(r)
            self.queued = keep
        for rid in [i for i in ids if i in self.handoffs]:
            h = self.handoffs.pop(rid)
            self.kv.free(h.request)
            removed.append(h.request)
            self._send(h.peer, AbortRequest((rid,), "aborted on the decode instance"))
            log.debug("splitwise %s: aborted during the handoff; %s told", rid, h.peer)
        if self._failed:
            keep_failed = []
            for r in self._failed:
                (removed if r.request_id in ids else keep_failed).append(r)
            self._failed = keep_failed
        for rid in [i for i in ids if i in self.jobs]:  # the engine ended a job (runner failure, pause)
            self._reply_error(self.jobs.pop(rid), "the prefill instance dropped the request", 503)
        removed.extend(self.local.abort(ids - {r.request_id for r in removed}))
        self._blocked = False
        return removed

    def preempt_all(self) -> list[Request]:
        return self.abort(self.request_ids())

    # ------------------------------------------------------------------ tables

    def get(self, request_id: str) -> Request | None:
        h = self.handoffs.get(request_id)
        if h is not None:
            return h.request
        for r in self.queued:
            if r.request_id == request_id:
                return r
        return self.local.get(request_id)

    def request_ids(self) -> list[str]:
        return [*self.local.request_ids(), *(r.request_id for r in self.queued), *self.handoffs,
                *(r.request_id for r in self._failed)]

    @property
    def num_running(self) -> int:
        return self.local.num_running

    @property
    def num_waiting(self) -> int:
        return self.local.num_waiting + len(self.queued) + len(self.handoffs) + len(self._failed)

    def has_work(self) -> bool:
        """Local work, results to report, a queue that may fit now, a
        message waiting on the connector, or handoffs due a check -- not
        handoffs merely in flight (the loop then sleeps in its poll)."""
        if self._failed or self._emitted or self.local.has_work() or (self.queued and not self._blocked):
            return True
        if any(s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in self.connector.pollables()):
            return True
        return bool(self.handoffs or self.jobs) and time.monotonic() >= self._next_maintenance

    def pollables(self) -> list[Any]:
        return self.connector.pollables()

    def stats(self) -> dict[str, int]:
        return {**self.local.stats(), "num_waiting": self.num_waiting, "splitwise_handoffs": self.latency.count}

    def splitwise_stats(self) -> SplitwiseStats:
        lat = self.latency
        return SplitwiseStats(self.role, self.connector.address, lat.count, self.num_failed_handoffs, self.kv_bytes,
                              lat.total, tuple(lat.buckets), self.recomputed_prompt_tokens)

    def check_invariants(self) -> None:
        """Block accounting with the handoffs (tests)."""
        from fdx.testing import check_kv_invariants

        check_kv_invariants(self.kv, [*self.local.live_requests(), *(h.request for h in self.handoffs.values())])


def _create(config: EngineConfig, kv: KVCacheManager, connector: KVConnector | None = None) -> Scheduler:
    return SplitwiseScheduler(config, kv, connector)


@hookimpl
def fdx_register_schedulers(register: Register) -> None:
    register("splitwise", _create,
             description="prefill/decode disaggregation: --splitwise-role prefill|decode, KV handed over by "
                         "--kv-connector, --splitwise-local-scheduler (v1) for each role's own work")


# ---------------------------------------------------------------------- API process


@hookimpl
def fdx_add_routes(app: FastAPI, client: EngineClient) -> None:
    """``GET /v1/splitwise/info`` and the ``fdx:splitwise_*`` metrics on a
    splitwise instance (nothing otherwise)."""
    config = client.config
    if config.scheduler != "splitwise" or config.splitwise_role is None:
        return
    from fastapi.responses import JSONResponse

    async def info() -> JSONResponse:
        import asyncio

        deadline = time.monotonic() + 2 * config.heartbeat_timeout
        # the engine's first stats (with its bound kv_addr) follow its ready message by up to one heartbeat
        while (sw := getattr(client.stats, "splitwise", None)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if sw is None:
            return JSONResponse({"error": {"message": "the engine is not ready", "type": "service_unavailable",
                                           "param": None, "code": 503}}, status_code=503)
        return JSONResponse({"role": config.splitwise_role, "kv_connector": config.kv_connector,
                             "kv_addr": sw.address, "model": config.model_name, "block_size": config.block_size,
                             # what a peer's KV blocks must match, byte for byte
                             "kv_layout": {"block_size": config.block_size,
                                           "tensor_parallel_size": config.tensor_parallel_size}})

    app.add_api_route("/v1/splitwise/info", info, methods=["GET"],
                      summary="this splitwise instance's role and KV connector address (for the router)")
    metrics = getattr(app.state, "metrics", None)
    if metrics is not None:
        metrics.registry.register(SplitwiseCollector(lambda: client.stats, config.model_name))


class SplitwiseCollector:
    """``fdx:splitwise_*`` at scrape time, from the latest EngineStats:
    handoffs and failed handoffs by role, KV bytes moved, the handoff
    latency histogram, and the prompt tokens D recomputed (should stay 0)."""

    def __init__(self, get_stats: Any, model: str) -> None:
        self.get_stats = get_stats
        self.model = model

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        st = self.get_stats()
        sw = st.splitwise if st is not None else None
        if sw is None:
            return
        lab, val = ["model_name", "role"], [self.model, sw.role]
        role = GaugeMetricFamily("fdx:splitwise_role", "1 for this instance's splitwise role.", labels=lab)
        role.add_metric(val, 1.0)
        yield role
        for name, doc, v in (
            ("splitwise_handoffs", "KV handoffs completed (D: KV inserted; P: KV sent).", sw.handoffs),
            ("splitwise_handoff_failures", "KV handoffs that failed (peer lost, timeout, errors).", sw.failed),
            ("splitwise_kv_bytes", "KV bytes moved by handoffs (D: received; P: sent).", sw.kv_bytes),
            ("splitwise_recomputed_prompt_tokens", "Prompt tokens of handed-off requests that the decode "
             "instance computed itself (0 unless it preempted one).", sw.recomputed_prompt_tokens),
        ):
            m = CounterMetricFamily(f"fdx:{name}", doc, labels=lab)
            m.add_metric(val, float(v))
            yield m
        h = HistogramMetricFamily("fdx:splitwise_handoff_seconds", "KV handoff latency (D: preallocation to KV "
                                  "inserted; P: job received to KV sent).", labels=lab)
        buckets = [(str(b), float(c)) for b, c in zip(HANDOFF_BUCKETS, sw.handoff_buckets)]
        h.add_metric(val, buckets + [("+Inf", float(sw.handoffs))], sum_value=sw.handoff_seconds)
        yield h
