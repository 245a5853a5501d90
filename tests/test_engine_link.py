"""The API process's half of the IPC (fdx/deploy/engine_link.py): the short
decode path of an OutputBatch equals the generic decode, and the loop reader
delivers every message a real engine socket sent, in order, including a
burst queued before the reader started and a garbled one in between."""

from __future__ import annotations

import asyncio

import pytest

from fdx.core.ipc import EngineSide, make_run_dir
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
from fdx.deploy.engine_link import FrontendSide, decode_output

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
def test_decode_output_equals_decode(msg: object) -> None:
    got = decode_output(encode(msg))  # type: ignore[arg-type]
    assert got == decode(encode(msg)) == msg  # type: ignore[arg-type]
    assert type(got) is type(msg)
    if isinstance(got, OutputBatch):
        assert all(type(o.new_token_ids) is tuple for o in got.outputs)
        assert got.stats is None or type(got.stats.expert_tokens) is tuple


def test_reader_delivers_every_message_in_order() -> None:
    paths = make_run_dir()

    async def main() -> list[object]:
        side = FrontendSide(paths)
        engine = EngineSide(paths)
        got: list[object] = []
        try:
            sent = [OutputBatch((RequestOutput(f"r{i}", (i,), None, 1, 0, 1),), STATS) for i in range(50)]
            for m in sent[:20]:  # queued before the reader starts
                engine.send(m)
            await asyncio.sleep(0.2)
            drain = side.start_reader(got.append)
            engine.out.send(b"\xc1 not msgpack")  # logged and skipped
            for m in sent[20:]:
                engine.send(m)
            for _ in range(500):
                if len(got) == len(sent):
                    break
                await asyncio.sleep(0.01)
            drain()  # safe at any time
            assert got == sent
            return got
        finally:
            side.close()
            engine.close()

    try:
        asyncio.run(main())
    finally:
        paths.cleanup()
