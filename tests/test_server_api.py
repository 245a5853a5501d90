"""`fdx serve` end to end: the official `openai` client and raw HTTP errors
against a real server subprocess (one per module)."""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import openai
import pytest

from serverutil import start_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048
# the README's first request: with its system message the int8 default answers it as float32 does (without one,
# the first token is a near-tie between "The" and "L" even in float32, and int8 tips it to "L'Étoile, ...")
QUESTION = [{"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with start_server() as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from fdx.model.loader import load_tokenizer

    return load_tokenizer("smollm2")


# --------------------------------------------------------------------------
# info routes
# --------------------------------------------------------------------------


def test_info_routes(server: str, oai: openai.OpenAI) -> None:
    models = oai.models.list()
    card = models.data[0]
    assert card.id == "smollm2"
    assert "version" in card.model_dump()
    v = httpx.get(server + "/version").json()
    assert v["version"] and v["engine_pid"] > 0
    h = httpx.get(server + "/health")
    assert h.status_code == 200 and h.json()["engine_pid"] == v["engine_pid"]
    m = httpx.get(server + "/metrics").text
    for name in ("fdx:num_requests_running", "fdx:num_requests_waiting", "fdx:kv_cache_usage_perc",
                 "fdx:kv_blocks_used", "fdx:prefix_cache_queries_total", "fdx:prefix_cache_hits_total",
                 "fdx:num_preemptions_total", "fdx:time_to_first_token_seconds", "fdx:inter_token_latency_seconds",
                 "fdx:e2e_request_latency_seconds", "fdx:request_queue_time_seconds", "fdx:prompt_tokens_total",
                 "fdx:generation_tokens_total", "process_resident_memory_bytes"):
        assert name in m, name


# --------------------------------------------------------------------------
# chat
# --------------------------------------------------------------------------


def test_chat_greedy(oai: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    r = oai.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=30)
    c = r.choices[0]
    assert "Paris" in c.message.content and c.finish_reason == "stop" and c.message.role == "assistant"
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(QUESTION)) == 27
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_non_stream(oai: openai.OpenAI) -> None:
    ref = oai.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=30)
    chunks = list(oai.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=30,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == ref.choices[0].message.content and finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens


def test_chat_stop_string(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=30, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert "Paris" not in r.choices[0].message.content and r.choices[0].message.content.startswith("The capital")
    chunks = list(oai.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=30,
                                              stop="Paris", stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content


def test_chat_logprobs(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=8,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4
    chunks = list(oai.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=8,
                                              logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_chat_n_seeded(oai: openai.OpenAI) -> None:
    kw = dict(messages=QUESTION, model="smollm2", temperature=1.0, max_tokens=12, n=3, seed=123)
    a = oai.chat.completions.create(**kw)
    b = oai.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens
    assert a.usage.prompt_tokens == 27  # the prompt is counted once


def test_max_tokens_length(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(messages=QUESTION, model="smollm2", max_completion_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


# --------------------------------------------------------------------------
# completions
# --------------------------------------------------------------------------


def test_completions(oai: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = "The quick brown fox"
    r = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    chunks = list(oai.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10
    e = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0, echo=True,
                               extra_body={"ignore_eos": True})
    assert e.choices[0].text == prompt + r.choices[0].text


def test_completions_prompt_forms_and_n(oai: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("Hello there")
    r = oai.completions.create(model="smollm2", prompt=[ids, tokenizer.encode("Good morning")], max_tokens=4, n=2, temperature=0,
                               extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3]  # greedy: the n copies agree
    assert r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Good morning"))
    r2 = oai.completions.create(model="smollm2", prompt="Hello there", max_tokens=4, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r2.choices[0].text == by[0]


def test_completions_logprobs(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_completions_stop_and_stop_token_ids(oai: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    base = oai.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    assert " 6" in base
    r = oai.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"],
                               extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[: base.index(" 6")]
    first = tokenizer.encode(base)[0]
    r = oai.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True, "stop_token_ids": [first]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


def test_prefix_cache_reported(oai: openai.OpenAI) -> None:
    prompt = "Repeat after me: " + "alpha beta gamma delta " * 20
    oai.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)
    r = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


# --------------------------------------------------------------------------
# errors (raw HTTP): every one in the OpenAI envelope, none disturbs others
# --------------------------------------------------------------------------


def _err(resp: httpx.Response, code: int) -> dict:
    assert resp.status_code == code, resp.text
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


CHAT = {"model": "smollm2", "messages": QUESTION}
CMPL = {"model": "smollm2", "prompt": "hi"}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {**CMPL, "temperature": -1}, "temperature"),
        ("/v1/completions", {**CMPL, "top_p": 0}, "top_p"),
        ("/v1/completions", {**CMPL, "top_p": 1.01}, "top_p"),
        ("/v1/completions", {**CMPL, "n": 0}, "n"),
        ("/v1/completions", {**CMPL, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {**CMPL, "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**CMPL, "max_tokens": "ten"}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "messages": "hello"}, "messages"),
        ("/v1/completions", {"model": "smollm2"}, "prompt"),
        ("/v1/completions", {**CMPL, "prompt": [10**9]}, "prompt"),
        ("/v1/completions", {**CMPL, "prompt": ""}, "prompt"),
        ("/v1/completions", {**CMPL, "prompt": [[1, 2], "mixed"]}, "prompt"),
    ],
)
def test_400(server: str, path: str, body: dict, param: str) -> None:
    e = _err(httpx.post(server + path, json=body), 400)
    assert e["param"] == param and e["type"] == "invalid_request_error"


def test_400_too_long(server: str) -> None:
    e = _err(httpx.post(server + "/v1/completions", json={**CMPL, "max_tokens": MAX_MODEL_LEN}), 400)
    assert str(MAX_MODEL_LEN) in e["message"] and str(MAX_MODEL_LEN + 1) in e["message"]
    long_prompt = "word " * (MAX_MODEL_LEN + 10)
    e = _err(httpx.post(server + "/v1/chat/completions",
                        json={**CHAT, "messages": [{"role": "user", "content": long_prompt}]}), 400)
    assert str(MAX_MODEL_LEN) in e["message"]


def test_malformed_json(server: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        e = _err(httpx.post(server + path, content=b'{"prompt": ', headers={"content-type": "application/json"}),
                 400)
        assert "JSON" in e["message"]


def test_404(server: str) -> None:
    e = _err(httpx.post(server + "/v1/completions", json={**CMPL, "model": "gpt-5"}), 404)
    assert "gpt-5" in e["message"]
    _err(httpx.get(server + "/v1/nope"), 404)


def test_errors_do_not_disturb_others(server: str, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="smollm2", prompt="x", temperature=-3)
    r = oai.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert httpx.get(server + "/health").status_code == 200


def test_logprobs_with_sampling_filters_stay_valid_json(server: str) -> None:
    body = {**CMPL, "max_tokens": 4, "temperature": 0.8, "top_k": 2, "top_p": 0.5, "logprobs": 5, "seed": 1}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert all(isinstance(v, float) for v in lp["token_logprobs"])
    body = {**CHAT, "max_tokens": 4, "temperature": 0.8, "top_k": 2, "logprobs": True, "top_logprobs": 5,
            "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:], parse_constant=_reject)  # strict JSON: no NaN / Infinity


def _reject(token: str) -> None:
    raise ValueError(f"non-standard JSON constant {token}")
