"""Control-plane logic without Paddle: the real Engine, scheduler and KV
manager around a fake model runner (it samples token 7 every step), plus
the request-id mapping of fdx/server/control.py and the --api-key guard.
The end-to-end behaviour is in test_control_pause_abort.py and
test_control_sleep_weights.py."""

from __future__ import annotations

import types
from typing import Any, Sequence

import numpy as np
import pytest

from fdx.config import make_config
from fdx.engine_control import ControlError, parse_tags
from fdx.core.engine import Engine
from fdx.core.errors import ModelLoadError
from fdx.core.interfaces import ModelOutput, ScheduledBatch
from fdx.core.messages import AddRequest, SamplingParams


class FakeRunner:
    """Just enough of ModelRunner for the engine: always samples token 7."""

    num_kv_blocks = 64
    block_size = 16
    max_model_len = 512
    eos_token_ids = frozenset({2})
    vocab_size = 100

    def __init__(self) -> None:
        self.weights_version = ""
        self.released: list[str] = []
        self.fail_restore = False
        self.calls: list[tuple[str, Any]] = []

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        assert "weight" not in self.released and "kv_cache" not in self.released, "ran while asleep"
        return ModelOutput(np.full(len(batch.seqs), 7, dtype=np.int64))

    def release(self, tags: Sequence[str]) -> None:
        self.calls.append(("release", list(tags)))
        self.released += [t for t in tags if t not in self.released]

    def restore(self, tags: Sequence[str]) -> None:
        self.calls.append(("restore", list(tags)))
        if self.fail_restore:
            raise OSError("weights file vanished")
        self.released = [t for t in self.released if t not in tags]

    def load_weights(self, path: str, version: str) -> None:
        if path == "bad-shapes":
            raise ModelLoadError("bad-shapes: shapes differ from the running model: num_layers=2 (running 30)")
        self.weights_version = version


@pytest.fixture(params=["v1", "v0"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """v1 and v0 both pause through ``Scheduler.preempt_all``: v1 preempts
    every request, v0 (which cannot recompute) drops them the same way, so
    pausing never waits for running requests to drain."""
    cfg = make_config(scheduler=request.param, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
    return Engine(cfg, runner=FakeRunner())  # type: ignore[arg-type]


def add(engine: Engine, rid: str, max_tokens: int = 50) -> None:
    engine.add_request(AddRequest(rid, tuple(range(10, 30)), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                          ignore_eos=True), 0.0))


def drain(engine: Engine) -> list[Any]:
    out = []
    for _ in range(1000):
        if not engine.has_work():
            return out
        out += engine.step()
    raise AssertionError("engine never went idle")


def test_parse_tags() -> None:
    assert parse_tags(None) == ["weight", "kv_cache"]
    assert parse_tags("") == ["weight", "kv_cache"]
    assert parse_tags("kv_cache") == ["kv_cache"]
    assert parse_tags("kv_cache, weight,kv_cache") == ["weight", "kv_cache"]
    assert parse_tags(["kv_cache"]) == ["kv_cache"]
    with pytest.raises(ControlError, match="gpu") as e:
        parse_tags("weight,gpu")
    assert e.value.code == 400
    with pytest.raises(ControlError):
        parse_tags(3)  # type: ignore[arg-type]


def test_dispatch_errors(engine: Engine) -> None:
    for method in ("nope", "__init__", "../x", ""):
        with pytest.raises(ControlError, match="unknown control method") as e:
            engine.control(method, {})
        assert e.value.code == 400
    with pytest.raises(ControlError, match="bad arguments for pause") as e:
        engine.control("pause", {"x": 1})
    assert e.value.code == 400
    engine.runner.fail_restore = True  # type: ignore[attr-defined]
    engine.control("sleep", {"tags": "weight"})
    with pytest.raises(ControlError, match="control method wakeup failed: OSError: weights file vanished") as e:
        engine.control("wakeup", {})
    assert e.value.code == 500
    # still asleep and paused: a retried wakeup works
    assert engine.control("is_paused", {}) == {"is_paused": True, "sleeping": ["weight"]}
    engine.runner.fail_restore = False  # type: ignore[attr-defined]
    assert engine.control("wakeup", {})["is_paused"] is False


def test_pause_ends_every_request_and_rejects_new_ones(engine: Engine) -> None:
    for i in range(12):
        add(engine, f"r{i}")
    engine.step()
    engine.step()
    assert engine.kv.num_used_blocks > 0
    assert engine.control("pause", {}) == {"is_paused": True, "num_aborted": 12}
    assert engine.kv.num_used_blocks == 0
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(f"r{i}" for i in range(12))
    assert all(o.finish_reason == "error" and o.error_code == 503 for o in outs)
    add(engine, "late")
    (late,) = engine.step()
    assert late.finish_reason == "error" and late.error_code == 503 and "paused" in (late.error or "")
    assert engine.control("pause", {}) == {"is_paused": True, "num_aborted": 0}
    assert not engine.has_work()
    assert engine.control("resume", {}) == {"is_paused": False}
    add(engine, "after", 3)
    outs = drain(engine)
    assert [o.finish_reason for o in outs if o.finish_reason] == ["length"]


def test_abort_requests_returns_partial_counts(engine: Engine) -> None:
    add(engine, "a")
    add(engine, "b")
    for _ in range(4):
        engine.step()
    res = engine.control("abort_requests", {"req_ids": ["a", "zz"]})
    assert res["not_found"] == ["zz"]
    assert res["aborted"] == [{"request_id": "a", "output_token_count": 4}]
    (out,) = engine.step()[:1]
    assert out.request_id == "a" and out.finish_reason == "abort"
    res = engine.control("abort_requests", {"abort_all": True})
    assert [a["request_id"] for a in res["aborted"]] == ["b"] and res["not_found"] == []
    engine.step()
    assert engine.kv.num_used_blocks == 0
    with pytest.raises(ControlError) as e:
        engine.control("abort_requests", {"req_ids": [1]})
    assert e.value.code == 400


def test_sleep_wakeup_state_machine(engine: Engine) -> None:
    add(engine, "a")
    engine.step()
    res = engine.control("sleep", {"tags": "weight,kv_cache"})
    assert res["sleeping"] == ["kv_cache", "weight"] and res["released"] == ["weight", "kv_cache"]
    assert engine.is_paused
    assert engine.step()[0].error_code == 503  # "a" was ended by the implicit pause
    # sleeping twice releases nothing more
    assert engine.control("sleep", {})["released"] == []
    with pytest.raises(ControlError, match="call wakeup") as e:
        engine.control("resume", {})
    assert e.value.code == 400
    with pytest.raises(ControlError, match="weights are asleep"):
        engine.control("update_weights", {"path": "x"})
    # partial wakeup keeps the engine paused
    assert engine.control("wakeup", {"tags": "kv_cache"}) == {"restored": ["kv_cache"], "sleeping": ["weight"],
                                                              "is_paused": True}
    assert engine.control("wakeup", {}) == {"restored": ["weight"], "sleeping": [], "is_paused": False}
    add(engine, "b", 3)
    assert [o.finish_reason for o in drain(engine) if o.finish_reason] == ["length"]
    # a plain wakeup with nothing asleep resumes (like the seed)
    engine.control("pause", {})
    assert engine.control("wakeup", {})["is_paused"] is False


def test_update_weights_rules(engine: Engine) -> None:
    with pytest.raises(ControlError, match="paused engine") as e:
        engine.control("update_weights", {"path": "/x", "version": "v2"})
    assert e.value.code == 400
    engine.control("pause", {})
    with pytest.raises(ControlError, match="needs 'path'"):
        engine.control("update_weights", {})
    with pytest.raises(ControlError, match="num_layers=2 \\(running 30\\)") as e:
        engine.control("update_weights", {"path": "bad-shapes"})
    assert e.value.code == 400
    assert engine.control("update_weights", {"path": "/ckpt", "version": "v2"}) == {"version": "v2", "path": "/ckpt"}
    assert engine.stats().weights_version == "v2"
    assert engine.control("update_weights", {"path": "/ckpt2"})["version"] == "/ckpt2"


# --------------------------------------------------------------------------
# API-level request-id mapping
# --------------------------------------------------------------------------


def _handle(rid: str, index: int, sink: object) -> Any:
    return types.SimpleNamespace(request_id=rid, tag=types.SimpleNamespace(index=index), sink=sink)


def test_engine_ids_for_and_api_ids() -> None:
    from fdx.deploy.request_ids import api_ids, engine_ids_for

    s1, s2, s3, s4 = object(), object(), object(), object()
    live = {
        "cmpl-a": _handle("cmpl-a", 0, s1),
        "cmpl-b-0": _handle("cmpl-b-0", 0, s2),
        "cmpl-b-1": _handle("cmpl-b-1", 1, s2),
        "job-7-2": _handle("job-7-2", 2, s3),  # n=3, choices 0 and 1 already done
        "x-0": _handle("x-0", 0, s4),  # a user id that happens to end in -0
    }
    client = types.SimpleNamespace(_live=live)
    assert engine_ids_for(client, "cmpl-a") == ["cmpl-a"]
    assert engine_ids_for(client, "cmpl-b") == ["cmpl-b-0", "cmpl-b-1"]
    assert engine_ids_for(client, "job-7") == ["job-7-2"]
    assert engine_ids_for(client, "cmpl-zzz") == ["cmpl-zzz"]
    assert engine_ids_for(client, "cmpl-b-1") == ["cmpl-b-1"]
    assert api_ids(client) == {"cmpl-a": "cmpl-a", "cmpl-b-0": "cmpl-b", "cmpl-b-1": "cmpl-b", "job-7-2": "job-7",
                               "x-0": "x-0"}


def test_api_key_guards_control_routes(tmp_path: Any) -> None:
    from starlette.testclient import TestClient

    from fdx.core.ipc import IpcPaths
    from fdx.server.app import create_app
    from fdx.deploy.engine_client import EngineClient

    cfg = make_config(api_key="sekret")
    client = EngineClient(cfg, IpcPaths(str(tmp_path)))
    with TestClient(create_app(cfg, client)) as http:
        for method, path in (("POST", "/v1/pause"), ("GET", "/v1/is_paused"), ("POST", "/v1/sleep"),
                             ("POST", "/v1/update_weights"), ("POST", "/v1/abort_requests")):
            assert http.request(method, path).status_code == 401, path
        r = http.post("/v1/pause", headers={"Authorization": "Bearer sekret"}, json={})
        # authorised, but no engine in this test: a clear 503, in the control reply shape
        assert r.status_code == 503 and r.json()["status"] == "error" and "engine" in r.json()["message"]
