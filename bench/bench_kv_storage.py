"""TTFT of a long shared prefix: computed vs device-cached vs storage-cached,
for each KV storage backend, printed as ratios against the computed
baseline measured in the same run.

    python bench/bench_kv_storage.py [--tokens 1024] [--repeats 3] [--backends memory,file,redis,mooncake]

One engine (the real model, in this process) is reused; for each backend a
fresh storage tier is attached.  Per repeat, with a fresh random prompt:

* computed: the prompt's first token with nothing cached;
* device: the same prompt again (device prefix cache);
* storage: the device prefix cache is reset, so the prefix comes back from
  the backend (the writer queue is drained first).

redis-server and mooncake_master (+ a mooncake_client pool; the engine
contributes no segment, as across processes) are started on free loopback
ports and stopped by PID (tests/kvservices.py).  The machine may be shared:
read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Iterator

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


@contextlib.contextmanager
def backend_options(name: str) -> Iterator[dict[str, Any]]:
    """Start what the backend needs; yield its options."""
    if name == "memory":
        yield {"max_bytes": "2G"}
    elif name == "file":
        with tempfile.TemporaryDirectory(prefix="fdx-bench-kv-") as d:
            yield {"path": d}
    elif name == "redis":
        from kvservices import RedisServer

        with RedisServer(maxmemory="4gb") as srv:
            yield {"url": srv.url}
    elif name == "mooncake":
        from kvservices import MooncakeMaster, MooncakePool

        with MooncakeMaster() as master, MooncakePool(master, "2 GB"):
            yield {"master": master.address, "global_segment_size": 0}
    else:
        raise SystemExit(f"unknown backend {name!r}")


def ttft(engine: Any, rid: str, tokens: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first output token; cached tokens."""
    from fdx.core.messages import AddRequest, SamplingParams

    t0 = time.perf_counter()
    engine.add_request(AddRequest(rid, tuple(tokens), SamplingParams(max_tokens=1, temperature=0.0), time.time()))
    first: float | None = None
    cached = 0
    while engine.has_work():
        for out in engine.step():
            if out.error:
                raise RuntimeError(out.error)
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
                cached = out.num_cached_tokens
    assert first is not None
    return first, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length (default 1024)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="memory,file,redis,mooncake")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()

    from fdx.config import make_config
    from fdx.core.engine import Engine
    from fdx.kv_storage import KVStorage
    from fdx.core.plugins import get_plugins

    n_blocks = max(256, 2 * (args.tokens // 16 + 4))
    cfg = make_config(model=args.model, num_kv_blocks=n_blocks, max_model_len=max(2048, args.tokens + 64))
    engine = Engine(cfg)
    plugins = get_plugins()
    rng = random.Random(0)
    ttft(engine, "warmup", [rng.randrange(100, 40000) for _ in range(64)])
    rows = []
    for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
        with backend_options(name) as opts:
            backend = plugins.create("cache_backend", name, options=opts)
            storage = KVStorage(backend, engine.runner, engine.kv)
            if not storage.wait_ready(30):
                raise SystemExit(f"{name}: backend not reachable")
            engine.storage, engine.kv.storage = storage, storage
            samples: dict[str, list[float]] = {"computed": [], "device": [], "storage": []}
            cached: dict[str, list[int]] = {"computed": [], "device": [], "storage": []}
            try:
                for rep in range(args.repeats):
                    prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
                    for kind in ("computed", "device", "storage"):
                        if kind == "storage":
                            storage.drain(60)
                            engine.kv.reset_prefix_cache()
                        t, c = ttft(engine, f"{name}-{rep}-{kind}", prompt)
                        samples[kind].append(t)
                        cached[kind].append(c)
                    engine.kv.reset_prefix_cache()
            finally:
                engine.storage = engine.kv.storage = None
                st = storage.stats()
                storage.close()
            med = {k: statistics.median(v) for k, v in samples.items()}
            load_mb_s = st.get("hits", 0) and (st["hit_blocks"] * engine.runner.bytes_per_block / 1e6
                                               / max(st.get("load_seconds", 0), 1e-9))
            rows.append((name, med, {k: min(v) for k, v in cached.items()}, load_mb_s, st))
    print(f"\nTTFT, prompt of {args.tokens} tokens, median of {args.repeats} (shared machine: read the ratios)")
    print(f"{'backend':10} {'computed':>10} {'device':>18} {'storage':>18} {'cached tok':>12} {'load MB/s':>10}")
    for name, med, cached_min, load_mb_s, st in rows:
        c = med["computed"]
        print(
            f"{name:10} {c * 1e3:8.0f}ms {med['device'] * 1e3:8.0f}ms ({med['device'] / c:5.3f}x) "
            f"{med['storage'] * 1e3:8.0f}ms ({med['storage'] / c:5.3f}x) {cached_min['storage']:>12} "
            f"{load_mb_s:10.0f}"
        )
    for name, _, _, _, st in rows:
        print(f"  {name}: errors={int(st['errors'])} rejected={int(st['rejected'])} puts={int(st['puts'])} "
              f"put_dropped={int(st['put_dropped'])}")


if __name__ == "__main__":
    main()
