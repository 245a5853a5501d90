#!/usr/bin/env python
"""The int8 GEMM's AMX path on and off (``FDX_NATIVE_AMX``, read per call)
side by side in one process: a ``--prefill-len`` prompt's prefill and
decode steps at ``--concurrency`` sequences, alternating the switch every
few steps so both halves see the same machine load.  Needs a CPU with
AMX-INT8 (fdx/csrc/qgemm.cc); elsewhere both halves run the same kernels.

    .venv/bin/python bench/bench_amx.py [--concurrency 32] [--prefill-len 512] [--rounds 6] [--cpu-time]

Reported: best and median ms (wall, or with ``--cpu-time`` process CPU time on one thread) per prefill / per decode step for each
side, and their ratio (the machine is shared: read the ratios).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=4, help="decode steps per side per round")
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--cpu-time", action="store_true", help="time process CPU time, one thread (a loaded machine's "
                    "time slices given to other processes do not count)")
    args = ap.parse_args()
    if args.cpu_time:
        args.num_threads = 1
    clock = time.process_time if args.cpu_time else time.perf_counter

    import numpy as np

    from fdx import LLM
    from fdx.core.messages import AddRequest, SamplingParams
    from fdx.model import native

    llm = LLM(dtype="int8", num_threads=args.num_threads, max_num_seqs=max(args.concurrency, 1),
              enable_prefix_caching=False, max_num_batched_tokens=max(args.prefill_len, 2048))
    eng = llm.engine
    rng = np.random.default_rng(0)
    vocab = 40000
    sides = {"off": "0", "on": "1"}

    def switch(side: str) -> None:
        os.environ["FDX_NATIVE_AMX"] = sides[side]

    switch("on")
    amx = native.loaded_int8_amx()
    print(f"kernels: {native.describe()} (AMX available: {amx}); {args.num_threads} thread(s), "
          f"{'process CPU time' if args.cpu_time else 'wall time'}")
    pre: dict[str, list[float]] = {s: [] for s in sides}
    n = 0
    for _ in range(args.rounds):
        for side in sides:
            switch(side)
            ids = tuple(int(x) for x in rng.integers(100, vocab, args.prefill_len))
            eng.add_request(AddRequest(f"p{n}", ids, SamplingParams(temperature=0.0, max_tokens=1), time.time()))
            n += 1
            t = clock()
            while eng.has_work():
                eng.step()
            pre[side].append(clock() - t)
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.rounds * args.chunk + 8, ignore_eos=True)
    switch("on")
    for i in range(args.concurrency):
        ids = tuple(int(x) for x in rng.integers(100, vocab, args.prompt_len))
        eng.add_request(AddRequest(f"d{i}", ids, params, time.time()))
    while any(r is not None and r.num_output_tokens == 0 for r in map(eng.scheduler.get, eng.scheduler.request_ids())):
        eng.step()
    for _ in range(2):
        eng.step()
    dec: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.rounds):
        for side in sides:
            switch(side)
            for _ in range(args.chunk):
                t = clock()
                eng.step()
                dec[side].append(clock() - t)
    os.environ.pop("FDX_NATIVE_AMX", None)
    print(f"| figure | AMX off best / median ms | AMX on best / median ms | off / on (median) |\n|---|---|---|---|")
    for name, d in ((f"prefill {args.prefill_len} tokens", pre), (f"decode step, {args.concurrency} seqs", dec)):
        off, on = d["off"], d["on"]
        print(f"| {name} | {min(off) * 1e3:.1f} / {statistics.median(off) * 1e3:.1f} | "
              f"{min(on) * 1e3:.1f} / {statistics.median(on) * 1e3:.1f} | "
              f"{statistics.median(off) / statistics.median(on):.2f} |")


if __name__ == "__main__":
    main()
