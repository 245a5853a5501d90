"""What vLLM's own HTTP API tests expect of a server, on a real ``fdx serve``
(issue #23's list): ``$defs``/``$ref`` in tool and response schemas,
``prompt_logprobs: -1`` and its ``null`` default, token ids of multi-byte
characters, ``token_id:N`` logprobs, continuous usage on a chunked long
prompt, a stream cut by ``max_tokens``, a moderately complex
``json_schema``, ``POST /invocations`` and ``POST /v1/chat/completions/batch``.
One server for the module (a 4,096-token context, the default 512-token step
budget, so the long prompt is prefilled in chunks)."""

from __future__ import annotations

import json
import math
from typing import Any, Iterator

import httpx
import jsonschema
import pytest
from serverutil import start_server

from fdx.core.messages import MAX_ALL_LOGPROBS_PROMPT

VOCAB = 49152

CITY_SCHEMA = {
    "$defs": {
        "City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                  "country": {"$ref": "#/$defs/Country"}},
                 "required": ["name", "country"], "additionalProperties": False},
        "Country": {"type": "string", "enum": ["France", "Italy", "Japan"]},
    },
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/City"}},
    "required": ["city"],
    "additionalProperties": False,
}

# vLLM's sample_json_schema (tests/entrypoints/openai/conftest.py)
EMPLOYEE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3},
        "work_history": {"type": "array", "items": {
            "type": "object",
            "properties": {"company": {"type": "string"}, "duration": {"type": "number"},
                           "position": {"type": "string"}},
            "required": ["company", "position"]}},
    },
    "required": ["name", "age", "skills", "work_history"],
}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with start_server(default_args=("--num-kv-blocks", "512", "--max-model-len", "4096"), timeout=600) as (url, _proc):
        yield url


def post(base: str, path: str, body: dict[str, Any], timeout: float = 180) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=timeout)


def stream(base: str, path: str, body: dict[str, Any], timeout: float = 300) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks and not any("error" in c for c in chunks), chunks[-1:]
    return chunks


def detokenize(base: str, ids: list[int]) -> str:
    r = post(base, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


# -- 1. $defs / $ref -------------------------------------------------------


def test_defs_and_refs_in_response_format_and_tools(base: str) -> None:
    msgs = [{"role": "user", "content": "Name a famous city and its country."}]
    r = post(base, "/v1/chat/completions", {
        "messages": msgs, "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), CITY_SCHEMA)

    tools = [{"type": "function", "function": {"name": "find_city", "parameters": CITY_SCHEMA}},
             {"type": "function", "function": {"name": "other", "parameters": {
                 "$defs": {"City": {"type": "integer"}}, "type": "object",
                 "properties": {"n": {"$ref": "#/$defs/City"}}, "required": ["n"]}}}]
    for choice in ("required", {"type": "function", "function": {"name": "find_city"}}):
        r = post(base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 80, "temperature": 0,
                                                "tools": tools, "tool_choice": choice})
        assert r.status_code == 200, r.text  # was 400 "Pointer '/$defs/City' does not exist"
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert calls, r.text
        for call in calls:  # two tools share the name City in their $defs: each resolves to its own
            name = call["function"]["name"]
            schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


# -- 2, 3. prompt_logprobs -------------------------------------------------


def test_prompt_logprobs_whole_vocabulary(base: str) -> None:
    r = post(base, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 1,
                                       "prompt_logprobs": -1})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    for pos in plp[1:]:
        assert len(pos) == VOCAB  # every token of the vocabulary (the prompt token among them)
        ranks = sorted(v["rank"] for v in pos.values())
        assert ranks[0] == 1 and ranks[-1] <= VOCAB
        total = math.fsum(math.exp(v["logprob"]) for v in pos.values())
        assert total == pytest.approx(1.0, abs=1e-3)  # a whole distribution
    long_prompt = "word " * (MAX_ALL_LOGPROBS_PROMPT + 8)
    r = post(base, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1, "prompt_logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    r = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "prompt_logprobs": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_prompt_logprobs_key_is_null_when_not_asked(base: str) -> None:
    r = post(base, "/v1/completions", {"prompt": ["Hello", "Bye"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert "prompt_logprobs" in c and c["prompt_logprobs"] is None
    r = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert "prompt_logprobs" in r.json() and r.json()["prompt_logprobs"] is None
    r = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                            "prompt_logprobs": 1})
    assert r.json()["prompt_logprobs"][0] is None and len(r.json()["prompt_logprobs"]) > 1


# -- 4, 5. token ids of multi-byte characters, token_id:N ------------------

EMOJI = {"prompt": "Three emoji:", "max_tokens": 16, "temperature": 0, "return_token_ids": True, "logprobs": 1,
         "structured_outputs": {"regex": "[🚀🐱🎉]{3} done"}}  # forces emoji, each split over byte tokens


def test_return_token_ids_with_multibyte_characters(base: str) -> None:
    r = post(base, "/v1/completions", EMOJI)
    assert r.status_code == 200, r.text
    full = r.json()["choices"][0]
    ids = full["token_ids"]
    assert detokenize(base, ids).removesuffix("<|im_end|>") == full["text"]
    assert any("\ufffd" in detokenize(base, [t]) for t in ids)  # some token is part of a character
    chunks = stream(base, "/v1/completions", {**EMOJI, "return_tokens_as_token_ids": True})
    streamed: list[int] = []
    held_back = 0
    for ch in chunks:
        c = ch["choices"][0]
        assert c["token_ids"] is not None
        # the ids of a chunk are exactly its tokens, even when its text is held back
        assert [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] == c["token_ids"]
        held_back += bool(c["token_ids"]) and not c["text"]
        streamed += c["token_ids"]
    assert held_back > 0
    assert streamed == ids
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == full["text"]
    assert detokenize(base, streamed).startswith(full["text"])

    msgs = [{"role": "user", "content": "Write three emoji."}]
    body = {"messages": msgs, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
            "structured_outputs": {"regex": "[🚀🐱🎉]{3}"}}
    full_chat = post(base, "/v1/chat/completions", body).json()
    chat_ids = full_chat["choices"][0]["token_ids"]
    chunks = stream(base, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] and all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for ch in chunks for c in ch["choices"] for t in c.get("token_ids") or []]
    assert streamed == chat_ids
    text = "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])
    assert text == full_chat["choices"][0]["message"]["content"] and detokenize(base, streamed).startswith(text)


def test_return_tokens_as_token_ids(base: str) -> None:
    r = post(base, "/v1/completions", {"prompt": "Say 'Hello, world! 🎉'", "echo": True, "temperature": 0,
                                       "max_tokens": 10, "logprobs": 1, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    tokens = c["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens)
    # vLLM: the first key of each top_logprobs entry is the token itself
    assert tokens[1:] == [next(iter(d)) for d in c["logprobs"]["top_logprobs"][1:]]
    assert all(k.startswith("token_id:") for d in c["logprobs"]["top_logprobs"][1:] for k in d)
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert detokenize(base, ids).removesuffix("<|im_end|>") == c["text"]

    msgs = [{"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}]
    r = post(base, "/v1/chat/completions", {"messages": msgs,
                                            "temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
                                            "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    content = c["logprobs"]["content"]
    for e in [*content, *(t for e in content for t in e["top_logprobs"])]:
        assert e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode())
    ids = [int(e["token"].removeprefix("token_id:")) for e in content]
    assert detokenize(base, ids).removesuffix("<|im_end|>") == c["message"]["content"]


# -- 6, 7. streams -----------------------------------------------------------


def test_chunked_long_prompt_streams_usage_and_logprobs(base: str) -> None:
    prompt = "What is the capital of France?" * 400  # about 2,800 tokens: prefilled in 512-token chunks
    usage = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(base, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                              "stream_options": usage, "logprobs": 5})
    assert chunks[0]["usage"]["prompt_tokens"] > 2048
    received = 0
    for ch in chunks:
        u = ch["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        if ch["choices"]:
            received += 1
            assert ch["choices"][0]["text"] and ch["choices"][0]["logprobs"]["tokens"]
            assert u["completion_tokens"] == received  # the usage of what this chunk carries, not more
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == received == 5

    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": prompt}]
    chunks = stream(base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                   "stream_options": usage, "logprobs": True, "top_logprobs": 5})
    empty = received = 0
    for ch in chunks:
        u = ch["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        if not ch["choices"]:
            continue
        c = ch["choices"][0]
        if c["delta"].get("content") == "":
            assert u["completion_tokens"] == 0 and c["logprobs"] is None  # the role chunk comes before any token
            empty += 1
        else:
            received += 1
            assert u["completion_tokens"] == received
    assert empty <= 1 and chunks[-1]["usage"]["completion_tokens"] == received == 5


def test_stream_cut_by_max_tokens_ends_with_length(base: str) -> None:
    # min_tokens keeps eos out of the first 5 tokens, so max_tokens is what ends it
    body = {"prompt": "What is an LLM?", "max_tokens": 5, "min_tokens": 5, "temperature": 0}
    single = post(base, "/v1/completions", body).json()["choices"][0]
    assert single["finish_reason"] == "length"
    chunks = stream(base, "/v1/completions", body)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["length"] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == single["text"]
    msgs = [{"role": "user", "content": "Tell me a long story."}]
    chunks = stream(base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "min_tokens": 6,
                                                   "stream_options": {"include_usage": True}})
    finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert finishes == ["length"] and chunks[-1]["usage"]["completion_tokens"] == 6


# -- 8. json_schema ------------------------------------------------------------


def test_json_schema_is_bounded_and_valid(base: str) -> None:
    # vLLM's test_response_format_json_schema: no max_tokens (the whole context is the budget), an object that
    # does not say whether other keys may appear; open, SmolLM2 added keys for minutes
    schema = {"type": "object", "properties": {"result": {"type": "integer"}}}
    msgs = [{"role": "user", "content": 'what is 1+1? please respond with a JSON object, the format is {"result": 2}'}]
    for seed in (0, 1):
        r = post(base, "/v1/chat/completions", {
            "messages": msgs, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "foo_test", "schema": schema}}},
            timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop", c
        assert set(json.loads(c["message"]["content"])) <= {"result"}
    # vLLM's nested schema (arrays, maxLength, minItems; test_json_completion): the schema compiles at once and the
    # reply is bounded by max_tokens.  Whether SmolLM2 closes an unbounded array before the budget is the model's
    # business (greedy, it can repeat "C++" in "skills"), so a cut reply must be a cut, of exactly max_tokens
    # Sampled at temperature 1, a choice closes the document or not by chance (measured: 0-2 of 3 per seed):
    # seeds in turn until one does, so the stopped branch is always checked too
    finished = []
    for seed in range(6):
        r = post(base, "/v1/completions", {
            "prompt": f"Give an example JSON for an employee profile that fits this schema: {EMPLOYEE_SCHEMA}",
            "n": 3, "temperature": 1.0, "seed": seed, "max_tokens": 500,
            "response_format": {"type": "json_schema", "json_schema": {"name": "employee", "schema": EMPLOYEE_SCHEMA}}},
            timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        for c in body["choices"]:
            if c["finish_reason"] == "stop":
                doc = json.loads(c["text"])
                jsonschema.validate(doc, EMPLOYEE_SCHEMA)
                assert set(doc) <= set(EMPLOYEE_SCHEMA["properties"])
                finished.append(doc)
            else:
                assert c["finish_reason"] == "length" and c["text"].startswith('{"name": ')
        assert body["usage"]["completion_tokens"] <= 3 * 500
        if finished:
            break
    assert finished, "no sampled choice of seeds 0-5 closed the document"


# -- 9, 10. /invocations and /v1/chat/completions/batch --------------------------


def test_invocations_dispatches_by_body(base: str) -> None:
    r = post(base, "/invocations", {"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    r = post(base, "/invocations", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    chunks = stream(base, "/invocations", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert chunks[0]["object"] == "chat.completion.chunk"
    r = post(base, "/invocations", {"input": "Hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"], r.text
    r = post(base, "/invocations", {"prompt": "Hi", "max_tokens": 3, "no_such_field": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field", r.text


def test_batched_chat_completions(base: str) -> None:
    convs = [[{"role": "user", "content": "Reply with exactly the word: alpha"}],
             [{"role": "user", "content": "Reply with exactly the word: beta"}],
             [{"role": "user", "content": "Say a word"}, {"role": "assistant", "content": "Hello"}]]
    r = post(base, "/v1/chat/completions/batch", {"messages": convs, "max_tokens": 8, "temperature": 0,
                                                  "logprobs": True, "top_logprobs": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1, 2]
    for conv, c in zip(convs, body["choices"]):
        single = post(base, "/v1/chat/completions", {"messages": conv, "max_tokens": 8, "temperature": 0}).json()
        assert c["message"]["content"] == single["choices"][0]["message"]["content"]  # each conversation on its own
        assert c["token_ids"] and not any(e["token"].startswith("token_id:") for e in c["logprobs"]["content"])
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])

    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    r = post(base, "/v1/chat/completions/batch", {
        "messages": [[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                     [{"role": "user", "content": "Is fire cold? Answer in JSON."}]],
        "max_tokens": 30, "return_tokens_as_token_ids": True, "logprobs": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
        assert all(e["token"].startswith("token_id:") for e in c["logprobs"]["content"])
    for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")):
        r = post(base, "/v1/chat/completions/batch", {"messages": convs[:1], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(base, "/v1/chat/completions/batch", {"messages": [{"role": "user", "content": "flat"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_return_tokens_as_token_ids_flag_sets_the_default() -> None:
    from fdx.cli import build_parser
    from fdx.config import from_args

    on = from_args(build_parser().parse_args(["serve", "--return-tokens-as-token-ids"]))
    off = from_args(build_parser().parse_args(["serve"]))
    assert on.return_tokens_as_token_ids is True and off.return_tokens_as_token_ids is False
