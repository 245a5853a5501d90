"""fdx's C++ CPU ops (csrc/, loaded by fdx/model/native.py): kernel-set
choice and fallback, each op against a numpy reference (with lengths that
leave SIMD tails for both the 8- and the 16-lane sets), and the real model's
native forward against its pure-Paddle forward.

The op and model tests run whichever kernel set this CPU gets (AVX2 on an
AVX2-only CPU, AVX-512 elsewhere; ``FDX_NATIVE_ISA=avx2`` tests the AVX2 set
on an AVX-512 CPU) and are skipped only on a CPU with neither.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from typing import Any, Iterator

import numpy as np
import pytest

from fdx.model import native

AVX512_FLAGS = "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw\n"
AVX2_FLAGS = "flags\t\t: fpu sse2 avx avx2 fma f16c\n"
NO_FMA_FLAGS = "flags\t\t: fpu sse2 avx avx2 f16c\n"

needs_simd = pytest.mark.skipif(native.cpu_isa() is None, reason="CPU has neither AVX-512F nor AVX2+FMA+F16C")


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Any:
    """native.load_ops as if never called in this process (restored after)."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_ops", None)
    monkeypatch.setattr(native, "_isa", None)
    return native


# --------------------------------------------------------------------------
# kernel-set choice and fallback
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "env", "want"),
    [
        (AVX512_FLAGS, None, "avx512"),
        (AVX2_FLAGS, None, "avx2"),
        (NO_FMA_FLAGS, None, None),
        ("flags\t\t: fpu sse2\n", None, None),
        (AVX512_FLAGS, "avx2", "avx2"),
        (AVX2_FLAGS, "avx512", None),
    ],
)
def test_cpu_isa_choice(monkeypatch: pytest.MonkeyPatch, flags: str, env: str | None, want: str | None) -> None:
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    if env is None:
        monkeypatch.delenv("FDX_NATIVE_ISA", raising=False)
    else:
        monkeypatch.setenv("FDX_NATIVE_ISA", env)
    assert native.cpu_isa() == want


def test_unknown_isa_name_lists_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FDX_NATIVE_ISA", "sse9")
    with pytest.raises(ValueError, match=r"avx2.*avx512"):
        native.cpu_isa()


def test_disabled_by_env(fresh_loader: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FDX_NATIVE_OPS", "0")
    assert fresh_loader.load_ops() is None
    assert fresh_loader.loaded_isa() is None


def test_cpu_without_simd_falls_back_with_one_line(
    fresh_loader: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("FDX_NATIVE_OPS", raising=False)
    monkeypatch.delenv("FDX_NATIVE_ISA", raising=False)
    monkeypatch.setattr(native, "_cpu_flags", lambda: NO_FMA_FLAGS)
    monkeypatch.setattr(native, "_build", lambda isa, **kw: pytest.fail("must not build without a kernel set"))
    with caplog.at_level(logging.INFO, logger="fdx.model"):
        assert fresh_loader.load_ops() is None
    lines = [r for r in caplog.records if r.name == "fdx.model"]
    assert len(lines) == 1 and "AVX2+FMA+F16C" in lines[0].getMessage()
    assert fresh_loader.loaded_isa() is None


def test_cache_key_separates_kernel_sets(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Builds for the two sets land in different cache folders (and modules)."""
    from fdx.model import ops_build

    seen: list[tuple[str, str, list[str]]] = []

    def fake_compile(module: str, sources: list[str], cflags: list[str], ldflags: list[str],
                     include_dirs: list[str], build_dir: str) -> str:
        seen.append((build_dir, module, cflags))
        return "module.so"

    monkeypatch.setenv("FDX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "PREBUILT", str(tmp_path / "pkg"))  # no install-time build to find
    monkeypatch.setattr(ops_build, "compile_op_library", fake_compile)
    monkeypatch.setattr(native, "_load_built", lambda build_dir, module: "module")
    native._build("avx512")
    native._build("avx2")
    (d512, n512, f512), (d2, n2, f2) = seen
    assert d512 != d2 and n512 != n2
    assert "avx512-" in d512 and "avx2-" in d2
    assert "-DFDX_EXPECT_AVX512" in f512 and "-mno-avx512f" in f2 and "-DFDX_EXPECT_AVX2" in f2


@needs_simd
def test_native_ops_load_on_this_cpu(caplog: pytest.LogCaptureFixture) -> None:
    import os

    if os.environ.get("FDX_NATIVE_OPS") == "0":
        pytest.skip("FDX_NATIVE_OPS=0")
    ops = native.load_ops()
    assert ops is not None, "native ops did not build on a CPU that has a kernel set"
    assert native.loaded_isa() == native.cpu_isa()
    for name in ("fdx_paged_attention", "fdx_qgemv", "fdx_qgemm", "fdx_add_rms_norm", "fdx_swiglu"):
        assert callable(getattr(ops, name))
    assert native.loaded_int8_dot() in ("vpdpbusd", "vpmaddubsw")
    assert native.describe().startswith(f"{native.loaded_isa()} kernel set") and native.loaded_int8_dot() in native.describe()
    # the bf16 GEMM uses vdpbf16ps exactly where the CPU has AVX512-BF16 (and the build targets it)
    with open("/proc/cpuinfo") as f:
        has_bf16 = " avx512_bf16" in f.read() and native.loaded_isa() == "avx512"
    assert native.loaded_bf16_dot() == ("vdpbf16ps" if has_bf16 else "fma")
    assert ("bf16: vdpbf16ps" if has_bf16 else "bf16: fma, no AVX512-BF16") in native.describe()


@needs_simd
def test_load_logs_one_line_naming_the_kernels(
    ops: Any, fresh_loader: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the extension cannot be loaded twice into one process: reuse the built module
    monkeypatch.setattr(native, "_build", lambda isa, **kw: ops)
    with caplog.at_level(logging.INFO, logger="fdx.model"):
        assert fresh_loader.load_ops() is not None
    lines = [r.getMessage() for r in caplog.records if r.name == "fdx.model"]
    assert len(lines) == 1, lines
    assert native.cpu_isa() in lines[0] and native.loaded_int8_dot() in lines[0] and "bf16: " in lines[0]


# --------------------------------------------------------------------------
# each op against numpy
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ops() -> Any:
    if native.cpu_isa() is None:
        pytest.skip("CPU has neither AVX-512F nor AVX2+FMA+F16C")
    o = native.load_ops()
    if o is None:
        pytest.skip("native ops disabled or not buildable here")
    return o


def _quantize(rng: np.random.Generator, N: int, K: int, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """Random GGUF rows of ``qtype`` and their dequantized fp32 matrix."""
    nb = K // 32
    d = rng.uniform(0.005, 0.05, size=(N, nb)).astype(np.float16)
    if qtype == 8:
        q = rng.integers(-128, 128, size=(N, nb, 32), dtype=np.int8)
        raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=2)
        deq = d.astype(np.float32)[..., None] * q.astype(np.float32)
    else:
        q = rng.integers(0, 16, size=(N, nb, 32), dtype=np.uint8)
        packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)  # byte i: weights i and i + 16
        if qtype == 3:
            m = rng.uniform(-0.3, 0.3, size=(N, nb)).astype(np.float16)
            raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), packed], axis=2)
            deq = d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None]
        else:
            raw = np.concatenate([d[..., None].view(np.uint8), packed], axis=2)
            deq = d.astype(np.float32)[..., None] * (q.astype(np.float32) - 8.0)
    return raw.reshape(N, -1), deq.reshape(N, K).astype(np.float32)


@pytest.mark.parametrize("qtype", [2, 3, 8])
@pytest.mark.parametrize("M", [1, 3, 6])
def test_qgemv_matches_dequantized_matmul(ops: Any, qtype: int, M: int) -> None:
    import paddle

    rng = np.random.default_rng(qtype * 10 + M)
    N, K = 37, 96
    raw, w = _quantize(rng, N, K, qtype)
    x = rng.standard_normal((M, K)).astype(np.float32)
    got = ops.fdx_qgemv(paddle.to_tensor(x), paddle.to_tensor(raw), qtype).numpy()
    want = (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _int8_reference(x: np.ndarray, raw: np.ndarray, qtype: int) -> np.ndarray:
    """The int8 scheme of fdx_qgemm in numpy: x quantized per 32-block to
    Q8 (float32 maths, as the kernel), exact integer block sums, float64 sum."""
    from fdx.model.packed_weights import blocks

    q, d, m = blocks(raw, qtype)
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    amax = np.abs(xb).max(axis=2)
    dx = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qx = np.rint(xb * inv[..., None]).astype(np.int64)
    sx = (dx * qx.sum(axis=2).astype(np.float32)).astype(np.float64)
    isum = np.einsum("nbk,mbk->mnb", q.astype(np.int64), qx)
    out = (isum * (d.astype(np.float64)[None] * dx.astype(np.float64)[:, None])).sum(axis=2)
    if m is not None:
        out += (m.astype(np.float64)[None] * sx[:, None]).sum(axis=2)
    return out


@pytest.mark.parametrize("qtype", [2, 3, 8])
@pytest.mark.parametrize("M", [1, 3, 6, 70])
def test_qgemm_matches_int8_reference(ops: Any, qtype: int, M: int) -> None:
    """N = 37 leaves a 5-column tail in the last group of 8."""
    import paddle

    from fdx.model.packed_weights import pack_gguf

    rng = np.random.default_rng(qtype * 100 + M)
    N, K = 37, 96
    raw, w = _quantize(rng, N, K, qtype)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block quantizes to scale 0
    p = pack_gguf(raw, qtype)
    got = ops.fdx_qgemm(paddle.to_tensor(x), paddle.to_tensor(p.data), p.kind, p.n_out).numpy()
    want = _int8_reference(x, raw, qtype)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    exact = x.astype(np.float64) @ w.T.astype(np.float64)  # int8 activations: ~1% of the scale
    assert float(np.abs(got - exact).max()) < 0.02 * float(np.abs(exact).max())


@pytest.mark.parametrize("qtype", [3, 8, "bf16"])
def test_qgemm_rows_are_batch_invariant(ops: Any, qtype: int | str) -> None:
    """Each output row is bit-identical whatever rows share the call: alone,
    in any slice (every tile position and tail size), and shuffled."""
    import paddle

    from fdx.model.packed_weights import pack_bf16, pack_gguf

    rng = np.random.default_rng(16 if qtype == "bf16" else qtype)
    N, K, M = 300, 128, 70
    if qtype == "bf16":
        p = pack_bf16((rng.standard_normal((N, K)) * 0.05).astype(np.float32))
    else:
        raw, _ = _quantize(rng, N, K, qtype)
        p = pack_gguf(raw, qtype)
    w = paddle.to_tensor(p.data)
    x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 10, size=(M, 1))).astype(np.float32)

    def run(rows: np.ndarray) -> np.ndarray:
        return ops.fdx_qgemm(paddle.to_tensor(np.ascontiguousarray(x[rows])), w, p.kind, p.n_out).numpy()

    full = run(np.arange(M))
    for size in (1, 2, 3, 5, 8, 33):
        for start in range(0, M - size, 11):
            np.testing.assert_array_equal(run(np.arange(start, start + size)), full[start : start + size])
    perm = rng.permutation(M)
    np.testing.assert_array_equal(run(perm), full[perm])


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c), correctly rounded, elementwise: a*b is exact in
    float64, the float64 sum's rounding error is recovered exactly (TwoSum)
    and breaks the one case float64 -> float32 double rounding gets wrong (a
    float64 sum that lands exactly halfway between two float32s)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    # halfway: s sits exactly between r and its float32 neighbour on s's side
    nb = np.where(s > r64, np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf))).astype(np.float64)
    tie = (s != r64) & ((r64 + nb) / 2 == s) & (err != 0)
    if tie.any():
        nudged = np.nextafter(s, np.where(err > 0, np.inf, -np.inf))
        r = np.where(tie, nudged.astype(np.float32), r)
    return r


def _qgemm_exact(x: np.ndarray, p: Any) -> np.ndarray:
    """fdx_qgemm's every bit in numpy: the kernel's quantize_row (d = max|x|
    * (1/127), q = rint(x * (127 / max|x|)), s = d * sum q, float32) and the
    BATCH INVARIANCE sequence of qgemm.cc, one block at a time in order:
    acc = fma(isum, dw*dx, acc), then (Q4) acc = fma(mw, sx, acc)."""
    from fdx.model.packed_weights import dequantize

    data = np.asarray(p.data)
    G, nb, _ = data.shape
    M, K = x.shape
    xb = x.reshape(M, nb, 32)
    amax = np.abs(xb).max(axis=2)
    dx = (amax * (np.float32(1) / np.float32(127))).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    qx = np.rint(xb * inv[..., None]).astype(np.int64)
    sx = (dx * qx.sum(axis=2).astype(np.float32)).astype(np.float32)
    if p.kind == 8:
        qw = data[:, :, :256].view(np.int8).reshape(G, nb, 8, 8, 4).transpose(0, 3, 1, 2, 4).reshape(G * 8, nb, 32)
        dw = data[:, :, 256:272].copy().view(np.float16).transpose(0, 2, 1).reshape(G * 8, nb).astype(np.float32)
        mw = None
    else:
        qs = data[:, :, :128].reshape(G, nb, 4, 8, 4)
        qw = np.stack([qs & 0x0F, qs >> 4], axis=4).transpose(0, 3, 1, 2, 4, 5).reshape(G * 8, nb, 32)
        dw = data[:, :, 128:144].copy().view(np.float16).transpose(0, 2, 1).reshape(G * 8, nb).astype(np.float32)
        mw = data[:, :, 144:160].copy().view(np.float16).transpose(0, 2, 1).reshape(G * 8, nb).astype(np.float32)
    isum = np.einsum("nbk,mbk->mnb", qw.astype(np.int64), qx).astype(np.float32)  # |isum| < 2^24: exact
    acc = np.zeros((M, G * 8), np.float32)
    for b in range(nb):
        acc = _fma32(isum[:, :, b], (dw[None, :, b] * dx[:, b, None]).astype(np.float32), acc)
        if mw is not None:
            acc = _fma32(np.broadcast_to(mw[None, :, b], acc.shape), np.broadcast_to(sx[:, b, None], acc.shape), acc)
    return acc[:, : p.n_out]


@pytest.mark.parametrize("qtype", [2, 3, 8])
def test_qgemm_bits_match_the_fma_sequence(ops: Any, qtype: int) -> None:
    """Every output bit is the documented float sequence (so a faster kernel
    cannot drift from the one before it): all row tiles (M = 1..9 and 70,
    tails of 1-3 rows), an odd number of column groups with a 5-column tail,
    more blocks than one integer pass (K = 800: 25 blocks), zero blocks."""
    import paddle

    from fdx.model.packed_weights import pack_gguf

    rng = np.random.default_rng(1000 + qtype)
    N, K = 173, 800
    raw, _ = _quantize(rng, N, K, qtype)
    p = pack_gguf(raw, qtype)
    w = paddle.to_tensor(p.data)
    for M in (1, 2, 3, 4, 5, 9, 70):
        x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 30, size=(M, 1))).astype(np.float32)
        x[0, 64:96] = 0.0
        got = ops.fdx_qgemm(paddle.to_tensor(x), w, p.kind, p.n_out).numpy()
        want = _qgemm_exact(x, p)
        assert got.tobytes() == want.tobytes(), f"M={M}: {int((got != want).sum())} elements differ"


def _bf16_gemm_exact(x: np.ndarray, p: Any) -> np.ndarray:
    """fdx_qgemm's kind 16 in numpy: x rounded to bf16 (bf16_round), then
    per input pair p in order acc = fma(w[2p+1], x[2p+1], acc), acc =
    fma(w[2p], x[2p], acc) (the vdpbf16ps sequence of qgemm.cc)."""
    from fdx.model.packed_weights import bf16_bits_to_f32, bf16_round, dequantize

    xb = bf16_bits_to_f32(bf16_round(x))
    wb = dequantize(p)
    acc = np.zeros((x.shape[0], wb.shape[0]), np.float32)
    for k in range(0, x.shape[1], 2):
        for j in (k + 1, k):
            acc = _fma32(np.broadcast_to(xb[:, j, None], acc.shape), np.broadcast_to(wb[None, :, j], acc.shape), acc)
    return acc


def test_bf16_gemm_bits_match_the_fma_sequence(ops: Any) -> None:
    """kind 16: every output bit is the documented sequence, for all row
    tiles (M = 1..9, 70), a 5-column tail, a zero row, inputs that round
    to a tie, and denormal inputs (read as zero)."""
    import paddle

    from fdx.model.packed_weights import pack_bf16

    rng = np.random.default_rng(1616)
    N, K = 173, 320
    p = pack_bf16((rng.standard_normal((N, K)) * rng.uniform(0.001, 0.2, size=(N, 1))).astype(np.float32))
    assert p.kind == 16 and p.data.shape == (22, 10, 512)
    w = paddle.to_tensor(p.data)
    for M in (1, 2, 3, 4, 5, 9, 70):
        x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 30, size=(M, 1))).astype(np.float32)
        x[0, 32:40] = np.float32(1.00390625)  # halfway between two bf16s: rounds to even
        x[-1, 40:44] = np.float32(1e-40)      # denormal: zero
        if M > 3:
            x[2] = 0.0
        got = ops.fdx_qgemm(paddle.to_tensor(x), w, 16, p.n_out).numpy()
        want = _bf16_gemm_exact(x, p)
        assert got.tobytes() == want.tobytes(), f"M={M}: {int((got != want).sum())} elements differ"


def test_bf16_rounding_matches_paddle() -> None:
    """bf16_round (the packer's, and by the test above the kernel's) rounds
    as Paddle's own float32 -> bfloat16 cast does: nearest, ties to even."""
    import paddle

    from fdx.model.packed_weights import bf16_round

    rng = np.random.default_rng(5)
    x = (rng.standard_normal(20000) * np.exp(rng.uniform(-20, 20, 20000))).astype(np.float32)
    x[:4] = [1.00390625, 1.01171875, -1.00390625, 65504.0]  # ties and a large value
    want = paddle.to_tensor(x).astype("bfloat16").view("uint16").numpy() if hasattr(paddle.Tensor, "view") else None
    if want is None:
        pytest.skip("this Paddle cannot view a bfloat16 tensor as uint16")
    np.testing.assert_array_equal(bf16_round(x), want)
    assert list(bf16_round(np.array([1e-40, -1e-40, np.inf, np.nan], np.float32))) == [0, 0x8000, 0x7F80, 0x7FC0]


def test_bf16_packing_is_exact() -> None:
    from fdx.model.packed_weights import bf16_bits_to_f32, bf16_round, dequantize, pack_bf16

    rng = np.random.default_rng(3)
    w = rng.standard_normal((21, 64)).astype(np.float32)
    p = pack_bf16(w)
    assert p.data.shape == (3, 2, 512) and p.data.dtype == np.uint8 and p.n_out == 21
    np.testing.assert_array_equal(dequantize(p), bf16_bits_to_f32(bf16_round(w)))
    # dword j of pair q of block b: column j's inputs 32b + 2q (low half) and 32b + 2q + 1 (high half)
    words = np.asarray(p.data).view(np.uint32).reshape(3, 2, 16, 8)
    bits = bf16_round(w)
    assert words[1, 1, 3, 4] == int(bits[12, 32 + 6]) | (int(bits[12, 32 + 7]) << 16)


_THREADS_SCRIPT = r"""
import sys, numpy as np, paddle
from fdx.model import native
from fdx.model.packed_weights import pack_gguf
ops = native.load_ops()
rng = np.random.default_rng(7)
out = []
for qtype, K, N in ((3, 576, 300), (8, 256, 1000)):
    nb = K // 32
    d = rng.uniform(0.005, 0.05, size=(N, nb)).astype(np.float16)
    if qtype == 8:
        raw = np.concatenate([d[..., None].view(np.uint8), rng.integers(0, 256, size=(N, nb, 32), dtype=np.uint8)], axis=2)
    else:
        m = rng.uniform(-0.3, 0.3, size=(N, nb)).astype(np.float16)
        raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8),
                              rng.integers(0, 256, size=(N, nb, 16), dtype=np.uint8)], axis=2)
    p = pack_gguf(raw.reshape(N, -1), qtype)
    for M in (1, 3, 37, 300):
        x = rng.standard_normal((M, K)).astype(np.float32)
        out.append(ops.fdx_qgemm(paddle.to_tensor(x), paddle.to_tensor(p.data), p.kind, p.n_out).numpy().tobytes())
from fdx.model.packed_weights import pack_bf16
p = pack_bf16(rng.standard_normal((300, 576)).astype(np.float32) * 0.05)
for M in (1, 3, 37, 300):
    x = rng.standard_normal((M, 576)).astype(np.float32)
    out.append(ops.fdx_qgemm(paddle.to_tensor(x), paddle.to_tensor(p.data), p.kind, p.n_out).numpy().tobytes())
sys.stdout.buffer.write(b"".join(out))
"""


@needs_simd
def test_qgemm_bits_do_not_depend_on_the_thread_count(ops: Any) -> None:
    import os
    import subprocess
    import sys

    def run(threads: int) -> bytes:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        r = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, timeout=600)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        return r.stdout

    one, two = run(1), run(2)
    assert len(one) > 0 and one == two
    assert run(3) == one


@pytest.mark.parametrize("qtype", [2, 3, 8])
def test_packing_is_exact(qtype: int) -> None:
    from fdx.model.packed_weights import dequantize, pack_float, pack_gguf

    rng = np.random.default_rng(qtype)
    raw, w = _quantize(rng, 21, 64, qtype)
    p = pack_gguf(raw, qtype)
    assert p.data.shape == (3, 2, 160 if qtype != 8 else 272) and p.n_out == 21
    np.testing.assert_array_equal(dequantize(p), w)
    f = rng.standard_normal((21, 64)).astype(np.float32)
    pf = pack_float(f)
    assert pf.kind == 8
    scale = np.abs(f.reshape(21, 2, 32)).max(axis=2, keepdims=True) / 127
    assert np.all(np.abs(dequantize(pf) - f).reshape(21, 2, 32) <= 0.51 * scale + 1e-6)


@pytest.mark.parametrize("H", [5, 24, 579])
def test_add_rms_norm_and_swiglu(ops: Any, H: int) -> None:
    import paddle

    rng = np.random.default_rng(H)
    x = rng.standard_normal((3, H)).astype(np.float32)
    res = rng.standard_normal((3, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    out, res_out = ops.fdx_add_rms_norm(paddle.to_tensor(x), paddle.to_tensor(res), paddle.to_tensor(w), 1e-5)
    s = (x + res).astype(np.float64)
    want = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(res_out.numpy(), s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    out0, res0 = ops.fdx_add_rms_norm(paddle.to_tensor(x), paddle.zeros([0], "float32"), paddle.to_tensor(w), 1e-5)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(out0.numpy(), x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(res0.numpy(), x)

    g = (rng.standard_normal((3, 2 * H)) * 6).astype(np.float32)  # large |x| exercises exp's clamping
    got = ops.fdx_swiglu(paddle.to_tensor(g)).numpy()
    a, b = g[:, :H].astype(np.float64), g[:, H:].astype(np.float64)
    np.testing.assert_allclose(got, a / (1 + np.exp(-a)) * b, rtol=1e-5, atol=1e-5)


def _rot_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("window", [0, 1, 5, 16])
def test_paged_attention_matches_numpy(ops: Any, window: int) -> None:
    """Two sequences prefilled in one call (lengths 13 and 21: softmax tails
    for 8 and 16 lanes), then one decode token each; block tables are
    interleaved, not contiguous.  ``window`` > 0: a sliding window, the
    query at p attends to the keys p - window < j <= p only (0: all)."""
    import paddle

    rng = np.random.default_rng(7)
    H, KV, D, BS, NB, P = 4, 2, 16, 4, 24, 64
    half = D // 2
    inv = 1.0 / (10000.0 ** (np.arange(half) * 2.0 / D))
    ang = np.arange(P)[:, None] * inv[None, :]
    rope = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    lens = [13, 21]
    tables = np.full((2, 8), -1, dtype=np.int32)
    nxt = NB - 1
    for j in range(8):
        for s in range(2):
            if j * BS < lens[s] + 1:
                tables[s, j] = nxt
                nxt -= 1
    cache = paddle.zeros([2, NB, KV, BS, D], "float32")
    ks: list[list[np.ndarray]] = [[], []]
    vs: list[list[np.ndarray]] = [[], []]

    def step(seq_pos: list[tuple[int, int]]) -> None:
        T = len(seq_pos)
        qkv = rng.standard_normal((T, (H + 2 * KV) * D)).astype(np.float32)
        meta = np.array(seq_pos, dtype=np.int32)
        out = ops.fdx_paged_attention(paddle.to_tensor(qkv), cache, paddle.to_tensor(rope), paddle.to_tensor(meta),
                                      paddle.to_tensor(tables), H, KV, BS, float(D) ** -0.5, window).numpy()
        q = qkv[:, : H * D].reshape(T, H, D)
        k = qkv[:, H * D : (H + KV) * D].reshape(T, KV, D)
        v = qkv[:, (H + KV) * D :].reshape(T, KV, D)
        for t, (s, p) in enumerate(seq_pos):
            ks[s].append(_rot_half(k[t], rope[p, :half], rope[p, half:]))
            vs[s].append(v[t])
        for t, (s, p) in enumerate(seq_pos):
            qr = _rot_half(q[t], rope[p, :half], rope[p, half:]).astype(np.float64)
            lo = max(0, p + 1 - window) if window else 0
            K_, V_ = np.stack(ks[s][lo : p + 1]), np.stack(vs[s][lo : p + 1])  # [n, KV, D]
            for h in range(H):
                kh = h // (H // KV)
                sc = K_[:, kh] @ qr[h] * D**-0.5
                e = np.exp(sc - sc.max())
                want = (e / e.sum()) @ V_[:, kh]
                np.testing.assert_allclose(out[t, h * D : (h + 1) * D], want, rtol=1e-4, atol=1e-5)

    step([(0, p) for p in range(lens[0])] + [(1, p) for p in range(lens[1])])
    step([(0, lens[0]), (1, lens[1])])
    # the cache holds the rotated keys where the block tables say (K blocks dim-major), the values as they came
    c = cache.numpy()
    p = lens[1]
    np.testing.assert_allclose(_keys_of_cache(c[0], "float32")[tables[1, p // BS], :, p % BS], ks[1][p],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(c[1, tables[1, p // BS], :, p % BS], vs[1][p])


def _keys_in_cache(k: np.ndarray, dtype: str) -> np.ndarray:
    """The K half of a cache, ``[NB, KV, BS, D]`` key-major, in the op's
    layout (paged_attention.cc, KEY BLOCKS): each block dim-major (float32:
    value (j, d) at d * BS + j), or in pairs of dims (bfloat16: at
    ((d // 2) * BS + j) * 2 + d % 2); the same shape, the values moved."""
    NB, KV, BS, D = k.shape
    if dtype == "float32":
        return np.ascontiguousarray(k.transpose(0, 1, 3, 2)).reshape(NB, KV, BS, D)
    return np.ascontiguousarray(k.reshape(NB, KV, BS, D // 2, 2).transpose(0, 1, 3, 2, 4)).reshape(NB, KV, BS, D)


def _keys_of_cache(c: np.ndarray, dtype: str) -> np.ndarray:
    """``_keys_in_cache`` undone: the K half ``[NB, KV, BS, D]`` key-major."""
    NB, KV, BS, D = c.shape
    if dtype == "float32":
        return np.ascontiguousarray(c.reshape(NB, KV, D, BS).transpose(0, 1, 3, 2))
    return np.ascontiguousarray(c.reshape(NB, KV, D // 2, BS, 2).transpose(0, 1, 3, 2, 4)).reshape(NB, KV, BS, D)


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 as the kernels round, back as float32."""
    from fdx.model.packed_weights import bf16_bits_to_f32, bf16_round

    return bf16_bits_to_f32(bf16_round(a)).reshape(a.shape)


@pytest.mark.parametrize("D", [64, 36])
def test_paged_attention_bfloat16_cache_is_the_float32_sequence_on_rounded_values(ops: Any, D: int) -> None:
    """``--kv-cache-dtype bfloat16``: the op writes each new key and value
    rounded to bfloat16 and reads them back exactly, so its output is the
    float32 cache's, bit for bit, on the rounded values.  Made comparable by
    feeding keys and values that are already bfloat16 and a RoPE table whose
    rows at the new tokens' positions are the identity (cos 1, sin 0), so
    both caches receive the same values; prefill chunks and decode rows
    over a cache already holding other keys (D = 36: the tails of a row)."""
    import paddle

    rng = np.random.default_rng(11 + D)
    H, KV, BS, NB = 6, 2, 8, 40
    lens = [37, 90, 3]
    tables = rng.permutation(NB)[: 3 * 12].reshape(3, 12).astype(np.int32)
    P = max(lens) + 1
    rope = rng.standard_normal((P, D)).astype(np.float32)
    rope[:, : D // 2], rope[:, D // 2 :] = 1.0, 0.0  # identity rotation everywhere: rope(k) = k, exactly
    old = _bf16(rng.standard_normal((2, NB, KV, BS, D)).astype(np.float32))  # keys key-major
    c32 = paddle.to_tensor(np.stack([_keys_in_cache(old[0], "float32"), old[1]]))
    cb = paddle.to_tensor(np.stack([_keys_in_cache(old[0], "bfloat16"), old[1]])).astype("bfloat16")
    assert np.array_equal(_keys_of_cache(cb.astype("float32").numpy()[0], "bfloat16"), old[0])  # Paddle's cast: exact

    def same_caches() -> None:
        b, f = cb.astype("float32").numpy(), c32.numpy()
        np.testing.assert_array_equal(_keys_of_cache(b[0], "bfloat16"), _keys_of_cache(f[0], "float32"))
        np.testing.assert_array_equal(b[1], f[1])

    W = (H + 2 * KV) * D
    for seq_pos in ([(0, p) for p in range(20, 37)] + [(1, p) for p in range(80, 90)], [(0, 37), (1, 90), (2, 2)]):
        meta = np.array(seq_pos, dtype=np.int32)
        qkv = rng.standard_normal((len(meta), W)).astype(np.float32)
        qkv[:, H * D :] = _bf16(qkv[:, H * D :])
        args = (paddle.to_tensor(rope), paddle.to_tensor(meta), paddle.to_tensor(tables), H, KV, BS, float(D) ** -0.5, 0)
        o32 = ops.fdx_paged_attention(paddle.to_tensor(qkv), c32, *args).numpy()
        ob = ops.fdx_paged_attention(paddle.to_tensor(qkv), cb, *args).numpy()
        np.testing.assert_array_equal(ob, o32)
        same_caches()
    # a key that is not a bfloat16 value is stored rounded to nearest even
    qkv = np.zeros((1, W), np.float32)
    qkv[0, H * D : H * D + 5] = [1.0 + 2.0**-9, 1.0 + 3 * 2.0**-9, -(1.0 + 2.0**-8), -(1.0 + 3 * 2.0**-8), 3.0e-39]
    meta = np.array([(2, 0)], dtype=np.int32)
    ops.fdx_paged_attention(paddle.to_tensor(qkv), cb, paddle.to_tensor(rope), paddle.to_tensor(meta),
                            paddle.to_tensor(tables), H, KV, BS, float(D) ** -0.5, 0)
    got = _keys_of_cache(cb.astype("float32").numpy()[0], "bfloat16")[tables[2, 0], 0, 0, :5]  # ties to even; a denormal to 0
    np.testing.assert_array_equal(got, np.array([1.0, 1.0 + 2.0**-7, -1.0, -(1.0 + 2.0**-6), 0.0], np.float32))


def test_paged_attention_window_zero_is_no_window(ops: Any) -> None:
    """Window 0 and a window as long as the context give the very bits of
    each other (the same keys, the same operations); a shorter one differs."""
    import paddle

    rng = np.random.default_rng(3)
    H, KV, D, BS, n = 4, 2, 36, 5, 41
    half, W = D // 2, (H + 2 * KV) * D
    ang = np.arange(n)[:, None] * (1.0 / (10000.0 ** (np.arange(half) * 2.0 / D)))[None, :]
    rope = paddle.to_tensor(np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32))
    qkv = paddle.to_tensor(rng.standard_normal((n, W)).astype(np.float32))
    meta = paddle.to_tensor(np.array([(0, p) for p in range(n)], np.int32))
    tables = paddle.to_tensor(rng.permutation(9).astype(np.int32)[None, :])
    outs = {}
    for window in (0, n, 1000, n - 1):
        cache = paddle.zeros([2, 9, KV, BS, D], "float32")
        outs[window] = ops.fdx_paged_attention(qkv, cache, rope, meta, tables, H, KV, BS, float(D) ** -0.5,
                                               window).numpy()
    assert outs[0].tobytes() == outs[n].tobytes() == outs[1000].tobytes()
    assert outs[0][: n - 1].tobytes() == outs[n - 1][: n - 1].tobytes()  # rows within the window: the same keys
    assert not np.array_equal(outs[0][n - 1], outs[n - 1][n - 1])  # the last row lost key 0


@contextlib.contextmanager
def _omp_threads(n: int) -> Iterator[bool]:
    """The OpenMP thread count of the ops' runtime (Paddle's libiomp5) set to
    ``n`` for the block; yields False where it cannot be set."""
    import paddle

    lib = os.path.join(os.path.dirname(paddle.__file__), "libs", "libiomp5.so")
    if not os.path.exists(lib):
        yield False
        return
    omp = ctypes.CDLL(lib)
    old = omp.omp_get_max_threads()
    omp.omp_set_num_threads(n)
    try:
        assert omp.omp_get_max_threads() == n
        yield True
    finally:
        omp.omp_set_num_threads(old)


@pytest.mark.parametrize("H,KV,D,BS,lens,window", [(9, 3, 64, 16, (300, 130, 37, 5), 0), (8, 2, 36, 5, (70, 41, 9), 0),
                                                    (8, 2, 36, 5, (70, 41, 9), 29)])
def test_paged_attention_rows_are_batch_invariant(ops: Any, H: int, KV: int, D: int, BS: int,
                                                  lens: tuple[int, ...], window: int) -> None:
    """A query row's output bits depend only on its own q, its sequence's
    K/V and its position: the same rows computed one token per call (decode,
    T=1), as whole prompts (one prefill of up to 300 tokens), in chunks of
    1/5/37/130 tokens mixed with other sequences' chunks in one call (T from
    1 to ~170, the rows at every offset of the call) and with 1 or 2 OpenMP
    threads all give identical outputs and identical caches.  The first
    geometry is SmolLM2-135M's; the second leaves SIMD tails (head size 36,
    4 query heads per kv head, blocks of 5)."""
    import paddle

    rng = np.random.default_rng(11)
    S, W, half, P = len(lens), (H + 2 * KV) * D, D // 2, max(lens) + 1
    inv = 1.0 / (10000.0 ** (np.arange(half) * 2.0 / D))
    ang = np.arange(P)[:, None] * inv[None, :]
    rope = paddle.to_tensor(np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32))
    xs = [rng.standard_normal((n, W)).astype(np.float32) for n in lens]  # each token's qkv row
    nblk = [(n + BS - 1) // BS for n in lens]
    NB = sum(nblk) + 3
    perm = rng.permutation(NB)  # the sequences' blocks interleaved over the cache
    tables = np.full((S, max(nblk)), -1, np.int32)
    k = 0
    for s in range(S):
        for j in range(nblk[s]):
            tables[s, j] = perm[k]
            k += 1
    tables_t = paddle.to_tensor(tables)
    scale = float(D) ** -0.5

    def run(calls: list[list[tuple[int, int]]]) -> tuple[list[np.ndarray], np.ndarray]:
        """Run the calls (each a list of (sequence, position)) on a fresh
        cache; every row's output, per sequence, and the final cache."""
        cache = paddle.zeros([2, NB, KV, BS, D], "float32")
        outs = [np.full((n, H * D), np.nan, np.float32) for n in lens]
        for call in calls:
            qkv = np.stack([xs[s][p] for s, p in call])
            out = ops.fdx_paged_attention(paddle.to_tensor(qkv), cache, rope,
                                          paddle.to_tensor(np.array(call, np.int32)), tables_t,
                                          H, KV, BS, scale, window).numpy()
            for row, (s, p) in zip(out, call):
                outs[s][p] = row
        return outs, cache.numpy()

    decode = [[(s, p)] for s in range(S) for p in range(lens[s])]
    whole = [[(s, p) for p in range(lens[s])] for s in range(S)]
    sizes = (1, 5, 37, 130)
    mixed: list[list[tuple[int, int]]] = []
    done = [0] * S
    while min(d - n for d, n in zip(done, lens)) < 0:
        k = len(mixed)
        call = []
        for s in [(k + i) % S for i in range(S)]:  # the sequences in a rotating order
            c = min(sizes[(k + s) % len(sizes)], lens[s] - done[s])
            call += [(s, p) for p in range(done[s], done[s] + c)]
            done[s] += c
        mixed.append(call)
    assert len({len(c) for c in mixed}) >= 4  # calls of many sizes (SmolLM2's: T = 1 ... 130)

    want, want_cache = run(decode)
    for s, n in enumerate(lens):  # the reference is attention (spot checks against numpy)
        q = xs[s][:, : H * D].reshape(n, H, D)
        kk = xs[s][:, H * D : (H + KV) * D].reshape(n, KV, D)
        vv = xs[s][:, (H + KV) * D :].reshape(n, KV, D)
        rp = rope.numpy()
        for p in {0, n // 2, n - 1}:
            lo = max(0, p + 1 - window) if window else 0  # the sliding window's first key
            K_ = np.stack([_rot_half(kk[j], rp[j, :half], rp[j, half:]) for j in range(lo, p + 1)]).astype(np.float64)
            qr = _rot_half(q[p], rp[p, :half], rp[p, half:]).astype(np.float64)
            for h in range(H):
                sc = K_[:, h // (H // KV)] @ qr[h] * scale
                e = np.exp(sc - sc.max())
                np.testing.assert_allclose(want[s][p, h * D : (h + 1) * D], (e / e.sum()) @ vv[lo : p + 1, h // (H // KV)],
                                           rtol=1e-4, atol=1e-5)
    variants = {"whole prompts": whole, "mixed chunks": mixed}
    results = {name: run(calls) for name, calls in variants.items()}
    with _omp_threads(1) as ok:
        if ok:
            results["decode, 1 thread"] = run(decode)
            results["mixed chunks, 1 thread"] = run(mixed)
    for name, (outs, cache) in results.items():
        for s in range(S):
            assert np.array_equal(outs[s].view(np.uint32), want[s].view(np.uint32)), (name, s)
        assert np.array_equal(cache.view(np.uint32), want_cache.view(np.uint32)), name


# --------------------------------------------------------------------------
# the real model: native forward vs pure-Paddle forward
# --------------------------------------------------------------------------

PROMPTS = ["What is the capital of France?", "def fibonacci(n):", "Name three colours."]
N_TOKENS = 12


@pytest.mark.slow
def test_native_forward_matches_paddle(ops: Any) -> None:
    from fdx.config import make_config
    from fdx.model.loader import load_tokenizer
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice
    from test_model_parity import run_greedy

    runner = PaddleModelRunner(make_config(num_kv_blocks=64, max_model_len=512, dtype="float32"), CPUDevice())
    assert runner.attention_impl == "native" and runner.model.ops is ops and runner.compute == "float32"
    tok = load_tokenizer(None)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    model = runner.model
    forward = model.forward
    logits: list[np.ndarray] = []

    def recording(step: Any, caches: Any) -> Any:
        out = forward(step, caches)
        if out is not None:
            logits.append(out.numpy().copy())
        return out

    model.forward = recording  # type: ignore[method-assign]
    native_toks = run_greedy(runner, prompts, N_TOKENS)
    native_logits, logits[:] = list(logits), []
    model.ops = None
    try:
        paddle_toks = run_greedy(runner, prompts, N_TOKENS)
    finally:
        model.ops = ops
        model.forward = forward  # type: ignore[method-assign]
    assert native_toks == paddle_toks
    assert len(native_logits) == len(logits) == N_TOKENS
    for a, b in zip(native_logits, logits):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * max(1.0, float(np.abs(b).max())))


def test_dtype_choice_on_the_cpu_runner() -> None:
    """``--dtype`` on the cpu runner: bf16 needs the native ops like int8
    (a one-line error naming the way out), auto falls back to float32, and
    an unknown name lists the choices."""
    from types import SimpleNamespace

    from fdx.core.errors import ModelLoadError
    from fdx.model.runner import resolve_compute

    args = SimpleNamespace(hidden_size=576, q_size=576, intermediate_size=1536)
    ops = object()
    assert [resolve_compute(d, ops, args) for d in ("auto", "int8", "bf16", "BFloat16", "fp32")] == [
        "int8", "int8", "bfloat16", "bfloat16", "float32"]
    assert resolve_compute("auto", None, args) == "float32"
    with pytest.raises(ModelLoadError, match=r"--dtype bf16: fdx's native CPU ops are not loaded.*use --dtype float32"):
        resolve_compute("bf16", None, args)
    with pytest.raises(ModelLoadError, match="--dtype bfloat16: the layer widths are not multiples of 32"):
        resolve_compute("bfloat16", ops, SimpleNamespace(hidden_size=100, q_size=100, intermediate_size=300))
    with pytest.raises(ModelLoadError, match="auto, int8, bfloat16, float32"):
        resolve_compute("float16", ops, args)


def test_a_failing_compile_is_one_line_naming_the_file(tmp_path: Any) -> None:
    """The ops build's error (what ``python -m fdx.model.native`` and the
    fallback's warning print) is one line: the file and the compiler's first error."""
    from fdx.model.ops_build import BuildError, compile_op_library

    src = tmp_path / "broken.cc"
    src.write_text("int f( { return 0; }\n")
    with pytest.raises(BuildError) as info:
        compile_op_library("fdx_broken", [str(src)], ["-O0"], [], [], str(tmp_path / "build"))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("compiling broken.cc failed: ") and "error" in msg, msg


def test_every_openmp_entry_the_ops_import_is_in_libiomp5() -> None:
    """The ops link Paddle's libiomp5, which lacks some of GCC's GOMP_* entry
    points (``omp for schedule(dynamic)`` calls GOMP_loop_nonmonotonic_dynamic_*):
    one of those resolves to libgomp instead, which does not know libiomp5's
    team -- every thread then runs every iteration (fdx_sample_rows did, at
    first: right tokens, twice the work).  So every OpenMP symbol the library
    imports must be one libiomp5 defines."""
    import shutil
    import subprocess

    if native.load_ops() is None or native._so_path is None:
        pytest.skip("fdx's native CPU ops are not loaded here")
    if shutil.which("nm") is None:
        pytest.skip("needs binutils' nm")
    libs = [a[len("-L"):] for a in native._ldflags() if a.startswith("-L")]
    if not libs:
        pytest.skip("the ops are not linked against libiomp5 here (-fopenmp)")
    iomp = ctypes.CDLL(os.path.join(libs[0], "libiomp5.so"))
    out = subprocess.run(["nm", "-D", "--undefined-only", native._so_path], capture_output=True, text=True,
                         check=True).stdout
    wanted = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    omp = sorted(s for s in wanted if s.startswith(("GOMP_", "omp_", "kmp_", "__kmpc")))
    assert omp, "no OpenMP symbol imported: is the library built with -fopenmp?"
    missing = [s for s in omp if not hasattr(iomp, s)]
    assert not missing, f"libiomp5 lacks {missing}: libgomp would run them outside libiomp5's thread team"
