#!/usr/bin/env python
"""Where a decode step's time goes at ``--concurrency`` sequences (default
32): the model forward (Paddle + the C++ kernels), the rest of
``runner.execute`` (step layout, sampling: NumPy), and the engine's own
Python around it (``scheduler.schedule`` / ``update``, outputs).  Only
the forward keeps the cores busy; the rest is host time an overlapped
step loop could hide.  Printed as shares of the step, which hold on a
busy machine better than absolute times.

    .venv/bin/python bench/bench_step_overhead.py [--concurrency 32] [--tokens 96] [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    import numpy as np

    from fdx import LLM
    from fdx.core.messages import AddRequest, SamplingParams

    llm = LLM(dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=max(args.concurrency, 1))
    eng = llm.engine
    runner = eng.runner
    timers = {"forward": 0.0, "execute": 0.0}

    def timed(fn, key):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[key] += time.perf_counter() - t
        return wrapper

    runner._forward, runner.execute = timed(runner._forward, "forward"), timed(runner.execute, "execute")
    rng = np.random.default_rng(0)
    vocab = 40000
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for i in range(args.concurrency):
        ids = tuple(int(x) for x in rng.integers(100, vocab, args.prompt_len))
        eng.add_request(AddRequest(f"r{i}", ids, params, time.time()))
    # prefill first, then time only steps where every sequence decodes
    while any(r is not None and r.num_output_tokens == 0 for r in map(eng.scheduler.get, eng.scheduler.request_ids())):
        eng.step()
    for k in timers:
        timers[k] = 0.0
    steps, t0 = 0, time.perf_counter()
    while eng.has_work() and steps < args.tokens - 8:
        eng.step()
        steps += 1
    total = time.perf_counter() - t0
    f, e = timers["forward"], timers["execute"]
    print(f"{steps} decode steps of {args.concurrency} sequences, {total / steps * 1000:.1f} ms a step "
          f"({steps * args.concurrency / total:.0f} tok/s), dtype {runner.describe() if hasattr(runner, 'describe') else args.dtype}")
    print("| part of the step | share |\n|---|---|")
    print(f"| model forward (kernels) | {f / total:.3f} |")
    print(f"| rest of runner.execute (layout, sampling) | {(e - f) / total:.3f} |")
    print(f"| engine Python (schedule, update, outputs) | {(total - e) / total:.3f} |")
    print(f"| host time an overlapped loop could hide | {(total - f) / total:.3f} |")


if __name__ == "__main__":
    main()
