"""The loaded kernel set against a plain scalar C++ reference of the canonical order.

tests/csrc/scalar_reference.cc computes RMSNorm, SwiGLU, paged attention and
the fp32 GEMV, the float32 GEMM and the float32 mixture-of-experts block one float at a time in the order fdx/csrc/simd_math.h defines
for every kernel set (16 lanes, one fixed tree); it is built with the ops'
own flags (fdx/model/native.py) and every output must match the loaded set
bit for bit.  The int8 and bf16 GEMMs have their exact numpy references in
tests/test_native_ops.py (``test_qgemm_bits_match_the_fma_sequence``,
``test_bf16_gemm_bits_match_the_fma_sequence``).  An AVX2-only CPU cannot
run the AVX-512 set, but it checks the semantics that set is held to;
tests/test_isa_bits.py compares the two sets directly where both run.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from fdx.model import native
from isa_bits_probe import block_tables, rope_table

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "scalar_reference.cc")


@pytest.fixture(scope="module")
def ops() -> Any:
    o = native.load_ops() if native.cpu_isa() is not None else None
    if o is None:
        pytest.skip("fdx native ops not loaded here (no AVX-512F or AVX2+FMA+F16C, or disabled)")
    return o


@pytest.fixture(scope="module")
def ref(ops: Any) -> Any:
    return native._build(native.loaded_isa(), sources=(REFERENCE,), name="fdx_ref")  # type: ignore[arg-type]


def _same(got: Any, want: Any, what: str) -> None:
    g, w = np.asarray(got), np.asarray(want)
    assert g.shape == w.shape, what
    n = int((g.view(np.uint32) != w.view(np.uint32)).sum())
    assert n == 0, f"{what}: {n} of {g.size} elements differ from the scalar reference ({native.describe()})"


@pytest.mark.parametrize("H", [576, 5, 24, 579])
def test_add_rms_norm_and_swiglu_match_the_reference(ops: Any, ref: Any, H: int) -> None:
    import paddle

    rng = np.random.default_rng(H)
    x = paddle.to_tensor((rng.standard_normal((5, H)) * 3).astype(np.float32))
    r = paddle.to_tensor(rng.standard_normal((5, H)).astype(np.float32))
    w = paddle.to_tensor(rng.standard_normal(H).astype(np.float32))
    none = paddle.zeros([0], "float32")
    for res in (r, none):
        got, want = ops.fdx_add_rms_norm(x, res, w, 1e-5), ref.fdx_ref_add_rms_norm(x, res, w, 1e-5)
        _same(got[0].numpy(), want[0].numpy(), f"rms norm H={H}")
        _same(got[1].numpy(), want[1].numpy(), f"residual H={H}")
    g = paddle.to_tensor((rng.standard_normal((5, 2 * H)) * 6).astype(np.float32))
    _same(ops.fdx_swiglu(g).numpy(), ref.fdx_ref_swiglu(g).numpy(), f"swiglu F={H}")


@pytest.mark.parametrize("window", [0, 7, 50])
@pytest.mark.parametrize("H,KV,D,BS,lens", [(9, 3, 64, 16, (300, 37, 5)), (8, 2, 36, 5, (70, 9)), (4, 4, 20, 3, (17,))])
def test_paged_attention_matches_the_reference(ops: Any, ref: Any, H: int, KV: int, D: int, BS: int,
                                               lens: tuple[int, ...], window: int) -> None:
    """Prefill of every sequence in one call, then a decode token each;
    head sizes 64 (SmolLM2), 36 and 20 (tails of both lane counts); no
    sliding window, and windows of 7 and 50 keys."""
    import paddle

    rng = np.random.default_rng(D)
    W = (H + 2 * KV) * D
    tables, NB = block_tables(rng, tuple(n + 1 for n in lens), BS)  # room for a decode token each
    rope = paddle.to_tensor(rope_table(max(lens) + 1, D))
    caches = [paddle.zeros([2, NB, KV, BS, D], "float32") for _ in range(2)]
    tb = paddle.to_tensor(tables)
    for meta in ([(s, p) for s, n in enumerate(lens) for p in range(n)], [(s, n) for s, n in enumerate(lens)]):
        qkv = paddle.to_tensor(rng.standard_normal((len(meta), W)).astype(np.float32))
        mt = paddle.to_tensor(np.array(meta, np.int32))
        got = ops.fdx_paged_attention(qkv, caches[0], rope, mt, tb, H, KV, BS, float(D) ** -0.5, window)
        want = ref.fdx_ref_paged_attention(qkv, caches[1], rope, mt, tb, H, KV, BS, float(D) ** -0.5, window)
        _same(got.numpy(), want.numpy(), f"attention D={D}, {len(meta)} tokens")
        _same(caches[0].numpy(), caches[1].numpy(), f"cache D={D}")


@pytest.mark.parametrize("qtype", [2, 3, 8])
def test_qgemv_matches_the_reference(ops: Any, ref: Any, qtype: int) -> None:
    import paddle

    rng = np.random.default_rng(qtype)
    N, K = 45, 576
    nb = K // 32
    d = rng.uniform(0.005, 0.05, size=(N, nb)).astype(np.float16)
    body = rng.integers(0, 256, size=(N, nb, 32 if qtype == 8 else 16), dtype=np.uint8)
    parts = [d[..., None].view(np.uint8)]
    if qtype == 3:
        parts.append(rng.uniform(-0.3, 0.3, size=(N, nb)).astype(np.float16)[..., None].view(np.uint8))
    raw = paddle.to_tensor(np.concatenate(parts + [body], axis=2).reshape(N, -1))
    for M in (1, 3, 6):
        x = paddle.to_tensor(rng.standard_normal((M, K)).astype(np.float32))
        _same(ops.fdx_qgemv(x, raw, qtype).numpy(), ref.fdx_ref_qgemv(x, raw, qtype).numpy(), f"qgemv M={M}")


def test_fgemm_and_moe_match_the_reference(ops: Any, ref: Any) -> None:
    """fdx_fgemm (every row tile, column tails of both lane counts) and
    fdx_moe in float32 (top-2 renormalised, top-3 not, a rank's experts)."""
    import paddle

    rng = np.random.default_rng(25)
    for M, K, N in ((1, 64, 8), (3, 96, 1100), (4, 32, 37), (5, 64, 40), (7, 96, 37), (70, 128, 130)):
        x = paddle.to_tensor(rng.standard_normal((M, K)).astype(np.float32))
        w = paddle.to_tensor((rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32))
        _same(ops.fdx_fgemm(x, w).numpy(), ref.fdx_ref_fgemm(x, w).numpy(), f"fgemm M={M} K={K} N={N}")
    E, H, F = 8, 128, 64
    t = lambda a: paddle.to_tensor(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    router = t(rng.standard_normal((H, E)) / np.sqrt(H))
    gu = [t(rng.standard_normal((H, 2 * F)) / np.sqrt(H)) for _ in range(E)]
    dn = [t(rng.standard_normal((F, H)) / np.sqrt(F)) for _ in range(E)]
    for T in (1, 9, 40):
        h = t(rng.standard_normal((T, H)) * 2)
        for k, renorm, first, n in ((2, True, 0, E), (3, False, 0, E), (2, True, 3, 4)):
            got = ops.fdx_moe(h, router, gu[first : first + n], dn[first : first + n], 0, E, k, renorm, first)
            want = ref.fdx_ref_moe(h, router, gu[first : first + n], dn[first : first + n], E, k, renorm, first)
            np.testing.assert_array_equal(got[1].numpy(), want[1].numpy())
            _same(got[0].numpy(), want[0].numpy(), f"moe T={T} k={k} first={first}")
