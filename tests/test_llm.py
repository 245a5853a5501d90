"""The offline API ``fdx.LLM`` over the real embedded model and the real
engine (v1 scheduler, default token processor)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> Any:
    import fdx

    return fdx.LLM(num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=64)


def greedy(max_tokens: int = 24, **kw: Any) -> Any:
    from fdx import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_import_fdx_is_light() -> None:
    code = "import sys, fdx; fdx.SamplingParams; assert 'paddle' not in sys.modules; print(fdx.__all__)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chat_capital_of_france(llm: Any) -> None:
    # the README's request (with its system message: without one the first token is a near-tie even in float32)
    [res] = llm.chat([{"role": "system", "content": "Answer in one short sentence."},
                      {"role": "user", "content": "What is the capital of France?"}], greedy(32))
    assert "Paris" in res.text
    assert res.finish_reason == "stop" and res.token_ids[-1] == 2
    assert len(res.prompt_token_ids) == 27
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.scheduler.has_work()


def test_generate_batch_matches_single_and_token_prompts(llm: Any) -> None:
    texts = ["The sky is", "Write a long poem about the ocean, the wind and the stars above the sea:", "1, 2, 3,"]
    together = llm.generate(texts, greedy(20, ignore_eos=True))
    for t, r in zip(texts, together):
        [alone] = llm.generate(t, greedy(20, ignore_eos=True))
        assert alone.token_ids == r.token_ids and alone.text == r.text
        assert r.finish_reason == "length" and len(r.token_ids) == 20
    ids = llm.tokenizer.encode(texts[0])
    [by_ids] = llm.generate([ids], greedy(20, ignore_eos=True))
    assert by_ids.token_ids == together[0].token_ids and by_ids.prompt is None


def test_stop_string_aborts_and_cuts(llm: Any) -> None:
    [full] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(32))
    word = full.text.split()[3]  # a stop string the greedy reply holds (its 4th word), whatever the reply is
    [cut] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(32, stop=(word,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(word)]
    assert cut.num_cached_tokens > 0  # the same prompt hit the prefix cache
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.scheduler.has_work()


def test_seeded_sampling_n_and_logprobs(llm: Any) -> None:
    from fdx import SamplingParams

    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True, logprobs=2, n=2)
    [a] = llm.generate("Once upon a time", p)
    [b] = llm.generate("Once upon a time", p)
    assert len(a.outputs) == 2 and [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(a.logprobs) == 12 and all(lp.logprob <= 0 and len(lp.top) == 2 for lp in a.logprobs)


def test_too_long_prompt_is_a_clear_error(llm: Any) -> None:
    from fdx.core.errors import RequestError

    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate([[5] * 1000], greedy(100))
    assert not llm.engine.scheduler.has_work()


def test_failing_token_processor_fails_its_call_only(plugin_manager: Any) -> None:
    """A token-processor plugin registered on a fresh manager and chosen
    through ``fdx serve``'s own option parsing: when it raises for one
    request, that call fails with a clear error, the request is aborted in
    the engine (no KV block kept) and the next call is served."""
    import failing_token_processor as failing

    import fdx
    from fdx.cli import build_parser, config_from_args
    from fdx.core.errors import RequestError
    from fdx.core.plugins import collect, load_entry_points, set_plugins

    infos = load_entry_points(plugin_manager)  # the built-ins (device, runner, scheduler, ...)
    plugin_manager.register(failing, name="failing")
    plugins = collect(plugin_manager, infos)
    args = build_parser(plugins).parse_args(["serve", "--token-processor", "failing"])
    cfg = config_from_args(args, plugins)
    set_plugins(plugins)
    try:
        llm = fdx.LLM(token_processor=cfg.token_processor, num_kv_blocks=128, max_model_len=1024)
    finally:
        set_plugins(None)
    with pytest.raises(RequestError, match="token processor") as info:
        llm.generate(["The sky is", f"Tell me a story {failing.FAIL_FEED}"], greedy(400, ignore_eos=True))
    assert info.value.code == 500 and failing.SECRET not in str(info.value)
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.has_work()
    with pytest.raises(RequestError, match="token processor"):
        llm.generate(f"{failing.FAIL_OPEN} hello", greedy(4))
    assert not llm.engine.has_work()
    [ok] = llm.generate("The sky is", greedy(8, ignore_eos=True))
    assert ok.finish_reason == "length" and len(ok.token_ids) == 8 and ok.text


def test_generate_without_params_uses_the_model_defaults(llm: Any) -> None:
    """As ``fdx serve`` does (and vLLM's ``LLM``): no params -> the model's
    generation defaults (SmolLM2: temperature 0.2, top_p 0.9), not 1.0."""
    import fdx

    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.max_tokens) == (0.2, 0.9, 512), d
    [res] = llm.chat([{"role": "system", "content": "Answer in one short sentence."},
                      {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in res.text and res.finish_reason == "stop", res.text
    plain = fdx.LLM(num_kv_blocks=8, max_model_len=256, generation_config="vllm")
    assert plain.get_default_sampling_params() == fdx.SamplingParams()
