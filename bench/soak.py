"""Soak test: N minutes of mixed load against one ``fdx serve``, then the
leak check.

    .venv/bin/python bench/soak.py [--duration 600] [--concurrency 8] [--base-url URL] [--json OUT]

Without ``--base-url`` it starts its own server (``--server-arg`` passes
flags on) and stops it at the end (SIGTERM: it must exit 0).  The load
mixes streaming and non-streaming completions and chat completions of short,
medium and long prompts and outputs, ``n=2``, streams the client drops
after a few chunks, requests the client abandons before their answer, and a
few bad requests (each must get a 4xx with the error envelope).

It reports, and exits 1 if any is non-zero:

* **lost**: sent but never answered: the connection cut, a stream that ended
  without ``[DONE]`` or an error event, a 5xx or an error event;
* **hung**: no answer within ``--hang-after`` seconds;
* **leaked KV blocks**: ``fdx:kv_blocks_used`` once the load has drained;
* **engine restarts** during the run (``fdx:engine_restarts_total``);

and the RSS of the engine and API processes (from ``/proc``) at the start,
the middle and the end.  Absolute figures depend on the machine; compare
RSS growth and the counts, not latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from typing import Any

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew strong coffee near "
         "old stone bridges and rivers of light carry ships past silent towers into morning").split()

#: scenario -> weight
SCENARIOS = {
    "completion": 3,
    "completion_stream": 3,
    "chat": 3,
    "chat_stream": 3,
    "n2_stream": 1,
    "drop_stream": 2,     # read a few chunks, then disconnect
    "abandon": 1,         # give up before the answer (client-side timeout)
    "bad": 1,             # must be a 4xx with the error envelope
}

#: (path, body, a 200 is fine too): each must get a 4xx with the error envelope
#: (or, where the third item says so, a normal answer), never a 5xx
BAD_BODIES: list[tuple[str, Any, bool]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, False),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, False),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, False),
    ("/v1/chat/completions", {"messages": "not a list"}, False),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**64}, False),
    ("/v1/completions", {"prompt": "hi", "seed": -1, "max_tokens": 2}, True),  # rejected or wrapped
    ("/v1/completions", "{not json", False),
]


def rss_mib(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def prompt_text(rng: random.Random) -> str:
    n = rng.choice((rng.randint(3, 20), rng.randint(40, 120), rng.randint(200, 400)))
    return " ".join(rng.choice(WORDS) for _ in range(n))


def max_tokens(rng: random.Random) -> int:
    return rng.choice((rng.randint(1, 8), rng.randint(16, 48), rng.randint(64, 128)))


class Soak:
    def __init__(self, base: str, args: argparse.Namespace, model: str, headers: dict[str, str]) -> None:
        self.base, self.args, self.model, self.headers = base, args, model, headers
        self.outcomes: Counter[str] = Counter()
        self.by_scenario: Counter[str] = Counter()
        self.problems: list[str] = []

    def problem(self, kind: str, scenario: str, detail: str) -> None:
        self.outcomes[kind] += 1
        if len(self.problems) < 50:
            self.problems.append(f"{kind}: {scenario}: {detail}"[:300])

    async def worker(self, wid: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + wid)
        names, weights = zip(*SCENARIOS.items())
        timeout = httpx.Timeout(self.args.hang_after, connect=30)
        async with httpx.AsyncClient(timeout=timeout, headers=self.headers) as c:
            while time.monotonic() < deadline:
                scenario = rng.choices(names, weights)[0]
                self.by_scenario[scenario] += 1
                try:
                    await self.one(c, scenario, rng)
                except httpx.TimeoutException as exc:
                    self.problem("hung", scenario, f"no answer within {self.args.hang_after:g}s ({type(exc).__name__})")
                except httpx.HTTPError as exc:
                    self.problem("lost", scenario, f"connection: {type(exc).__name__}: {exc}")
                except Exception as exc:  # noqa: BLE001 - e.g. a body that is not JSON
                    self.problem("unexpected", scenario, f"{type(exc).__name__}: {exc}")

    async def one(self, c: httpx.AsyncClient, scenario: str, rng: random.Random) -> None:
        chat = scenario.startswith("chat") or (scenario in ("drop_stream", "abandon") and rng.random() < 0.5)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens(rng), "temperature": rng.choice((0, 0.8))}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt_text(rng)}]
        else:
            body["prompt"] = prompt_text(rng)
        if scenario == "bad":
            path, bad, may_pass = rng.choice(BAD_BODIES)
            kw: dict[str, Any] = {"content": bad, "headers": {"content-type": "application/json"}} if isinstance(
                bad, str) else {"json": {"model": self.model, **bad}}
            r = await c.post(self.base + path, **kw)
            try:
                ok_env = "error" in r.json()
            except ValueError:
                ok_env = False
            if 400 <= r.status_code < 500 and ok_env:
                self.outcomes["rejected_as_expected"] += 1
            elif r.status_code == 200 and may_pass:
                self.outcomes["ok"] += 1
            elif r.status_code >= 500:
                self.problem("lost", scenario, f"{r.status_code} for a bad request: {r.text[:120]}")
            else:
                self.problem("unexpected", scenario, f"{r.status_code} for a bad request {bad!r}: {r.text[:120]}")
            return
        if scenario == "abandon":
            try:
                await asyncio.wait_for(c.post(self.base + path, json=body), rng.uniform(0.05, 0.5))
                self.outcomes["ok"] += 1  # answered before we gave up
            except asyncio.TimeoutError:
                self.outcomes["abandoned"] += 1
            return
        stream = scenario.endswith("stream")
        if scenario == "n2_stream":
            body["n"] = 2
        if not stream:
            r = await c.post(self.base + path, json=body)
            self.check_plain(scenario, r)
            return
        body["stream"] = True
        drop_after = rng.randint(1, 6) if scenario == "drop_stream" else None
        chunks = 0
        async with c.stream("POST", self.base + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self.check_plain(scenario, r)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.outcomes["ok"] += 1
                    return
                ev = json.loads(line[6:])
                if "error" in ev:
                    self.problem("lost", scenario, f"error event: {ev['error']}")
                    return
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    self.outcomes["dropped_by_client"] += 1
                    return  # leaving the block closes the connection mid-stream
        self.problem("lost", scenario, f"stream ended after {chunks} chunks without [DONE] or an error event")

    def check_plain(self, scenario: str, r: httpx.Response) -> None:
        if r.status_code == 200:
            data = r.json()
            if data.get("choices") and all(ch.get("finish_reason") for ch in data["choices"]):
                self.outcomes["ok"] += 1
            else:
                self.problem("lost", scenario, f"200 without finished choices: {r.text[:120]}")
        elif r.status_code == 429:
            self.outcomes["overloaded_429"] += 1
        else:
            self.problem("lost", scenario, f"HTTP {r.status_code}: {r.text[:160]}")


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def scrape(c: httpx.AsyncClient, base: str) -> str:
    return (await c.get(base + "/metrics")).text


async def run(base: str, args: argparse.Namespace, headers: dict[str, str]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30, headers=headers) as c:
        health = (await c.get(base + "/health")).json()
        models = (await c.get(base + "/v1/models")).json()
        model = models["data"][0]["id"]
        pids = {"engine": health.get("engine_pid"), "api": health.get("api_pid")}
        m0 = await scrape(c, base)
        restarts0 = metric(m0, "fdx:engine_restarts_total")
        rss: dict[str, dict[str, float | None]] = {"start": {k: rss_mib(p) for k, p in pids.items()}}
        soak = Soak(base, args, model, headers)
        t0 = time.monotonic()
        deadline = t0 + args.duration
        workers = [asyncio.create_task(soak.worker(i, deadline)) for i in range(args.concurrency)]

        async def middle() -> None:
            await asyncio.sleep(args.duration / 2)
            rss["middle"] = {k: rss_mib(p) for k, p in pids.items()}

        mid = asyncio.create_task(middle())
        await asyncio.gather(*workers)
        await mid
        elapsed = time.monotonic() - t0
        # drain: nothing running or waiting, then the KV blocks still held are leaks
        drain_deadline = time.monotonic() + 60
        while True:
            text = await scrape(c, base)
            busy = metric(text, "fdx:num_requests_running") + metric(text, "fdx:num_requests_waiting")
            if busy == 0 or time.monotonic() > drain_deadline:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the last abort's stats snapshot
        text = await scrape(c, base)
        rss["end"] = {k: rss_mib(p) for k, p in pids.items()}
        health_end = (await c.get(base + "/health")).json()
    return {
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "requests": sum(soak.by_scenario.values()),
        "by_scenario": dict(soak.by_scenario),
        "outcomes": dict(soak.outcomes),
        "lost": soak.outcomes["lost"],
        "hung": soak.outcomes["hung"],
        "unexpected": soak.outcomes["unexpected"],
        "leaked_kv_blocks": metric(text, "fdx:kv_blocks_used"),
        "still_running_after_drain": metric(text, "fdx:num_requests_running") + metric(text, "fdx:num_requests_waiting"),
        "engine_restarts": metric(text, "fdx:engine_restarts_total") - restarts0,
        "engine_pid_changed": health_end.get("engine_pid") != pids["engine"],
        "pids": pids,
        "rss_mib": rss,
        "problems": soak.problems,
    }


def report(res: dict[str, Any]) -> None:
    print(f"soak: {res['requests']} requests in {res['duration_s']}s at concurrency {res['concurrency']}")
    print("  scenarios: " + ", ".join(f"{k}={v}" for k, v in sorted(res["by_scenario"].items())))
    print("  outcomes:  " + ", ".join(f"{k}={v}" for k, v in sorted(res["outcomes"].items())))
    for k in ("lost", "hung", "unexpected", "leaked_kv_blocks", "still_running_after_drain", "engine_restarts"):
        print(f"  {k:<26} {res[k]:g}")
    print("  RSS MiB        start    middle   end")
    for proc in ("engine", "api"):
        vals = [res["rss_mib"].get(when, {}).get(proc) for when in ("start", "middle", "end")]
        print(f"  {proc:<12}" + "".join(f"{v:9.1f}" if v is not None else "        -" for v in vals))
    for p in res["problems"][:20]:
        print("  ! " + p)


def failed(res: dict[str, Any]) -> bool:
    return bool(res["lost"] or res["hung"] or res["unexpected"] or res["leaked_kv_blocks"]
                or res["still_running_after_drain"] or res["engine_restarts"] or res["engine_pid_changed"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--hang-after", type=float, default=180.0, help="seconds without an answer that count as hung")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-url", help="an already running server (default: start one)")
    ap.add_argument("--api-key", default=os.environ.get("FDX_API_KEY"))
    ap.add_argument("--server-arg", action="append", default=[], help="extra `fdx serve` flag (repeatable)")
    ap.add_argument("--json", help="write the result here as JSON")
    args = ap.parse_args(argv)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    exit_code: int | None = None
    if args.base_url:
        res = asyncio.run(run(args.base_url.rstrip("/"), args, headers))
    else:
        from serverutil import read_log, start_server

        with start_server(*args.server_arg) as (base, proc):
            res = asyncio.run(run(base, args, headers))
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(60)
            except Exception:  # noqa: BLE001
                exit_code = None
            if exit_code != 0:
                print(read_log(proc)[-3000:], file=sys.stderr)
        res["server_exit_code"] = exit_code
    report(res)
    if exit_code is not None:
        print(f"  server exit code           {exit_code}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    bad = failed(res) or (exit_code is not None and exit_code != 0) or (not args.base_url and exit_code is None)
    print("soak: FAIL" if bad else "soak: OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
