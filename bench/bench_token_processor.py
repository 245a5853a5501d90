"""Cost of detokenization per generated token (default token processor).

    .venv/bin/python bench/bench_token_processor.py [--tokens 2000] [--repeat 5]

Streams a ~N-token mixed text (prose, accents, CJK, emoji, code, CRLF) one
token per ``feed`` call through the byte-level stream, the generic offset
stream (vLLM's approach over ``tokenizer.decode``), both with and without two
stop strings, and the naive "re-decode everything each step" approach.  The
baseline, measured in the same run, is one ``tokenizer.decode([id])`` per
token.  Prints microseconds per token and ratios to the baseline; the
machine may be shared, so compare the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

from fdx.core.messages import SamplingParams
from fdx.model.loader import load_tokenizer
from fdx.plugins.token_processors.detokenizer import DefaultTokenProcessor

SAMPLE = (
    "Héllo wörld, crème brûlée; 你好，世界。日本語のテキスト 😀🎉👍🏽 and ✨.\r\n"
    "def f(x: int) -> int:\n    return {'a': [1, 2, 3]}[x] ** 2  # 42\n"
    "The quick brown fox jumps over the lazy dog. Numbers 1234567890 and naïve café.\n"
)


def sample_ids(tok: Any, n_tokens: int) -> list[int]:
    """``n_tokens`` ids of :data:`SAMPLE` repeated."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tok.encode(SAMPLE)
    return ids[:n_tokens]


def per_token(fn: Callable[[], None], n_tokens: int, repeat: int) -> float:
    """Median seconds per token of ``fn`` (which handles ``n_tokens``) over ``repeat`` runs."""
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / n_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(None)
    ids = sample_ids(tok, args.tokens)
    n = len(ids)
    t0 = time.perf_counter()
    byte_proc = DefaultTokenProcessor(tok)
    build = time.perf_counter() - t0
    generic = DefaultTokenProcessor(tok, byte_level=False)

    def baseline() -> None:
        for i in ids:
            tok.decode([i])

    def run(proc: DefaultTokenProcessor, stops: tuple[str, ...]) -> Callable[[], None]:
        def go() -> None:
            s = proc.open_stream([1, 2, 3], SamplingParams(stop=stops))
            for i in ids:
                s.feed((i,), False)
            s.feed((), True)

        return go

    def naive() -> None:
        prev = ""
        for k in range(1, n + 1):
            text = tok.decode(ids[:k])
            prev = text[len(prev) :] and text

    base = per_token(baseline, n, args.repeat)
    stops = ("###END###", "\n\nUser:")
    rows = [
        ("decode([id]) baseline", base),
        ("byte-level stream", per_token(run(byte_proc, ()), n, args.repeat)),
        ("byte-level + 2 stop strings", per_token(run(byte_proc, stops), n, args.repeat)),
        ("offset stream (generic)", per_token(run(generic, ()), n, args.repeat)),
        ("offset + 2 stop strings", per_token(run(generic, stops), n, args.repeat)),
        (f"naive re-decode all ({n} tok)", per_token(naive, n, 1)),
    ]
    print(f"{n} tokens, 1 token per feed; byte table build {build * 1e3:.0f} ms (once per processor)")
    for name, t in rows:
        print(f"  {name:<32} {t * 1e6:8.2f} us/token  {t / base:6.2f}x")


if __name__ == "__main__":
    main()
