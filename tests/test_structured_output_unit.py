"""Structured outputs and logit_bias below the HTTP surface: the token mask
and the bias in the batched NumPy sampler (rows without a grammar are
untouched; the matcher accepts each output token once), the llguidance
backend (compile, cache, bad specs, a complete grammar allows only eos),
the request-field translation (400s naming the field), the wire round trip,
and the grammar-backend plugin kind with a toy backend served through
``fdx.LLM``."""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import pytest

from fdx.config import make_config
from fdx.core import messages as m
from fdx.core.errors import RequestError
from fdx.core.hookspecs import Register, hookimpl
from fdx.core.interfaces import GrammarBackend, GrammarMatcher
from fdx.core.messages import SamplingParams, StructuredOutput
from fdx.core.request import Request
from fdx.model.sampler import Sampler

V = 300


class AllowSet(GrammarMatcher):
    """Allows ``allowed``; records what it accepted."""

    def __init__(self, allowed: Sequence[int]) -> None:
        self.allowed = list(allowed)
        self.accepted: list[int] = []

    def accept(self, token_ids: Sequence[int]) -> None:
        self.accepted.extend(token_ids)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row].view(np.uint32)
        words[:] = 0
        for t in self.allowed:
            words[t >> 5] |= np.uint32(1 << (t & 31))


def req(rid: str, **kw: Any) -> Request:
    grammar = kw.pop("grammar", None)
    r = Request(rid, [1, 2, 3], SamplingParams(**kw), frozenset({0}))
    r.grammar = grammar
    return r


def logits(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, V)).astype(np.float32)


def test_grammar_mask_applies_to_its_rows_only() -> None:
    x = logits(4)
    g = AllowSet([7, 250, 33])
    rs = [req("a", temperature=0), req("b", temperature=0, grammar=g), req("c", temperature=0), req("d", temperature=0)]
    toks, _ = Sampler(V).sample(x, rs)
    raw = x.argmax(axis=1)
    assert toks[0] == raw[0] and toks[2] == raw[2] and toks[3] == raw[3]
    assert toks[1] == [7, 250, 33][int(np.argmax(x[1, [7, 250, 33]]))]


def test_grammar_mask_random_rows_sample_only_allowed_tokens() -> None:
    g = AllowSet([5, 6, 290])
    seen = set()
    s = Sampler(V, seed=1)
    for i in range(40):
        r = req("r", temperature=1.5, top_p=0.9, grammar=g)
        toks, _ = s.sample(logits(2, i), [r, req("x", temperature=1.0)])
        seen.add(int(toks[0]))
    assert seen <= {5, 6, 290} and len(seen) >= 2


def test_matcher_accepts_each_output_token_once() -> None:
    g = AllowSet(range(V))
    r = req("r", temperature=0, grammar=g)
    s = Sampler(V)
    s.sample(logits(1), [r])
    assert g.accepted == []
    r.output_token_ids += [11, 12]
    s.sample(logits(1), [r])
    s.sample(logits(1), [r])  # a re-run of the same step: nothing new to accept
    r.output_token_ids.append(13)
    s.sample(logits(1), [r])
    assert g.accepted == [11, 12, 13]


def test_logit_bias_bans_and_forces_and_composes_with_penalties() -> None:
    x = logits(3)
    greedy = x.argmax(axis=1)
    rs = [req("ban", temperature=0, logit_bias=((int(greedy[0]), -100.0),)),
          req("force", temperature=0, logit_bias=((123, 100.0),)),
          req("plain", temperature=0)]
    toks, _ = Sampler(V).sample(x, rs)
    assert toks[0] != greedy[0] and toks[1] == 123 and toks[2] == greedy[2]
    # penalty then bias on the same token: the bias adds to the penalised logit
    x2 = np.zeros((1, V), np.float32)
    x2[0, 9] = 4.0
    x2[0, 8] = 3.5
    r = req("p", temperature=0, repetition_penalty=2.0, logit_bias=((9, 1.0),))
    r.output_token_ids.append(9)  # 4 / 2 + 1 = 3 < 3.5
    assert Sampler(V).sample(x2, [r])[0][0] == 8
    r2 = req("q", temperature=0, repetition_penalty=2.0, logit_bias=((9, 2.0),))
    r2.output_token_ids.append(9)  # 4 / 2 + 2 = 4 > 3.5
    assert Sampler(V).sample(x2, [r2])[0][0] == 9


def test_engine_checks_logit_bias_ranges() -> None:
    from fdx.core.request import check_request

    ok = m.AddRequest("r", (1, 2), SamplingParams(logit_bias=((5, -100.0),)), 0.0)
    assert check_request(ok, 100, 10, 5) is None
    for bad in (((10, 1.0),), ((-1, 1.0),), ((3, 100.5),), ((3, float("nan")),)):
        msg = m.AddRequest("r", (1, 2), SamplingParams(logit_bias=bad), 0.0)
        assert "logit_bias" in (check_request(msg, 100, 10, 5) or "")


def test_sampling_params_with_structured_output_round_trip() -> None:
    p = SamplingParams(structured=StructuredOutput("json", '{"type": "object"}'), logit_bias=((3, -1.5), (9, 100.0)))
    msg = m.AddRequest("r", (1,), p, 1.0)
    assert m.decode(m.encode(msg)) == msg


# ---------------------------------------------------------------- llguidance


@pytest.fixture(scope="module")
def backend() -> Any:
    from fdx.model.loader import load_tokenizer
    from fdx.plugins.grammar.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(make_config(), load_tokenizer(None).vocab_size)


def allowed_ids(matcher: GrammarMatcher, vocab: int) -> np.ndarray:
    bm = np.zeros((1, -(-vocab // 32)), dtype=np.int32)
    matcher.fill_bitmask(bm, 0)
    return np.flatnonzero(np.unpackbits(bm.view(np.uint8), axis=1, count=vocab, bitorder="little")[0])


def test_llguidance_json_schema_walk_to_eos(backend: Any) -> None:
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    spec = StructuredOutput("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"], "additionalProperties": False}))
    mt = backend.matcher(spec)
    first = allowed_ids(mt, backend.vocab_size)
    assert all(tok.decode([int(t)]).startswith("{") for t in first)
    mt.accept(tok.encode('{"a": 42}'))
    assert allowed_ids(mt, backend.vocab_size).tolist() == sorted(tok.eos_token_ids)  # complete: eos only
    before = backend.compiles
    backend.matcher(spec)
    assert backend.compiles == before  # cached by spec


def test_llguidance_refused_token_breaks_to_eos(backend: Any) -> None:
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    mt = backend.matcher(StructuredOutput("regex", "[0-9]+"))
    mt.accept(tok.encode("abc"))
    assert allowed_ids(mt, backend.vocab_size).tolist() == sorted(tok.eos_token_ids)


@pytest.mark.parametrize("spec,needle", [
    (StructuredOutput("json", '{"type": "nope"}'), "nope"),
    (StructuredOutput("json", "{not json"), ""),
    (StructuredOutput("regex", "(ab"), "regex"),
    (StructuredOutput("choice", "[]"), "choice"),
    (StructuredOutput("grammar", "start: ("), ""),
    (StructuredOutput("bogus", "x"), "kind"),
])
def test_llguidance_bad_specs_are_value_errors(backend: Any, spec: StructuredOutput, needle: str) -> None:
    with pytest.raises(ValueError) as ei:
        backend.matcher(spec)
    assert needle in str(ei.value)


def test_llguidance_kinds_compile(backend: Any) -> None:
    for spec in (StructuredOutput("json_object"), StructuredOutput("choice", '["yes", "no"]'),
                 StructuredOutput("grammar", 'root ::= "a" | "b"'), StructuredOutput("grammar", 'start: "x"+')):
        assert len(allowed_ids(backend.matcher(spec), backend.vocab_size)) > 0


# ------------------------------------------------------- request fields -> spec


def parse(body: dict[str, Any]) -> Any:
    from fdx.server.protocol import ChatCompletionRequest, parse_body

    return parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], **body}).encode(),
                      ChatCompletionRequest)


def test_request_fields_become_one_spec() -> None:
    from fdx.structured_outputs import requested_spec

    schema = {"type": "object"}
    assert requested_spec(parse({})) is None
    assert requested_spec(parse({"response_format": {"type": "text"}})) is None
    assert requested_spec(parse({"response_format": {"type": "json_object"}})) == (
        StructuredOutput("json_object"), "response_format")
    s, p = requested_spec(parse({"response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema}}}))
    assert (s.kind, json.loads(s.spec), p) == ("json", schema, "response_format")
    assert requested_spec(parse({"guided_json": json.dumps(schema)}))[0].kind == "json"
    assert requested_spec(parse({"guided_regex": "a+"})) == (StructuredOutput("regex", "a+"), "guided_regex")
    assert requested_spec(parse({"guided_choice": ["a", "b"]}))[0] == StructuredOutput("choice", '["a", "b"]')
    assert requested_spec(parse({"guided_grammar": "start: 'a'"}))[1] == "guided_grammar"
    assert requested_spec(parse({"structured_outputs": {"regex": "b"}})) == (StructuredOutput("regex", "b"),
                                                                           "structured_outputs")


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
])
def test_request_field_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    from fdx.structured_outputs import requested_spec

    with pytest.raises(RequestError) as ei:
        requested_spec(parse(body))
    assert ei.value.code == 400 and ei.value.param == param


@pytest.mark.parametrize("lb", [{"x": 1}, {"-1": 1}, {"49152": 1}, {"5": 101}, {"5": -100.5}])
def test_logit_bias_field_errors(lb: dict[str, Any]) -> None:
    from fdx.structured_outputs import logit_bias

    with pytest.raises(RequestError) as ei:
        logit_bias(parse({"logit_bias": lb}), 49152)
    assert ei.value.param == "logit_bias"
    assert logit_bias(parse({"logit_bias": {"7": 5, "3": -100}}), 49152) == ((3, -100.0), (7, 5.0))


# ------------------------------------------------------------- the plugin kind


class ForcedText(GrammarMatcher):
    """A toy grammar: exactly these token ids, then eos."""

    def __init__(self, ids: list[int], eos: int) -> None:
        self.ids, self.eos, self.pos = ids, eos, 0

    def accept(self, token_ids: Sequence[int]) -> None:
        self.pos += len(token_ids)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        t = self.ids[self.pos] if self.pos < len(self.ids) else self.eos
        words = bitmask[row].view(np.uint32)
        words[:] = 0
        words[t >> 5] = np.uint32(1 << (t & 31))


class ToyBackend(GrammarBackend):
    def __init__(self, config: Any, vocab_size: int) -> None:
        from fdx.model.loader import load_tokenizer

        self.tok = load_tokenizer(config.model)

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        if spec.kind != "regex":
            raise ValueError("the toy backend takes regex only")
        return ForcedText(self.tok.encode(spec.spec), min(self.tok.eos_token_ids))


class ToyGrammarPlugin:
    @hookimpl
    def fdx_register_grammar_backends(self, register: Register) -> None:
        register("toy", ToyBackend, description="test: the regex text itself")


def test_toy_grammar_backend_serves_a_request_through_fdx_llm() -> None:
    import fdx
    from fdx.core.errors import PluginError
    from fdx.core.plugins import load_plugins, set_plugins

    plugins = load_plugins(extra=[ToyGrammarPlugin()])
    toy = next(p for p in plugins.pm.get_plugins() if isinstance(p, ToyGrammarPlugin))
    try:
        assert "toy" in plugins.registry("grammar_backend").names()
        assert "llguidance" in plugins.registry("grammar_backend").names()
        with pytest.raises(PluginError) as ei:
            plugins.registry("grammar_backend").get("nope")
        assert "llguidance" in str(ei.value) and "toy" in str(ei.value)
        set_plugins(plugins)
        llm = fdx.LLM(grammar_backend="toy", num_kv_blocks=64, max_model_len=256)
        out = llm.chat([{"role": "user", "content": "Say anything."}],
                       SamplingParams(temperature=0.9, seed=3, max_tokens=20,
                                      structured=StructuredOutput("regex", "forty-two, exactly")))[0]
        assert out.text == "forty-two, exactly" and out.finish_reason == "stop"
        with pytest.raises(RequestError) as bad:  # a spec the backend refuses: 400, the engine goes on
            llm.chat([{"role": "user", "content": "x"}],
                     SamplingParams(max_tokens=4, structured=StructuredOutput("json", "{}")))
        assert bad.value.code == 400 and "regex only" in str(bad.value)
    finally:
        plugins.pm.unregister(toy)
        set_plugins(None)


def test_device_sampler_applies_masks_and_bias_too() -> None:
    """The GPU runner's sampler (run here on Paddle's CPU place) masks the
    grammar rows and adds logit_bias like the NumPy sampler."""
    paddle = pytest.importorskip("paddle")
    from fdx.model.device_sampler import DeviceSampler

    x = logits(4, seed=3)
    greedy = x.argmax(axis=1)
    g = AllowSet([7, 250, 33])
    rs = [req("a", temperature=0), req("b", temperature=0, grammar=g),
          req("c", temperature=0, logit_bias=((int(greedy[2]), -100.0),)), req("d", temperature=0, logit_bias=((5, 100.0),))]
    toks, _ = DeviceSampler(V).sample(paddle.to_tensor(x), rs)
    assert toks[0] == greedy[0]
    assert toks[1] == [7, 250, 33][int(np.argmax(x[1, [7, 250, 33]]))]
    assert toks[2] != greedy[2] and toks[3] == 5
    seen = {int(DeviceSampler(V, seed=s).sample(paddle.to_tensor(logits(1, s)),
                                                [req("r", temperature=1.0, grammar=AllowSet([5, 6]))])[0][0])
            for s in range(12)}
    assert seen <= {5, 6}


def test_unknown_backend_or_parser_names_fail_at_start_listing_the_choices() -> None:
    from fdx.cli import check_component_names
    from fdx.core.errors import PluginError
    from fdx.core.plugins import get_plugins

    for kw, choice in (({"grammar_backend": "nope"}, "llguidance"), ({"tool_call_parser": "nope"}, "hermes")):
        with pytest.raises(PluginError) as ei:
            check_component_names(make_config(**kw), get_plugins())
        assert "'nope'" in str(ei.value) and choice in str(ei.value)


def test_closed_objects_closes_only_objects_that_leave_extra_keys_unsaid() -> None:
    from fdx.plugins.grammar.llguidance_backend import closed_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "free": {"type": "object"},
        "pat": {"type": "object", "properties": {}, "patternProperties": {"^k": {}}},
    }, "allOf": [{"properties": {"p": {}}}], "$defs": {"D": {"properties": {"q": {}}}},
        "enum": [{"properties": {}}]}
    out = closed_objects(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and "additionalProperties" not in props["free"]
    assert "additionalProperties" not in props["pat"]
    assert "additionalProperties" not in out["allOf"][0]  # closing an allOf part would refuse the other parts' keys
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert out["enum"] == [{"properties": {}}]  # data, not a schema
    assert "additionalProperties" not in schema  # the input is left alone


def test_a_compiling_grammar_keeps_its_request_out_of_the_batch(backend: Any) -> None:
    """matcher_async returns a pending matcher for a new spec (the compile
    runs on the backend's worker); v0 and v1 schedule the others meanwhile,
    admit the request once it compiled, end a failed compile with a 400, and
    abort a compiling request without leaking it."""
    import concurrent.futures as cf

    from fdx.core.kv_cache import KVCacheManager
    from fdx.plugins.grammar.llguidance_backend import PendingMatcher
    from fdx.plugins.schedulers.v0 import V0Scheduler
    from fdx.plugins.schedulers.v1 import V1Scheduler

    spec = StructuredOutput("regex", "[0-9]{2,5} apples")
    async_m = backend.matcher_async(spec)
    assert isinstance(async_m, PendingMatcher)
    async_m.wait(30)
    assert not async_m.pending and async_m.error is None and len(allowed_ids(async_m, backend.vocab_size)) > 0
    assert not isinstance(backend.matcher_async(spec), PendingMatcher)  # compiled: a plain copy now
    template = backend.compile(spec)
    for cls in (V0Scheduler, V1Scheduler):
        sched = cls(make_config(num_kv_blocks=64, block_size=4), KVCacheManager(64, 4))
        futs = {name: cf.Future() for name in ("ok", "bad", "gone")}

        def req(name: str, grammar: Any) -> Request:
            p = SamplingParams(max_tokens=4, structured=spec if grammar is not None else None)
            return Request(name, [3, 4, 5], p, frozenset({0}), grammar=grammar)

        for name, fut in futs.items():
            sched.add_request(req(name, PendingMatcher(fut, backend)))
        sched.add_request(req("plain", None))
        batch = sched.schedule()
        assert [s.request.request_id for s in batch.seqs] == ["plain"] and sched.num_waiting == 3
        futs["ok"].set_result(template)
        futs["bad"].set_exception(ValueError("no such rule"))
        assert [r.request_id for r in sched.abort(["gone"])] == ["gone"]
        batch = sched.schedule()
        assert sorted(s.request.request_id for s in batch.seqs) == ["ok", "plain"], cls  # plain decodes
        assert [(r.request_id, r.error_code) for r in batch.failed] == [("bad", 400)]
        assert "no such rule" in (batch.failed[0].error or "") and sched.get("gone") is None
