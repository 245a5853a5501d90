"""fdx.output_processor.OutputProcessor over the real tokenizer and the
``default`` token processor (and the ``failing`` test plugin): events,
stop strings, finish reasons, failures, usage."""

from __future__ import annotations

from typing import Any

import pytest

from fdx.core.errors import RequestError
from fdx.core.messages import RequestOutput, SamplingParams, TokenLogprob
from fdx.output_processor import DETOKENIZE_FAILED, OPEN_FAILED, ChoiceState, OutputProcessor, Usage

import failing_token_processor as failing


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from fdx.model.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def outputs(tokenizer: Any) -> OutputProcessor:
    from fdx.core.plugins import load_plugins

    return OutputProcessor(load_plugins().create("token_processor", "default", tokenizer=tokenizer, config=None))


def outs(ids: list[int], last: str | None = None) -> list[RequestOutput]:
    return [RequestOutput("r", (t,), last if k == len(ids) - 1 else None, 3, 1, k + 1) for k, t in enumerate(ids)]


def test_stop_string_ends_the_choice_and_asks_for_an_abort(outputs: OutputProcessor, tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world. STOP and more text after it")
    st = outputs.open("r", 0, 0, [1, 2, 3], SamplingParams(stop=("STOP",)))
    events = [ev for o in outs(ids) if (ev := outputs.process(st, o)) is not None]
    assert "".join(e.text for e in events) == "Hello world. "
    assert [e.finish_reason for e in events][-1] == "stop" and events[-1].abort_in_engine
    assert all(e.finish_reason is None and not e.abort_in_engine for e in events[:-1])
    assert st.finished and outputs.process(st, outs(ids)[-1]) is None  # stale outputs are dropped


def test_tokens_after_the_stop_string_in_the_same_output_are_not_reported(outputs: OutputProcessor,
                                                                           tokenizer: Any) -> None:
    """Several tokens in one output (speculative decoding): the stop string
    completes at one of them; the ids, logprobs and usage stop there too."""
    ids = tokenizer.encode("Hello world. STOP and more text after it")
    stop_at = next(k for k in range(len(ids)) if "STOP" in tokenizer.decode(ids[: k + 1]))
    assert 0 < stop_at < len(ids) - 2
    lps = tuple(TokenLogprob(t, -0.5, ()) for t in ids)
    one = outputs.open("r", 0, 0, [1, 2, 3], SamplingParams(stop=("STOP",)))
    want = "".join(e.text for o in outs(ids) if (e := outputs.process(one, o)) is not None)
    for first in (1, stop_at):  # the stop inside the second output, and at the first id of the second
        st = outputs.open("r", 0, 0, [1, 2, 3], SamplingParams(stop=("STOP",)))
        a = outputs.process(st, RequestOutput("r", tuple(ids[:first]), None, 3, 0, first, lps[:first]))
        b = outputs.process(st, RequestOutput("r", tuple(ids[first:]), None, 3, 0, len(ids), lps[first:]))
        assert a is not None and b is not None and a.finish_reason is None
        assert b.finish_reason == "stop" and b.abort_in_engine and a.text + b.text == want == "Hello world. "
        assert a.token_ids + b.token_ids == tuple(ids[: stop_at + 1])
        assert a.logprobs + b.logprobs == lps[: stop_at + 1]
        assert st.num_output_tokens == stop_at + 1


def test_length_finish_keeps_tokens_logprobs_and_counts(outputs: OutputProcessor, tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    st = outputs.open("r", 1, 0, [1, 2, 3], SamplingParams())
    lp = (TokenLogprob(ids[0], -0.25, ((ids[0], -0.25),)),)
    first = outputs.process(st, RequestOutput("r", (ids[0],), None, 3, 2, 1, lp))
    assert first is not None and first.logprobs == lp and first.index == 1
    events = [first] + [outputs.process(st, o) for o in outs(ids, "length")[1:]]
    assert "".join(e.text for e in events if e) == text
    assert events[-1].finish_reason == "length" and not events[-1].abort_in_engine
    assert sum(len(e.token_ids) for e in events if e) == len(ids)
    assert st.num_output_tokens == len(ids) and st.num_cached_tokens == 2


def test_engine_error_is_a_failure(outputs: OutputProcessor) -> None:
    st = outputs.open("r", 0, 0, [1, 2, 3], SamplingParams())
    ev = outputs.process(st, RequestOutput("r", (), "error", 3, error="sampler failed", error_code=500))
    assert ev is not None and ev.finish_reason == "error" and not ev.abort_in_engine
    assert ev.failure is not None and (ev.failure.message, ev.failure.code) == ("sampler failed", 500)


def test_failing_plugin_fails_its_request_only(tokenizer: Any) -> None:
    proc = OutputProcessor(failing.FailingTokenProcessor(tokenizer))
    bad_prompt = tokenizer.encode(f"story {failing.FAIL_FEED}")
    ids = tokenizer.encode("once upon a time there was a princess")
    bad = proc.open("bad", 0, 0, bad_prompt, SamplingParams())
    good = proc.open("good", 1, 1, [1, 2, 3], SamplingParams())
    bad_events = [proc.process(bad, o) for o in outs(ids)]
    good_events = [proc.process(good, o) for o in outs(ids, "length")]
    failed = bad_events[failing.FAIL_AFTER - 1]
    assert failed is not None and failed.finish_reason == "error" and failed.abort_in_engine
    assert failed.failure is not None and failed.failure.message == DETOKENIZE_FAILED
    assert failing.SECRET not in failed.failure.message
    assert all(e is None for e in bad_events[failing.FAIL_AFTER:])
    assert "".join(e.text for e in good_events if e) == "once upon a time there was a princess"
    # failing on the output that finishes the request: nothing left to abort
    last = proc.open("last", 0, 0, bad_prompt, SamplingParams())
    evs = [proc.process(last, o) for o in outs(ids[: failing.FAIL_AFTER], "length")]
    assert evs[-1] is not None and evs[-1].failure is not None and not evs[-1].abort_in_engine


def test_failing_open_is_a_500(tokenizer: Any) -> None:
    proc = OutputProcessor(failing.FailingTokenProcessor(tokenizer))
    with pytest.raises(RequestError) as info:
        proc.open("r", 0, 0, tokenizer.encode(f"x {failing.FAIL_OPEN}"), SamplingParams())
    assert info.value.code == 500 and str(info.value) == OPEN_FAILED


def test_usage_counts_prompts_once_and_every_choice(outputs: OutputProcessor) -> None:
    def state(index: int, prompt_index: int, n_prompt: int, n_out: int, cached: int) -> ChoiceState:
        st = outputs.open(f"r{index}", index, prompt_index, list(range(n_prompt)), SamplingParams())
        st.num_output_tokens, st.num_cached_tokens = n_out, cached
        return st

    u = Usage.of([state(0, 0, 5, 3, 4), state(1, 0, 5, 7, 4), state(2, 1, 9, 2, 0), state(3, 1, 9, 1, 0)])
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.total_tokens) == (14, 13, 4, 27)


def test_choice_params_one_sequence_each_seed_plus_j() -> None:
    from fdx.output_processor import choice_params

    p = SamplingParams(n=3, seed=10, temperature=0.7)
    assert [(c.n, c.seed, c.temperature) for c in (choice_params(p, j) for j in range(3))] == [
        (1, 10, 0.7), (1, 11, 0.7), (1, 12, 0.7)]
    unseeded = SamplingParams(n=2)
    assert [choice_params(unseeded, j).seed for j in range(2)] == [None, None]
    single = SamplingParams(seed=5)
    assert choice_params(single, 0) is single
