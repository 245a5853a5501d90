"""Time Sampler.sample() against a plain argmax baseline, side by side.

    .venv/bin/python bench/bench_sampler.py [--repeat 30] [--paddle]

For n = 1, 8, 32 rows x V = 49152 it prints the median time per call of:
plain ``np.argmax`` (the baseline), the greedy fast path, temperature+top_p,
and the full-featured path (temperature, top_k, top_p, min_p, repetition /
frequency / presence penalties, seed, 5 logprobs, 500-token prompts, 100
output tokens), each as a ratio to the baseline measured in the same run.
With ``--paddle`` the logits are a Paddle CPU tensor (the model runner's
case) and ``paddle.argmax`` is added as a second baseline.  The machine may be
shared: compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np

from fdx.core.messages import SamplingParams
from fdx.core.request import Request
from fdx.model.sampler import Sampler

V = 49152


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def make_requests(n: int, kind: str, rng: np.random.Generator, vocab: int = V) -> list[Request]:
    if kind == "greedy":
        params = SamplingParams(temperature=0.0)
    elif kind == "temp+top_p":
        params = SamplingParams(temperature=0.8, top_p=0.9)
    else:
        params = SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
            frequency_penalty=0.2, presence_penalty=0.1, seed=1, logprobs=5, min_tokens=200,
        )
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", rng.integers(0, vocab, 500).tolist(), params, eos_token_ids=frozenset({2}))
        r.output_token_ids = rng.integers(0, vocab, 100).tolist()
        reqs.append(r)
    return reqs


def make_logits(n: int, shape: str, rng: np.random.Generator) -> np.ndarray:
    if shape == "flat":
        return (rng.standard_normal((n, V)) * 3).astype(np.float32)
    x = (rng.standard_normal((n, V)) * 1.5).astype(np.float32)
    for i in range(n):
        x[i, rng.integers(0, V, 5)] += rng.uniform(6, 12, 5).astype(np.float32)
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--paddle", action="store_true", help="pass logits as a Paddle CPU tensor")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sampler = Sampler(V)
    paddle = None
    if args.paddle:
        import paddle as _paddle

        paddle = _paddle
    print(f"V={V}, median of {args.repeat} calls; ratios vs np.argmax on the same logits")
    print("logits: 'peaked' = N(0,1.5) + 5 tokens boosted by 6..12 (LM-like: small nucleus);")
    print("        'flat' = N(0,3) (high entropy: top_p nucleus of thousands -> dense fallback)")
    print(f"{'n':>3} {'logits':>7} {'argmax us':>10} {'paddle.argmax':>14} {'.numpy()':>9} {'greedy':>8} {'temp+top_p':>11} {'full':>8}")
    for n, shape in ((1, "peaked"), (8, "peaked"), (32, "peaked"), (1, "flat"), (8, "flat"), (32, "flat")):
        x = make_logits(n, shape, rng)
        logits: Any = paddle.to_tensor(x) if paddle is not None else x
        base = median_time(lambda: x.argmax(axis=1), args.repeat)
        row = [f"{n:>3}", f"{shape:>7}", f"{base * 1e6:>10.1f}"]
        if paddle is not None:
            t_pa = median_time(lambda: paddle.argmax(logits, axis=-1).numpy(), args.repeat)
            t_np = median_time(lambda: logits.numpy(), args.repeat)
            row += [f"{t_pa / base:>13.2f}x", f"{t_np / base:>8.2f}x"]
        else:
            row += [f"{'-':>14}", f"{'-':>9}"]
        for kind, w in (("greedy", 8), ("temp+top_p", 11), ("full", 8)):
            reqs = make_requests(n, kind, rng)
            t = median_time(lambda: sampler.sample(logits, reqs), args.repeat)
            row.append(f"{t / base:>{w - 1}.2f}x")
        print(" ".join(row))
        full_reqs = make_requests(n, "full", rng)
        t_full = median_time(lambda: sampler.sample(logits, full_reqs), args.repeat)
        print(f"    (n={n}: full path {t_full * 1e3:.2f} ms/call = {t_full / n * 1e6:.0f} us/row; argmax {base * 1e6:.0f} us)")
    # Per-call Python overhead: the same paths on a 64-token vocabulary.
    print("overhead (V=64, numpy work negligible):")
    small = Sampler(64)
    for n in (8, 32):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        parts = []
        for kind in ("greedy", "temp+top_p", "full"):
            reqs = make_requests(n, kind, rng, vocab=64)
            t = median_time(lambda: small.sample(x, reqs), args.repeat)
            parts.append(f"{kind} {t * 1e6:.0f} us ({t / n * 1e6:.1f} us/row)")
        print(f"  n={n}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
