"""Time Sampler.sample() against a plain argmax baseline, side by side
(the random rows by NumPy, and by the C++ kernel where fdx's ops load: the
"C++" columns, what the engine runs).

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_sampler.py [--repeat 30] [--paddle]

(OMP_NUM_THREADS: the engine's threads, over which the C++ kernel spreads
the rows.)  For n = 1, 8, 32 rows x V = 49152 it prints, per call: plain
``np.argmax`` (the baseline, absolute microseconds), the greedy fast path,
temperature+top_p, greedy with 5 logprobs, and the full-featured path
(temperature, top_k, top_p, min_p, repetition / frequency / presence
penalties, seed, 5 logprobs, min_tokens, 500-token prompts, 100 output
tokens).  Every variant is timed
once per round, interleaved with the baseline, and the printed figure is the
median over rounds of its time divided by that round's baseline, so load
from other processes mostly cancels.  With ``--paddle`` the logits are a
Paddle CPU tensor (the model runner's case) and ``paddle.argmax`` and
``Tensor.numpy()`` are added for comparison.
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


def _once(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(base: Callable[[], Any], fns: list[Callable[[], Any]], repeat: int) -> tuple[float, list[float]]:
    """Median baseline seconds and median per-round ratios of ``fns``."""
    for f in [base, *fns]:
        f()
    bases: list[float] = []
    ratios: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        b = _once(base)
        bases.append(b)
        for j, f in enumerate(fns):
            ratios[j].append(_once(f) / b)
    return statistics.median(bases), [statistics.median(r) for r in ratios]


def make_logits(n: int, shape: str, rng: np.random.Generator, vocab: int = V) -> np.ndarray:
    if shape == "flat":
        return (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    x = (rng.standard_normal((n, vocab)) * 1.5).astype(np.float32)
    for i in range(n):
        x[i, rng.integers(0, vocab, 5)] += rng.uniform(6, 12, 5).astype(np.float32)
    return x


def make_requests(n: int, kind: str, rng: np.random.Generator, vocab: int = V) -> list[Request]:
    if kind == "greedy":
        params = SamplingParams(temperature=0.0)
    elif kind == "temp+top_p":
        params = SamplingParams(temperature=0.8, top_p=0.9)
    elif kind == "greedy+lp5":
        params = SamplingParams(temperature=0.0, logprobs=5)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--paddle", action="store_true", help="pass logits as a Paddle CPU tensor")
    ap.add_argument("--logits", help="a .npy [rows, 49152] of real logits, added as shape 'file'")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    from fdx.model import native

    native.load_ops()
    kernel = native.sampling_kernel()
    samplers = {"": Sampler(V)}
    if kernel is not None:  # the random rows in C++ (fdx/csrc/sampling.cc): the engine's sampler on this CPU
        samplers[" C++"] = Sampler(V, native=kernel)
    else:
        print("fdx's native ops are not loaded: NumPy columns only")
    paddle: Any = None
    if args.paddle:
        import paddle as _paddle

        paddle = _paddle
    kinds = [("greedy", "", "greedy")] + [(k + tag, tag, k) for k in ("temp+top_p", "greedy+lp5", "full")
                                          for tag in samplers]
    print(f"V={V}; per call, median over {args.repeat} interleaved rounds of time / np.argmax time")
    print("logits 'peaked': N(0,1.5) + 5 tokens boosted by 6..12 (small nucleus, mostly);")
    print("       'flat':   N(0,3) (top_p=0.9 nucleus of ~300-700 tokens at T=0.8)")
    head = f"{'n':>3} {'logits':>7} {'argmax us':>10}"
    if paddle is not None:
        head += f" {'paddle.argmax':>14} {'.numpy()':>9}"
    print(head + "".join(f" {k[0]:>15}" for k in kinds) + "  full us/row")
    real = np.load(args.logits).astype(np.float32) if args.logits else None
    for shape in ("peaked", "flat") + (("file",) if real is not None else ()):
        for n in (1, 8, 32):
            if shape == "file":
                assert real is not None
                x = np.ascontiguousarray(real[np.arange(n) % len(real)])
            else:
                x = make_logits(n, shape, rng)
            logits: Any = paddle.to_tensor(x) if paddle is not None else x
            fns: list[Callable[[], Any]] = []
            if paddle is not None:
                fns += [lambda: paddle.argmax(logits, axis=-1).numpy(), lambda: logits.numpy()]
            for _, tag, kind in kinds:
                reqs = make_requests(n, kind, rng)
                fns.append(lambda reqs=reqs, s=samplers[tag]: s.sample(logits, reqs))
            base, ratios = interleaved(lambda: x.argmax(axis=1), fns, args.repeat)
            cells = "".join(f" {r:>13.1f}x" if j == 0 else f" {r:>8.1f}x" for j, r in enumerate(ratios[: len(ratios) - len(kinds)]))
            tail = "".join(f" {r:>14.1f}x" for r in ratios[len(ratios) - len(kinds) :])
            per_row = ratios[-1] * base / n * 1e6
            print(f"{n:>3} {shape:>7} {base * 1e6:>10.1f}{cells}{tail}  {per_row:8.0f}")
    # Per-call Python overhead: the same paths on a 64-token vocabulary.
    print("overhead (V=64, numpy work negligible), absolute:")
    small = {tag: Sampler(64, native=kernel if tag else None) for tag in samplers}
    for n in (8, 32):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        parts = []
        for name, tag, kind in kinds:
            reqs = make_requests(n, kind, rng, vocab=64)
            t = statistics.median(_once(lambda: small[tag].sample(x, reqs)) for _ in range(args.repeat))
            parts.append(f"{name} {t * 1e6:.0f} us ({t / n * 1e6:.1f} us/row)")
        print(f"  n={n}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
