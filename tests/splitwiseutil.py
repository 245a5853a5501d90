"""In-process splitwise harness for tests: a prefill and a decode
:class:`~fdx.core.engine.Engine` (and a mixed one as the reference) on the
:class:`~fdx.testing.EchoRunner` -- a runner without a model whose KV pool
holds each position's token id and which fails a step whose computed
positions hold anything else, so a handoff that moved the wrong KV (or
none) fails loudly on D's first decode."""

from __future__ import annotations

import time
from typing import Any, Iterable

from fdx.config import make_config
from fdx.core.engine import Engine
from fdx.core.messages import AddRequest, KVTransferParams, RequestOutput, SamplingParams
from fdx.testing import EchoRunner


def echo_engine(plugins: Any = None, **cfg: Any) -> Engine:
    config = make_config(**{"num_kv_blocks": 64, "max_model_len": 512, **cfg})
    return Engine(config, plugins=plugins, runner=EchoRunner(config))


def pd_pair(connector: str = "zmq", plugins: Any = None, connector_config: dict | None = None,
            **cfg: Any) -> tuple[Engine, Engine]:
    common = {"scheduler": "splitwise", "kv_connector": connector, "kv_connector_config": connector_config or {},
              **cfg}
    return (echo_engine(plugins, splitwise_role="prefill", **common),
            echo_engine(plugins, splitwise_role="decode", **common))


def request(rid: str, prompt: Iterable[int], prefill: Engine | None = None, **params: Any) -> AddRequest:
    kv = KVTransferParams(prefill.connector.address) if prefill is not None else None
    return AddRequest(rid, tuple(prompt), SamplingParams(**{"temperature": 0.0, **params}), time.time(), kv)


def drive(engines: list[Engine], until: Any, timeout: float = 30.0) -> dict[str, list[RequestOutput]]:
    """Step every engine (even when idle: a toy connector has nothing to
    poll) until ``until(outputs)``; returns each request's outputs."""
    outs: dict[str, list[RequestOutput]] = {}
    deadline = time.monotonic() + timeout
    while not until(outs):
        if time.monotonic() > deadline:
            raise AssertionError(f"not done after {timeout} s: {outs}")
        for e in engines:
            for o in e.step():
                outs.setdefault(o.request_id, []).append(o)
        time.sleep(0.001)
    return outs


def finished(*ids: str) -> Any:
    return lambda outs: all(i in outs and outs[i][-1].finish_reason is not None for i in ids)


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def free_tcp_address() -> str:
    """A loopback TCP address nothing listens on (a moment ago)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
