"""Compare the v0 and v1 schedulers through the offline engine, side by side.

    .venv/bin/python bench/bench_schedulers.py [--requests 32] [--repeat 2] \
        [--min-prompt 32 --max-prompt 384 --output 32] [--num-kv-blocks 512] \
        [--prefix-len 1000 --prefix-repeat 3]

Part 1 (same workload, both schedulers): every request is submitted at
t=0 (offline batch, greedy, ``ignore_eos``); both schedulers share ONE model
runner and run alternately ``--repeat`` times, so load from other processes
hits both alike.  TTFT is measured from step timestamps: the end of the step
that produced a request's first token minus the submission time.  Printed:
output tok/s, total (prompt+output) tok/s, TTFT p50/p99, steps and
preemptions -- medians over repeats -- and v1/v0 ratios.

Part 2 (prefix cache): a ``--prefix-len`` token prompt with ``max_tokens=1``,
cold (prefix cache reset first) and then again (cached), alternated
``--prefix-repeat`` times per scheduler; printed: median TTFT of each and the
cold/cached ratio.

Timings on a shared machine are noisy: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")

import numpy as np  # noqa: E402

from fdx.config import make_config  # noqa: E402
from fdx.core.engine import Engine, build_runner  # noqa: E402
from fdx.core.messages import AddRequest, SamplingParams  # noqa: E402
from fdx.core.plugins import get_plugins  # noqa: E402


def workload(n: int, lo: int, hi: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(300, 20000) for _ in range(rng.randrange(lo, hi + 1))) for _ in range(n)]


def run_batch(engine: Engine, prompts: list[tuple[int, ...]], params: SamplingParams, tag: str) -> dict[str, Any]:
    """Submit all prompts now, step until done; timings from step ends."""
    t0 = time.perf_counter()
    now = time.time()
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(f"{tag}-{i}", p, params, now))
    first: dict[str, float] = {}
    n_out = 0
    steps0 = engine.steps
    pre0 = engine.stats().num_preemptions
    errors = 0
    while engine.has_work():
        outs = engine.step()
        t = time.perf_counter() - t0
        for o in outs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = t
            n_out += len(o.new_token_ids)
            errors += o.finish_reason == "error"
    wall = time.perf_counter() - t0
    ttft = np.array(sorted(first.values()))
    st = engine.stats()
    return {
        "wall": wall,
        "out_tps": n_out / wall,
        "total_tps": (n_out + sum(len(p) for p in prompts)) / wall,
        "ttft_p50": float(np.percentile(ttft, 50)) if len(ttft) else float("nan"),
        "ttft_p99": float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
        "steps": engine.steps - steps0,
        "preemptions": st.num_preemptions - pre0,
        "errors": errors,
    }


def ttft_one(engine: Engine, prompt: tuple[int, ...], tag: str) -> tuple[float, int]:
    r = run_batch(engine, [prompt], SamplingParams(max_tokens=1, temperature=0.0), tag)
    return r["ttft_p50"], engine.kv.prefix_hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--prefix-repeat", type=int, default=3)
    ap.add_argument("--schedulers", default="v0,v1")
    args = ap.parse_args()

    names = args.schedulers.split(",")
    base = make_config(
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=4096,
    )
    plugins = get_plugins(())
    runner = build_runner(base, plugins)
    engines = {n: Engine(base.replace(scheduler=n), plugins, runner) for n in names}
    print(f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine: compare ratios)")

    prompts = workload(args.requests, args.min_prompt, args.max_prompt)
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    # warm-up (Paddle allocations, native op JIT) on a tiny batch
    for n, eng in engines.items():
        run_batch(eng, prompts[:2], SamplingParams(max_tokens=2, temperature=0.0), f"warm-{n}")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeat):
        for n, eng in engines.items():
            eng.kv.reset_prefix_cache()
            results[n].append(run_batch(eng, prompts, params, f"{n}-{rep}"))
    n_prompt = sum(len(p) for p in prompts)
    print(
        f"\n## same workload: {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} "
        f"({n_prompt} tokens), {args.output} output tokens each, {args.num_kv_blocks} KV blocks, "
        f"budget {args.max_num_batched_tokens} tokens/step; median of {args.repeat}"
    )
    keys = ["out_tps", "total_tps", "ttft_p50", "ttft_p99", "wall", "steps", "preemptions", "errors"]
    med = {n: {k: statistics.median(r[k] for r in results[n]) for k in keys} for n in names}
    print(f"{'scheduler':10}" + "".join(f"{k:>12}" for k in keys))
    for n in names:
        print(f"{n:10}" + "".join(f"{med[n][k]:12.2f}" for k in keys))
    if "v0" in med and "v1" in med:
        print(f"{'v1/v0':10}" + "".join(f"{med['v1'][k] / med['v0'][k]:12.2f}" if med["v0"][k] else f"{'-':>12}" for k in keys))

    print(f"\n## prefix cache: {args.prefix_len}-token prompt, TTFT cold vs cached, median of {args.prefix_repeat}")
    prompt = workload(1, args.prefix_len, args.prefix_len, seed=7)[0]
    if -(-(args.prefix_len + 1) // base.block_size) > args.num_kv_blocks:
        print(f"skipped: a {args.prefix_len}-token prompt does not fit in {args.num_kv_blocks} KV blocks")
        return
    for n, eng in engines.items():
        cold, warm = [], []
        cached_tokens = 0
        for rep in range(args.prefix_repeat):
            eng.kv.reset_prefix_cache()
            cold.append(ttft_one(eng, prompt, f"cold-{n}-{rep}")[0])
            h0 = eng.kv.prefix_hits
            warm.append(ttft_one(eng, prompt, f"warm-{n}-{rep}")[0])
            cached_tokens = eng.kv.prefix_hits - h0
        c, w = statistics.median(cold), statistics.median(warm)
        print(
            f"{n:10} cold {1000 * c:8.1f} ms   cached {1000 * w:8.1f} ms   ({cached_tokens}/{args.prefix_len} tokens "
            f"from cache)   cold/cached = {c / w:.1f}x"
        )


if __name__ == "__main__":
    main()
