"""CPU cost of the API process (HTTP, JSON, detokenization, SSE) against the
engine process, for streaming clients of one real ``fdx serve``.

    .venv/bin/python bench/bench_server_overhead.py [--conc 1 16 64] [--tokens 64]

Prints, per concurrency, CPU seconds of each process (from /proc) and their
ratio; the ratio is the figure to compare (absolute times depend on how busy
the shared machine is).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from serverutil import start_server  # noqa: E402


def cpu_seconds(pid: int) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conc", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
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
