"""dp against one engine, side by side: 2 replicas x 1 thread vs 1 instance x 2 threads.

    .venv/bin/python bench/bench_dp.py [--concurrency 1,8,32] [--num-prompts 32] [--num-prompts-c1 8] \
        [--input-len 128] [--output-len 32] [--repeat 1]

Starts both servers at once (``fdx serve --scheduler dp --data-parallel-size
2 --num-threads 1`` and ``fdx serve --num-threads 2``, the same KV pool and
``--max-num-seqs`` per engine), then for every concurrency runs ``fdx bench
serve`` (random prompts, ``ignore_eos``, greedy, all arriving at once, at
most c in flight) on one and then the other, alternating which goes first,
``--repeat`` times; the idle one only waits meanwhile.  Printed per
concurrency: output tok/s and TTFT p50 / p99 of each (medians over the
repeats) and the ratios dp / single (throughput > 1 and TTFT < 1 favour dp).

Timings on a shared machine are noisy: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import httpx

COMMON = ("--num-kv-blocks", "1024", "--max-model-len", "2048", "--max-num-seqs", "32")
CONFIGS = {
    "dp 2x1": ("--scheduler", "dp", "--data-parallel-size", "2", "--num-threads", "1"),
    "single 1x2": ("--num-threads", "2"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(args: tuple[str, ...], timeout: float = 300.0) -> Iterator[tuple[str, int]]:
    """``fdx serve`` on a free port; yields (base url, pid); stopped by PID."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="bench-dp-", suffix=".log", delete=False)
    env = {**os.environ, "FDX_IPC_DIR": tempfile.mkdtemp(prefix="bench-dp-run-")}
    proc = subprocess.Popen([sys.executable, "-m", "fdx", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *COMMON, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fdx serve {' '.join(args)} exited {proc.returncode}; log {log.name}")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"fdx serve {' '.join(args)} not healthy after {timeout:.0f}s; log {log.name}")
            time.sleep(0.5)
        yield base, proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def run_point(base: str, pid: int, conc: int, n: int, opts: argparse.Namespace, label: str) -> dict[str, Any]:
    """One ``fdx bench serve`` run; its metrics."""
    from fdx.bench.serve import main as bench_main

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = ["--base-url", base, "--num-prompts", str(n), "--random-input-len", str(opts.input_len),
            "--random-output-len", str(opts.output_len), "--max-concurrency", str(conc), "--ignore-eos",
            "--warmup", "2", "--no-progress", "--no-idle-check", "--seed", str(opts.seed), "--label", label,
            "--server-pid", str(pid), "--json", path]
    code = bench_main(argv)
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    os.unlink(path)
    run = doc["runs"][0]
    if code != 0 or run["failed"]:
        raise RuntimeError(f"{label} c={conc}: {run['failed']} failed requests: {run.get('errors')}")
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per run at c > 1")
    p.add_argument("--num-prompts-c1", type=int, default=8, help="prompts per run at c = 1")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    concs = [int(c) for c in opts.concurrency.split(",")]
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(server(args)) for name, args in CONFIGS.items()}
        names = list(CONFIGS)
        for conc in concs:
            n = opts.num_prompts_c1 if conc == 1 else opts.num_prompts
            for rep in range(opts.repeat):
                order = names if rep % 2 == 0 else names[::-1]
                for name in order:  # alternating: the same load around both
                    base, pid = servers[name]
                    run = run_point(base, pid, conc, n, opts, name)
                    run["loadavg"] = os.getloadavg()[0]  # the machine's 1-min load after the run
                    results.setdefault((name, conc), []).append(run)
    a, b = names
    print(f"\n{opts.input_len}-token random prompts, {opts.output_len} output tokens (ignore_eos), "
          f"medians of {opts.repeat} alternating run(s); ratio = {a} / {b}")
    print(f"{'c':>3} {'prompts':>7} | {'out tok/s':>21} {'ratio':>6} | {'TTFT p50 ms':>19} {'ratio':>6} | "
          f"{'TTFT p99 ms':>19} {'ratio':>6} | load")
    for conc in concs:
        def med(name: str, key: str) -> float:
            return statistics.median(r[key] for r in results[(name, conc)])

        row = [f"{conc:>3} {results[(a, conc)][0]['num_prompts']:>7} |"]
        for key in ("output_throughput", "p50_ttft_ms", "p99_ttft_ms"):
            x, y = med(a, key), med(b, key)
            row.append(f"{x:>9.1f} vs {y:>9.1f} {x / y if y else float('nan'):>6.2f} |")
        loads = [r["loadavg"] for name in names for r in results[(name, conc)]]
        row.append(f"{min(loads):.1f}-{max(loads):.1f}")
        print(" ".join(row))
    print(f"load: the 1-min load average after each run ({os.cpu_count()} CPUs); above the CPU count, "
          "other processes competed for the cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
