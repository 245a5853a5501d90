#!/usr/bin/env python
"""How much a decode step slows down when other processes take CPU time
from the engine's cores: the step loop of ``--concurrency`` sequences
in-process, in rounds that alternate between an otherwise idle machine and
two "burner" processes that each spin ``--burn-ms`` then sleep
``--period-ms`` (the defaults, 0.5 ms every 6.5 ms each, are about what the
API process and a streaming client take per token at c=1: ~0.4 ms and
~0.5 ms, bench/bench_server_overhead.py).

The engine's kernels split each call's work evenly and statically between
its threads (OpenMP, one per core), so a thread that loses its core for a
while holds the others at the end of the call: the step loses more than
the CPU time taken.  Printed: the mean step with and without burners, their
ratio, and the step time lost per millisecond of CPU the burners took
(1.0 would be "only what they took"; 2.0, "twice that").

    .venv/bin/python bench/bench_preemption.py [--concurrency 1] [--rounds 3] [--burn-ms 0.5] [--period-ms 6]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BURNER = """
import sys, time
burn, sleep = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < burn:
        pass
    time.sleep(sleep)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--steps", type=int, default=100, help="decode steps timed a round and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burn-ms", type=float, default=0.5)
    ap.add_argument("--period-ms", type=float, default=6.0, help="each burner's sleep between bursts")
    args = ap.parse_args()

    import numpy as np

    from fdx import LLM
    from fdx.core.messages import AddRequest, SamplingParams

    llm = LLM(max_num_seqs=max(args.concurrency, 1))
    eng = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=8 + 2 * args.rounds * args.steps + 8, ignore_eos=True)
    for i in range(args.concurrency):
        ids = tuple(int(x) for x in rng.integers(100, 40000, args.prompt_len))
        eng.add_request(AddRequest(f"r{i}", ids, params, time.time()))
    for _ in range(8):  # the prefill and a few decode steps
        eng.step()
    if len(eng.scheduler.request_ids()) != args.concurrency:
        sys.exit("the requests did not all start (prompt + steps past the model's length?)")

    def timed() -> float:
        t = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        return (time.perf_counter() - t) / args.steps

    idle, busy, taken = [], [], []
    for _ in range(args.rounds):
        idle.append(timed())
        burners = [subprocess.Popen([sys.executable, "-c", BURNER, str(args.burn_ms), str(args.period_ms)])
                   for _ in range(2)]
        try:
            time.sleep(0.2)
            c0 = sum(_cpu(p.pid) for p in burners)
            t0 = time.perf_counter()
            busy.append(timed())
            wall = time.perf_counter() - t0
            taken.append((sum(_cpu(p.pid) for p in burners) - c0) / (wall / busy[-1]))  # CPU s a step
        finally:
            for p in burners:
                p.kill()
                p.wait()
    a, b, c = sum(idle) / len(idle), sum(busy) / len(busy), sum(taken) / len(taken)
    print(f"{args.concurrency} sequences, {args.rounds} rounds of {args.steps} steps a side")
    print(f"step idle {a * 1e3:.2f} ms, with burners {b * 1e3:.2f} ms ({b / a:.2f}x); "
          f"the burners took {c * 1e3:.2f} ms of CPU a step; step time lost per ms taken: {(b - a) / c:.2f}")


def _cpu(pid: int) -> float:
    """CPU seconds of ``pid`` (schedstat: nanoseconds)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


if __name__ == "__main__":
    main()
