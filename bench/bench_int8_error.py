"""What int8 schemes cost in accuracy, simulated on the real model: top-1
agreement with float32, teacher-forced on the parity prompts (the positions
of tests/test_int8_accuracy.py), for fdx's int8 and for the schemes a
faster AMX path would need.

The float32 runner runs with every matmul's input (and, for the ``w8``
schemes, its weights) rounded through an int8 grid first, then float32
maths: this models the quantization error, not the kernels' summation order
(which moves results by float32 rounding only).  Schemes:

* ``a8-block``: activations in 32-element blocks, one scale each (absmax /
  127, round to nearest) -- fdx's int8 mode today (its weights are the
  GGUF's Q4_1 / Q8_0 blocks, exactly what float32 dequantizes, so this is
  all of its error);
* ``a8-row``: one activation scale per row (token): the int8 sums of a row
  could stay integer across the blocks of K except for the weights' block
  scales -- an epilogue of 3 operations a block instead of 4 on the AMX path;
* ``w8a8``: one activation scale per row and the weights requantized to int8
  with one scale per output channel: int32 sums over all of K, one epilogue
  per output (what AMX runs at full speed, as vLLM's bf16 does), at 1 byte a
  weight instead of Q4_1's 0.625 (single-stream decode reads 1.6x the bytes).

    PYTHONPATH=. .venv/bin/python bench/bench_int8_error.py [--schemes a8-block,a8-row,w8a8] [--tokens 64] [--only down]
        [--kv-cache-dtype bfloat16]

Prints top-1 agreement and mean |delta logprob| of float32's token per scheme.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

SCHEMES = ("none", "a8-block", "a8-row", "w8a8", "a8-center", "a8-block16", "a8-mu", "a8-med", "a8-2digit")
MATMULS = ("qkv", "o", "gate_up", "down", "lm_head")


def fake_quant_rows(x: np.ndarray, block: int) -> np.ndarray:
    """x [M, K] through an int8 grid: one scale per ``block`` columns of a row
    (``block`` = K: per row), absmax / 127, round to nearest."""
    M, K = x.shape
    xb = x.reshape(M, K // block, block)
    d = np.abs(xb).max(-1, keepdims=True) / 127.0
    q = np.where(d > 0, np.rint(xb / np.where(d > 0, d, 1.0)), 0.0)
    return (q * d).reshape(M, K).astype(np.float32)


def fake_quant_centered(x: np.ndarray, block: int) -> np.ndarray:
    """x [M, K] through a centred int8 grid per ``block`` columns: c = (max +
    min) / 2, d = (max - min) / 254, x ~ c + d * q with q in [-127, 127]."""
    M, K = x.shape
    xb = x.reshape(M, K // block, block)
    hi, lo = xb.max(-1, keepdims=True), xb.min(-1, keepdims=True)
    c = (hi + lo) / 2
    d = (hi - lo) / 254.0
    q = np.where(d > 0, np.rint((xb - c) / np.where(d > 0, d, 1.0)), 0.0)
    return (c + q * d).reshape(M, K).astype(np.float32)


def per_channel_int8(w: np.ndarray) -> np.ndarray:
    """w [K, N] through an int8 grid with one scale per output column."""
    s = np.abs(w).max(0, keepdims=True) / 127.0
    return (np.rint(w / np.where(s > 0, s, 1.0)) * s).astype(np.float32)


def schemes_by_matmul(scheme: str) -> dict[str, str]:
    """The base scheme of each matmul: ``scheme`` for all of them, or a mix
    like ``qkv=a8-center/down=a8-2digit`` (the matmuls it does not name:
    ``a8-block``).  SystemExit naming the choices on an unknown part."""
    mix = "=" in scheme
    out = dict.fromkeys(MATMULS, "a8-block")
    for part in scheme.split("/") if mix else [f"qkv={scheme}"]:
        m, _, base = part.partition("=")
        if m not in MATMULS or base not in SCHEMES:
            sys.exit(f"unknown scheme {part if mix else scheme!r}: a scheme is one of {', '.join(SCHEMES)}, or a "
                     f"mix like qkv=a8-center/down=a8-2digit over the matmuls {', '.join(MATMULS)}")
        out[m] = base
    return out if mix else dict.fromkeys(MATMULS, scheme)


CALIBRATION = ["Tell me about the history of the Roman Empire.", "How do I sort a list in Python?"]


def calibrate(runner: Any) -> dict[tuple[int, str], np.ndarray]:
    """Every matmul input's rows over the calibration prompts (each with its
    greedy 32 tokens, teacher-forced), by (id of the layer, which matmul)."""
    from runnerutil import run_greedy
    from test_architectures import teacher_forced

    from fdx.model import llama
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CALIBRATION]
    seqs = [p + g for p, g in zip(prompts, run_greedy(runner, prompts, 32))]
    rows: dict[tuple[int, str], list[np.ndarray]] = {}
    lin0, head0 = llama.CPUKernels.linear, llama.CPUKernels.lm_head

    def linear(self: Any, h: Any, layer: Any, which: str) -> Any:
        rows.setdefault((id(layer), which), []).append(h.numpy())
        return lin0(self, h, layer, which)

    def lm_head(self: Any, h: Any) -> Any:
        rows.setdefault((0, "lm_head"), []).append(h.numpy())
        return head0(self, h)

    llama.CPUKernels.linear, llama.CPUKernels.lm_head = linear, lm_head  # type: ignore[method-assign]
    try:
        for sq in seqs:
            teacher_forced(runner, sq[:1], sq[1:])
    finally:
        llama.CPUKernels.linear, llama.CPUKernels.lm_head = lin0, head0  # type: ignore[method-assign]
    return {k: np.concatenate(v, 0) for k, v in rows.items()}


def install(runner: Any, scheme: str, only: set[str], calib: dict | None = None) -> Callable[[], None]:
    """Wrap the float32 runner's matmuls (CPUKernels.linear, lm_head; those
    named in ``only``) with ``scheme``'s rounding; returns the undo."""
    import paddle

    from fdx.model import llama

    ops = runner.model.ops
    lin0, head0 = llama.CPUKernels.linear, llama.CPUKernels.lm_head
    dense: dict[int, paddle.Tensor] = {}

    def weights_t(q: tuple[Any, int]) -> paddle.Tensor:
        """The GGUF blocks' float32 weights [K, N], requantized per channel (cached)."""
        key = id(q[0])
        if key not in dense:
            K = int(q[0].shape[1]) * 32 // (18 if q[1] == 2 else 20 if q[1] == 3 else 34 if q[1] == 8 else 0)
            eye = paddle.to_tensor(np.eye(K, dtype=np.float32))
            w = ops.fdx_qgemv(eye, q[0], q[1]).numpy()  # eye @ W^T = W^T: [K, N]
            dense[key] = paddle.to_tensor(per_channel_int8(w))
        return dense[key]

    base_of = schemes_by_matmul(scheme)

    def act(h: paddle.Tensor, key: tuple[int, str]) -> paddle.Tensor:
        x = h.numpy()
        base = base_of[key[1]]
        if base == "a8-2digit":  # a 16-bit grid per block: Q = rint(x * 32258 / max)
            xb = x.reshape(x.shape[0], -1, 32)
            d = np.abs(xb).max(-1, keepdims=True) / 32258.0
            q = np.where(d > 0, np.rint(xb / np.where(d > 0, d, 1.0)), 0.0)
            return paddle.to_tensor((q * d).reshape(x.shape).astype(np.float32))
        if base in ("a8-mu", "a8-med"):
            c = calib[key]
            mu = (np.median(c, 0) if base == "a8-med" else c.mean(0)).astype(np.float32)
            return paddle.to_tensor(fake_quant_rows(x - mu, 32) + mu)
        if base == "a8-center":
            return paddle.to_tensor(fake_quant_centered(x, 32))
        return paddle.to_tensor(fake_quant_rows(x, {"a8-block": 32, "a8-block16": 16}.get(base, x.shape[1])))

    def linear(self: Any, h: paddle.Tensor, layer: Any, which: str) -> paddle.Tensor:
        if which not in only or base_of[which] == "none":
            return lin0(self, h, layer, which)
        if base_of[which] == "w8a8":
            return paddle.matmul(act(h, (id(layer), which)), weights_t(getattr(layer, llama._LINEAR[which][1])))
        return lin0(self, act(h, (id(layer), which)), layer, which)

    def lm_head(self: Any, h: paddle.Tensor) -> paddle.Tensor:
        if "lm_head" not in only or base_of["lm_head"] == "none":
            return head0(self, h)
        if base_of["lm_head"] == "w8a8":
            return paddle.matmul(act(h, (0, "lm_head")), weights_t(self.model.q_lm_head))
        return head0(self, act(h, (0, "lm_head")))

    llama.CPUKernels.linear, llama.CPUKernels.lm_head = linear, lm_head  # type: ignore[method-assign]

    def undo() -> None:
        llama.CPUKernels.linear, llama.CPUKernels.lm_head = lin0, head0  # type: ignore[method-assign]

    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="a8-block,a8-row,w8a8",
                    help=f"comma-separated; choices: {', '.join(SCHEMES)}, or a per-matmul mix")
    ap.add_argument("--tokens", type=int, default=64, help="float32 greedy tokens per prompt")
    ap.add_argument("--only", default=",".join(MATMULS),
                    help="the matmuls the scheme applies to (the others stay float32), e.g. --only down")
    ap.add_argument("--kv-cache-dtype", default="float32",
                    help="the KV pool of the runner the schemes run on (bfloat16: what int8 serves with)")
    args = ap.parse_args()
    schemes = args.schemes.split(",")
    only = set(args.only.split(","))
    if only - set(MATMULS):
        sys.exit(f"unknown matmul(s) {sorted(only - set(MATMULS))}; choices: {', '.join(MATMULS)}")
    for s in schemes:
        schemes_by_matmul(s)  # refuses an unknown one up front

    from test_architectures import teacher_forced
    from test_int8_accuracy import float32_references, top1_agreement

    fp32, seqs, want = float32_references(args.tokens)
    assert fp32.model.q_lm_head is not None and fp32.model.ops is not None, "needs the GGUF blocks and fdx's ops"
    margins = np.concatenate([np.diff(np.sort(w, -1)[:, -2:], axis=-1)[:, 0] for w in want])
    under = ", ".join(f"< {t}: {int((margins < t).sum())}" for t in (0.05, 0.1, 0.2, 0.5))
    print(f"float32's top-2 logit margin: {under} of {len(margins)} positions (near-ties flip under small errors)")
    print(f"matmuls rounded: {', '.join(m for m in MATMULS if m in only)}")
    print(f"KV pool of the simulated runs: {args.kv_cache_dtype}")
    sim = fp32
    if args.kv_cache_dtype != "float32":
        from fdx.config import make_config
        from fdx.model import runner as runner_mod
        from fdx.plugins.hardware.cpu import CPUDevice

        # float32 compute refuses a bfloat16 pool (it is the exact path); the simulation wants one
        pool0 = runner_mod.kv_pool_dtype
        runner_mod.kv_pool_dtype = lambda *a: args.kv_cache_dtype  # type: ignore[assignment]
        try:
            sim = runner_mod.PaddleModelRunner(make_config(num_kv_blocks=200, max_model_len=1024, dtype="float32"),
                                               CPUDevice())
        finally:
            runner_mod.kv_pool_dtype = pool0
    print(f"{'scheme':10s} {'top-1':>14s} {'mean |dlogprob|':>16s}")
    calib = calibrate(sim) if any("a8-mu" in s or "a8-med" in s for s in schemes) else None
    for scheme in schemes:
        undo = install(sim, scheme, only, calib)
        try:
            got = [teacher_forced(sim, s[:1], s[1:]) for s in seqs]
        finally:
            undo()
        hits, total, dlp = top1_agreement(want, got)
        print(f"{scheme:10s} {hits:5d}/{total} {100 * hits / total:5.1f}% {dlp:16.4f}", flush=True)


if __name__ == "__main__":
    main()
