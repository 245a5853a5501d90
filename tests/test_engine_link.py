"""The output channel (fdx/core/ipc.py, fdx/deploy/engine_link.py): an
OutputBatch's compact rows decode to the same message; frames cut at any
byte come out whole; and the loop reader delivers every message a real
engine connection sent, in order, including a burst sent before the reader
started, a garbled one in between, and a second connection whose writer
died mid-frame."""

from __future__ import annotations

import asyncio

import pytest

import random

import msgpack

from fdx.core.ipc import FRAME, EngineSide, OutputWriter
from fdx.deploy.launcher import make_run_dir
from fdx.core.messages import (
    BeamSequence,
    EngineStats,
    Heartbeat,
    OutputBatch,
    RequestOutput,
    SpecDecodeStats,
    SplitwiseStats,
    TokenLogprob,
    decode,
    encode,
)
from fdx.deploy.engine_link import FrameReader, FrontendSide, OutputListener

PLAIN = RequestOutput("cmpl-1", (1, 2), None, 3, 1, 2, None, None, 0, 0.25)
DONE = RequestOutput("cmpl-2", (7,), "length", 4, 0, 9)
FAILED = RequestOutput("cmpl-3", (), "error", 4, 0, 0, error="boom", error_code=500)
WITH_LP = RequestOutput("cmpl-4", (5,), None, 2, 0, 1, logprobs=(TokenLogprob(5, -0.5, ((6, -1.0),), 2),))
WITH_BEAMS = RequestOutput("cmpl-5", (5,), "stop", 2, 0, 1, beams=(BeamSequence((5,), -0.5, -0.5, "stop"),))
STATS = EngineStats(num_running=2, kv_blocks_total=10, weights_version="v1", expert_tokens=((1, "r0", 3),),
                    splitwise=SplitwiseStats("prefill", "a", handoff_buckets=(1, 2)),
                    speculative=SpecDecodeStats(1, 2, 1, (1,)))


@pytest.mark.parametrize("msg", [
    OutputBatch((PLAIN, DONE, FAILED), STATS),
    OutputBatch((PLAIN,), None),
    OutputBatch((), EngineStats()),
    OutputBatch((PLAIN, WITH_LP), STATS),
    OutputBatch((WITH_BEAMS,), None),
    Heartbeat(1.0, STATS, pid=7, steps=3, busy_s=0.5),
])
def test_output_batch_round_trips(msg: object) -> None:
    got = decode(encode(msg))  # type: ignore[arg-type]
    assert got == msg
    assert type(got) is type(msg)
    if isinstance(got, OutputBatch):
        assert all(type(o.new_token_ids) is tuple for o in got.outputs)
        assert got.stats is None or type(got.stats.expert_tokens) is tuple


def test_plain_outputs_travel_as_rows() -> None:
    wire = msgpack.unpackb(encode(OutputBatch((PLAIN, WITH_LP, DONE), None)))
    rows = wire["outputs"]
    assert [type(r) for r in rows] == [list, dict, list]  # logprobs: the full map
    assert rows[0] == ["cmpl-1", [1, 2], None, 3, 1, 2, None, 0, 0.25]


def test_frames_cut_anywhere_come_out_whole() -> None:
    rng = random.Random(7)
    frames = [bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 5, 300, 70000]))) for _ in range(40)]
    stream = b"".join(FRAME.pack(len(f)) + f for f in frames)
    for _ in range(20):
        reader, got, pos = FrameReader(), [], 0
        while pos < len(stream):
            step = rng.choice([1, 3, 4, 7, 100, 5000, 100000])
            got.extend(reader.feed(stream[pos:pos + step]))
            pos += step
        assert got == frames and not reader.buf


def test_reader_delivers_every_message_in_order() -> None:
    paths = make_run_dir()

    async def main() -> None:
        side = FrontendSide(paths)
        engine = EngineSide(paths)
        got: list[object] = []
        try:
            sent = [OutputBatch((RequestOutput(f"r{i}", (i,), None, 1, 0, 1),), STATS) for i in range(50)]
            for m in sent[:20]:  # sent before the reader starts
                engine.send(m)
            await asyncio.sleep(0.2)
            await side.start_reader(got.append)
            engine.out.send_bytes(b"\xc1 not msgpack")  # logged and skipped
            # a second connection (the heartbeat thread's) that dies mid-frame: its part is dropped
            other = OutputWriter(paths.output_path)
            other.send(Heartbeat(2.0, STATS, pid=9))
            assert other.sock is not None
            other.sock.sendall(FRAME.pack(1000) + b"only part of it")
            other.close()
            for m in sent[20:]:
                engine.send(m)
            for _ in range(500):
                if len(got) == len(sent) + 1:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert [m for m in got if isinstance(m, OutputBatch)] == sent
            assert [m for m in got if not isinstance(m, OutputBatch)] == [Heartbeat(2.0, STATS, pid=9)]
        finally:
            side.close()
            engine.close()

    try:
        asyncio.run(main())
    finally:
        paths.cleanup()


def test_writer_raises_when_the_front_end_is_gone_and_connects_again() -> None:
    """An engine's send to a closed front end raises ChannelClosed (the
    engine loop exits on it; the heartbeat thread skips a beat), so does one
    that finds nobody listening, and the next send connects to whoever
    listens then."""
    from fdx.core.ipc import ChannelClosed

    paths = make_run_dir()
    try:
        first = OutputListener(paths)
        writer = OutputWriter(paths.output_path, timeout=1.0)
        writer.send(Heartbeat(1.0, STATS, pid=1))
        assert first.recv(5.0) == Heartbeat(1.0, STATS, pid=1)
        first.close()
        with pytest.raises(ChannelClosed):
            for _ in range(100):  # (the peer's close reaches this end at once; a few tries at most)
                writer.send(Heartbeat(2.0, STATS, pid=1))
        assert writer.sock is None
        with pytest.raises(ChannelClosed):  # nobody listens: it says so at once
            writer.send(Heartbeat(3.0, STATS, pid=1))
        second = OutputListener(paths)
        try:
            writer.send(Heartbeat(4.0, STATS, pid=1))
            assert second.recv(5.0) == Heartbeat(4.0, STATS, pid=1)
        finally:
            writer.close()
            second.close()
    finally:
        paths.cleanup()
