#!/usr/bin/env python
"""A plain greedy request's latency beside a width-4 beam search, against
its latency alone on the same server (issue 23's bound: at most 2x; the
beam's four rows cost what four plain requests beside it cost).  Printed as
ratios, best and median of ``--runs``; tests/test_beam_search.py checks only
that the plain requests are served while the search runs.

    .venv/bin/python bench/bench_beam_stall.py [--runs 5] [--beam-tokens 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dp import server  # noqa: E402

PLAIN = {"prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def latency(base: str, body: dict[str, Any]) -> float:
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--beam-tokens", type=int, default=300)
    opts = ap.parse_args()
    beam = {"prompt": "Once upon a time", "max_tokens": opts.beam_tokens, "use_beam_search": True, "n": 4,
            "ignore_eos": True}
    four = [{**PLAIN, "prompt": f"{i}: {PLAIN['prompt']}", "max_tokens": opts.beam_tokens} for i in range(4)]
    with server(()) as (base, _pid):
        latency(base, PLAIN)  # warm
        alone = [latency(base, PLAIN) for _ in range(opts.runs)]
        rows = {"alone": alone}
        for name, bodies in (("beside a width-4 beam", [beam]), ("beside 4 plain streams", four)):
            threads = [threading.Thread(target=latency, args=(base, b)) for b in bodies]
            for t in threads:
                t.start()
            time.sleep(1.0)
            rows[name] = [latency(base, PLAIN) for _ in range(opts.runs)]
            if not all(t.is_alive() for t in threads):
                print(f"warning: the background load ended before the {name} runs did (raise --beam-tokens)")
            for t in threads:
                t.join()
    base_best, base_med = min(alone), statistics.median(alone)
    print(f"plain request ({PLAIN['max_tokens']} tokens), best / median of {opts.runs}; ratio = row / alone")
    for name, xs in rows.items():
        print(f"  {name:24} {min(xs):6.3f} s ({min(xs) / base_best:5.2f}x)   median {statistics.median(xs):6.3f} s "
              f"({statistics.median(xs) / base_med:5.2f}x)")
    print(f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
