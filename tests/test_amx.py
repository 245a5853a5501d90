"""The int8 GEMM's AMX path (fdx/csrc/qgemm.cc, tiles of 16 rows on the tile
unit) gives the same bits as the vector path and the exact numpy sequence.

tdpbssd computes the same exact int32 block sums as vpdpbusd / vpmaddubsw,
and the float epilogue is the documented per-element sequence, so every
output element must be bit-identical with ``FDX_NATIVE_AMX=0`` (the VNNI
tiles, read per call: both run in this process), with the numpy model of
the sequence (tests/test_native_ops.py ``_qgemm_exact``) and with the AVX2
kernel set (``FDX_NATIVE_ISA=avx2``, in a subprocess).  Row counts cover one
full tile, a full tile plus a vector tail, two tiles and 6 tiles + 4 rows;
column counts are no multiple of 16; K includes the model's 576 and 1536.
Skipped where the CPU (or the build, or Linux) has no AMX-INT8: most
machines fdx runs on (AMD EPYC) do not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Iterator

import numpy as np
import pytest

from fdx.model import native
from test_native_ops import _qgemm_exact, _quantize

ROWS = (16, 17, 32, 100)
SHAPES = ((576, 173), (1536, 77), (96, 37), (576, 24))


@pytest.fixture(scope="module")
def ops() -> Iterator[Any]:
    if os.environ.get("FDX_NATIVE_ISA") or native.cpu_isa() != "avx512":
        pytest.skip("the AMX path is part of the AVX-512 kernel set")
    o = native.load_ops()
    if o is None:
        pytest.skip("fdx native ops not loaded here")
    saved = os.environ.pop("FDX_NATIVE_AMX", None)
    try:
        if not native.loaded_int8_amx():
            pytest.skip("this CPU (or the build, or Linux) has no AMX-INT8: the int8 GEMM runs its vector tiles only")
        yield o
    finally:
        if saved is not None:
            os.environ["FDX_NATIVE_AMX"] = saved


def _gemm(ops: Any, x: np.ndarray, data: np.ndarray, kind: int, n_out: int, amx: bool) -> np.ndarray:
    import paddle

    os.environ["FDX_NATIVE_AMX"] = "1" if amx else "0"
    try:
        return ops.fdx_qgemm(paddle.to_tensor(x), paddle.to_tensor(data), kind, n_out).numpy()
    finally:
        del os.environ["FDX_NATIVE_AMX"]


def _cases() -> Iterator[tuple[str, np.ndarray, Any]]:
    from fdx.model.packed_weights import pack_gguf

    rng = np.random.default_rng(1601)
    for K, N in SHAPES:
        for qtype in (2, 3, 8):
            p = pack_gguf(_quantize(rng, N, K, qtype)[0], qtype)
            for M in ROWS:
                x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 30, size=(M, 1))).astype(np.float32)
                x[M // 2, 32:64] = 0.0  # a zero block
                yield f"q{qtype} K={K} N={N} M={M}", x, p


def test_the_switch_turns_amx_off(ops: Any) -> None:
    os.environ["FDX_NATIVE_AMX"] = "0"
    try:
        assert not native.loaded_int8_amx()
        assert native.amx_unused_reason() is None  # turned off on purpose: nothing to warn about
    finally:
        del os.environ["FDX_NATIVE_AMX"]
    assert native.loaded_int8_amx() and "AMX" in native.describe()
    assert native.amx_unused_reason() is None


def test_amx_the_cpu_has_but_the_gemm_does_not_use_is_said(ops: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "loaded_int8_amx", lambda: False)  # as when Linux refuses the tile state
    why = native.amx_unused_reason()
    assert why is not None and "AMX-INT8" in why and "same bits" in why


def test_amx_gives_the_vnni_bits_and_the_exact_sequence(ops: Any) -> None:
    for name, x, p in _cases():
        on = _gemm(ops, x, p.data, p.kind, p.n_out, True)
        off = _gemm(ops, x, p.data, p.kind, p.n_out, False)
        assert on.tobytes() == off.tobytes(), f"{name}: {int((on != off).sum())} elements differ, AMX vs VNNI"
        want = _qgemm_exact(x, p)
        assert on.tobytes() == want.tobytes(), f"{name}: {int((on != want).sum())} elements differ from the sequence"


def test_amx_rows_are_batch_invariant(ops: Any) -> None:
    """A row's bits do not depend on whether it sits in an AMX tile or the vector tail."""
    from fdx.model.packed_weights import pack_gguf

    rng = np.random.default_rng(77)
    p = pack_gguf(_quantize(rng, 200, 576, 3)[0], 3)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    full = _gemm(ops, x, p.data, p.kind, p.n_out, True)
    for rows in (slice(0, 16), slice(3, 20), slice(20, 40), slice(39, 40)):
        part = _gemm(ops, np.ascontiguousarray(x[rows]), p.data, p.kind, p.n_out, True)
        assert part.tobytes() == full[rows].tobytes(), rows


_AVX2 = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import paddle
from fdx.model import native
from test_amx import _cases
ops = native.load_ops()
assert native.loaded_isa() == "avx2", native.loaded_isa()
out = {name: ops.fdx_qgemm(paddle.to_tensor(x), paddle.to_tensor(p.data), p.kind, p.n_out).numpy()
       for name, x, p in _cases()}
np.savez(sys.argv[2], **out)
"""


def test_amx_gives_the_avx2_bits(ops: Any, tmp_path: Any) -> None:
    if not {"avx2", "fma", "f16c"} <= set(native._cpu_flags().split()):
        pytest.skip("no AVX2 kernel set on this CPU")
    path = str(tmp_path / "avx2.npz")
    env = dict(os.environ, FDX_NATIVE_ISA="avx2")
    r = subprocess.run([sys.executable, "-c", _AVX2, os.path.dirname(os.path.abspath(__file__)), path], env=env,
                       capture_output=True, timeout=900)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    avx2 = np.load(path)
    for name, x, p in _cases():
        on = _gemm(ops, x, p.data, p.kind, p.n_out, True)
        assert on.tobytes() == avx2[name].tobytes(), f"{name}: {int((on != avx2[name]).sum())} elements differ, AMX vs AVX2"


def test_the_rows_outer_order_gives_the_same_bits(ops: Any) -> None:
    """Many rows and an output past L2 run rows outer within chunks of
    column pairs (qgemm.cc gemm_range_amx): 144 rows on the tiles + 6 in
    vector tails, 2,803 columns (more than one chunk per thread, a partial
    last group), still the VNNI bits and the exact sequence."""
    from fdx.model.packed_weights import pack_gguf

    rng = np.random.default_rng(1602)
    M, K, N = 150, 576, 2803
    for qtype in (3, 8):
        p = pack_gguf(_quantize(rng, N, K, qtype)[0], qtype)
        x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 30, size=(M, 1))).astype(np.float32)
        on = _gemm(ops, x, p.data, p.kind, p.n_out, True)
        off = _gemm(ops, x, p.data, p.kind, p.n_out, False)
        assert on.tobytes() == off.tobytes(), f"q{qtype}: {int((on != off).sum())} elements differ, AMX vs VNNI"
        assert on.tobytes() == _qgemm_exact(x, p).tobytes(), f"q{qtype}: differs from the sequence"
