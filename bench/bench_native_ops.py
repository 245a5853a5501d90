"""Native C++ CPU ops (csrc/) against the pure-Paddle path, side by side.

One process, one runner (the embedded GGUF): each figure -- prefill of one
prompt, a decode step at 1 and at 32 sequences -- is timed with the native
ops and with ``model.ops = None`` (what ``FDX_NATIVE_OPS=0`` gives) in
alternation, ``--rounds`` times, best of each; the machine is shared, so read
the **ratios**.  The kernel set (AVX-512 / AVX2) is printed first.

    .venv/bin/python bench/bench_native_ops.py [--prefill-len 256] [--decode-steps 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

from bench_model import decode_tok_s, make_requests, prompts_of, step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="alternations; best of each side")
    ap.add_argument("--blocks", type=int, default=400)
    args = ap.parse_args()

    from fdx.config import make_config
    from fdx.model import native
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    # float32 compute: the int8 mode has no pure-Paddle twin (bench_model.py --compare-dtypes times it)
    runner = PaddleModelRunner(make_config(num_kv_blocks=args.blocks, max_model_len=4096, max_num_seqs=64,
                                           dtype="float32"), CPUDevice())
    ops = runner.model.ops
    if ops is None:
        sys.exit("native ops are not loaded here (FDX_NATIVE_OPS=0, or no AVX-512F / AVX2+FMA+F16C): nothing to compare")
    print(f"machine: {os.cpu_count()} cores (shared), kernel set: {native.loaded_isa()}")

    def prefill(k: int) -> float:
        reqs = make_requests(runner, prompts_of(1, args.prefill_len, k), 1)
        t = time.perf_counter()
        step(runner, reqs)
        return args.prefill_len / (time.perf_counter() - t)

    def decode(batch: int, k: int) -> float:
        return decode_tok_s(runner, args, batch, k)

    figures = {"prefill tok/s": lambda k: prefill(k), "decode tok/s, 1 seq": lambda k: decode(1, k),
               "decode tok/s, 32 seqs": lambda k: decode(32, k)}
    best: dict[str, dict[str, float]] = {name: {"native": 0.0, "paddle": 0.0} for name in figures}
    for side in ("native", "paddle"):  # warm-up both
        runner.model.ops = ops if side == "native" else None
        step(runner, make_requests(runner, prompts_of(2, 16, 9), 4))
    for k in range(args.rounds):
        for name, fn in figures.items():
            for side in (("native", "paddle") if k % 2 == 0 else ("paddle", "native")):
                runner.model.ops = ops if side == "native" else None
                best[name][side] = max(best[name][side], fn(k))
    runner.model.ops = ops
    print(f"{'metric':24s} {'paddle':>9s} {'native':>9s} {'native/paddle':>14s}")
    for name, b in best.items():
        print(f"{name:24s} {b['paddle']:9.1f} {b['native']:9.1f} {b['native'] / b['paddle']:14.2f}")


if __name__ == "__main__":
    main()
