"""fdx_paged_attention old vs new, side by side in one process.

The "old" kernel is a reference revision's csrc/paged_attention.cc (default
``HEAD``, the last commit, so a working-tree change is measured against it;
``--ref``), read with ``git show``, renamed (op
``fdx_paged_attention_ref``, its C++ symbols in another namespace) and
JIT-built with the flags fdx/model/native.py uses; the "new" one is this
checkout's fdx ops.  Each case (one 512-token prefill, a decode step of 1
sequence at context 256, a decode step of 32 sequences at context ~300; the
geometry of SmolLM2-135M: 9 query heads, 3 kv heads, head size 64, block
size 16) is timed old and new in alternation, ``--rounds`` times, best of
each; the machine is shared, so read the **ratios**.  The last column says
whether the two kernels' outputs and caches are bit-identical for the case.

    .venv/bin/python bench/bench_attention.py [--ref HEAD] [--rounds 7] [--kv-dtype bfloat16] [--layers 30]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import re
import subprocess
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from ref_ops import op_source  # noqa: E402

H, KV, D, BS = 9, 3, 64, 16


def build_ref(ref: str) -> object:
    """The reference revision's attention op, renamed so it loads beside fdx's."""
    from fdx.model import native

    git = lambda path: subprocess.run(["git", "-C", ROOT, "show", f"{ref}:{path}"], check=True,  # noqa: E731
                                      capture_output=True, text=True).stdout
    src = op_source(git, "paged_attention.cc")
    header = git("fdx/csrc/kernels.h").replace("#pragma once", "")
    header = re.sub(r"\bnamespace fdx\b", "namespace fdx_ref", header)
    src = src.replace('#include "kernels.h"', header)
    # every fdx name the revision's source uses is its own (its kernels.h, its helpers), but the SIMD layer
    src = re.sub(r"\bfdx::(?!simd\b)", "fdx_ref::", re.sub(r"\bnamespace fdx\b", "namespace fdx_ref", src))
    src = src.replace("fdx_paged_attention", "fdx_paged_attention_ref")
    src = re.sub(r"\bPagedAttention", "RefPagedAttention", src)
    key = hashlib.sha256((src + git("fdx/csrc/simd_math.h")).encode()).hexdigest()[:12]
    d = os.path.join(native.cache_dir(), "bench", f"attn-ref-{key}")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "paged_attention_ref.cc")
    with open(path, "w") as f:
        f.write(src)
    with open(os.path.join(d, "simd_math.h"), "w") as f:  # the revision's own SIMD layer, next to the source
        f.write(git("fdx/csrc/simd_math.h"))
    isa = native.cpu_isa()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from paddle.utils import cpp_extension

        return cpp_extension.load(name=f"fdx_attn_ref_{key}", sources=[path],
                                  extra_cxx_cflags=list(native.CFLAGS + native.ISA_CFLAGS[isa]),
                                  extra_ldflags=native._ldflags(),
                                  extra_include_paths=[d], build_directory=d, verbose=False)


def case(seq_pos: list[tuple[int, int]], rng: np.random.Generator, kv_dtype: str = "float32", layers: int = 1) -> dict:
    """Inputs for one call: tokens (seq, pos); every sequence's cache
    filled with random keys/values up to its largest position, blocks shuffled.
    ``layers`` copies of the cache for each side (old, new): the timed calls
    go round them, as a step goes through its layers' caches (a working set
    the size of a real step's comes from memory, not from the L2)."""
    import paddle

    S = max(s for s, _ in seq_pos) + 1
    n = [0] * S
    for s, p in seq_pos:
        n[s] = max(n[s], p + 1)
    nblk = [(x + BS - 1) // BS for x in n]
    NB = sum(nblk) + 1
    perm = rng.permutation(NB)
    MAXB = max(nblk)
    tables = np.full((S, MAXB), -1, np.int32)
    k = 0
    for s in range(S):
        for j in range(nblk[s]):
            tables[s, j] = perm[k]
            k += 1
    P = max(n) + 1
    half = D // 2
    inv = 1.0 / (10000.0 ** (np.arange(half) * 2.0 / D))
    ang = np.arange(P)[:, None] * inv[None, :]
    rope = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    T = len(seq_pos)
    cache = rng.standard_normal((2, NB, KV, BS, D)).astype(np.float32)

    def copies() -> list:
        return [paddle.to_tensor(cache.copy()).astype(kv_dtype) for _ in range(layers)]

    return dict(qkv=paddle.to_tensor(rng.standard_normal((T, (H + 2 * KV) * D)).astype(np.float32)),
                caches=[copies(), copies()], rope=paddle.to_tensor(rope),
                meta=paddle.to_tensor(np.array(seq_pos, np.int32)), tables=paddle.to_tensor(tables))


def timed(op: object, c: dict, caches: list, reps: int) -> float:
    rest = (c["rope"], c["meta"], c["tables"], H, KV, BS, float(D) ** -0.5)
    op(c["qkv"], caches[0], *rest)  # warm
    t = time.perf_counter()
    for i in range(reps):
        out = op(c["qkv"], caches[i % len(caches)], *rest)
    out.numpy()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="HEAD", help="git revision of the old kernel")
    ap.add_argument("--rounds", type=int, default=7, help="alternations; best of each side")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"), help="the KV cache's dtype")
    ap.add_argument("--layers", type=int, default=1,
                    help="caches per side, gone round by the timed calls (30: a SmolLM2 step's working set)")
    args = ap.parse_args()

    from fdx.model import native

    new = native.load_ops()
    if new is None:
        sys.exit("fdx's native ops are not loaded here")
    ref = build_ref(args.ref)
    # the sliding window, 0 (none), to an op that takes one (a revision before it has no such argument)
    no_window = lambda op: (lambda *a: op(*a, 0)) if "window" in inspect.signature(op).parameters else op  # noqa: E731
    old_op, new_op = no_window(ref.fdx_paged_attention_ref), no_window(new.fdx_paged_attention)
    print(f"machine: {os.cpu_count()} cores (shared), kernel set: {native.loaded_isa()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, old = {args.ref}, KV cache {args.kv_dtype}, "
          f"{args.layers} cache(s) a side")
    rng = np.random.default_rng(0)
    mk = lambda seq_pos: case(seq_pos, rng, args.kv_dtype, args.layers)  # noqa: E731
    cases = {
        "prefill 512 (T=512, 1 seq)": (mk([(0, p) for p in range(512)]), 3),
        "decode c=1 ctx 256": (mk([(0, 255)]), 300),
        "decode c=32 ctx ~300": (mk([(s, 285 + s) for s in range(32)]), 20),
        "decode c=1 ctx 80": (mk([(0, 79)]), 300),
        "decode c=32 ctx ~80": (mk([(s, 64 + s) for s in range(32)]), 50),
        # a c=32 run's mixed step: 32 decoding sequences and 3 prompts' chunks of 160
        "mixed: 3 x 160 prefill + 32 decode": (mk([(s, 285 + s) for s in range(32)]
                                                  + [(32 + s, p) for s in range(3) for p in range(160)]), 5),
    }
    print(f"{'case':30s} {'old':>10s} {'new':>10s} {'old/new':>8s} {'same bits':>10s}")
    for name, (c, reps) in cases.items():
        bits = lambda x: x.astype("float32").numpy().view(np.uint32)  # noqa: E731
        fresh = [bits(x[0]) for x in c["caches"]]
        outs = [op(c["qkv"], x[0], c["rope"], c["meta"], c["tables"], H, KV, BS, float(D) ** -0.5).numpy()
                for op, x in ((old_op, c["caches"][0]), (new_op, c["caches"][1]))]
        same = np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)) and np.array_equal(
            bits(c["caches"][0][0]), bits(c["caches"][1][0]))
        assert np.array_equal(fresh[0], fresh[1])
        best_old = best_new = float("inf")
        for _ in range(args.rounds):
            best_old = min(best_old, timed(old_op, c, c["caches"][0], reps))
            best_new = min(best_new, timed(new_op, c, c["caches"][1], reps))
        print(f"{name:30s} {best_old * 1e6:8.0f}us {best_new * 1e6:8.0f}us {best_old / best_new:7.2f}x "
              f"{'yes' if same else 'no':>10s}", flush=True)


if __name__ == "__main__":
    main()
