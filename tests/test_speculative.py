"""Speculative decoding without a draft model (``--speculative ngram``).

* the n-gram proposer against a plain reference;
* the speculator plugin kind: a toy proposer registered on a fresh plugin
  manager serves requests, an unknown name lists the choices, bad configs
  are one-line errors;
* the real model: greedy output identical with speculation on and off
  (summarization-style copying, random text, code; alone and in a batch;
  float32 and int8), other requests of the batch (sampled, logprobs,
  penalties) decoding normally, KV blocks all free and consistent after,
  a stop token inside the accepted drafts ending the request exactly there;
* the ``fdx:spec_decode_*`` counters on /metrics and on the wire.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import fdx.core.hookspecs
import fdx.plugins.grammar.llguidance_backend
import fdx.plugins.hardware.cpu
import fdx.plugins.model_runners.cpu
import fdx.plugins.schedulers.v1
import fdx.plugins.speculators.ngram
import fdx.plugins.token_processors.default
import fdx.plugins.tool_parsers.hermes
from fdx.core.errors import ConfigError, PluginError
from fdx.core.interfaces import Speculator
from fdx.plugins.speculators.ngram import ngram_propose

ARTICLE = (
    "The city council approved a plan on Tuesday to build a new public library on Main Street. The library "
    "will cost 12 million dollars, open in March 2027 and hold 40,000 books, a children's wing and a cafe. "
    "Mayor Ana Ruiz said the project will create 80 jobs."
)
COPY_PROMPT = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{ARTICLE}"}]
SUMMARY_PROMPT = [{"role": "user", "content": f"{ARTICLE}\n\nSummarize the article above in two sentences."}]
CODE_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" \
              "def factorial(n):\n"


# ---------------------------------------------------------------- proposer


def _reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        hits = [i for i in range(L - n - 1, -1, -1) if tokens[i : i + n] == suffix]  # latest first
        if hits:  # the latest with k tokens after it, else the latest
            i = next((i for i in hits if i + n + k <= L), hits[0])
            return tokens[i + n : i + n + k]
    return []


def test_ngram_proposer_matches_the_reference() -> None:
    rng = random.Random(7)
    for _ in range(400):
        L = rng.randrange(1, 60)
        toks = [rng.randrange(4) for _ in range(L)]
        k, n_min = rng.randrange(0, 6), rng.randrange(1, 3)
        n_max = n_min + rng.randrange(0, 4)
        got = ngram_propose(np.asarray(toks, dtype=np.int64), k, n_min, n_max).tolist()
        assert got == (_reference(toks, k, n_min, n_max) if k else []), (toks, k, n_min, n_max)


def test_ngram_proposer_prefers_the_longest_then_most_recent_match() -> None:
    t = np.array([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3], dtype=np.int64)
    assert ngram_propose(t, 2, 1, 4).tolist() == [9, 2]  # "1 2 3" (n=3) beats the later "2 3"
    assert ngram_propose(t, 2, 1, 2).tolist() == [8, 7]  # n <= 2: the most recent "2 3"
    assert ngram_propose(t, 2, 4, 4).tolist() == []  # no 4-gram repeats
    assert ngram_propose(np.array([5], dtype=np.int64), 3, 1, 4).tolist() == []


# ---------------------------------------------------------------- plugin kind


class EchoLastSpeculator(Speculator):
    """Toy proposer: drafts the last token K times."""

    calls = 0

    def __init__(self, config: Any) -> None:
        self.k = config.num_speculative_tokens

    def propose(self, token_ids: np.ndarray, k: int) -> np.ndarray:
        EchoLastSpeculator.calls += 1
        return np.full(k, token_ids[-1], dtype=np.int64)


class ToySpeculatorPlugin:
    @fdx.core.hookspecs.hookimpl
    def fdx_register_speculators(self, register: Any) -> None:
        register("echo-last", EchoLastSpeculator, description="test double: the last token, K times")


BUILTINS = (fdx.plugins.hardware.cpu, fdx.plugins.model_runners.cpu, fdx.plugins.schedulers.v1,
            fdx.plugins.token_processors.default, fdx.plugins.grammar.llguidance_backend, fdx.plugins.tool_parsers.hermes)


def test_toy_speculator_serves_requests_and_unknown_names_list_choices(plugin_manager: Any) -> None:
    import fdx
    from fdx.cli import check_component_names
    from fdx.config import make_config
    from fdx.core.engine import Engine
    from fdx.core.plugins import collect

    toy = ToySpeculatorPlugin()
    for mod in BUILTINS:
        plugin_manager.register(mod)
    plugin_manager.register(toy)
    try:
        plugins = collect(plugin_manager)
        assert plugins.registry("speculator").names() == ["echo-last"]
        with pytest.raises(PluginError, match=r"unknown speculator 'nope'; choices: echo-last"):
            check_component_names(make_config(speculative="nope"), plugins)
        with pytest.raises(PluginError, match="choices: echo-last"):  # what Engine() meets for fdx.LLM(speculative=...)
            plugins.create("speculator", "nope", config=make_config())
        base = dict(dtype="int8", num_kv_blocks=32, max_model_len=256)
        on = Engine(make_config(speculative="echo-last", num_speculative_tokens=3, **base), plugins)
        off = Engine(make_config(**base), plugins)
        prompt = [1, 504, 3458, 314, 4649, 314, 4649, 314]
        got = []
        for eng in (on, off):
            eng.add_request(fdx.core.messages.AddRequest("r", tuple(prompt), fdx.SamplingParams(temperature=0,
                                                                                                max_tokens=12), 0.0))
            toks: list[int] = []
            while eng.has_work():
                for out in eng.step():
                    toks += out.new_token_ids
            got.append(toks)
            assert eng.kv.num_used_blocks == 0
        assert got[0] == got[1] and len(got[0]) == 12
        st = on.stats().speculative
        assert EchoLastSpeculator.calls > 0 and st is not None and st.num_draft_tokens > 0
        assert off.stats().speculative is None
    finally:
        plugin_manager.unregister(toy)


def test_builtin_ngram_is_an_entry_point_and_shows_in_fdx_plugins(capsys: Any) -> None:
    from fdx.cli import main

    assert main(["plugins"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("speculator")]
    assert line and "ngram" in line[0] and "speculator_ngram" in line[0]


def test_config_checks() -> None:
    from fdx.config import make_config

    with pytest.raises(ConfigError, match="--speculative needs --scheduler v1"):
        make_config(speculative="ngram", scheduler="v0")
    with pytest.raises(ConfigError, match="--prompt-lookup-min"):
        make_config(speculative="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ConfigError, match="--num-speculative-tokens must be > 0"):
        make_config(speculative="ngram", num_speculative_tokens=0)
    from fdx.cli import build_parser, config_from_args
    from fdx.core.plugins import get_plugins

    args = build_parser(get_plugins()).parse_args(
        ["serve", "--speculative", "ngram", "--num-speculative-tokens", "5", "--prompt-lookup-max", "3",
         "--prompt-lookup-min", "2"])
    cfg = config_from_args(args, get_plugins())
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == \
        ("ngram", 5, 3, 2)


def test_metrics_and_wire() -> None:
    from fdx.core.messages import EngineStats, OutputBatch, SpecDecodeStats, decode, encode
    from fdx.server.metrics import Metrics

    st = EngineStats(speculative=SpecDecodeStats(7, 21, 15, (7, 5, 3)))
    assert decode(encode(OutputBatch((), st))) == OutputBatch((), st)
    text = Metrics("m", lambda: st).render().decode()
    assert 'fdx:spec_decode_num_draft_tokens_total{model_name="m"} 21.0' in text
    assert 'fdx:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0' in text
    assert 'fdx:spec_decode_num_drafts_total{model_name="m"} 7.0' in text
    assert 'fdx:spec_decode_num_draft_tokens_total{model_name="m"} 0.0' in Metrics("m", EngineStats).render().decode()


# ---------------------------------------------------------------- the real model


def _pair(dtype: str) -> tuple[Any, Any]:
    import fdx

    kw = dict(dtype=dtype, num_kv_blocks=96, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)
    return fdx.LLM(**kw), fdx.LLM(speculative="ngram", num_speculative_tokens=4, **kw)


@pytest.fixture(scope="module")
def int8_pair() -> tuple[Any, Any]:
    return _pair("int8")


@pytest.fixture(scope="module")
def float32_pair() -> tuple[Any, Any]:
    return _pair("float32")


def _prompts(llm: Any) -> list[list[int]]:
    tok = llm.tokenizer
    chat = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in (COPY_PROMPT, SUMMARY_PROMPT)]
    rng = random.Random(3)
    rand = [rng.randrange(200, 40000) for _ in range(40)]
    return [*chat, tok.encode(CODE_PROMPT, add_special_tokens=True), rand]


def _greedy(llm: Any, prompts: list[list[int]], max_tokens: int = 40, **kw: Any) -> list[list[int]]:
    import fdx

    res = llm.generate(prompts, fdx.SamplingParams(temperature=0, max_tokens=max_tokens, **kw))
    return [list(r.token_ids) for r in res]


def _checked(llm: Any) -> None:
    """Check the scheduler's and the block pool's invariants after every step."""
    eng = llm.engine
    if getattr(eng, "_checked", False):
        return
    step = eng.step

    def checked_step() -> Any:
        outs = step()
        eng.scheduler.check_invariants()
        for r in eng.scheduler.running:  # no block beyond the computed positions (rejected drafts' returned)
            assert len(r.block_ids) == -(-r.num_computed_tokens // eng.kv.block_size), r.request_id
        return outs

    eng.step = checked_step
    eng._checked = True


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_greedy_identical_with_speculation_on_and_off(dtype: str, request: Any) -> None:
    from fdx.testing import check_kv_invariants

    off, on = request.getfixturevalue(f"{dtype}_pair")
    _checked(on)
    prompts = _prompts(off)
    before = on.engine.stats().speculative
    alone = [_greedy(on, [p])[0] for p in prompts]
    batch = _greedy(on, prompts)
    want_alone = [_greedy(off, [p])[0] for p in prompts]
    want_batch = _greedy(off, prompts)
    for i in range(len(prompts)):
        assert alone[i] == want_alone[i], f"prompt {i} alone differs with speculation ({dtype})"
        assert batch[i] == want_batch[i], f"prompt {i} in a batch differs with speculation ({dtype})"
    st = on.engine.stats().speculative
    assert st is not None and st.num_draft_tokens > (before.num_draft_tokens if before else 0)
    assert st.num_accepted_tokens > 0
    for llm in (on, off):  # no leak: every block free or cached-evictable, accounting exact
        assert llm.engine.kv.num_used_blocks == 0
        check_kv_invariants(llm.engine.kv, [])
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.slow
def test_copying_prompt_accepts_most_drafts_and_prefix_cache_is_clean(int8_pair: Any) -> None:
    """The copy prompt accepts most drafts.  Its outputs are then reused as
    prompts (prefix-cache hits on blocks the speculative run registered):
    a block holding a rejected token would change the continuation."""
    off, on = int8_pair
    p = _prompts(on)[0]
    s0 = on.engine.stats().speculative
    out = _greedy(on, [p], max_tokens=48)[0]
    s1 = on.engine.stats().speculative
    acc = (s1.num_accepted_tokens - s0.num_accepted_tokens) / max(1, s1.num_draft_tokens - s0.num_draft_tokens)
    assert acc > 0.5, acc
    follow = [p + out[:40], p + out[:33]]
    assert _greedy(on, follow, max_tokens=8) == _greedy(off, follow, max_tokens=8)
    assert on.engine.kv.num_used_blocks == 0


@pytest.mark.slow
def test_stop_conditions_inside_accepted_drafts(int8_pair: Any) -> None:
    import fdx

    off, on = int8_pair
    _checked(on)
    p = _prompts(on)[0]
    full = _greedy(off, [p], max_tokens=40)[0]
    # a stop token in the middle of the copied text, where drafts are accepted
    j = next(i for i in range(12, len(full)) if full[i] not in full[:i])
    masked = []
    sched = on.engine.scheduler
    accept, cut = sched._accept, []

    def recording_accept(req: Any, k: int, toks: list[int]) -> Any:
        n0 = req.num_output_tokens
        reason = accept(req, k, toks)
        if reason == "stop" and req.num_output_tokens - n0 < len(toks):  # stopped on an accepted draft
            cut.append(len(toks) - (req.num_output_tokens - n0))
        return reason

    sched._accept = recording_accept
    for llm in (on, off):
        s0 = llm.engine.stats().speculative
        res = llm.generate([p], fdx.SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full[j]]))[0]
        assert list(res.token_ids) == full[: j + 1] and res.finish_reason == "stop"
        if llm is on:
            assert cut, "the stop token was not inside the accepted drafts"  # tokens after it were dropped
        # min_tokens past the stop: the stop id is masked there (speculation waits until min_tokens is met)
        res = llm.generate([p], fdx.SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full[j]],
                                                   min_tokens=j + 2))[0]
        assert list(res.token_ids)[:j] == full[:j] and len(res.token_ids) > j + 1
        masked.append(list(res.token_ids))
        # max_tokens in the middle of an accepted run: exactly that many
        res = llm.generate([p], fdx.SamplingParams(temperature=0, max_tokens=j, ignore_eos=True))[0]
        assert list(res.token_ids) == full[:j] and res.finish_reason == "length"
        if llm is on:
            s1 = llm.engine.stats().speculative
            assert s1.num_accepted_tokens > s0.num_accepted_tokens
        assert llm.engine.kv.num_used_blocks == 0
    assert masked[0] == masked[1]
    sched._accept = accept


@pytest.mark.slow
def test_requests_where_speculation_is_not_exact_decode_normally(int8_pair: Any) -> None:
    """In one batch: greedy (speculated), seeded sampling, greedy with
    logprobs, greedy with a repetition penalty: the same tokens (and
    logprobs) as without speculation; only the plain greedy one drafts."""
    import fdx

    off, on = int8_pair
    p = _prompts(on)[0]
    params = [fdx.SamplingParams(temperature=0, max_tokens=24),
              fdx.SamplingParams(temperature=0.8, seed=11, max_tokens=24),
              fdx.SamplingParams(temperature=0, max_tokens=24, logprobs=2),
              fdx.SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)]
    got = [(list(r.token_ids), [(lp.token_id, lp.logprob) for lp in r.logprobs or []])
           for r in on.generate([p] * 4, params)]
    want = [(list(r.token_ids), [(lp.token_id, lp.logprob) for lp in r.logprobs or []])
            for r in off.generate([p] * 4, params)]
    assert got == want
    s0 = on.engine.stats().speculative
    on.generate([p] * 3, params[1:])
    assert on.engine.stats().speculative == s0  # none of them drafted
