"""The OpenAI surface of issue 15 end to end, through the official
``openai`` client against one real ``fdx serve``: unknown fields refused,
``stream_options`` without ``stream``, ``prompt_logprobs`` (vLLM's shape,
checked against the server's own next-token logprobs), ``echo`` with
``logprobs``, ``top_logprobs`` limits, ``return_token_ids``,
``continuous_usage_stats``, the chat options and ``/tokenize`` /
``/detokenize``."""

from __future__ import annotations

import copy

from typing import Any, Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")

from serverutil import start_server  # noqa: E402

PROMPT = "The capital of France is Paris. The capital of Italy is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with start_server("--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--max-model-len", "512",
                      default_args=()) as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def oai(server: str) -> Any:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def tokens_of(server: str, **body: Any) -> list[int]:
    r = httpx.post(server + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# -- no field silently ignored ------------------------------------------------


@pytest.mark.parametrize("field,value", [("bogus_option", 1), ("best_of", 2), ("logit_bias_typo", {"1": 2}),
                                         ("skip_special_tokens", False)])
def test_unimplemented_field_is_a_400_naming_it(oai: Any, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model="smollm2", prompt="Hi", max_tokens=1, extra_body={field: value})
    assert ei.value.body["param"] == field and field in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1, extra_body={field: value})
    assert ei.value.body["param"] == field


def test_no_effect_fields_are_accepted(oai: Any) -> None:
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, user="u1", store=False,
                                    metadata={"k": "v"}, service_tier="auto")
    assert r.choices[0].message.content


def test_stream_options_without_stream_is_a_400(oai: Any) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model="smollm2", prompt="Hi", max_tokens=1, stream_options={"include_usage": True})
    assert ei.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1, stream=False,
                                    stream_options={"include_usage": True})


# -- logprobs and token ids ----------------------------------------------------


def test_prompt_logprobs_vllm_shape_and_values(server: str, oai: Any) -> None:
    ids = tokens_of(server, prompt=PROMPT)
    r = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0,
                               extra_body={"prompt_logprobs": 2})
    plp = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for t in (1, len(ids) // 2, len(ids) - 1):
        entry = plp[t]
        own = entry[str(ids[t])]
        assert own["rank"] >= 1 and own["logprob"] <= 0 and isinstance(own["decoded_token"], str)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[t]) or own["rank"] <= 2)
        assert ranks[:2] == [1, 2]
        # the server's own next-token distribution after ids[:t] agrees
        ref = oai.completions.create(model="smollm2", prompt=ids[:t], max_tokens=1, temperature=0, logprobs=5)
        top = ref.choices[0].logprobs.top_logprobs[0]
        best = max(entry.values(), key=lambda v: v["logprob"])
        assert max(top, key=top.get) == best["decoded_token"]
        assert max(top.values()) == pytest.approx(best["logprob"], abs=0.05)
    # chat: at the response level
    c = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    cplp = c.model_dump()["prompt_logprobs"]
    assert cplp[0] is None and len(cplp) == c.usage.prompt_tokens and all(len(d) == 1 for d in cplp[1:])


def test_prompt_logprobs_limits(oai: Any) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model="smollm2", prompt="Hi", max_tokens=1, extra_body={"prompt_logprobs": 21})
    assert ei.value.body["param"] == "prompt_logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs(server: str, oai: Any, stream: bool) -> None:
    ids = tokens_of(server, prompt=PROMPT)
    kw: dict[str, Any] = dict(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2,
                              extra_body={"ignore_eos": True})
    if stream:
        text, tokens, token_lps, tops = "", [], [], []
        for ch in oai.completions.create(stream=True, **kw):
            if ch.choices:
                text += ch.choices[0].text
                if ch.choices[0].logprobs:
                    tokens += ch.choices[0].logprobs.tokens
                    token_lps += ch.choices[0].logprobs.token_logprobs
                    tops += ch.choices[0].logprobs.top_logprobs
    else:
        r = oai.completions.create(**kw)
        c = r.choices[0]
        text, tokens, token_lps, tops = c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs
        assert c.logprobs.text_offset == sorted(c.logprobs.text_offset)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert len(tokens) == len(ids) + 3 and "".join(tokens[: len(ids)]) == PROMPT
    assert token_lps[0] is None and tops[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in token_lps[1:])
    assert all(len(t) >= 2 for t in tops[1:])  # the 2 alternatives (the token itself may be one of them)


def test_top_logprobs_edges(oai: Any) -> None:
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=0)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(c.top_logprobs == [] and c.logprob <= 0 for c in content)
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=20)
    assert all(len(c.top_logprobs) == 20 for c in r.choices[0].logprobs.content)
    for kw in ({"top_logprobs": 2}, {"top_logprobs": 0}, {"logprobs": False, "top_logprobs": 3},
               {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}):
        with pytest.raises(openai.BadRequestError) as ei:
            oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1, **kw)
        assert ei.value.body["param"] == "top_logprobs", kw


def test_return_token_ids(server: str, oai: Any) -> None:
    ids = tokens_of(server, prompt=PROMPT)
    r = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0,
                               extra_body={"return_token_ids": True, "ignore_eos": True}).model_dump()
    c = r["choices"][0]
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == r["usage"]["completion_tokens"] == 4
    text = httpx.post(server + "/detokenize", json={"tokens": c["token_ids"]}, timeout=30).json()["prompt"]
    assert text == c["text"]
    named = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                   extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert named.choices[0].logprobs.tokens == [f"token_id:{t}" for t in c["token_ids"]]
    streamed: list[int] = []
    prompt_ids = None
    for ch in oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                     extra_body={"return_token_ids": True, "ignore_eos": True}):
        d = ch.model_dump()
        for choice in d["choices"]:
            streamed += choice.get("token_ids") or []
            prompt_ids = prompt_ids or choice.get("prompt_token_ids")
    assert streamed == c["token_ids"] and prompt_ids == ids
    # chat: prompt ids at the response level, the completion's per choice
    chat_ids = tokens_of(server, messages=CHAT)
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3, temperature=0,
                                    extra_body={"return_token_ids": True}).model_dump()
    assert r["prompt_token_ids"] == chat_ids and len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]
    first = None
    streamed = []
    for ch in oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3, temperature=0, stream=True,
                                          extra_body={"return_token_ids": True}):
        d = ch.model_dump()
        first = first or d.get("prompt_token_ids")
        for choice in d["choices"]:
            streamed += choice.get("token_ids") or []
    assert first == chat_ids and streamed == r["choices"][0]["token_ids"]


# -- usage while streaming -------------------------------------------------------


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats(oai: Any, include_usage: bool) -> None:
    chunks = list(oai.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=5, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": include_usage, "continuous_usage_stats": True}))
    content = [c for c in chunks if c.choices]
    if not include_usage:  # vLLM: continuous_usage_stats qualifies include_usage
        assert all(c.usage is None for c in chunks)
        return
    assert all(c.usage is not None for c in content)
    done = [c.usage.completion_tokens for c in content]
    assert done == sorted(done) and done[-1] == 5 and done[0] <= 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in content)
    final = [c for c in chunks if not c.choices]
    assert len(final) == 1 and final[0].usage.completion_tokens == 5


# -- chat options ---------------------------------------------------------------


def test_continue_final_message_and_add_generation_prompt(server: str, oai: Any) -> None:
    partial = [*CHAT, {"role": "assistant", "content": "The capital of France is"}]
    r = oai.chat.completions.create(model="smollm2", messages=partial, max_tokens=3, temperature=0,
                                    extra_body={"continue_final_message": True, "return_token_ids": True}).model_dump()
    prompt = httpx.post(server + "/detokenize", json={"tokens": r["prompt_token_ids"]}, timeout=30).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert tokens_of(server, messages=partial, continue_final_message=True) == r["prompt_token_ids"]
    assert "Paris" in r["choices"][0]["message"]["content"]
    for stream in (False, True):  # vLLM's chat echo: the continued message leads the reply
        kw: dict[str, Any] = dict(model="smollm2", messages=partial, max_tokens=3, temperature=0,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                              "echo": True})
        if stream:
            content = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                              if c.choices)
        else:
            content = oai.chat.completions.create(**kw).choices[0].message.content
        assert content == "The capital of France is" + r["choices"][0]["message"]["content"], (stream, content)
    no_gen = tokens_of(server, messages=CHAT, add_generation_prompt=False)
    with_gen = tokens_of(server, messages=CHAT)
    assert with_gen[: len(no_gen)] == no_gen and len(with_gen) > len(no_gen)
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1,
                                    extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(no_gen)
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model="smollm2", messages=partial, max_tokens=1,
                                    extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert ei.value.body["param"] == "continue_final_message"
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(with_gen)  # SmolLM2's template reads no extra variable


def test_chat_template_kwargs_reach_the_template() -> None:
    from fdx.model.loader import load_tokenizer
    from fdx.chat_template import render_chat

    tok = copy.copy(load_tokenizer("smollm2"))  # a copy: load_tokenizer is cached and shared with later tests
    tok.chat_template, tok._template = "{{ greeting }}|{% for m in messages %}{{ m.content }}{% endfor %}", None
    assert render_chat(tok, [{"role": "user", "content": "x"}], True, False, {"greeting": "hi"}) == "hi|x"
    # the fixed variables win over the caller's
    assert render_chat(tok, [{"role": "user", "content": "x"}], True, False, {"messages": []}) == "|x"


# -- /tokenize, /detokenize -------------------------------------------------------


def test_tokenize_detokenize(server: str) -> None:
    r = httpx.post(server + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}, timeout=30).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 512
    assert "".join(r["token_strs"]) == "Hello world"
    back = httpx.post(server + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(server + "/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert chat["token_strs"] is None and chat["count"] > 5
    for path, body, param in (("/tokenize", {}, "messages"),
                              ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
                              ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        e = httpx.post(server + path, json=body, timeout=30)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, (path, body, e.text)
    assert httpx.post(server + "/tokenize", json={"prompt": "a", "model": "nope"}, timeout=30).status_code == 404
