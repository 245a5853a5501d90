"""A bad request fails alone; the engine never dies (issue 14, engine side).

The real model in an in-process Engine: requests with bad sampling params
end at once with a 400, requests poisoned past validation fail inside the
step with a 500 while the others finish with the very tokens they give
alone, and a scheduler plugin that raises ends only what it touches.  Every
test ends with no KV block in use and the engine serving again."""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import pytest

from fdx.config import make_config
from fdx.core.engine import Engine
from fdx.core.hookspecs import hookimpl
from fdx.core.messages import AddRequest, SamplingParams
from fdx.core.plugins import collect
from fdx.plugins.schedulers.v1 import V1Scheduler
from fdx.testing import EchoRunner

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [tuple(range(1000 + 7 * i, 1000 + 7 * i + 10 + 3 * i)) for i in range(6)]


def run(engine: Engine, reqs: dict[str, tuple[tuple[int, ...], SamplingParams]], poison: dict[str, Any] | None = None,
        ) -> dict[str, Any]:
    """Add every request, optionally poison some params past validation,
    then step until idle; return each request's tokens and final output."""
    for rid, (prompt, params) in reqs.items():
        engine.add_request(AddRequest(rid, prompt, params, time.time()))
    for rid, changes in (poison or {}).items():
        req = engine.scheduler.get(rid)
        assert req is not None
        req.params = attrs.evolve(req.params, **changes)
    toks: dict[str, list[int]] = {}
    ends: dict[str, Any] = {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.request_id not in ends, f"{o.request_id}: output after its final one"
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                ends[o.request_id] = o
    assert not engine.has_work(), "engine never went idle"
    assert set(ends) == set(reqs), "a request was lost"
    assert engine.kv.num_used_blocks == 0
    return {"tokens": toks, "ends": ends}


def good() -> dict[str, tuple[tuple[int, ...], SamplingParams]]:
    return {f"g{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}


# ---------------------------------------------------------------------------
# the real model
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(make_config(num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def baseline(engine: Engine) -> dict[str, list[int]]:
    res = run(engine, good())
    assert all(o.finish_reason == "length" for o in res["ends"].values())
    return res["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"seed": -1, "temperature": 1.0}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2**63, "temperature": 1.0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop_token_ids": (1 << 40,)}, "stop_token_ids"),
        ({"logprobs": 10_000}, "logprobs"),
        ({"min_tokens": 13}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_params_end_at_once_with_a_400(engine: Engine, baseline: dict[str, list[int]], changes: dict[str, Any],
                                           field: str) -> None:
    reqs = good()
    reqs["bad"] = (PROMPTS[0], attrs.evolve(GREEDY, **changes))
    res = run(engine, reqs)
    bad = res["ends"]["bad"]
    assert bad.finish_reason == "error" and bad.error_code == 400 and field in (bad.error or "")
    assert res["tokens"].get("bad", []) == []
    assert {k: v for k, v in res["tokens"].items() if k != "bad"} == baseline


@pytest.mark.slow
def test_prompt_token_outside_the_vocabulary_is_a_400(engine: Engine, baseline: dict[str, list[int]]) -> None:
    reqs = good()
    reqs["bad"] = ((5, engine.runner.vocab_size), GREEDY)
    res = run(engine, reqs)
    assert res["ends"]["bad"].error_code == 400 and "prompt token ids" in res["ends"]["bad"].error
    assert {k: v for k, v in res["tokens"].items() if k != "bad"} == baseline


@pytest.mark.slow
@pytest.mark.parametrize("changes", [{"seed": -1, "temperature": 1.0}, {"top_k": 2**63 + 5, "temperature": 1.0}])
def test_request_poisoned_inside_the_step_fails_alone(engine: Engine, baseline: dict[str, list[int]],
                                                       changes: dict[str, Any], caplog: Any) -> None:
    """The sampler raises for one row (``PCG64(-1)``, an int64 overflow):
    that request ends with a 500, the rest of its batch finishes with the
    tokens it gives without it."""
    reqs = good()
    reqs["poison"] = (PROMPTS[2], GREEDY)
    with caplog.at_level(logging.ERROR, logger="fdx.engine"):
        res = run(engine, reqs, poison={"poison": changes})
    assert "request poison fails alone in the model runner" in caplog.text  # the step really failed
    bad = res["ends"]["poison"]
    assert bad.finish_reason == "error" and bad.error_code == 500 and bad.error
    assert {k: v for k, v in res["tokens"].items() if k != "poison"} == baseline
    assert all(res["ends"][k].finish_reason == "length" for k in baseline)
    # and the engine goes on serving
    assert run(engine, good())["tokens"] == baseline


# ---------------------------------------------------------------------------
# a scheduler plugin that raises for one request (EchoRunner: no model needed)
# ---------------------------------------------------------------------------


class FlakyScheduler(V1Scheduler):
    """v1, but raises in add_request / update / schedule for marked ids."""

    def add_request(self, request: Any) -> None:
        if request.request_id == "bad-add":
            raise RuntimeError("cannot queue bad-add")
        super().add_request(request)

    def schedule(self) -> Any:
        if any(r.request_id == "bad-schedule" for r in self.waiting):
            raise RuntimeError("schedule broke on bad-schedule")
        return super().schedule()

    def abort(self, request_ids: Any) -> Any:
        ids = list(request_ids)
        if "bad-abort" in ids:
            raise RuntimeError("abort broke on bad-abort")
        return super().abort(ids)

    def update(self, batch: Any, output: Any) -> None:
        super().update(batch, output)
        if any(s.request.request_id == "bad-update" for s in batch.seqs):
            raise RuntimeError("update broke on bad-update")


class FlakyPlugin:
    @hookimpl
    def fdx_register_schedulers(self, register: Any) -> None:
        register("flaky", FlakyScheduler)


@pytest.fixture
def flaky_engine(plugin_manager: Any) -> Any:
    plugin = FlakyPlugin()
    plugin_manager.register(plugin)
    try:
        cfg = make_config(scheduler="flaky", num_kv_blocks=64, max_model_len=512)
        yield Engine(cfg, collect(plugin_manager), runner=EchoRunner(cfg))
    finally:
        plugin_manager.unregister(plugin)


def echoed(prompt: tuple[int, ...], n: int = GREEDY.max_tokens) -> list[int]:
    return [prompt[k % len(prompt)] for k in range(n)]


def echo_reqs(*ids: str) -> dict[str, tuple[tuple[int, ...], SamplingParams]]:
    return {rid: (PROMPTS[i % len(PROMPTS)], GREEDY) for i, rid in enumerate(ids)}


def test_scheduler_failing_to_queue_one_request_ends_only_that_one(flaky_engine: Engine) -> None:
    res = run(flaky_engine, echo_reqs("a", "bad-add", "b"))
    assert res["ends"]["bad-add"].error_code == 500 and "cannot queue bad-add" in res["ends"]["bad-add"].error
    for rid, i in (("a", 0), ("b", 2)):
        assert res["ends"][rid].finish_reason == "length"
        assert res["tokens"][rid] == echoed(PROMPTS[i])  # the echo runner repeats the prompt


def test_a_broken_step_ends_its_requests_and_the_engine_goes_on(flaky_engine: Engine) -> None:
    res = run(flaky_engine, echo_reqs("a", "bad-update", "b"))
    for rid in ("a", "bad-update", "b"):  # all three ran in the broken step
        assert res["ends"][rid].finish_reason == "error" and res["ends"][rid].error_code == 500
        assert "update broke" in res["ends"][rid].error
    res = run(flaky_engine, echo_reqs("c", "d"))
    assert all(o.finish_reason == "length" for o in res["ends"].values())


def test_a_failing_abort_is_logged_and_the_engine_goes_on(flaky_engine: Engine) -> None:
    assert flaky_engine.abort(("bad-abort",)) == []
    res = run(flaky_engine, echo_reqs("c"))
    assert res["ends"]["c"].finish_reason == "length"


def test_a_failing_schedule_ends_the_live_requests_and_the_engine_goes_on(flaky_engine: Engine) -> None:
    res = run(flaky_engine, echo_reqs("a", "bad-schedule"))
    assert {o.error_code for o in res["ends"].values()} == {500}
    res = run(flaky_engine, echo_reqs("c"))
    assert res["ends"]["c"].finish_reason == "length" and res["tokens"]["c"] == echoed(PROMPTS[0])


def test_runner_failures_are_pinned_to_the_requests_that_cause_them(plugin_manager: Any) -> None:
    """Two poisoned requests among eight: bisection ends exactly those two;
    the six others get every token they would get alone."""
    import fdx.plugins.schedulers.v1
    from echo_runner_plugin import PoisonEchoRunner

    plugin_manager.register(fdx.plugins.schedulers.v1)
    cfg = make_config(num_kv_blocks=64, max_model_len=512)
    runner = PoisonEchoRunner(cfg)
    runner.poison = 77
    engine = Engine(cfg, collect(plugin_manager), runner=runner)
    reqs = {f"r{i}": (PROMPTS[i % len(PROMPTS)] + ((77,) if i in (2, 5) else ()), GREEDY) for i in range(8)}
    res = run(engine, reqs)
    for rid, (prompt, _) in reqs.items():
        if rid in ("r2", "r5"):
            assert res["ends"][rid].finish_reason == "error" and res["ends"][rid].error_code == 500
            assert res["tokens"].get(rid, []) == []
        else:
            assert res["ends"][rid].finish_reason == "length" and res["tokens"][rid] == echoed(prompt)
