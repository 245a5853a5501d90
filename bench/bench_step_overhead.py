#!/usr/bin/env python
"""Where a decode step's time goes at ``--concurrency`` sequences (default
32): the model forward (Paddle + the C++ kernels), the rest of
``runner.execute`` (step layout, sampling: NumPy), and the engine's own
Python around it (``scheduler.schedule`` / ``update``, outputs).  Only
the forward keeps the cores busy; the rest is host time an overlapped
step loop could hide.  Printed as shares of the step, which hold on a
busy machine better than absolute times.

    .venv/bin/python bench/bench_step_overhead.py [--concurrency 32] [--tokens 96] [--dtype auto]
    .venv/bin/python bench/bench_step_overhead.py --by-op [--concurrency 1]
    .venv/bin/python bench/bench_step_overhead.py --by-kernel --prompt-len 192 [--num-threads 1]

``--by-op`` also times every native op call (the per-layer path, so that
each kernel is timed on its own: qgemm by output width, attention, norms,
SwiGLU) and prints each one's share of the step.  ``--by-kernel`` splits
the default fused path instead, from the layer loop's own clocks
(``fdx_stack_profile``: the wall time of each kernel inside the one op
call, every layer), for the prefill steps and the decode steps apart; run
it with ``--num-threads 1`` and 2 to see how each kernel scales.

The prompts' prefill is timed too (prompt tokens a second, before the
decode steps): at ``--concurrency 32 --prompt-len 192`` it is the
three-way table's c32 prefill.

``--seconds S`` keeps ``--concurrency`` requests of ``--prompt-len`` tokens
going for S seconds instead, each replaced by a new prompt when its
``--tokens`` are out: a served stream's mix of prefills and contexts, long
enough to attach ``perf record -p PID`` to (the steps' mean time is printed,
prefills included).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


KERNELS = ("attn_norm (add_rms_norm)", "qkv (qgemm, + bias)", "attention (paged_attention)", "o (qgemm, + all-reduce)",
           "ffn_norm (add_rms_norm)", "gate_up (qgemm)", "swiglu", "down (qgemm, + all-reduce)")


def kernel_table(title: str, clocks, forward: float, wall: float) -> None:  # type: ignore[no-untyped-def]
    """The fused layer loop's clocks (fdx_stack_profile: ns by kernel, the
    whole calls, calls, rows) as ms a step and shares of the steps' wall time."""
    calls = max(float(clocks[-2]), 1.0)
    print(f"\n{title}: {int(clocks[-2])} layer-loop calls, {clocks[-1] / calls:.0f} rows each\n"
          "| kernel (fused layer loop, every layer) | ms a step | share of the step |\n|---|---|---|")
    for name, ns in zip(KERNELS, clocks[:len(KERNELS)]):
        print(f"| {name} | {ns / calls / 1e6:.2f} | {ns / 1e9 / wall:.3f} |")
    loop = clocks[len(KERNELS)] / 1e9
    print(f"| the layer loop, whole | {loop / calls * 1e3:.2f} | {loop / wall:.3f} |")
    print(f"| rest of the forward (embedding, final norm, LM head, dispatch) | {(forward - loop) / calls * 1e3:.2f} | "
          f"{(forward - loop) / wall:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--by-op", action="store_true", help="time each native op (runs the per-layer path)")
    ap.add_argument("--time-ops", action="store_true", help="time each native op call on the default (fused) path")
    ap.add_argument("--by-kernel", action="store_true",
                    help="split the fused layer loop by kernel (fdx_stack_profile), for the prefill and the decode steps")
    ap.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=0.0,
                    help="keep --concurrency requests going this long, new prompts replacing finished ones")
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
    op_times: dict[str, float] = {}
    if (args.by_op or args.time_ops) and getattr(runner, "model", None) is not None and runner.model.ops is not None:
        model = runner.model
        if args.by_op:
            model.fused_layers = False  # the same kernels, one op call each

        class TimedOps:
            def __init__(self, ops):  # type: ignore[no-untyped-def]
                self._ops = ops

            def __getattr__(self, name):  # type: ignore[no-untyped-def]
                fn = getattr(self._ops, name)

                def call(*a, **k):  # type: ignore[no-untyped-def]
                    key = f"{name} (N={a[3]})" if name == "fdx_qgemm" else name
                    t = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        op_times[key] = op_times.get(key, 0.0) + time.perf_counter() - t
                return call

        model.ops = TimedOps(model.ops)
    stack_profile = None
    if args.by_kernel:
        ops = getattr(getattr(runner, "model", None), "ops", None)
        if ops is None or not hasattr(ops, "fdx_stack_profile"):
            sys.exit("--by-kernel needs fdx's native ops (the fused int8 layer loop)")
        import paddle

        place = paddle.zeros([1], "float32")
        stack_profile = lambda start: ops.fdx_stack_profile(place, start).numpy()  # noqa: E731
        stack_profile(1)
    rng = np.random.default_rng(0)
    vocab = 40000
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.tokens, ignore_eos=True)
    added = 0

    def add() -> None:
        nonlocal added
        ids = tuple(int(x) for x in rng.integers(100, vocab, args.prompt_len))
        eng.add_request(AddRequest(f"r{added}", ids, params, time.time()))
        added += 1

    for _ in range(args.concurrency):
        add()
    if args.seconds > 0:
        print(f"pid {os.getpid()}: {args.concurrency} requests of {args.prompt_len} + {args.tokens} tokens "
              f"for {args.seconds:.0f} s", flush=True)
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            eng.step()
            steps += 1
            for _ in range(args.concurrency - len(eng.scheduler.request_ids())):
                add()
        print(f"{steps} steps, {(time.perf_counter() - t0) / steps * 1000:.2f} ms a step (prefills included)")
        return
    # prefill first (timed on its own: the prompts' tokens a second), then
    # time only steps where every sequence decodes
    t0, psteps = time.perf_counter(), 0
    while any(r is not None and r.num_output_tokens == 0 for r in map(eng.scheduler.get, eng.scheduler.request_ids())):
        eng.step()
        psteps += 1
    took = time.perf_counter() - t0
    print(f"prefill: {args.concurrency} prompts of {args.prompt_len} tokens in {psteps} steps, {took:.3f} s "
          f"({args.concurrency * args.prompt_len / took:.0f} prompt tok/s)")
    prefill_kernels = stack_profile(1) if stack_profile else None
    prefill_forward = timers["forward"]
    for k in timers:
        timers[k] = 0.0
    op_times.clear()
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
    if stack_profile is not None:
        kernel_table("prefill steps", prefill_kernels, prefill_forward, took)
        kernel_table("decode steps", stack_profile(0), f, total)
    if op_times:
        print(f"\n| native op ({'per-layer' if args.by_op else 'fused'} path) | ms a step | share of the step |\n|---|---|---|")
        for key, v in sorted(op_times.items(), key=lambda kv: -kv[1]):
            print(f"| {key} | {v / steps * 1000:.2f} | {v / total:.3f} |")
        rest = f - sum(op_times.values())
        print(f"| rest of the forward (Python, Paddle dispatch, embedding) | {rest / steps * 1000:.2f} | {rest / total:.3f} |")


if __name__ == "__main__":
    main()
