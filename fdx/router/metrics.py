"""Prometheus metrics of ``fdx router`` (its ``GET /metrics``).

Its own series (``fdx:router_*``):

* ``fdx:router_requests_total{instance,role,reason}``: requests routed to an
  instance; ``reason`` is ``affinity`` or ``load`` (P picked by prefix or by
  load), ``load`` for a D, ``whole`` for a request a mixed (not splitwise)
  instance serves whole;
* ``fdx:router_responses_total{instance,role,code}``: answers relayed to the end;
* ``fdx:router_failures_total{instance,role,kind}``: ``before_answer`` (refused,
  lost or cut before its headers; retried elsewhere when possible) and
  ``stream`` (a stream cut or ended early: one 503 error event);
* ``fdx:router_rejected_total{code}``: errors the router answered itself;
* ``fdx:router_retries_total``, ``fdx:router_client_disconnects_total``;
* ``fdx:router_instance_up{instance,role}``, ``fdx:router_in_flight{instance,role}``;
* ``fdx:router_instance_restarts_total{instance,role}``: new engine pids seen
  (its engine, or the whole instance, started again).

Then every instance's own ``/metrics`` (scraped when the router's is, in
parallel, a bounded wait each), every series re-labelled with
``instance="<base URL>"`` and ``role="prefill"|"decode"``; one family per
name across the instances.  The router exports no ``process_*`` series of
its own (the instances' carry the labels).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterator

import aiohttp
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from fdx.router.instances import Instance, InstancePool

log = logging.getLogger("fdx.router")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TIMEOUT_S = 3.0


def relabel(texts: list[tuple[Instance, str]]) -> list[Metric]:
    """The instances' exposition texts as families, each sample with
    ``instance`` and ``role`` labels; families of one name merged."""
    merged: dict[str, Metric] = {}
    for inst, text in texts:
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as exc:  # noqa: BLE001 - a broken scrape is skipped, not fatal
            log.warning("cannot parse /metrics of %s: %s", inst.url, exc)
            continue
        for fam in families:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            elif out.type != fam.type:
                continue
            for s in fam.samples:
                out.add_sample(s.name, {"instance": inst.url, "role": inst.role, **s.labels}, s.value,
                               s.timestamp)
    return list(merged.values())


class _InstanceCollector(Collector):
    def __init__(self, owner: RouterMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        pool = self.owner.pool
        up = GaugeMetricFamily("fdx:router_instance_up", "1 while the instance is routed to.",
                               labels=["instance", "role"])
        flying = GaugeMetricFamily("fdx:router_in_flight", "Requests in flight on the instance (for a P: "
                                   "handoffs not done yet).", labels=["instance", "role"])
        restarts = CounterMetricFamily("fdx:router_instance_restarts", "Times a new engine pid was seen on the "
                                       "instance (its engine, or the whole instance, started again).",
                                       labels=["instance", "role"])
        for inst in pool.instances:
            up.add_metric([inst.url, inst.role], 1.0 if inst.up else 0.0)
            flying.add_metric([inst.url, inst.role], float(inst.in_flight))
            restarts.add_metric([inst.url, inst.role], float(inst.restarts))
        yield up
        yield flying
        yield restarts
        yield from self.owner.scraped


class RouterMetrics:
    """The router's counters plus the instances' re-labelled series."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=True)
        reg, lab = self.registry, ["instance", "role"]
        self._routed = Counter("fdx:router_requests", "Requests routed to the instance, by reason.",
                               lab + ["reason"], registry=reg)
        self._answered = Counter("fdx:router_responses", "Answers relayed from the instance, by status code.",
                                 lab + ["code"], registry=reg)
        self._failures = Counter("fdx:router_failures", "Requests the instance failed: before_answer (retried "
                                 "elsewhere when possible) or stream (ended with an error event).",
                                 lab + ["kind"], registry=reg)
        self._rejected = Counter("fdx:router_rejected", "Errors the router answered itself, by status code.",
                                 ["code"], registry=reg)
        self.retries = Counter("fdx:router_retries", "Requests sent again to another instance.", registry=reg)
        self.disconnected = Counter("fdx:router_client_disconnects",
                                    "Clients that left before their answer ended.", registry=reg)
        self.scraped: list[Metric] = []
        reg.register(_InstanceCollector(self))

    def routed(self, inst: Instance, reason: str) -> None:
        self._routed.labels(inst.url, inst.role, reason).inc()

    def answered(self, inst: Instance, code: int) -> None:
        self._answered.labels(inst.url, inst.role, str(code)).inc()

    def failure(self, inst: Instance, kind: str) -> None:
        self._failures.labels(inst.url, inst.role, kind).inc()

    def rejected(self, code: int) -> None:
        self._rejected.labels(str(code)).inc()

    async def render(self) -> bytes:
        """Scrape the instances that are up, then render everything."""
        session = self.pool.session
        assert session is not None
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)

        async def one(inst: Instance) -> tuple[Instance, str] | None:
            try:
                async with session.get(inst.url + "/metrics", timeout=timeout, headers=self.pool.headers) as r:
                    if r.status != 200:
                        return None
                    return inst, await r.text()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return None

        got = await asyncio.gather(*(one(i) for i in self.pool.instances if i.up))
        self.scraped = relabel([g for g in got if g is not None])
        try:
            return generate_latest(self.registry)
        finally:
            self.scraped = []


__all__ = ["CONTENT_TYPE", "RouterMetrics", "relabel"]
