"""OpenTelemetry tracing (``--otlp-traces-endpoint URL``), as vLLM and FastDeploy offer it.

Off by default.  Off, nothing here imports the OpenTelemetry SDK and no
request does any tracing work beyond one ``is None`` test; the only trace
of tracing on the wire is the empty ``AddRequest.trace_context``.

On, each process that takes part exports its own spans over OTLP/HTTP
(protobuf) to the endpoint, through one batching span processor (flushed
at exit and every :data:`FLUSH_DELAY_MS`, ``OTEL_BSP_SCHEDULE_DELAY``
overrides it).  A W3C ``traceparent`` header from the client is continued;
the context then travels as a ``traceparent`` string: router -> instance
in the HTTP hop, API process -> engine in ``AddRequest.trace_context``,
decode engine -> prefill engine in the splitwise job (the same field).

The spans of one request (see docs/TRACING.md):

* API process (:class:`RequestTrace`): the SERVER span ``chat MODEL`` /
  ``text_completion MODEL`` (arrival to the last byte) with the GenAI
  attributes, and its children ``preprocess`` (template + tokenization),
  ``queue`` (sent -> first scheduled), ``prefill`` (first scheduled ->
  first token), ``decode`` (first -> last token) and ``detokenize``.  The
  engine-side phases are built here from the timestamps the engine already
  reports (``RequestOutput.queue_time``, the arrival of the first and last
  tokens), so the engine's step loop does no tracing work at all.
* router (:func:`router_span`): a SERVER span ``router`` per relayed
  request, parent of the instance's API span.
* splitwise engines (:func:`engine_span`, from the splitwise scheduler):
  P's ``prefill`` (job received -> first token) and ``kv_transfer`` (the
  send: connector, bytes), D's ``kv_transfer`` (preallocation -> KV
  inserted: connector, bytes).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from fdx.core.errors import ConfigError

if TYPE_CHECKING:  # (fdx.config imports this module to check the flag: its EngineConfig is typed Any here)
    from fdx.core.messages import SamplingParams

log = logging.getLogger("fdx.tracing")

#: the batching span processor's export delay (ms) unless ``OTEL_BSP_SCHEDULE_DELAY`` is set
FLUSH_DELAY_MS = 500
#: the name under which fdx's spans are created (the instrumentation scope)
SCOPE = "fdx"

_lock = threading.Lock()
_tracer: Any = None
_provider: Any = None


def check_endpoint(url: str) -> None:
    """A one-line :class:`ConfigError` unless ``url`` is an http(s) URL and
    the SDK is installed (checked without importing it)."""
    from importlib.util import find_spec
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--otlp-traces-endpoint {url!r}: expected an OTLP/HTTP URL like "
                          "http://127.0.0.1:4318/v1/traces")
    for mod in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError("--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter: "
                              "pip install 'fdx[tracing]'")


def tracer(endpoint: str | None, process: str, **resource: Any) -> Any:
    """The process's OpenTelemetry tracer exporting to ``endpoint``, made
    on first use (``None`` when ``endpoint`` is unset: tracing is off).
    ``process`` (``api``, ``engine``, ``router``) and ``resource`` become
    resource attributes (``fdx.process``, ...)."""
    global _tracer, _provider
    if not endpoint:
        return None
    with _lock:
        if _tracer is not None:
            return _tracer
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME", "fdx"), "fdx.process": process,
                 "process.pid": os.getpid()}
        attrs.update({k: v for k, v in resource.items() if v is not None})
        provider = TracerProvider(resource=Resource.create(attrs))
        delay = int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", FLUSH_DELAY_MS))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                       schedule_delay_millis=delay))
        _tracer = provider.get_tracer(SCOPE)
        _provider = provider
        log.info("tracing: OTLP/HTTP spans to %s", endpoint)
        return _tracer


def config_tracer(config: Any, process: str) -> Any:
    """:func:`tracer` for an ``fdx serve`` process of ``config`` (an
    :class:`~fdx.config.EngineConfig`; its role and dp rank as resource
    attributes)."""
    return tracer(config.otlp_traces_endpoint, process, **{"fdx.splitwise.role": config.splitwise_role,
                                                           "fdx.dp.rank": config.dp_rank})


def shutdown() -> None:
    """Flush and stop the exporter (at a clean exit; the SDK also does it atexit)."""
    global _tracer, _provider
    with _lock:
        provider, _tracer, _provider = _provider, None, None
    if provider is None:
        return
    try:
        provider.shutdown()
    except Exception:  # noqa: BLE001 - the collector is away: its spans are lost, serving is not
        log.debug("tracing: flush failed", exc_info=True)


def _ns(t: float) -> int:
    return int(t * 1e9)


def extract(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Any:
    """The OpenTelemetry context of a W3C ``traceparent`` (and
    ``tracestate``) in ``headers`` or a ``{"traceparent": ...}`` carrier;
    an empty context when there is none or it is malformed."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {k.lower(): v for k, v in (headers.items() if isinstance(headers, Mapping) else headers or ())}
    return TraceContextTextMapPropagator().extract(carrier)


def traceparent(span: Any) -> str:
    """``span``'s context as a W3C ``traceparent`` value."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _parent(trace_context: str) -> Any:
    return extract({"traceparent": trace_context}) if trace_context else None


def engine_span(config: Any, name: str, trace_context: str, start: float, end: float,
                attributes: dict[str, Any]) -> None:
    """Record one finished engine-side span (wall-clock ``start``..``end``)
    under ``trace_context``; nothing when tracing is off or the request
    carries no context.  Never raises."""
    if not trace_context or not config.otlp_traces_endpoint:
        return
    try:
        t = config_tracer(config, "engine")
        span = t.start_span(name, context=_parent(trace_context), start_time=_ns(start), attributes=attributes)
        span.end(end_time=_ns(max(start, end)))
    except Exception:  # noqa: BLE001 - tracing must never fail a request
        log.exception("tracing: cannot record span %s", name)


def monotonic_to_wall(t_mono: float) -> float:
    """A ``time.monotonic()`` reading as ``time.time()``."""
    return time.time() - (time.monotonic() - t_mono)


# ---------------------------------------------------------------------------- router


def router_span(tracer_: Any, headers: Any, path: str) -> Any:
    """Start the router's SERVER span for one relayed request (continuing
    the client's ``traceparent``)."""
    from opentelemetry.trace import SpanKind

    return tracer_.start_span("router", context=extract(headers), kind=SpanKind.SERVER,
                              attributes={"http.request.method": "POST", "url.path": path})


def end_span(span: Any, error: str | None = None) -> None:
    """End ``span``, with an ERROR status when ``error`` is set."""
    try:
        if error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
    except Exception:  # noqa: BLE001
        log.exception("tracing: cannot end a span")


# ---------------------------------------------------------------------------- API process


def refused_span(tracer_: Any, headers: Any, operation: str, model: str, code: int, error_type: str,
                 message: str) -> None:
    """Record the SERVER span of a generation request refused before any
    engine saw it (invalid, too long, overloaded, engine down): named as an
    accepted request's span, continuing the client's ``traceparent``, with an
    ERROR status, the HTTP status code and the OpenAI error type, and no
    phase children."""
    try:
        from opentelemetry.trace import SpanKind

        span = tracer_.start_span(f"{operation} {model}", context=extract(headers), kind=SpanKind.SERVER,
                                  attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                                              "http.response.status_code": code, "error.type": error_type})
        end_span(span, message)
    except Exception:  # noqa: BLE001 - tracing must never fail a request
        log.exception("tracing: cannot record a refused request's span")



def request_attributes(operation: str, model: str, params: SamplingParams) -> dict[str, Any]:
    """The GenAI semantic-convention request attributes."""
    a: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.system": "fdx",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": params.n,
    }
    if params.top_k > 0:
        a["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        a["gen_ai.request.seed"] = params.seed
    if params.frequency_penalty:
        a["gen_ai.request.frequency_penalty"] = params.frequency_penalty
    if params.presence_penalty:
        a["gen_ai.request.presence_penalty"] = params.presence_penalty
    if params.stop:
        a["gen_ai.request.stop_sequences"] = list(params.stop)
    return a


class RequestTrace:
    """The spans of one HTTP generation request in the API process.

    :meth:`start` opens the SERVER span at the request's arrival (its
    ``traceparent`` goes to the engine with every choice); :meth:`end`,
    once every choice is over, adds the phase spans from the handles'
    timestamps and closes it."""

    def __init__(self, tracer_: Any, headers: Any, operation: str, model: str, params: SamplingParams,
                 request_id: str, arrival: float) -> None:
        from opentelemetry.trace import SpanKind

        self.tracer = tracer_
        self.arrival = arrival
        self.submitted = time.time()
        self.span = tracer_.start_span(f"{operation} {model}", context=extract(headers), kind=SpanKind.SERVER,
                                       start_time=_ns(arrival),
                                       attributes={**request_attributes(operation, model, params),
                                                   "gen_ai.response.id": request_id})
        self.context = traceparent(self.span)
        self.error: str | None = None
        self.detok_first = 0.0
        self.detok_last = 0.0
        self.detok_busy = 0.0
        self.detok_calls = 0
        self.ended = False

    def timed(self, process: Callable[..., Any]) -> Callable[..., Any]:
        """``process`` (the output processor's detokenizing step), timed."""

        def run(*args: Any) -> Any:
            t0 = time.time()
            try:
                return process(*args)
            finally:
                t1 = time.time()
                if not self.detok_calls:
                    self.detok_first = t0
                self.detok_last = t1
                self.detok_busy += t1 - t0
                self.detok_calls += 1

        return run

    def end(self, handles: Iterable[Any], model: str, finish_reasons: list[str], input_tokens: int,
            output_tokens: int) -> None:
        """Record the phase spans and end the request's span (once)."""
        if self.ended:
            return
        self.ended = True
        try:
            self._end(list(handles), model, finish_reasons, input_tokens, output_tokens)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            log.exception("tracing: cannot record the request's spans")

    def _child(self, name: str, start: float, end: float, **attributes: Any) -> None:
        from opentelemetry import trace as api

        ctx = api.set_span_in_context(self.span)
        s = self.tracer.start_span(name, context=ctx, start_time=_ns(start), attributes=attributes)
        s.end(end_time=_ns(max(start, end)))

    def _end(self, handles: list[Any], model: str, finish_reasons: list[str], input_tokens: int,
             output_tokens: int) -> None:
        span = self.span
        now = time.time()
        self._child("preprocess", self.arrival, self.submitted)
        ttft: float | None = None
        for h in handles:
            rid = {"fdx.request_id": h.request_id}
            sched = self.arrival + h.queue_time if h.queue_time is not None else None
            if sched is not None:
                self._child("queue", self.submitted, max(self.submitted, sched), **rid)
            if h.first_token_time is not None:
                start = sched if sched is not None else self.submitted
                self._child("prefill", start, h.first_token_time, **rid,
                            **{"gen_ai.usage.input_tokens": h.num_prompt_tokens,
                               "fdx.cached_tokens": h.num_cached_tokens})
                t = h.first_token_time - self.arrival
                ttft = t if ttft is None else min(ttft, t)
                self._child("decode", h.first_token_time, h.last_token_time or h.first_token_time, **rid,
                            **{"gen_ai.usage.output_tokens": h.num_output_tokens})
            if h.dp_rank is not None:
                span.set_attribute("fdx.dp.rank", h.dp_rank)
        if self.detok_calls:
            self._child("detokenize", self.detok_first, self.detok_last,
                        **{"fdx.detokenize.busy_s": self.detok_busy, "fdx.detokenize.calls": self.detok_calls})
        span.set_attribute("gen_ai.response.model", model)
        span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        if finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
        if ttft is not None:
            span.set_attribute("gen_ai.latency.time_to_first_token", ttft)
        queue = [h.queue_time for h in handles if h.queue_time is not None]
        if queue:
            span.set_attribute("gen_ai.latency.time_in_queue", max(queue))
        span.set_attribute("gen_ai.latency.e2e", now - self.arrival)
        end_span(span, self.error)
