"""OpenTelemetry tracing (``--otlp-traces-endpoint``, fdx/tracing.py) against a
real OTLP/HTTP receiver on loopback (an ``http.server`` thread decoding
``ExportTraceServiceRequest`` with ``opentelemetry-proto``):

* a real ``fdx serve`` continues a client's W3C ``traceparent``: the API
  span is its child, the phase spans (preprocess, queue, prefill, decode,
  detokenize) are the API span's, with the GenAI attributes and the usage
  the reply reported; streaming and not; without a traceparent a new trace;
* the splitwise topology (router, P, D): one trace id across the router's
  span, D's API span and the engine spans of P (prefill, KV send) and D
  (KV receive: connector, bytes), each exported by its own process;
* dp (two replicas): the API span names the replica that served;
* off (the default), the serving modules import no OpenTelemetry SDK; a bad
  endpoint is a one-line error.
"""

from __future__ import annotations

import http.server
import os
import secrets
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from serverutil import start_server

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest, ExportTraceServiceResponse)

COMMON = ("--num-threads", "1", "--max-num-seqs", "8")
SPAN_KIND_SERVER = 2


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it is sent, flattened."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                got = []
                for rs in req.resource_spans:
                    res = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            got.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                        "parent": s.parent_span_id.hex(), "kind": s.kind,
                                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                        "status": s.status.code, "attrs": {a.key: _value(a.value)
                                                                           for a in s.attributes},
                                        "resource": res, "path": self.path})
                with receiver.lock:
                    receiver.spans.extend(got)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def trace(self, trace_id: str, names: set[str], timeout: float = 30.0) -> list[dict[str, Any]]:
        """The spans of ``trace_id`` once every name in ``names`` arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(receiver: Receiver) -> Iterator[str]:
    with start_server("--otlp-traces-endpoint", receiver.url, *COMMON) as (base, _proc):
        yield base


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _by_name(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        out.setdefault(s["name"], []).append(s)
    return out


PHASES = {"preprocess", "queue", "prefill", "decode", "detokenize"}


@pytest.mark.parametrize("stream", [False, True])
def test_client_traceparent_is_continued_with_genai_attributes(server: str, receiver: Receiver,
                                                              stream: bool) -> None:
    tp, trace_id, client_span = _traceparent()
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 12, "temperature": 0.0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers={"traceparent": tp}, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        import json

        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
    else:
        usage = r.json()["usage"]
    spans = receiver.trace(trace_id, {"chat smollm2"} | PHASES)
    names = _by_name(spans)
    assert {"chat smollm2"} | PHASES <= set(names), sorted(names)
    (api,) = names["chat smollm2"]
    assert api["parent"] == client_span and api["kind"] == SPAN_KIND_SERVER
    assert api["resource"]["fdx.process"] == "api"
    a = api["attrs"]
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "smollm2"
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    for name in PHASES:
        (s,) = names[name]
        assert s["parent"] == api["span_id"], name
        assert api["start"] <= s["start"] <= s["end"] <= api["end"], name
    q, p, d = names["queue"][0], names["prefill"][0], names["decode"][0]
    assert q["end"] <= p["start"] + 1000 and p["end"] <= d["start"] + 1000  # in order (1 µs of rounding)
    assert d["attrs"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert names["detokenize"][0]["attrs"]["fdx.detokenize.calls"] >= 1


def test_without_traceparent_a_new_trace_per_request(server: str, receiver: Receiver) -> None:
    ids = []
    for _ in range(2):
        r = httpx.post(server + "/v1/completions", json={"model": "smollm2", "prompt": "Hello", "max_tokens": 3},
                       timeout=120)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with receiver.lock:
            roots = [s for s in receiver.spans if s["name"] == "text_completion smollm2"
                     and s["attrs"].get("gen_ai.response.id") in ids]
        if len(roots) == 2:
            break
        time.sleep(0.1)
    assert len(roots) == 2
    assert all(s["parent"] == "" for s in roots)
    assert roots[0]["trace_id"] != roots[1]["trace_id"]


def test_a_stream_cut_by_the_client_ends_its_span_with_an_error(server: str, receiver: Receiver) -> None:
    tp, trace_id, _ = _traceparent()
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers={"traceparent": tp}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one event, then hang up
    spans = receiver.trace(trace_id, {"text_completion smollm2"})
    (api,) = [s for s in spans if s["name"] == "text_completion smollm2"]
    assert api["status"] == 2  # STATUS_CODE_ERROR
    assert api["attrs"]["gen_ai.usage.output_tokens"] < 400


@pytest.mark.parametrize("body,code,kind", [
    ({"temperature": -1.0}, 400, "validation"),  # refused by the request schema
    ({"max_tokens": 10**6}, 400, "length"),  # refused by the serving layer: too long for the context
])
def test_a_refused_request_has_an_error_span(server: str, receiver: Receiver, body: dict[str, Any], code: int,
                                              kind: str) -> None:
    tp, trace_id, client_span = _traceparent()
    req = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], **body}
    r = httpx.post(server + "/v1/chat/completions", json=req, headers={"traceparent": tp}, timeout=120)
    assert r.status_code == code, (kind, r.text)
    spans = receiver.trace(trace_id, {"chat smollm2"})
    (api,) = [s for s in spans if s["name"] == "chat smollm2"]  # one span: no phase children, no duplicate
    assert len(spans) == 1, [s["name"] for s in spans]
    assert api["parent"] == client_span and api["status"] == 2  # STATUS_CODE_ERROR
    assert api["attrs"]["http.response.status_code"] == code
    assert api["attrs"]["error.type"] == r.json()["error"]["type"]


def test_tracing_off_imports_no_sdk() -> None:
    code = ("import sys; import fdx.server.api_proc, fdx.server.serving.endpoints, fdx.router.app, "
            "fdx.plugins.schedulers.splitwise, fdx.core.engine_proc; "
            "print([m for m in sys.modules if m.startswith('opentelemetry.sdk') or 'exporter' in m])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("url", ["foo", "ftp://127.0.0.1:4318/v1/traces"])
def test_a_bad_endpoint_is_a_one_line_error(url: str) -> None:
    out = subprocess.run([sys.executable, "-m", "fdx", "serve", "--otlp-traces-endpoint", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--otlp-traces-endpoint" in lines[0], out.stderr


@pytest.mark.slow
def test_splitwise_one_trace_across_router_prefill_and_decode(receiver: Receiver) -> None:
    with start_server("--scheduler", "splitwise", "--num-prefill", "1", "--num-decode", "1",
                      "--splitwise-handoff-timeout", "600", "--otlp-traces-endpoint", receiver.url,
                      *COMMON, timeout=300) as (base, _proc):
        tp, trace_id, client_span = _traceparent()
        prompt = list(range(1000, 1040))  # 40 tokens: 3 blocks of KV to move
        r = httpx.post(base + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 4,
                                                       "temperature": 0.0}, headers={"traceparent": tp},
                       timeout=300)
        assert r.status_code == 200, r.text
        want = {"router", "text_completion smollm2", "prefill", "kv_transfer", "decode"}
        spans = receiver.trace(trace_id, want, timeout=30)
        deadline = time.monotonic() + 30
        while sum(s["name"] == "kv_transfer" for s in spans) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            spans = receiver.trace(trace_id, want, timeout=1)
    names = _by_name(spans)
    assert want <= set(names), sorted(names)
    (router,) = names["router"]
    assert router["parent"] == client_span and router["resource"]["fdx.process"] == "router"
    (api,) = names["text_completion smollm2"]
    assert api["parent"] == router["span_id"]
    assert api["resource"]["fdx.process"] == "api" and api["resource"]["fdx.splitwise.role"] == "decode"
    assert api["attrs"]["gen_ai.usage.input_tokens"] == len(prompt)
    # P's engine: the prompt computed, then the KV sent; D's engine: the KV received
    p_prefill = [s for s in names["prefill"] if s["resource"]["fdx.process"] == "engine"]
    assert len(p_prefill) == 1 and p_prefill[0]["resource"]["fdx.splitwise.role"] == "prefill"
    assert p_prefill[0]["attrs"]["gen_ai.usage.input_tokens"] == len(prompt)
    kv = {s["attrs"]["fdx.kv_transfer.direction"]: s for s in names["kv_transfer"]}
    assert set(kv) == {"send", "receive"}
    assert kv["send"]["resource"]["fdx.splitwise.role"] == "prefill"
    assert kv["receive"]["resource"]["fdx.splitwise.role"] == "decode"
    for s in kv.values():
        assert s["attrs"]["fdx.kv_connector"] == "zmq"
        assert s["attrs"]["fdx.kv_transfer.bytes"] > 0 and s["attrs"]["fdx.kv_transfer.blocks"] == 3
        assert s["parent"] == api["span_id"]
    assert kv["send"]["attrs"]["fdx.kv_transfer.bytes"] == kv["receive"]["attrs"]["fdx.kv_transfer.bytes"]
    pids = {(s["resource"]["fdx.process"], s["resource"]["process.pid"]) for s in spans}
    assert len(pids) == 4, pids  # router, D's API, P's engine, D's engine


@pytest.mark.slow
def test_dp_the_replica_that_served_is_named(receiver: Receiver) -> None:
    with start_server("--scheduler", "dp", "--data-parallel-size", "2", "--otlp-traces-endpoint", receiver.url,
                      *COMMON, timeout=300) as (base, _proc):
        tp, trace_id, client_span = _traceparent()
        r = httpx.post(base + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3},
                       headers={"traceparent": tp}, timeout=120)
        assert r.status_code == 200, r.text
        spans = receiver.trace(trace_id, {"text_completion smollm2"} | PHASES)
    (api,) = _by_name(spans)["text_completion smollm2"]
    assert api["parent"] == client_span
    assert api["attrs"]["fdx.dp.rank"] in (0, 1)
    assert PHASES <= {s["name"] for s in spans}
