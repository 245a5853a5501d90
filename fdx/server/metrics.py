"""Prometheus metrics of the API process (``GET /metrics``).

Names follow vLLM's with an ``fdx:`` prefix.  Front-end latencies and token
counts are observed here per request; engine-side numbers (queue sizes, KV
usage, prefix-cache counters, preemptions) are read at scrape time from the
latest :class:`~fdx.core.messages.EngineStats` the engine sent, through a
custom collector, so the engine's cumulative counters are exported as-is.
With ``--scheduler dp`` the unlabelled names are the totals over the
replicas, and each replica's numbers are exported again as ``fdx:dp_NAME``
with a ``dp_rank`` label (plus ``fdx:dp_replica_up``,
``fdx:dp_requests_routed``, ``fdx:dp_engine_restarts`` and
``fdx:dp_engine_crashes``).
Each :class:`Metrics` owns a private registry (no global state).
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from fdx.core.messages import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: the ``reason`` label values of ``fdx:engine_crashes_total``
CRASH_REASONS = ("crashed", "exited", "hung", "start_failed")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


#: (name, help, kind, value of an EngineStats) of every engine-side series
_ENGINE_SERIES: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("num_requests_running", "Requests running in the engine.", "gauge", lambda s: s.num_running),
    ("num_requests_waiting", "Requests waiting in the engine.", "gauge", lambda s: s.num_waiting),
    ("kv_cache_usage_perc", "KV-cache usage (1 = 100%).", "gauge", lambda s: s.kv_usage),
    ("kv_blocks_used", "KV blocks in use.", "gauge", lambda s: s.kv_blocks_used),
    ("kv_blocks_total", "KV blocks in the pool.", "gauge", lambda s: s.kv_blocks_total),
    ("engine_paused", "1 while the engine is paused.", "gauge", lambda s: 1.0 if s.is_paused else 0.0),
    ("prefix_cache_queries", "Prefix-cache queries (tokens).", "counter", lambda s: s.prefix_queries),
    ("prefix_cache_hits", "Prefix-cache hits (tokens).", "counter", lambda s: s.prefix_hits),
    ("kv_storage_hits", "KV storage (cache backend) hits.", "counter", lambda s: s.storage_hits),
    ("kv_storage_errors", "KV storage (cache backend) errors.", "counter", lambda s: s.storage_errors),
    ("kv_storage_puts", "KV blocks written to the storage backend (write completed).", "counter",
     lambda s: getattr(s, "storage_puts", 0)),
    ("num_preemptions", "Preemptions.", "counter", lambda s: s.num_preemptions),
    ("engine_steps", "Engine steps.", "counter", lambda s: s.steps),
    ("engine_admissions", "Requests the engine admitted (its scheduler took them to run).", "counter",
     lambda s: getattr(s, "num_admitted", 0)),
    ("engine_batched_tokens", "Tokens run by the engine (prefill + decode).", "counter",
     lambda s: getattr(s, "num_batched_tokens", 0)),
    ("engine_generated_tokens", "Tokens sampled by the engine.", "counter",
     lambda s: getattr(s, "num_generated_tokens", 0)),
    ("spec_decode_num_drafts", "Speculative verification rounds (a decode step with drafts).", "counter",
     lambda s: s.speculative.num_drafts if s.speculative else 0),
    ("spec_decode_num_draft_tokens", "Speculative draft tokens proposed and verified.", "counter",
     lambda s: s.speculative.num_draft_tokens if s.speculative else 0),
    ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.", "counter",
     lambda s: s.speculative.num_accepted_tokens if s.speculative else 0),
)

#: ``(rank, stats, serving)`` of each dp replica
ReplicaStats = Callable[[], "list[tuple[int, EngineStats, bool]]"]


class _EngineCollector(Collector):
    """Exports the latest EngineStats snapshot at scrape time: the totals
    under ``fdx:NAME`` and, with dp replicas, each replica's under
    ``fdx:dp_NAME{dp_rank}`` (other names, so a sum over a total's series
    never counts a replica twice)."""

    def __init__(self, get_stats: Callable[[], EngineStats], model: str,
                 get_replicas: ReplicaStats | None = None) -> None:
        self.get_stats = get_stats
        self.model = model
        self.get_replicas = get_replicas

    def collect(self) -> Iterator[Metric]:
        s = self.get_stats()
        for name, doc, kind, value in _ENGINE_SERIES:
            fam = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            m = fam(f"fdx:{name}", doc, labels=["model_name"])
            m.add_metric([self.model], value(s))
            yield m
        if s.expert_tokens:  # a mixture of experts: each expert's load, and the rank that holds it
            m = CounterMetricFamily("fdx:moe_expert_tokens", "(token, expert) pairs routed to the expert, summed over "
                                    "the MoE layers; rank: the rank that holds it (all: every rank a slice).",
                                    labels=["model_name", "expert", "rank"])
            for e, rank, n in s.expert_tokens:
                m.add_metric([self.model, str(e), rank], n)
            yield m
        if self.get_replicas is None:
            return
        replicas = self.get_replicas()
        for name, doc, kind, value in _ENGINE_SERIES:
            fam = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            m = fam(f"fdx:dp_{name}", f"{doc} (per dp replica)", labels=["model_name", "dp_rank"])
            for rank, rs, _up in replicas:
                m.add_metric([self.model, str(rank)], value(rs))
            yield m
        up = GaugeMetricFamily("fdx:dp_replica_up", "1 while the dp replica serves.", labels=["model_name", "dp_rank"])
        for rank, _rs, serving in replicas:
            up.add_metric([self.model, str(rank)], 1.0 if serving else 0.0)
        yield up


class LoopHistogram(Collector):
    """A histogram observed from the event loop only, once per streamed
    token (``fdx:inter_token_latency_seconds``): a bisect and two plain
    additions, where prometheus_client's Histogram takes a lock per bucket
    and walks the bounds in Python.  Scrapes read the counts as they are."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model: str) -> None:
        self.name, self.doc, self.model = name, doc, model
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # bucket le=b counts amount <= b
        self.sum += amount

    def collect(self) -> Iterator[Metric]:
        m = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += n
            cumulative.append((bound, running))
        m.add_metric([self.model], cumulative, self.sum)
        yield m


class Metrics:
    """Per-process metrics; observed by :class:`fdx.deploy.engine_client.EngineClient`."""

    def __init__(self, model: str, get_stats: Callable[[], EngineStats],
                 get_replicas: ReplicaStats | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg, lab = self.registry, ["model_name"]
        self.model = model
        ProcessCollector(registry=reg)
        reg.register(_EngineCollector(get_stats, model, get_replicas))
        self.ttft = Histogram("fdx:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_TTFT_BUCKETS, registry=reg).labels(model)
        self.itl = LoopHistogram("fdx:inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS, model)
        reg.register(self.itl)
        self.e2e = Histogram("fdx:e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=_E2E_BUCKETS, registry=reg).labels(model)
        self.queue = Histogram("fdx:request_queue_time_seconds",
                               "Arrival to the request's first scheduling in the engine.", lab,
                               buckets=_E2E_BUCKETS, registry=reg).labels(model)
        self.prompt_tokens = Counter("fdx:prompt_tokens", "Prompt tokens processed.", lab, registry=reg).labels(model)
        self.generation_tokens = Counter("fdx:generation_tokens", "Tokens generated.", lab,
                                         registry=reg).labels(model)
        self._success = Counter("fdx:request_success", "Requests finished normally.", lab + ["finished_reason"],
                                registry=reg)
        self.success = {r: self._success.labels(model, r) for r in ("stop", "length")}
        self._aborted = Counter("fdx:request_aborted", "Requests that ended without finishing.", lab,
                                registry=reg).labels(model)
        self.rejected = Counter("fdx:request_rejected", "Requests rejected before reaching the engine.",
                                lab + ["code"], registry=reg)
        self.engine_restarts = Counter("fdx:engine_restarts", "New engine processes ready after a crash.", lab,
                                       registry=reg).labels(model)
        self._crashes = Counter("fdx:engine_crashes",
                                "Engine crashes by reason: crashed (an error in the engine loop), exited (the "
                                "process vanished, e.g. killed), hung (killed after --step-timeout without "
                                "progress), start_failed (a restarted engine could not start).",
                                lab + ["reason"], registry=reg)
        for r in CRASH_REASONS:
            self._crashes.labels(model, r)
        self._last_crash = Info("fdx:engine_last_crash", "The last engine crash: its reason and message.", lab,
                                registry=reg)
        self._dp = get_replicas is not None
        if self._dp:
            dlab = lab + ["dp_rank"]
            self._dp_restarts = Counter("fdx:dp_engine_restarts", "New engine processes of the dp replica ready "
                                        "after a crash.", dlab, registry=reg)
            self._dp_crashes = Counter("fdx:dp_engine_crashes", "Engine crashes of the dp replica, by reason.",
                                       dlab + ["reason"], registry=reg)
            self._dp_routed = Counter("fdx:dp_requests_routed", "Engine requests routed to the dp replica, by "
                                      "reason: affinity (its cached prefix), load (least loaded) or rerouted "
                                      "(its replica went down before any token).",
                                      dlab + ["reason"], registry=reg)
            for rank, _s, _up in get_replicas():  # type: ignore[misc]
                self._dp_restarts.labels(model, str(rank))
                for r in CRASH_REASONS:
                    self._dp_crashes.labels(model, str(rank), r)

    def set_parallel(self, tensor_parallel_size: int, backend: str) -> None:
        """The model's split: ``fdx:tensor_parallel_info{size, backend}``
        (backend ``none`` for one rank)."""
        Info("fdx:tensor_parallel", "Tensor parallelism: the ranks a model is split over and their "
             "collectives backend.", ["model_name"], registry=self.registry).labels(self.model).info(
            {"size": str(tensor_parallel_size), "backend": backend if tensor_parallel_size > 1 else "none"})

    def finished(self, reason: str, num_prompt: int, num_output: int, e2e: float) -> None:
        c = self.success.get(reason)
        if c is not None:
            c.inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        self.e2e.observe(e2e)

    def aborted(self, num_prompt: int, num_output: int) -> None:
        self._aborted.inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)

    def engine_crashed(self, reason: str, message: str, dp_rank: int | None = None) -> None:
        self._crashes.labels(self.model, reason).inc()
        if dp_rank is not None and self._dp:
            self._dp_crashes.labels(self.model, str(dp_rank), reason).inc()
            message = f"dp replica {dp_rank}: {message}"
        self._last_crash.labels(self.model).info({"reason": reason, "message": " ".join(message.split())[:200]})

    def engine_restarted(self, dp_rank: int | None = None) -> None:
        self.engine_restarts.inc()
        if dp_rank is not None and self._dp:
            self._dp_restarts.labels(self.model, str(dp_rank)).inc()

    def dp_routed(self, dp_rank: int, reason: str) -> None:
        """One engine request routed to replica ``dp_rank`` (``affinity``/``load``)."""
        if self._dp:
            self._dp_routed.labels(self.model, str(dp_rank), reason).inc()

    def reject(self, code: int) -> None:
        self.rejected.labels(self.model, str(code)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
