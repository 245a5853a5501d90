"""Metric arithmetic of ``fdx bench serve`` from synthetic timestamps (pure
logic, no server), plus the exact-length invariant of the synthetic datasets."""

from __future__ import annotations

import pytest

from fdx.bench.metrics import RequestResult, compute_metrics, meets_slos, parse_goodput, percentile, summarize


def _req(send: float, token_times: list[float], end: float, prompt_len: int = 10, tokens: int | None = None) -> RequestResult:
    """A request sent at ``send`` whose chunks arrived at ``token_times``."""
    r = RequestResult(success=True, prompt_len=prompt_len, start=send)
    r.ttft = token_times[0] - send
    r.itl = [b - a for a, b in zip(token_times, token_times[1:])]
    r.e2el = end - send
    r.chunks = len(token_times)
    r.output_tokens = len(token_times) if tokens is None else tokens
    return r


def test_ttft_tpot_itl_e2el_of_one_request() -> None:
    r = _req(0.0, [0.5, 0.6, 0.8, 0.9], 1.0)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.1])
    assert r.e2el == pytest.approx(1.0)
    # (e2el - ttft) / (n - 1) = 0.5 / 3
    assert r.tpot == pytest.approx(0.5 / 3)


def test_tpot_undefined_for_one_token_and_failures() -> None:
    assert _req(0.0, [0.2], 0.2).tpot is None
    assert RequestResult(success=False, output_tokens=5, ttft=0.1, e2el=1.0).tpot is None


def test_compute_metrics_two_requests() -> None:
    a = _req(0.0, [0.1, 0.2, 0.3], 0.3, prompt_len=100)  # ttft .1, itl .1 .1, tpot .1
    b = _req(0.5, [0.9, 1.3], 1.5, prompt_len=50, tokens=3)  # ttft .4, itl .4, e2el 1.0, tpot .3
    fail = RequestResult(success=False, prompt_len=999, error="HTTP 400: bad")
    m = compute_metrics([a, b, fail], duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["errors"] == {"HTTP 400: bad": 1}
    assert m["total_input_tokens"] == 150  # failed requests do not count
    assert m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(78.0)
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["p99_ttft_ms"] == pytest.approx(100.0 + 0.99 * 300.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0)
    # ITLs pooled over requests: .1 .1 .4
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(100.0 + 0.98 * 300.0)
    assert m["mean_e2el_ms"] == pytest.approx(650.0)
    assert "request_goodput" not in m


def test_percentiles_interpolate_linearly() -> None:
    vals = [float(x) for x in range(1, 101)]  # 1..100
    assert percentile(vals, 50) == pytest.approx(50.5)
    assert percentile(vals, 99) == pytest.approx(99.01)
    assert percentile([], 99) == 0.0
    s = summarize([1.0, 2.0, 3.0, 10.0], (50, 90))
    assert s["median"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.0 + 0.7 * 7.0)
    assert s["mean"] == pytest.approx(4.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = _req(0.0, [0.1, 0.15, 0.2], 0.2)  # ttft 100 ms, tpot 50 ms
    slow_first = _req(0.0, [0.6, 0.65], 0.65)  # ttft 600 ms
    slow_decode = _req(0.0, [0.1, 0.3, 0.5], 0.5)  # tpot 200 ms
    single = _req(0.0, [0.2], 0.2)  # no tpot: that SLO counts as met
    slos = parse_goodput(["ttft:500", "tpot:60"])
    assert slos == {"ttft": 0.5, "tpot": 0.06}
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_decode, single)] == [True, False, False, True]
    m = compute_metrics([fast, slow_first, slow_decode, single], duration=4.0, slos=slos)
    assert m["good_requests"] == 2
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["goodput_slos_ms"] == {"ttft": 500.0, "tpot": 60.0}


def test_parse_goodput_rejects_bad_input() -> None:
    for bad in (["ttft"], ["foo:10"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_goodput(["ttft:200,e2el:1000"]) == {"ttft": 0.2, "e2el": 1.0}


def test_empty_run() -> None:
    m = compute_metrics([], duration=0.0)
    assert m["completed"] == 0 and m["output_throughput"] == 0.0 and m["mean_ttft_ms"] == 0.0


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from fdx.bench.datasets import load_tokenizer

    try:
        return load_tokenizer("smollm2")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"embedded model not installed: {exc}")


def test_random_prompts_have_exact_token_counts(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from fdx.bench.datasets import WordVocab, check_exact, random_dataset

    vocab = WordVocab(tokenizer)
    samples = random_dataset(tokenizer, 20, 192, 128, 1 / 3, seed=3, nonce="abcd", vocab=vocab)
    check_exact(tokenizer, samples)
    assert all(128 <= s.prompt_len <= 256 for s in samples)
    assert all(85 <= (s.output_len or 0) <= 171 for s in samples)
    assert len({s.text for s in samples}) == 20
    assert all(s.text.startswith("Run abcd request ") for s in samples)
    fixed_out = random_dataset(tokenizer, 20, 192, 128, 1 / 3, vocab=vocab, output_range_ratio=0.0)
    assert {s.output_len for s in fixed_out} == {128} and len({s.prompt_len for s in fixed_out}) > 1
    # a 3-token prompt is still exact
    check_exact(tokenizer, random_dataset(tokenizer, 3, 3, 4, vocab=vocab))


def test_shared_prefix_groups_share_their_prefix(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from fdx.bench.datasets import check_exact, shared_prefix_dataset

    samples = shared_prefix_dataset(tokenizer, 8, 2, 100, 10, 16, nonce="n1")
    check_exact(tokenizer, samples)
    assert all(s.prompt_len == 110 for s in samples)
    assert samples[0].token_ids[:100] == samples[2].token_ids[:100]
    assert samples[0].token_ids[:100] != samples[1].token_ids[:100]
    assert samples[0].text == (samples[0].system or "") + " " + (samples[0].user or "")


def test_cpu_sampler_attributes_the_server_tree() -> None:
    import subprocess
    import sys
    import time

    from fdx.bench.machine import CpuSampler, describe_idle, idle_check

    # a "server" whose busy child must count as the server's, not as noise
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        s = CpuSampler(frozenset({proc.pid}))
        s.start()
        time.sleep(1.0)
        out = s.stop()
    finally:
        import os
        import signal

        for line in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split():
            os.kill(int(line), signal.SIGKILL)
        proc.kill()
        proc.wait()
    assert out["checked"] and out["server_cores"] > 0 and out["others_cores"] >= 0
    info = idle_check(0.2)
    assert info["checked"] and describe_idle(info).startswith("machine idle: ")
