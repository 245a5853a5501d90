"""The one output path: ``fdx.LLM`` and a real ``fdx serve`` share
:class:`fdx.output_processor.OutputProcessor`, so the same greedy request
gives the same text, logprobs and finish reason in both; and a server's
non-streaming reply is the collected stream (same text, usage, finish
reason)."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from serverutil import start_server

pytestmark = pytest.mark.slow

ARGS = ("--num-kv-blocks", "256", "--max-model-len", "1024", "--max-num-batched-tokens", "64")
# the README's first request: with its system message the int8 default answers it as float32 does (without one,
# the first token is a near-tie between "The" and "L" even in float32, and int8 tips it to "L'Étoile, ...")
QUESTION = [{"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with start_server(*ARGS, default_args=()) as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def llm() -> Any:
    import fdx

    return fdx.LLM(num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=64)


def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base + path, json={"model": "smollm2", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", base + path, json={"model": "smollm2", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events
    return events


# -- fdx.LLM == fdx serve ----------------------------------------------------


@pytest.mark.parametrize("stop", [None, ["France"], [" is"]])
def test_llm_and_server_agree_on_chat(server: str, llm: Any, stop: list[str] | None) -> None:
    from fdx import SamplingParams

    [off] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24, logprobs=3, stop=tuple(stop or ())))
    on = post(server, "/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 24,
                                                "logprobs": True, "top_logprobs": 3, "stop": stop})
    choice = on["choices"][0]
    assert choice["message"]["content"] == off.text
    assert choice["finish_reason"] == off.finish_reason == "stop"  # a stop string, or the end of turn
    content = choice["logprobs"]["content"]
    # the server reports a logprob for every token the engine sent, as fdx.LLM
    assert [c["token"] for c in content] == [llm.processor.token_text(lp.token_id) for lp in off.logprobs]
    for c, lp in zip(content, off.logprobs):
        assert c["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert [t["token"] for t in c["top_logprobs"]] == [llm.processor.token_text(t) for t, _ in lp.top]
    if stop:
        [full] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))
        assert off.text == full.text[: full.text.index(stop[0])]


def test_llm_and_server_agree_on_completions_with_length(server: str, llm: Any) -> None:
    from fdx import SamplingParams

    prompt = "The three primary colours are"
    [off] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True))
    on = post(server, "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 12, "logprobs": 2,
                                          "ignore_eos": True})
    choice = on["choices"][0]
    assert choice["text"] == off.text and choice["finish_reason"] == off.finish_reason == "length"
    lps = choice["logprobs"]
    assert lps["tokens"] == [llm.processor.token_text(lp.token_id) for lp in off.logprobs]
    assert lps["token_logprobs"] == pytest.approx([lp.logprob for lp in off.logprobs], abs=1e-4)
    assert on["usage"]["completion_tokens"] == len(off.token_ids) == 12
    assert on["usage"]["prompt_tokens"] == len(off.prompt_token_ids)


def test_llm_and_server_agree_on_seeded_choices(server: str, llm: Any) -> None:
    """Choice j of a seeded request samples with seed + j in both front ends."""
    from fdx import SamplingParams

    prompt = "Once upon a time"
    [off] = llm.generate(prompt, SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=12, ignore_eos=True))
    # top_p set: the server would apply the model's default (0.9), and fdx.LLM does not apply defaults yet
    on = post(server, "/v1/completions", {"prompt": prompt, "temperature": 0.9, "top_p": 1.0, "seed": 7, "n": 2,
                                          "max_tokens": 12, "ignore_eos": True})
    texts = [c["text"] for c in sorted(on["choices"], key=lambda c: c["index"])]
    assert texts == [o.text for o in off.outputs]
    assert texts[0] != texts[1]  # seeds 7 and 8


# -- streaming == non-streaming ----------------------------------------------


def _streamed_completion(events: list[dict[str, Any]], n: int) -> tuple[list[str], list[str | None], Any]:
    texts, reasons = [""] * n, [None] * n
    usage = None
    for ev in events:
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev["choices"]:
            texts[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            if c["finish_reason"] is not None:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons, usage


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["Once upon a time", "1, 2, 3,"], "max_tokens": 16, "n": 2,
                         "stop": [","], "echo": True}),
    ("/v1/completions", {"prompt": "The sky is", "max_tokens": 10, "ignore_eos": True, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 20, "stop": ["Paris"], "n": 2}),
    ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}),
])
def test_streaming_and_non_streaming_agree(server: str, path: str, body: dict[str, Any]) -> None:
    body = {"temperature": 0, **body}
    full = post(server, path, body)
    n = len(full["choices"])
    events = stream(server, path, {**body, "stream_options": {"include_usage": True}})
    texts, reasons, usage = _streamed_completion(events, n)
    chat = path.endswith("chat/completions")
    want = [c["message"]["content"] if chat else c["text"] for c in sorted(full["choices"], key=lambda c: c["index"])]
    assert texts == want
    assert reasons == [c["finish_reason"] for c in sorted(full["choices"], key=lambda c: c["index"])]
    # the second request may hit the prefix cache: cached_tokens may differ
    drop = {"prompt_tokens_details"}
    assert {k: v for k, v in usage.items() if k not in drop} == {k: v for k, v in full["usage"].items() if k not in drop}
    if "logprobs" in body:
        streamed = [c["logprobs"] for ev in events for c in ev["choices"] if c.get("logprobs")]
        whole = full["choices"][0]["logprobs"]
        if chat:
            got = [x for s in streamed for x in s["content"]]
            assert [x["token"] for x in got] == [x["token"] for x in whole["content"]]
            assert [x["logprob"] for x in got] == pytest.approx([x["logprob"] for x in whole["content"]], abs=1e-4)
        else:
            for key in ("tokens", "text_offset"):
                assert [x for s in streamed for x in s[key]] == whole[key]
            got_lp = [x for s in streamed for x in s["token_logprobs"]]
            assert got_lp == pytest.approx(whole["token_logprobs"], abs=1e-4)
