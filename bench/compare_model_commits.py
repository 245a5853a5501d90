#!/usr/bin/env python
"""``bench/bench_model.py`` of two checkouts side by side, alternating.

Each round runs the "before" checkout's bench_model (``--before-dtype``)
and this checkout's (``--after-dtype``) in fresh processes, in an order that
flips every round; every figure is the best over the rounds, and the table
prints after/before.  Both use this venv's Python with ``PYTHONPATH`` set to
their checkout (so ``import fdx`` is theirs) and their own op build cache.

    git worktree add /tmp/fdx-before 3a637bf
    .venv/bin/python bench/compare_model_commits.py --before-repo /tmp/fdx-before \\
        --before-dtype float32 --after-dtype int8 --rounds 3

Read the ratios only: absolute figures on a shared machine drift.  On a
loaded one, ``--cpu-time`` runs both on one thread timed in CPU time
(bench/cpu_clock.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROWS = [("prefill tok/s (512-token prompt)", "prefill_tok_s"), ("decode tok/s, 1 sequence", "decode_b1_tok_s"),
        ("decode tok/s, 8 sequences", "decode_b8_tok_s"), ("decode tok/s, 32 sequences", "decode_b32_tok_s"),
        ("end-to-end tok/s, 8 seqs (+prefill)", "e2e_b8_tok_s"), ("end-to-end tok/s, 32 seqs (+prefill)", "e2e_b32_tok_s")]


def run(repo: str, dtype: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=repo, FDX_CACHE_DIR=os.path.join(args.cache_root, os.path.basename(repo.rstrip("/"))))
    cmd = [sys.executable, os.path.join(repo, "bench", "bench_model.py"), "--json", "--no-peer", "--dtype", dtype,
           "--repeats", "1", "--decode-steps", str(args.decode_steps)]
    if args.cpu_time:  # either checkout's bench_model, timed in CPU time on one thread (bench/cpu_clock.py)
        cmd[1:1] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_clock.py")]
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{repo}: bench_model failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["fdx"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-repo", required=True)
    ap.add_argument("--before-dtype", default="int8")
    ap.add_argument("--after-repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--after-dtype", default="int8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--cache-root", default="/tmp/fdx-compare-model-cache")
    ap.add_argument("--cpu-time", action="store_true", help="one thread, process CPU time (bench/cpu_clock.py): "
                    "for a loaded machine")
    args = ap.parse_args()
    sides = {"before": (args.before_repo, args.before_dtype), "after": (args.after_repo, args.after_dtype)}
    best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    for r in range(args.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            res = run(*sides[name], args)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k}={res[k]:.1f}" for _, k in ROWS), flush=True)
            for _, k in ROWS:
                best[name][k] = max(best[name].get(k, 0.0), res[k])
    b, a = f"before ({args.before_dtype})", f"after ({args.after_dtype})"
    print(f"\n| figure | {b} | {a} | after / before |\n|---|---|---|---|")
    for label, k in ROWS:
        print(f"| {label} | {best['before'][k]:.1f} | {best['after'][k]:.1f} | **{best['after'][k] / best['before'][k]:.2f}** |")


if __name__ == "__main__":
    main()
