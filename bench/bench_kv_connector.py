"""The KV handoff of the splitwise connectors, measured alone: bytes/s and
ms per handoff for prompts of 256, 1,024 and 1,500 tokens of the real model
(SmolLM2-135M, float32 KV: 30 layers x 2 x 3 heads x 64 dims x 4 bytes =
46,080 bytes per token).

A handoff here is what the engines do between "P sampled the first token"
and "D may decode": ``send`` on the sender (the blocks gathered out of the
pool by ``read_kv_blocks``, then the connector's transfer) + ``recv`` and
``load`` on the receiver (the connector's transfer, then ``write_kv_blocks``
into the destination blocks).  Sender and receiver are two real runners in
this process, talking over loopback TCP (zmq: ZMQ's I/O threads; mooncake:
the store's transfer engine against a real ``mooncake_master``).  The pool
gather/scatter alone is printed too, so the connector's own share shows.

Each row runs twice, handoff by handoff alternating: the runners' block I/O
as it is (float32 pool: NumPy straight over the pool's memory, one copy a
byte) and, as the baseline, Paddle's gather/scatter path (``index_select``
/ ``scatter_`` with the stacking and joining around them), with the ratio
new / baseline.

    .venv/bin/python bench/bench_kv_connector.py [--connectors zmq,mooncake] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _runner(cfg):  # type: ignore[no-untyped-def]
    from fdx.core.engine import build_runner
    from fdx.core.plugins import get_plugins

    return build_runner(cfg, get_plugins())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connectors", default="zmq,mooncake")
    ap.add_argument("--tokens", default="256,1024,1500")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    from fdx.config import make_config
    from fdx.core.messages import RequestOutput
    from fdx.core.plugins import get_plugins

    base = dict(num_threads=1, num_kv_blocks=200, max_model_len=2048, scheduler="splitwise", splitwise_role="decode")
    runners = [_runner(make_config(**base)) for _ in range(2)]
    bs = runners[0].block_size
    print(f"block: {bs} tokens, {runners[0].bytes_per_block} bytes; {args.repeat} handoffs per row (median)")
    print(f"{'connector':<10} {'tokens':>6} {'blocks':>6} {'MB':>7} {'ms/handoff':>18} {'ratio':>5} {'MB/s':>6} "
          f"{'gather+scatter ms':>18} {'ratio':>5}")
    print(f"{'':<10} {'':>6} {'':>6} {'':>7} {'host vs paddle':>18} {'':>5} {'host':>6} {'host vs paddle':>18}")
    for name in args.connectors.split(","):
        master = None
        opts: dict = {}
        if name == "mooncake":
            from kvservices import MooncakeMaster

            master = MooncakeMaster()
            opts = {"master": master.address, "global_segment_size": "512M"}
        cfg = make_config(**base, kv_connector=name, kv_connector_config=opts)
        a, b = (get_plugins().create("kv_connector", name, config=cfg, runner=r) for r in runners)
        try:
            for n_tok in (int(x) for x in args.tokens.split(",")):
                n = -(-n_tok // bs)
                src, dst = list(range(n)), list(range(100, 100 + n))
                times: dict[str, list[float]] = {"host": [], "paddle": []}
                local: dict[str, list[float]] = {"host": [], "paddle": []}
                nbytes = 0
                for i in range(2 * (args.repeat + 1)):
                    mode = ("host", "paddle")[i % 2]
                    for r in runners:  # the baseline: no host view, so Paddle's gather/scatter runs
                        if mode == "paddle":
                            r._host_pools = lambda: None
                        else:
                            r.__dict__.pop("_host_pools", None)
                    t0 = time.perf_counter()
                    nbytes = a.send(b.address, RequestOutput(f"r{i}", (1,)), src)
                    got = []
                    while not got:
                        got = b.recv()
                    (_, _, kv), = got
                    b.load(kv, dst)
                    t1 = time.perf_counter()
                    payloads = runners[0].read_kv_blocks(src)
                    runners[1].write_kv_blocks(dst, payloads)
                    t2 = time.perf_counter()
                    if i >= 2:  # the first of each warms the connection and the buffers
                        times[mode].append(t1 - t0)
                        local[mode].append(t2 - t1)
                for r in runners:
                    r.__dict__.pop("_host_pools", None)
                ms = {m: 1000 * statistics.median(v) for m, v in times.items()}
                lo = {m: 1000 * statistics.median(v) for m, v in local.items()}
                print(f"{name:<10} {n_tok:>6} {n:>6} {nbytes / 1e6:>7.1f} {ms['host']:>8.1f} vs {ms['paddle']:>6.1f} "
                      f"{ms['host'] / ms['paddle']:>5.2f} {nbytes / 1e6 / (ms['host'] / 1000):>6.0f} "
                      f"{lo['host']:>8.1f} vs {lo['paddle']:>6.1f} {lo['host'] / lo['paddle']:>5.2f}")
        finally:
            a.close()
            b.close()
            if master is not None:
                master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
