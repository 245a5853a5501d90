"""Every wire message round-trips through the msgpack codec unchanged."""

from __future__ import annotations

import attrs
import pytest

from fdx.core import messages as m

SAMPLES: dict[type, object] = {
    m.SamplingParams: m.SamplingParams(max_tokens=7, temperature=0.5, stop=("\n", "END"), stop_token_ids=(2,), seed=3, logprobs=2),
    m.AddRequest: m.AddRequest("r1", (1, 2, 3), m.SamplingParams(top_k=5), 12.5),
    m.AbortRequest: m.AbortRequest(("a", "b"), "client disconnected"),
    m.ControlRequest: m.ControlRequest("c1", "sleep", {"tags": ["weight", "kv_cache"], "n": 1}),
    m.Shutdown: m.Shutdown("bye"),
    m.TokenLogprob: m.TokenLogprob(5, -0.25, ((5, -0.25), (7, -1.5))),
    m.RequestOutput: m.RequestOutput(
        "r1", (4, 5), "length", 3, 1, 2, (m.TokenLogprob(4, -0.1, ()), m.TokenLogprob(5, -0.2, ((5, -0.2),))), None, 0
    ),
    m.EngineStats: m.EngineStats(num_running=2, num_waiting=1, kv_blocks_total=10, kv_blocks_used=4, is_paused=True),
    m.OutputBatch: m.OutputBatch((m.RequestOutput("x", (1,)), m.RequestOutput("y", (), "error", error="boom", error_code=500)), m.EngineStats()),
    m.ControlReply: m.ControlReply("c1", 200, {"aborted": [{"request_id": "a", "output_token_count": 3}], "not_found": []}),
    m.Heartbeat: m.Heartbeat(1.5, m.EngineStats(steps=9), pid=4321, steps=9, busy_s=2.25),
    m.EngineReady: m.EngineReady(123, 64, 2048, "smollm2", "v2"),
    m.EngineFailed: m.EngineFailed("no model", "Traceback...", pid=4321),
}


def test_every_message_type_has_a_sample() -> None:
    assert set(SAMPLES) == set(m.MESSAGE_TYPES)


@pytest.mark.parametrize("cls", m.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_round_trip(cls: type) -> None:
    msg = SAMPLES[cls]
    data = m.encode(msg)  # type: ignore[arg-type]
    assert isinstance(data, bytes)
    back = m.decode(data)
    assert type(back) is cls
    assert back == msg


@pytest.mark.parametrize("cls", m.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_messages_are_frozen(cls: type) -> None:
    msg = SAMPLES[cls]
    field = attrs.fields(cls)[0].name
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(msg, field, None)


def test_decode_rejects_garbage() -> None:
    with pytest.raises(Exception):
        m.decode(b"\x93\x01\x02")
