"""Throughput of ``fdx serve`` with tracing off (this checkout) against the
same server before tracing existed (``--ref``, default ``main``), and with
``--otlp-traces-endpoint`` on, side by side.

    .venv/bin/python bench/bench_tracing.py [--ref main] [--rounds 3] [--conc 16] [--tokens 64] [--requests 64]

The engine runs the ``echo`` model runner (``fdx.testing.EchoRunner``: no
model), so the API process -- where tracing works -- is the bottleneck and
the most sensitive place to see its cost.  Each round starts the three
servers in turn (``ref``, ``off``, ``on``; the order reversed every other
round) and sends each the same streaming load; the ``on`` server exports to
an OTLP/HTTP sink in this process that counts the spans.  The reference
checkout is a temporary ``git worktree`` of ``--ref``, run from its own
directory.  Printed: requests/s and tokens/s per round, the best of each
variant, and the ratios ``off/ref`` and ``on/ref`` (the figures to read: the
machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import echo_runner_plugin  # noqa: E402
from serverutil import start_server  # noqa: E402


class Sink:
    """An OTLP/HTTP endpoint that answers 200 and counts the bytes and posts."""

    def __init__(self) -> None:
        self.posts = 0
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", 0)))
                sink.posts += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@contextlib.contextmanager
def ref_checkout(ref: str) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="fdx-bench-ref-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", d, ref], check=True, capture_output=True)
    try:
        yield d
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", d], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


async def _one(c: httpx.AsyncClient, base: str, i: int, n: int) -> int:
    body = {"model": "smollm2", "prompt": f"Story {i}: once upon a time", "max_tokens": n, "ignore_eos": True,
            "stream": True, "temperature": 0}
    k = 0
    async with c.stream("POST", base + "/v1/completions", json=body,
                        headers={"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"}) as r:
        async for line in r.aiter_lines():
            k += line.startswith("data: {")
    return k


async def _load(base: str, conc: int, requests: int, tokens: int) -> float:
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        async def one(i: int) -> int:
            async with sem:
                return await _one(c, base, i, tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return time.perf_counter() - t0


def ref_plugins(ref: str) -> str:
    """``FDX_PLUGINS`` for the reference checkout: the ``fdx.plugins`` entry
    points its pyproject.toml declares, and the echo runner."""
    import tomllib

    with open(os.path.join(ref, "pyproject.toml"), "rb") as f:
        names = tomllib.load(f)["project"]["entry-points"]["fdx.plugins"]
    return ",".join([*names, "echo_runner"])


def run_variant(repo: str, extra: tuple[str, ...], env: dict[str, str], a: argparse.Namespace) -> float:
    cwd = os.getcwd()
    os.chdir(repo)  # `python -m fdx` puts the working directory first on sys.path
    try:
        with start_server("--model-runner", "echo", "--num-threads", "1", "--max-num-seqs", str(a.conc), *extra,
                          env=env) as (base, _proc):
            asyncio.run(_load(base, 4, 8, 4))  # warm-up
            return asyncio.run(_load(base, a.conc, a.requests, a.tokens))
    finally:
        os.chdir(cwd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="main", help="the revision before tracing (default main; b3834d0^ is the last without it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    plugin_dir = tempfile.mkdtemp(prefix="fdx-bench-echo-")
    plugin_path = echo_runner_plugin.write_entry_point(plugin_dir)
    sink = Sink()
    print(f"load average at start: {os.getloadavg()[0]:.1f} (shared machine: read the ratios)")
    with ref_checkout(a.ref) as ref:
        variants = {
            # the ref's own built-ins only: this venv's entry points name today's (e.g. deployments)
            "ref": (ref, (), {"PYTHONPATH": f"{ref}{os.pathsep}{plugin_path}", "FDX_PLUGINS": ref_plugins(ref)}),
            "off": (ROOT, (), {"PYTHONPATH": f"{ROOT}{os.pathsep}{plugin_path}"}),
            "on": (ROOT, ("--otlp-traces-endpoint", sink.url), {"PYTHONPATH": f"{ROOT}{os.pathsep}{plugin_path}"}),
        }
        best: dict[str, float] = {}
        for r in range(a.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                repo, extra, env = variants[name]
                secs = run_variant(repo, extra, env, a)
                best[name] = min(best.get(name, secs), secs)
                print(f"round {r + 1} {name:>3}: {a.requests / secs:7.1f} req/s  "
                      f"{a.requests * a.tokens / secs:8.0f} tok/s  ({secs:.2f} s)", flush=True)
    shutil.rmtree(plugin_dir, ignore_errors=True)
    print(f"\nbest of {a.rounds}: " + "  ".join(f"{k} {a.requests / v:.1f} req/s" for k, v in best.items()))
    print(f"throughput off/ref = {best['ref'] / best['off']:.3f}   on/ref = {best['ref'] / best['on']:.3f}   "
          f"(OTLP posts received: {sink.posts})")


if __name__ == "__main__":
    main()
