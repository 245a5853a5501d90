#!/usr/bin/env python
"""Model-runner speed on this machine: prefill, single-stream decode,
aggregate decode at 8 and 32 concurrent sequences, peak RSS; and the same
figures for llama.cpp's ``llama-server`` (2 threads, same GGUF) when
``/opt/peers/bin/llama-server`` exists.

Runs the runner directly with hand-built batches (no scheduler, no HTTP):
this measures the forward pass + sampling.  llama-server's figures come from
its own per-request ``timings`` (no HTTP overhead either); for 8/32
sequences the per-request decode rates of concurrent requests are summed.
Every figure is the best of ``--repeats`` runs.  "end-to-end" rows time
``B`` fresh requests (64-token prompts) from submission to their last
token, prefill included, wall clock -- the fairest fdx/peer comparison; the
peer's "decode" rows divide by the longest per-request decode window.  The machine is shared and
noisy: compare the fdx/peer ratio printed in the same run, not absolute
figures.

    .venv/bin/python bench/bench_model.py [--decode-steps 64] [--no-peer] [--dtype int8|float32]
    .venv/bin/python bench/bench_model.py --compare-dtypes int8,float32 [--repeats 3]
    .venv/bin/python bench/bench_model.py --compare-dtypes int8,int8:per-layer   # the fused layer op's gain
    .venv/bin/python bench/bench_model.py --compare-dtypes int8,int8:kv-bf16 --prompt-len 256  # a bfloat16 KV cache
    .venv/bin/python bench/bench_model.py --moe [--dtype int8]   # a random Qwen3-MoE: decode, expert vs dense GEMM

``--moe`` runs bench_tp's random Qwen3-MoE (hidden 512, 12 layers, 8
experts of width 512, top 2): decode tok/s at 1 and 16 sequences, and one
layer's experts (router, grouping, the experts' GEMMs, the weighted sum:
one ``fdx_moe`` call) in GMAC/s against one dense gate/up + down GEMM pair
of the same active width (top-k x the expert width) over the same tokens,
and against the block's pure-Paddle path (``MoeBlock.grouped``: one
``fdx_qgemm`` pair per expert from Python, the path before ``fdx_moe``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")

PEER = "/opt/peers/bin/llama-server"


def build_runner(args: argparse.Namespace):  # noqa: ANN201
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    model = {"model": args.model} if getattr(args, "model", None) else {}
    cfg = make_config(num_kv_blocks=args.blocks, max_model_len=4096, max_num_seqs=64, dtype=args.dtype,
                      kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), **model)
    r = PaddleModelRunner(cfg, CPUDevice())
    if args.attention == "paddle":
        r.model.ops = None
    return r


def make_requests(runner, prompts, max_tokens):  # noqa: ANN001, ANN201
    from fdx.core.messages import SamplingParams
    from fdx.core.request import Request

    bs = runner.block_size
    nxt = 0
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(f"b{i}", list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                    eos_token_ids=runner.eos_token_ids, max_model_len=runner.max_model_len)
        nb = -(-(len(p) + max_tokens + 1) // bs)
        r.block_ids = list(range(nxt, nxt + nb))
        nxt += nb
        reqs.append(r)
    assert nxt <= runner.num_kv_blocks, "raise --blocks"
    return reqs


def step(runner, reqs, chunk=None):  # noqa: ANN001, ANN201
    from fdx.core.interfaces import ScheduledBatch, ScheduledSeq

    seqs = [ScheduledSeq(r, min(chunk or 1 << 30, r.num_tokens - r.num_computed_tokens)) for r in reqs]
    smp = [s.samples for s in seqs]
    out = runner.execute(ScheduledBatch(seqs))
    for s, ok, t in zip(seqs, smp, out.token_ids):
        s.request.num_computed_tokens += s.num_new_tokens
        if ok:
            s.request.append_token(int(t))
    return sum(s.num_new_tokens for s in seqs)


def prompts_of(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, size=length).tolist() for _ in range(n)]


def decode_tok_s(runner, args: argparse.Namespace, batch: int, k: int) -> float:  # noqa: ANN001
    """Decode tok/s of ``batch`` fresh ``--prompt-len`` prompts (seed ``batch + k``)
    over ``--decode-steps`` steps, the prefill and first decode step not timed."""
    reqs = make_requests(runner, prompts_of(batch, args.prompt_len, batch + k), args.decode_steps + 2)
    step(runner, reqs)
    step(runner, reqs)
    t = time.perf_counter()
    for _ in range(args.decode_steps - 2):
        step(runner, reqs)
    return batch * (args.decode_steps - 2) / (time.perf_counter() - t)


def bench_fdx(args: argparse.Namespace) -> dict[str, float]:
    runner = build_runner(args)
    res: dict[str, float] = {}
    # warm-up
    step(runner, make_requests(runner, prompts_of(2, 16, 9), 4))
    # prefill: one --prefill-len prompt in one step (best of 3)
    best = 1e9
    for k in range(3):
        reqs = make_requests(runner, prompts_of(1, args.prefill_len, k), 1)
        t = time.perf_counter()
        step(runner, reqs)
        best = min(best, time.perf_counter() - t)
    res["prefill_tok_s"] = args.prefill_len / best
    for batch in (1, 8, 32):
        best = best_e2e = 0.0
        for rep in range(args.repeats):
            reqs = make_requests(runner, prompts_of(batch, args.prompt_len, batch + rep), args.decode_steps + 2)
            t0 = time.perf_counter()
            step(runner, reqs)  # prefill (first token)
            step(runner, reqs)
            t = time.perf_counter()
            for _ in range(args.decode_steps - 2):
                step(runner, reqs)
            t1 = time.perf_counter()
            best = max(best, batch * (args.decode_steps - 2) / (t1 - t))
            best_e2e = max(best_e2e, batch * args.decode_steps / (t1 - t0))
        res[f"decode_b{batch}_tok_s"] = best
        res[f"e2e_b{batch}_tok_s"] = best_e2e
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def bench_modes(args: argparse.Namespace, modes: list[str]) -> dict[str, dict[str, float]]:
    """The same figures for several compute modes (``--dtype``), one runner
    each in this process, measured in alternation (the order flips every
    round), best of ``--repeats``: the ratios survive a noisy machine."""
    runners = {}
    kv = args.kv_cache_dtype
    for m in modes:
        args.dtype, _, variant = m.partition(":")
        args.kv_cache_dtype = "bfloat16" if variant == "kv-bf16" else kv
        runners[m] = build_runner(args)
        if variant == "per-layer":  # int8 without the fused fdx_decoder_layers op
            runners[m].model.fused_layers = False
        elif variant and variant != "kv-bf16":
            raise SystemExit(f"mode {m!r}: the variants are ':per-layer' (int8 without the fused layer op) and "
                             "':kv-bf16' (--kv-cache-dtype bfloat16)")
        step(runners[m], make_requests(runners[m], prompts_of(2, 16, 9), 4))  # warm-up

    def prefill(r, k: int) -> dict[str, float]:  # noqa: ANN001
        reqs = make_requests(r, prompts_of(1, args.prefill_len, k), 1)
        t = time.perf_counter()
        step(r, reqs)
        return {"prefill_tok_s": args.prefill_len / (time.perf_counter() - t)}

    def decode(r, k: int, batch: int) -> dict[str, float]:  # noqa: ANN001
        reqs = make_requests(r, prompts_of(batch, args.prompt_len, batch + k), args.decode_steps + 2)
        t0 = time.perf_counter()
        step(r, reqs)
        step(r, reqs)
        t = time.perf_counter()
        for _ in range(args.decode_steps - 2):
            step(r, reqs)
        t1 = time.perf_counter()
        return {f"decode_b{batch}_tok_s": batch * (args.decode_steps - 2) / (t1 - t),
                f"e2e_b{batch}_tok_s": batch * args.decode_steps / (t1 - t0)}

    tasks = [prefill] + [lambda r, k, b=b: decode(r, k, b) for b in (1, 8, 32)]
    best: dict[str, dict[str, float]] = {m: {} for m in modes}
    for rep in range(args.repeats):
        for task in tasks:
            for m in (modes if rep % 2 == 0 else modes[::-1]):
                for key, v in task(runners[m], rep).items():
                    best[m][key] = max(best[m].get(key, 0.0), v)
    return best


# --------------------------------------------------------------------------
# llama.cpp peer
# --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def bench_peer(args: argparse.Namespace, gguf: str) -> dict[str, float]:
    port = _free_port()
    proc = subprocess.Popen(
        [PEER, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2",
         "--parallel", "32", "-c", str(32 * (max(args.prefill_len, args.prompt_len + args.decode_steps) + 16))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:  # noqa: BLE001
                time.sleep(0.2)
        else:
            raise RuntimeError("llama-server did not start")
        res: dict[str, float] = {}
        # prefill / single stream from the server's own timings (no HTTP overhead)
        res["prefill_tok_s"] = res["decode_b1_tok_s"] = 0.0
        for rep in range(args.repeats):
            out = _post(base + "/completion", {"prompt": prompts_of(1, args.prefill_len, 1 + rep)[0], "n_predict": 1,
                                               "cache_prompt": False})
            res["prefill_tok_s"] = max(res["prefill_tok_s"], out["timings"]["prompt_per_second"])
            out = _post(base + "/completion", {"prompt": prompts_of(1, args.prompt_len, 20 + rep)[0],
                                               "n_predict": args.decode_steps, "ignore_eos": True,
                                               "cache_prompt": False})
            res["decode_b1_tok_s"] = max(res["decode_b1_tok_s"], out["timings"]["predicted_per_second"])
        for batch, rep in [(b, r) for b in (8, 32) for r in range(args.repeats)]:
            ps = prompts_of(batch, args.prompt_len, 100 + batch + 7 * rep)
            timings: list[dict] = []
            errors: list[str] = []

            def one(p: list[int]) -> None:
                try:
                    o = _post(base + "/completion", {"prompt": p, "n_predict": args.decode_steps,
                                                     "ignore_eos": True, "cache_prompt": False})
                    timings.append(o["timings"])
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"{type(exc).__name__}: {exc}")

            ths = [threading.Thread(target=one, args=(p,)) for p in ps]
            t0 = time.perf_counter()
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            wall = time.perf_counter() - t0
            if errors:
                raise RuntimeError(errors[0])
            n = sum(t["predicted_n"] for t in timings)
            # decode-only: tokens over the longest per-request decode window
            # (a lower bound: windows overlap but start staggered)
            dec = n / (max(t["predicted_ms"] for t in timings) / 1000)
            res[f"decode_b{batch}_tok_s"] = max(res.get(f"decode_b{batch}_tok_s", 0.0), dec)
            res[f"e2e_b{batch}_tok_s"] = max(res.get(f"e2e_b{batch}_tok_s", 0.0), n / wall)
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_moe(args: argparse.Namespace) -> None:
    """``--moe``: see the module docstring."""
    import numpy as np
    import paddle

    from fdx.model.packed_weights import pack_bf16, pack_float

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_tp import bench_moe_model

    args.model = bench_moe_model()
    runner = build_runner(args)
    step(runner, make_requests(runner, prompts_of(2, 16, 9), 4))  # warm-up
    print(f"random Qwen3-MoE ({args.model}), compute {runner.compute}")
    for batch in (1, 16):
        best = max(decode_tok_s(runner, args, batch, rep) for rep in range(args.repeats))
        print(f"  decode tok/s, {batch:2d} sequences: {best:8.1f}")
    model = runner.model
    blk = model.layers[0].moe
    ops = model.ops
    packed = runner.compute != "float32"
    qgemm = ops.fdx_qgemm if packed else None
    swiglu = ops.fdx_swiglu if ops is not None else paddle.nn.functional.swiglu
    H, k, E = int(model.args.hidden_size), blk.top_k, blk.num_routed
    width = (blk.p_gate_up[0].n_out if packed else int(blk.w_gate_up[0].shape[1])) // 2
    rng = np.random.default_rng(0)
    pack = pack_bf16 if runner.compute == "bfloat16" else pack_float
    dense_gu = (rng.standard_normal((2 * k * width, H), np.float32) / np.sqrt(H)).astype(np.float32)
    dense_d = (rng.standard_normal((H, k * width), np.float32) / np.sqrt(k * width)).astype(np.float32)
    if packed:
        pg, pd = pack(dense_gu), pack(dense_d)
        pg_t, pd_t = paddle.to_tensor(pg.data), paddle.to_tensor(pd.data)
        dense = lambda x: qgemm(swiglu(qgemm(x, pg_t, pg.kind, pg.n_out)), pd_t, pd.kind, pd.n_out)  # noqa: E731
    else:
        wg, wd = paddle.to_tensor(np.ascontiguousarray(dense_gu.T)), paddle.to_tensor(np.ascontiguousarray(dense_d.T))
        dense = lambda x: paddle.matmul(swiglu(paddle.matmul(x, wg)), wd)  # noqa: E731

    def linear(x, w, p):  # noqa: ANN001, ANN202  (MoeBlock.grouped's matmul: packed, else float32)
        return qgemm(x, p.data, p.kind, p.n_out) if qgemm is not None and p is not None else paddle.matmul(x, w)

    def timed(fn, x, n=50) -> float:  # noqa: ANN001
        fn(x)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn(x)
            best = min(best, (time.perf_counter() - t) / n)
        return best

    saved = blk.routed.copy()
    print(f"one layer's MLP, {E} experts of width {width}, top {k}, vs one dense MLP of width {k * width}; "
          "GMAC/s = active multiply-accumulates / time")
    for T in (1, 16, 128):
        x = paddle.to_tensor(rng.standard_normal((T, H), np.float32))
        macs = T * k * 3 * H * width
        t_moe = timed(lambda h: blk(h, swiglu, qgemm), x)
        t_dense = timed(dense, x)
        t_py = timed(lambda h: blk.grouped(h, swiglu, linear), x)
        print(f"  T={T:4d}: experts {macs / t_moe / 1e9:7.2f} GMAC/s ({t_moe * 1e6:8.1f} us)   dense "
              f"{macs / t_dense / 1e9:7.2f} GMAC/s ({t_dense * 1e6:8.1f} us)   experts / dense "
              f"{t_dense / t_moe:5.2f}x   Paddle-ops path {macs / t_py / 1e9:7.2f} GMAC/s ({t_dense / t_py:5.2f}x dense)")
    blk.routed[:] = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=None,
                    help="KV blocks of the runner (default: enough for 32 sequences of --prompt-len / --prefill-len "
                         "plus --decode-steps, and at least 700)")
    ap.add_argument("--repeats", type=int, default=3, help="best of N (filters out a busy machine)")
    ap.add_argument("--attention", choices=("native", "paddle"), default="native")
    ap.add_argument("--dtype", default="auto", help="fdx's compute mode: auto, int8, float32")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's dtype: auto, float32, bfloat16")
    ap.add_argument("--compare-dtypes", metavar="A,B", help="time these compute modes side by side in one process "
                    "(alternating; e.g. int8,float32) and print their ratio instead of the peer comparison")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--moe", action="store_true", help="a random Qwen3-MoE instead (see above)")
    args = ap.parse_args()
    if args.blocks is None:  # 32 sequences (the largest batch) of the longer prompt, 16-token blocks
        args.blocks = max(700, 33 * -(-(max(args.prompt_len, args.prefill_len) + args.decode_steps + 3) // 16))
    if args.moe:
        bench_moe(args)
        return

    from fdx.model.source import embedded_gguf_path

    print(f"machine: {os.cpu_count()} cores (shared; figures are noisy), OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    rows = [(f"prefill tok/s ({args.prefill_len}-token prompt)", "prefill_tok_s"),
            ("decode tok/s, 1 sequence", "decode_b1_tok_s"),
            ("decode tok/s, 8 sequences", "decode_b8_tok_s"), ("decode tok/s, 32 sequences", "decode_b32_tok_s"),
            ("end-to-end tok/s, 8 seqs (+prefill)", "e2e_b8_tok_s"),
            ("end-to-end tok/s, 32 seqs (+prefill)", "e2e_b32_tok_s")]
    if args.compare_dtypes:
        modes = [m.strip() for m in args.compare_dtypes.split(",") if m.strip()]
        best = bench_modes(args, modes)
        print(f"{'metric':38s}" + "".join(f" {m:>9s}" for m in modes) + f" {modes[0] + '/' + modes[-1]:>16s}")
        for label, key in rows:
            vals = [best[m][key] for m in modes]
            print(f"{label:38s}" + "".join(f" {v:9.1f}" for v in vals) + f" {vals[0] / vals[-1]:16.2f}")
        if args.json:
            print(json.dumps(best))
        return
    fdx = bench_fdx(args)
    peer = None
    if args.no_peer:
        print("peer: skipped (--no-peer)")
    elif not (os.path.exists(PEER) and os.access(PEER, os.X_OK)):
        print(f"peer: skipped ({PEER} not found)")
    else:
        try:
            peer = bench_peer(args, embedded_gguf_path())
        except Exception as exc:  # noqa: BLE001
            print(f"peer: failed ({type(exc).__name__}: {exc})")
    print(f"{'metric':38s} {'fdx':>9s}" + (f" {'llama.cpp':>10s} {'fdx/peer':>9s}" if peer else ""))
    for label, key in rows:
        line = f"{label:38s} {fdx[key]:9.1f}"
        if peer and key in peer:
            line += f" {peer[key]:10.1f} {fdx[key] / peer[key]:9.2f}"
        print(line)
    print(f"{'peak RSS MiB (fdx process)':38s} {fdx['peak_rss_mib']:9.0f}")
    if args.json:
        print(json.dumps({"fdx": fdx, "peer": peer}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
