"""The int8 GEMM (csrc/qgemm.cc, ``fdx_qgemm``): a reference commit's kernel
against the working tree's, side by side in one process.

The reference kernel is rebuilt from ``git show <ref>:fdx/csrc/qgemm.cc``
(with that commit's headers) under another op name (``fdx_qgemm_ref``) and
the same flags as fdx/model/native.py; both run on the same inputs, in
alternation, ``--rounds`` times, best of each.  The machine is shared, so
read the **ratios** (new/old speed).  Every output is also checked to be
bit-identical between the two kernels (the batch-invariance contract pins
each element's float sequence, so a faster kernel must give the same bits).

    PYTHONPATH=. .venv/bin/python bench/bench_qgemm.py [--ref HEAD] [--rows 1,4,32,64,512] [--rounds 5]

A kernel that changes the bits on purpose (issue 27's two-level
activations) runs with ``--bits-may-differ``.  On a loaded machine
``--cpu-time`` times process CPU time instead of wall time (meant with
``OMP_NUM_THREADS=1``: time slices given to other processes do not count).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np
from ref_ops import op_source

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (name, K, N, ggml type) of the model's matmuls (SmolLM2-135M-like: Q4_1, lm_head Q8_0)
SHAPES = (
    ("qkv", 576, 960, 3),
    ("o", 576, 576, 3),
    ("gate_up", 576, 3072, 3),
    ("down", 1536, 576, 3),
    ("lm_head", 576, 49152, 8),
)


def load_ref_op(ref: str) -> Any:
    """``fdx_qgemm`` as commit ``ref`` had it, built as op ``fdx_qgemm_ref``."""
    from fdx.model import native

    import paddle  # noqa: F401  (cpp_extension needs it imported)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from paddle.utils import cpp_extension

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout

    isa = native.cpu_isa()
    if isa is None:
        sys.exit("no AVX-512F / AVX2+FMA+F16C here: nothing to compare")
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    build = os.path.join(native.cache_dir(), "qgemm-ref", f"{isa}-{sha}")
    os.makedirs(build, exist_ok=True)
    for h in native.HEADERS:
        with open(os.path.join(build, h), "w") as f:
            f.write(show(f"fdx/csrc/{h}"))
    src = op_source(show, "qgemm.cc")
    # another op name and no fdx::qgemm / fdx::qgemm_kernels symbol (the loaded fdx ops define them)
    src = src.replace("PD_BUILD_OP(fdx_qgemm)", "PD_BUILD_OP(fdx_qgemm_ref)")
    src = src.replace("PD_BUILD_OP(fdx_qgemm_dot)", "PD_BUILD_OP(fdx_qgemm_ref_dot)")
    src = re.sub(r"void fdx::qgemm\(", "static void qgemm_ref_impl(", src)
    src = src.replace("fdx::qgemm(x.data", "qgemm_ref_impl(x.data")
    src = re.sub(r"void fdx::qgemm_kernels\(", "static void qgemm_ref_kernels(", src)
    src = src.replace("fdx::qgemm_kernels(out", "qgemm_ref_kernels(out")
    path = os.path.join(build, "qgemm_ref.cc")
    with open(path, "w") as f:
        f.write(src)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cpp_extension.load(
            name=f"fdx_qgemm_ref_{isa}_{sha}",
            sources=[path],
            extra_cxx_cflags=list(native.CFLAGS + native.ISA_CFLAGS[isa]),
            extra_ldflags=native._ldflags(),
            extra_include_paths=[build],
            build_directory=build,
            verbose=False,
        )


def random_gguf(rng: np.random.Generator, N: int, K: int, qtype: int) -> np.ndarray:
    """Random raw GGUF rows of a Q4_1 / Q8_0 tensor (valid fp16 scales)."""
    nb = K // 32
    d = rng.uniform(0.001, 0.02, size=(N, nb)).astype(np.float16)
    if qtype == 8:
        q = rng.integers(-127, 128, size=(N, nb, 32), dtype=np.int8)
        raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=2)
    else:
        m = rng.uniform(-0.1, 0.1, size=(N, nb)).astype(np.float16)
        packed = rng.integers(0, 256, size=(N, nb, 16), dtype=np.uint8)
        raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), packed], axis=2)
    return raw.reshape(N, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="HEAD", help="commit whose qgemm.cc is the baseline")
    ap.add_argument("--rows", default="1,4,32,64,512")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--rounds", type=int, default=5, help="alternations; best of each side")
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per timing (repeats the call)")
    ap.add_argument("--bits-may-differ", action="store_true", help="report differing outputs, do not fail on them")
    ap.add_argument("--cpu-time", action="store_true", help="time process CPU time (with OMP_NUM_THREADS=1)")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter

    import paddle

    from fdx.model import native
    from fdx.model.packed_weights import pack_gguf

    new = native.load_ops()
    if new is None:
        sys.exit("fdx native ops did not load")
    old = load_ref_op(args.ref)
    print(f"machine: {os.cpu_count()} cores (shared), OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
          f"kernel set: {native.describe()}; baseline: {args.ref}")
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    want = set(args.shapes.split(","))

    def timed(fn: Any, reps: int) -> float:
        t = clock()
        for _ in range(reps):
            fn()
        return (clock() - t) / reps

    print(f"{'shape':8s} {'K':>5s} {'N':>6s} {'M':>4s} {'old GMAC/s':>11s} {'new GMAC/s':>11s} {'new/old':>8s}  bits")
    all_same = True
    for name, K, N, qtype in SHAPES:
        if name not in want:
            continue
        p = pack_gguf(random_gguf(rng, N, K, qtype), qtype)
        w = paddle.to_tensor(p.data)
        for M in rows:
            x = paddle.to_tensor((rng.standard_normal((M, K)) * rng.uniform(0.1, 4, size=(M, 1))).astype(np.float32))
            f_old = lambda: old.fdx_qgemm_ref(x, w, p.kind, p.n_out)  # noqa: E731
            f_new = lambda: new.fdx_qgemm(x, w, p.kind, p.n_out)  # noqa: E731
            a, b = f_old().numpy(), f_new().numpy()
            same = a.tobytes() == b.tobytes()
            all_same &= same
            one = max(timed(f_old, 1), 1e-6)
            reps = max(1, int(args.min_time / one))
            best = {"old": float("inf"), "new": float("inf")}
            for k in range(args.rounds):
                for side in (("old", "new") if k % 2 == 0 else ("new", "old")):
                    best[side] = min(best[side], timed(f_old if side == "old" else f_new, reps))
            mac = M * K * N / 1e9
            print(f"{name:8s} {K:5d} {N:6d} {M:4d} {mac / best['old']:11.1f} {mac / best['new']:11.1f} "
                  f"{best['old'] / best['new']:8.2f}  {'same' if same else 'DIFFER'}", flush=True)
    print("outputs bit-identical old vs new: " + ("yes" if all_same else "NO"))
    if not all_same and not args.bits_may_differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
