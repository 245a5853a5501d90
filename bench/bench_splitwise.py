"""Splitwise (1 P + 1 D behind the router) against one mixed instance, side by side, same thread count.

    .venv/bin/python bench/bench_splitwise.py [--num-prompts 16] [--input-len 1024] [--output-len 128] \
        [--concurrency 8] [--repeat 1] [--kv-connector zmq]

Starts both at once: ``fdx serve --num-threads 2`` (mixed) and ``fdx serve
--scheduler splitwise --num-prefill 1 --num-decode 1 --num-threads 1`` (P
and D with one thread each, the router in front), the same KV pool and
``--max-num-seqs`` per engine (bench/bench_dp.py's ``server``).  Then runs
``fdx bench serve`` (random token prompts, ``ignore_eos``, greedy, all
arriving at once, at most c in flight) on one and then the other,
alternating which goes first, ``--repeat`` times; the idle one only waits.
Printed: output tok/s, TTFT p50/p99 and ITL p50/p99 of each (medians over
the repeats) and the ratios splitwise / mixed (throughput > 1, TTFT and ITL
< 1 favour splitwise), plus the handoffs' KV bytes and mean latency from
D's ``fdx:splitwise_*`` metrics.

What to expect: D's decode steps never wait behind a prompt's prefill, so
its ITL stays flat where the mixed instance's steps stall on every new
1,024-token prompt (chunked prefill shares each step); P/D costs a KV copy
per request (here over loopback TCP), and each role gets only half the
threads: a prompt's prefill runs on 1 thread instead of 2.

Timings on a shared machine are noisy: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dp import run_point, server  # noqa: E402  (the same server start and fdx bench serve run)

KEYS = (("out tok/s", "output_throughput"), ("TTFT p50 ms", "p50_ttft_ms"), ("TTFT p99 ms", "p99_ttft_ms"),
        ("ITL p50 ms", "p50_itl_ms"), ("ITL p99 ms", "p99_itl_ms"))


def _metric(base: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if re.match(rf"{re.escape(name)}\{{.*role=\"decode\"", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--kv-connector", default="zmq")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    configs = {
        "splitwise 1P+1D x1": ("--scheduler", "splitwise", "--num-prefill", "1", "--num-decode", "1",
                               "--num-threads", "1", "--kv-connector", opts.kv_connector,
                               "--splitwise-handoff-timeout", "600"),
        "mixed 1x2": ("--num-threads", "2"),
    }
    results: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(server(args)) for name, args in configs.items()}
        names = list(configs)
        sw_base = servers[names[0]][0]
        for rep in range(opts.repeat):
            for name in (names if rep % 2 == 0 else names[::-1]):
                base, pid = servers[name]
                run = run_point(base, pid, opts.concurrency, opts.num_prompts, opts, name)
                run["loadavg"] = os.getloadavg()[0]
                results.setdefault(name, []).append(run)
        kv_bytes = _metric(sw_base, "fdx:splitwise_kv_bytes_total")
        h_sum = _metric(sw_base, "fdx:splitwise_handoff_seconds_sum")
        h_n = _metric(sw_base, "fdx:splitwise_handoff_seconds_count")
        recomputed = _metric(sw_base, "fdx:splitwise_recomputed_prompt_tokens_total")
    a, b = names
    print(f"\n{opts.input_len}-token random prompts, {opts.output_len} output tokens (ignore_eos), "
          f"c = {opts.concurrency}, {opts.num_prompts} prompts, medians of {opts.repeat} alternating run(s); "
          f"ratio = {a} / {b}")
    for label, key in KEYS:
        x = statistics.median(r[key] for r in results[a])
        y = statistics.median(r[key] for r in results[b])
        print(f"  {label:<12} {x:>9.1f} vs {y:>9.1f}   ratio {x / y if y else float('nan'):.2f}")
    if h_n:
        print(f"  handoffs on D: {h_n:.0f} (warm-up included), {kv_bytes / h_n / 1e6:.2f} MB of KV each, mean "
              f"handoff {1000 * h_sum / h_n:.0f} ms (D's preallocation to the KV in place: P's queue and "
              f"prefill included); prompt tokens D recomputed: {recomputed:.0f}")
    loads = [r["loadavg"] for rs in results.values() for r in rs]
    print(f"  load after the runs: {min(loads):.1f}-{max(loads):.1f} ({os.cpu_count()} CPUs; above that, other "
          "processes competed for the cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
