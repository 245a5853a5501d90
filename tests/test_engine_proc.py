"""The engine process's input handling: a message the engine fails on is
answered and logged, never the end of the loop; an undecodable message is
skipped.  (The engine is a stand-in here: these are the loop's own rules.)"""

from __future__ import annotations

from typing import Any

import zmq

from fdx.core.errors import ControlError
from fdx.core.engine_proc import handle_input
from fdx.core.ipc import EngineSide, IpcPaths
from fdx.deploy.engine_link import OutputListener
from fdx.core.messages import (
    AbortRequest,
    AddRequest,
    ControlReply,
    ControlRequest,
    EngineStats,
    OutputBatch,
    SamplingParams,
    Shutdown,
    encode,
)


class _Side:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


class _BrokenEngine:
    """Fails on everything, each in its own way."""

    def __init__(self) -> None:
        self.aborted: list[tuple[str, ...]] = []

    def add_request(self, msg: AddRequest) -> None:
        raise KeyError("scheduler table corrupted")

    def abort(self, ids: Any, reason: str = "") -> list[Any]:
        self.aborted.append(tuple(ids))
        if reason != "failed to add":
            raise RuntimeError("abort failed")
        return []

    def control(self, method: str, args: dict[str, Any]) -> Any:
        if method == "pause":
            raise ControlError("already paused", 400)
        raise ZeroDivisionError("boom")

    def stats(self) -> EngineStats:
        return EngineStats(steps=3)


def test_a_failing_message_is_answered_and_the_loop_goes_on() -> None:
    eng, side, cache = _BrokenEngine(), _Side(), [EngineStats()]
    assert handle_input(eng, AddRequest("r1", (1, 2), SamplingParams(), 0.0), side, cache)
    (batch,) = side.sent
    assert isinstance(batch, OutputBatch)
    (out,) = batch.outputs
    assert out.request_id == "r1" and out.finish_reason == "error" and out.error_code == 500
    assert "Error" not in (out.error or "")  # no Python exception names for the client
    assert eng.aborted == [("r1",)]  # whatever it half-registered is cleaned up
    side.sent.clear()
    assert handle_input(eng, AbortRequest(("x",), "client gone"), side, cache)
    assert side.sent == []
    assert handle_input(eng, ControlRequest("c1", "pause"), side, cache)
    assert handle_input(eng, ControlRequest("c2", "sleep"), side, cache)
    replies = [m for m in side.sent if isinstance(m, ControlReply)]
    assert [(r.call_id, r.code) for r in replies] == [("c1", 400), ("c2", 500)]
    assert replies[1].error == "control method sleep failed"
    assert cache[0].steps == 3  # the stats snapshot went out before each reply
    assert handle_input(eng, Shutdown("bye"), side, cache) is False


def test_an_undecodable_input_is_skipped(tmp_path: Any) -> None:
    paths = IpcPaths(str(tmp_path))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind(paths.input_addr)
    out = OutputListener(paths)
    side = EngineSide(paths)
    try:
        push.send(b"\xc1 not msgpack")
        push.send(encode(Shutdown("after the garbage")))
        assert side.poll(5000)
        got = None
        for _ in range(100):
            got = side.recv_nowait()
            if got is not None:
                break
            side.poll(50)
        assert got == Shutdown("after the garbage")
    finally:
        side.close()
        push.close(0)
        out.close()
        ctx.term()
