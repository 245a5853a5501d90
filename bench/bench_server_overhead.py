"""CPU cost of the API process (HTTP, JSON, detokenization, SSE) against the
engine process, for streaming clients of one real ``fdx serve``.

    .venv/bin/python bench/bench_server_overhead.py [--conc 1 16 64] [--tokens 64]
    .venv/bin/python bench/bench_server_overhead.py --baseline main [--conc 1 8 32] [--reps 3]

Prints, per concurrency, CPU seconds of each process (from /proc) and their
ratio; the ratio is the figure to compare (absolute times depend on how busy
the shared machine is).

``--baseline REF`` also serves git revision REF (a detached worktree of this
checkout, with this checkout's built ``fdx/_ops``) beside this checkout, and
runs the same load on the two in turn, ``--reps`` times per concurrency: it
prints the API process's CPU per streamed token of each (the median) and
their ratio, measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from serverutil import start_server  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` (schedstat: nanoseconds, not ticks)."""
    try:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError):
        pass
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one(c: httpx.AsyncClient, base: str, i: int, n: int) -> int:
    body = {"prompt": f"Story {i}:", "max_tokens": n, "ignore_eos": True, "stream": True}
    k = 0
    async with c.stream("POST", base + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            k += line.startswith("data: {")
    return k


async def _run(base: str, conc: int, n: int) -> None:
    limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as c:
        await asyncio.gather(*(_one(c, base, i, n) for i in range(conc)))


@contextlib.contextmanager
def baseline_checkout(ref: str) -> Iterator[str]:
    """A detached worktree of ``ref`` with this checkout's built ops."""
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    path = tempfile.mkdtemp(prefix="fdx-baseline-")
    subprocess.run(["git", "-C", here, "worktree", "add", "--detach", "-f", path, ref], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        shutil.copytree(os.path.join(here, "fdx", "_ops"), os.path.join(path, "fdx", "_ops"), dirs_exist_ok=True)
        yield path
    finally:
        subprocess.run(["git", "-C", here, "worktree", "remove", "--force", path], check=False)
        shutil.rmtree(path, ignore_errors=True)


def _measure(base: str, api: int, conc: int, n: int) -> float:
    a0 = cpu_seconds(api)
    asyncio.run(_run(base, conc, n))
    return (cpu_seconds(api) - a0) / (conc * n) * 1e6


@contextlib.contextmanager
def serve_from(root: str, *args: str) -> Iterator[tuple[str, object]]:
    """``fdx serve`` of the checkout at ``root``: its processes start there
    (``python -m`` puts the working directory first on ``sys.path``, before
    ``PYTHONPATH``) and import ``fdx`` from it."""
    here = os.getcwd()
    os.chdir(root)
    try:
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        cm = start_server(*args, env=env)
        served = cm.__enter__()
    finally:
        os.chdir(here)
    try:
        yield served
    finally:
        cm.__exit__(*sys.exc_info())


def compare(a: argparse.Namespace) -> None:
    args = ("--max-num-seqs", str(max(a.conc)), "--num-kv-blocks", "2048")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    with baseline_checkout(a.baseline) as path, serve_from(root, *args) as (new, _p1), \
            serve_from(path, *args) as (old, _p2):
        apis = {u: httpx.get(u + "/health").json()["api_pid"] for u in (old, new)}
        for u in (old, new):
            asyncio.run(_run(u, 4, 4))  # warm-up
        print(f"load average at start: {os.getloadavg()[0]:.1f}; baseline {a.baseline} vs this checkout, "
              f"API CPU us per streamed token (median of {a.reps}, alternating)")
        for conc in a.conc:
            got: dict[str, list[float]] = {old: [], new: []}
            for _ in range(a.reps):
                for u in (old, new):
                    got[u].append(_measure(u, apis[u], conc, a.tokens))
            b, c = statistics.median(got[old]), statistics.median(got[new])
            print(f"conc={conc:3d} tokens={conc * a.tokens:5d}  baseline={b:6.0f} us/token  this={c:6.0f} us/token  "
                  f"this/baseline={c / b:.3f}  (runs: {' '.join(f'{x:.0f}' for x in got[old])} | "
                  f"{' '.join(f'{x:.0f}' for x in got[new])})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conc", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--baseline", default=None, metavar="REF",
                    help="also serve git revision REF and compare API CPU per token side by side")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.baseline:
        compare(a)
        return
    with start_server("--max-num-seqs", str(max(a.conc)), "--num-kv-blocks", "2048") as (base, _proc):
        h = httpx.get(base + "/health").json()
        api, eng = h["api_pid"], h["engine_pid"]
        asyncio.run(_run(base, 4, 4))  # warm-up
        print(f"load average at start: {os.getloadavg()[0]:.1f} (shared machine: compare ratios only)")
        for conc in a.conc:
            a0, e0, t0 = cpu_seconds(api), cpu_seconds(eng), time.time()
            asyncio.run(_run(base, conc, a.tokens))
            a1, e1, t1 = cpu_seconds(api), cpu_seconds(eng), time.time()
            toks = conc * a.tokens
            print(f"conc={conc:3d} tokens={toks:5d} wall={t1 - t0:6.1f}s  cpu api={a1 - a0:6.2f}s "
                  f"engine={e1 - e0:7.2f}s  api/engine={(a1 - a0) / max(e1 - e0, 1e-9):.3f}  "
                  f"api us/token={(a1 - a0) / toks * 1e6:.0f}")


if __name__ == "__main__":
    main()
