"""Beam search (issue 23): the same best sequences as transformers.

The goldens (``tests/data/beam_goldens.json``, written by
``scripts/make_beam_goldens.py``) are transformers' ``generate(num_beams=W,
do_sample=False)`` in float32 on the embedded SmolLM2, prompts tokenized by
fdx.  fdx runs with ``--dtype float32``: the engine in process (token ids
and scores, KV invariants every step, under a small KV pool so groups are
preempted and restarted) and a real ``fdx serve`` (completions and chat,
streamed and not, refused combinations, a concurrent greedy request's
latency, no KV block left afterwards, also after a client disconnect).

Ranking ties: when two of transformers' beams score within ``TIE`` of each
other, fdx may order them either way (float32 sums in another order).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from controlutil import wait_metric
from serverutil import start_server

pytestmark = pytest.mark.slow

GOLDENS = json.loads((Path(__file__).parent / "data" / "beam_goldens.json").read_text())["goldens"]
TIE = 1e-3
SCORE_TOL = 2e-3
ES = {True: "true", False: "false", "never": "never"}


def case_id(c: dict[str, Any]) -> str:
    return f"{c['name']}-w{c['width']}-lp{c['length_penalty']}-es{c['early_stopping']}"


def assert_same_beams(got: list[list[int]], golden: dict[str, Any]) -> None:
    """``got`` (best first) is transformers' list, up to swaps inside score ties."""
    want = [b["token_ids"] for b in golden["beams"]]
    scores = [b["score"] for b in golden["beams"]]
    assert len(got) == len(want), (len(got), len(want))
    i = 0
    while i < len(want):  # compare tie groups as sets, in order
        j = i + 1
        while j < len(want) and abs(scores[j] - scores[i]) < TIE:
            j += 1
        assert sorted(got[i:j]) == sorted(want[i:j]), f"beams {i}..{j - 1}: {got[i:j]} != {want[i:j]}"
        i = j


# --------------------------------------------------------------------------
# the engine in process: ids and scores
# --------------------------------------------------------------------------


def test_engine_beams_and_scores_match_transformers() -> None:
    from fdx.config import EngineConfig
    from fdx.core.engine import Engine
    from fdx.core.messages import AddRequest, SamplingParams

    # 24 blocks: the eleven searches (up to 15 blocks each) cannot all run at once, so groups are preempted
    eng = Engine(EngineConfig(dtype="float32", num_kv_blocks=24, max_model_len=2048))
    for i, c in enumerate(GOLDENS):
        sp = SamplingParams(max_tokens=c["max_tokens"], temperature=0.0, beam_width=c["width"],
                            length_penalty=c["length_penalty"], early_stopping=ES[c["early_stopping"]])
        eng.add_request(AddRequest(f"b{i}", tuple(c["prompt_token_ids"]), sp, time.time()))
    outs = {}
    while eng.has_work():
        for o in eng.step():
            if o.finish_reason is not None:
                outs[o.request_id] = o
        eng.scheduler.check_invariants()
    assert eng.kv.num_used_blocks == 0
    for i, c in enumerate(GOLDENS):
        o = outs[f"b{i}"]
        assert o.finish_reason in ("stop", "length") and o.beams is not None, (case_id(c), o.error)
        assert_same_beams([list(b.token_ids) for b in o.beams], c)
        assert o.new_token_ids == o.beams[0].token_ids  # the best beam, for plain readers
        for b, w in zip(o.beams, c["beams"]):
            assert abs(b.score - w["score"]) < SCORE_TOL, (case_id(c), b.score, w["score"])
        assert [b.score for b in o.beams] == sorted((b.score for b in o.beams), reverse=True)
    assert eng.scheduler.num_preemptions > 0  # the small pool did restart some searches


# --------------------------------------------------------------------------
# a real server
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with start_server("--dtype", "float32", "--max-num-seqs", "16") as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    """fdx's default compute (int8, batch-invariant GEMM): what the latency bound is about.  In
    float32 (qgemv, a few rows at a time) five rows cost about three times one on this CPU, beam
    rows or not."""
    with start_server("--max-num-seqs", "16") as (base, _proc):
        yield base


def golden(name: str, width: int, lp: float = 1.0, es: Any = False) -> dict[str, Any]:
    return next(c for c in GOLDENS if c["name"] == name and c["width"] == width and c["length_penalty"] == lp
                and c["early_stopping"] == es)


def beam_body(c: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"max_tokens": c["max_tokens"], "use_beam_search": True, "n": c["width"],
            "length_penalty": c["length_penalty"], "early_stopping": c["early_stopping"],
            "return_token_ids": True, **extra}


def sse(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def texts_of(events: list[dict[str, Any]], n: int, key: str) -> tuple[list[str], list[str | None]]:
    texts, reasons = [""] * n, [None] * n
    for ev in events:
        assert "error" not in ev, ev
        for ch in ev["choices"]:
            piece = ch.get("text") if key == "text" else (ch.get("delta") or {}).get("content")
            texts[ch["index"]] += piece or ""
            reasons[ch["index"]] = ch.get("finish_reason") or reasons[ch["index"]]
    return texts, reasons


@pytest.mark.parametrize("c", [c for c in GOLDENS if c["kind"] == "text"], ids=case_id)
def test_completions_match_transformers(server: str, c: dict[str, Any]) -> None:
    r = httpx.post(server + "/v1/completions", json={"prompt": c["prompt_token_ids"], **beam_body(c)}, timeout=300)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == list(range(c["width"]))
    assert_same_beams([ch["token_ids"] for ch in choices], c)
    for ch in choices:
        assert ch["finish_reason"] == ("stop" if ch["token_ids"][-1] == 2 else "length")
    assert r.json()["usage"]["completion_tokens"] == sum(len(ch["token_ids"]) for ch in choices)


@pytest.mark.parametrize("c", [c for c in GOLDENS if c["kind"] == "chat"], ids=case_id)
def test_chat_streamed_and_not(server: str, c: dict[str, Any]) -> None:
    width = c["width"]
    body = {"messages": [{"role": "user", "content": c["text"]}], **beam_body(c)}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_token_ids"] == c["prompt_token_ids"]  # the same prompt as transformers got
    assert_same_beams([ch["token_ids"] for ch in out["choices"]], c)
    events = sse(server, "/v1/chat/completions", body)
    texts, reasons = texts_of(events, width, "content")
    assert texts == [ch["message"]["content"] for ch in out["choices"]]
    assert reasons == [ch["finish_reason"] for ch in out["choices"]]
    assert any(ch["finish_reason"] == "stop" for ch in out["choices"])  # eos ends beams here


def test_completions_streamed(server: str) -> None:
    c = golden("fib", 4)
    body = {"prompt": c["prompt_token_ids"], **beam_body(c)}
    full = httpx.post(server + "/v1/completions", json=body, timeout=300).json()
    texts, reasons = texts_of(sse(server, "/v1/completions", body), 4, "text")
    assert texts == [ch["text"] for ch in full["choices"]] and all(texts)
    assert reasons == [ch["finish_reason"] for ch in full["choices"]]


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"temperature": 0.7}, "temperature"),
    ("/v1/completions", {"top_p": 0.5}, "top_p"),
    ("/v1/completions", {"top_k": 5}, "top_k"),
    ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"stop": ["\n"]}, "stop"),
    ("/v1/completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"guided_regex": "[a-z]+"}, "guided_regex"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/completions", {"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
    ("/v1/completions", {"use_beam_search": False, "early_stopping": True}, "early_stopping"),
    ("/v1/completions", {"early_stopping": "always"}, "early_stopping"),
])
def test_refused_combinations(server: str, path: str, extra: dict[str, Any], param: str) -> None:
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    for stream in (False, True):
        r = httpx.post(server + path, json={**base, "max_tokens": 4, "use_beam_search": True, "n": 2, **extra,
                                            "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], err


def test_too_wide_is_refused(server: str) -> None:
    r = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "use_beam_search": True,
                                                     "n": 11}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n" and "beam width" in r.json()["error"]["message"]


def test_concurrent_greedy_request_is_not_stalled(default_server: str) -> None:
    """A plain greedy request is served while a width-4 beam search runs:
    five of them, one after another, each complete before the (300-token)
    search ends, so the search never holds the engine or the API loop.  The
    latency ratio issue 23 bounds (<= 2x alone; measured 1.7x, the cost of
    four more rows) is printed, not asserted: on two shared cores it is a
    timing, and timings belong in bench/ (bench_beam_stall.py)."""
    server = default_server
    plain = {"prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    def one() -> float:
        t0 = time.monotonic()
        r = httpx.post(server + "/v1/completions", json=plain, timeout=120)
        assert r.status_code == 200, r.text
        return time.monotonic() - t0

    one()  # warm (prefix cache, first-request costs)
    alone = min(one() for _ in range(5))
    beam = {"prompt": "Once upon a time", "max_tokens": 300, "use_beam_search": True, "n": 4, "ignore_eos": True}
    res: dict[str, Any] = {}

    def run_beam() -> None:
        t0 = time.monotonic()
        r = httpx.post(server + "/v1/completions", json=beam, timeout=600)
        res["status"], res["s"], res["body"] = r.status_code, time.monotonic() - t0, r.json()

    th = threading.Thread(target=run_beam)
    th.start()
    time.sleep(1.0)  # the beam is decoding
    assert th.is_alive()
    during = []
    for _ in range(5):
        during.append(one())
        assert th.is_alive(), "the beam search ended before the concurrent requests did (make it longer)"
    th.join()
    assert res["status"] == 200, res
    assert len(res["body"]["choices"]) == 4
    print(f"plain request alone {alone:.2f}s, beside a width-4 beam search {min(during):.2f}s (best of 5; median "
          f"{statistics.median(during):.2f}s); the search: {res['s']:.1f}s")


def test_no_kv_block_left_after_finish_and_disconnect(server: str) -> None:
    c = golden("language", 4)
    body = {"prompt": c["prompt_token_ids"], **beam_body(c, max_tokens=200, ignore_eos=True)}
    # a client that goes away while the search runs (nothing streamed yet: beams come at the end)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, timeout=2.0)
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
    assert wait_metric(server, "fdx:kv_blocks_used", 0.0, timeout=30) == 0.0
    r = httpx.post(server + "/v1/completions", json={"prompt": c["prompt_token_ids"], **beam_body(c)}, timeout=300)
    assert r.status_code == 200
    assert_same_beams([ch["token_ids"] for ch in r.json()["choices"]], c)  # the engine serves on, correctly
    assert wait_metric(server, "fdx:kv_blocks_used", 0.0, timeout=30) == 0.0
