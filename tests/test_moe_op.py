"""fdx_moe (fdx/csrc/moe.cc) against a numpy reference, bit for bit, in the loaded kernel set.

The reference: the router logits (numpy's fma chain over the inputs in
order: the router is float32 in every mode), the softmax with
simd_math.h's exp in numpy (``_exp``), the top-k (highest first, the lower
id on a tie), the renormalisation summed in slot order, then every
(token, slot) pair's expert ALONE (one row: ``fdx_qgemm`` -- whose bits
tests/test_native_ops.py checks against numpy -- or, float32, the numpy fma
chain; numpy's SwiGLU), weighted and added in slot order.  The op groups
the rows by expert and runs each expert's GEMMs over all of them at once,
so equal bits also say that a token's output does not depend on its batch.
``FDX_NATIVE_ISA=avx2`` runs the same tests on the AVX2 set;
tests/test_isa_bits.py compares the two sets directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fdx.model import native
from test_native_ops import _fma32

f32 = np.float32


@pytest.fixture(scope="module")
def ops() -> Any:
    o = native.load_ops() if native.cpu_isa() is not None else None
    if o is None or not hasattr(o, "fdx_moe"):
        pytest.skip("fdx native ops not loaded here")
    return o


def _exp(x: np.ndarray) -> np.ndarray:
    """simd_math.h's exp (and moe.cc's exp_scalar), float32, element-wise."""
    x = np.minimum(np.maximum(x.astype(f32), f32(-87.0)), f32(88.0))
    n = np.rint(x * f32(1.44269504088896341)).astype(f32)
    r = _fma32(-n, np.full_like(x, f32(0.693145751953125)), x)
    r = _fma32(-n, np.full_like(x, f32(1.428606765330187045e-06)), r)
    p = np.full_like(x, f32(1) / f32(5040))
    for c in (f32(1) / f32(720), f32(1) / f32(120), f32(1) / f32(24), f32(1) / f32(6), f32(0.5), f32(1), f32(1)):
        p = _fma32(p, r, np.full_like(x, c))
    return (p * np.ldexp(np.ones_like(p), n.astype(np.int32))).astype(f32)


def _swiglu(g: np.ndarray) -> np.ndarray:
    F = g.shape[1] // 2
    a, u = g[:, :F], g[:, F:]
    return ((a / (f32(1) + _exp(f32(0) - a))) * u).astype(f32)


def _fgemm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [M, K] @ w [K, N]: per element the fma chain over k in order from 0."""
    acc = np.zeros((x.shape[0], w.shape[1]), f32)
    for k in range(x.shape[1]):
        acc = _fma32(np.broadcast_to(x[:, k : k + 1], acc.shape), np.broadcast_to(w[k][None, :], acc.shape), acc)
    return acc


def _route(z: np.ndarray, k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    """One row's logits -> (ids, weights), moe.cc's route() in numpy float32."""
    e = _exp((z - z.max()).astype(f32))
    s = f32(0)
    for v in e:
        s = f32(s + v)
    p = (e / s).astype(f32)
    ids = np.argsort(-p, kind="stable")[:k]
    w = p[ids].copy()
    if renorm:
        total = w[0]
        for v in w[1:]:
            total = f32(total + v)
        w = (w / total).astype(f32)
    return ids.astype(np.int32), w


class Block:
    """Random weights of one MoE block in one mode, as the op takes them."""

    def __init__(self, mode: str, H: int, F: int, E: int, seed: int) -> None:
        import paddle

        from fdx.model.packed_weights import pack_bf16, pack_float

        rng = np.random.default_rng(seed)
        self.mode, self.E = mode, E
        self.router = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(f32)  # [out, in], as a checkpoint holds it
        self.gu = [(rng.standard_normal((2 * F, H)) / np.sqrt(H)).astype(f32) for _ in range(E)]
        self.dn = [(rng.standard_normal((H, F)) / np.sqrt(F)).astype(f32) for _ in range(E)]
        if mode == "float32":
            self.kind = 0
            conv = lambda w: paddle.to_tensor(np.ascontiguousarray(w.T))  # noqa: E731  [in, out]
        else:
            pack = pack_bf16 if mode == "bfloat16" else pack_float
            self.kind = 16 if mode == "bfloat16" else 8
            self.packed: dict[int, Any] = {}

            def conv(w: np.ndarray) -> Any:
                p = pack(w)
                t = paddle.to_tensor(p.data)
                self.packed[id(t)] = p.n_out
                return t
        self.t_router = paddle.to_tensor(np.ascontiguousarray(self.router.T))  # float32 [in, out] in every mode
        self.t_gu = [conv(w) for w in self.gu]
        self.t_dn = [conv(w) for w in self.dn]

    def linear(self, ops: Any, x: np.ndarray, w: np.ndarray, t: Any) -> np.ndarray:
        import paddle

        if self.kind == 0:
            return _fgemm(x, np.ascontiguousarray(w.T))
        return ops.fdx_qgemm(paddle.to_tensor(x), t, self.kind, int(w.shape[0])).numpy()

    def reference(self, ops: Any, h: np.ndarray, k: int, renorm: bool, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        logits = _fgemm(h, np.ascontiguousarray(self.router.T))
        out = np.zeros_like(h)
        ids = np.zeros((h.shape[0], k), np.int32)
        for t in range(h.shape[0]):
            ids[t], w = _route(logits[t], k, renorm)
            terms = []
            for j, e in enumerate(ids[t]):
                if not first <= e < first + n:
                    terms.append(np.zeros(h.shape[1], f32))
                    continue
                x = h[t : t + 1]
                y = self.linear(ops, _swiglu(self.linear(ops, x, self.gu[e], self.t_gu[e])), self.dn[e], self.t_dn[e])
                terms.append((y[0] * w[j]).astype(f32))
            o = terms[0]
            for term in terms[1:]:
                o = (o + term).astype(f32)
            out[t] = o
        return out, ids

    def run(self, ops: Any, h: np.ndarray, k: int, renorm: bool, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        import paddle

        out, ids = ops.fdx_moe(paddle.to_tensor(h), self.t_router, self.t_gu[first : first + n],
                               self.t_dn[first : first + n], self.kind, self.E, k, renorm, first)
        return out.numpy(), ids.numpy()


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    n = int((got.view(np.uint32) != want.view(np.uint32)).sum())
    assert n == 0, f"{what}: {n} of {got.size} elements differ from the reference ({native.describe()})"


@pytest.mark.parametrize("mode", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize(("H", "F", "E", "k", "renorm"), [(128, 64, 8, 2, True), (96, 96, 6, 3, False),
                                                        (64, 32, 4, 1, False)])
def test_moe_op_matches_the_numpy_reference(ops: Any, mode: str, H: int, F: int, E: int, k: int, renorm: bool) -> None:
    """Every expert held: 1, 5 and 37 tokens (experts with no rows, with one, with many)."""
    blk = Block(mode, H, F, E, seed=H + F + E)
    rng = np.random.default_rng(7)
    for T in (1, 5, 37):
        h = (rng.standard_normal((T, H)) * rng.uniform(0.1, 3, size=(T, 1))).astype(f32)
        got, ids = blk.run(ops, h, k, renorm, 0, E)
        want, want_ids = blk.reference(ops, h, k, renorm, 0, E)
        np.testing.assert_array_equal(ids, want_ids)
        _same(got, want, f"{mode} T={T}")


@pytest.mark.parametrize("mode", ["float32", "int8", "bfloat16"])
def test_moe_op_expert_parallel_partial_sums(ops: Any, mode: str) -> None:
    """A rank holding experts [first, first + n) gives the pairs of its own
    experts only (the others add 0), and the ranks' partial sums add up to
    the one-rank output exactly at top-2 (``a + 0 = a``, two terms commute)."""
    E, k = 8, 2
    blk = Block(mode, 128, 64, E, seed=11)
    h = np.random.default_rng(3).standard_normal((29, 128)).astype(f32)
    whole, ids = blk.run(ops, h, k, True, 0, E)
    parts = []
    for first in (0, 4):
        got, got_ids = blk.run(ops, h, k, True, first, 4)
        np.testing.assert_array_equal(got_ids, ids)  # the router is whole on every rank
        _same(got, blk.reference(ops, h, k, True, first, 4)[0], f"{mode} experts {first}..{first + 3}")
        parts.append(got)
    _same((parts[0] + parts[1]).astype(f32), whole, f"{mode}: rank 0 + rank 1")


@pytest.mark.parametrize("mode", ["float32", "int8", "bfloat16"])
def test_moe_op_rows_are_batch_invariant(ops: Any, mode: str) -> None:
    """Each of 70 tokens alone, and among the others in any order, gives the same bits."""
    blk = Block(mode, 128, 64, 8, seed=5)
    rng = np.random.default_rng(9)
    h = rng.standard_normal((70, 128)).astype(f32)
    batch, _ = blk.run(ops, h, 2, False, 0, 8)
    alone = np.concatenate([blk.run(ops, h[i : i + 1], 2, False, 0, 8)[0] for i in range(70)])
    _same(batch, alone, f"{mode}: batch vs alone")
    perm = rng.permutation(70)
    _same(blk.run(ops, h[perm], 2, False, 0, 8)[0], batch[perm], f"{mode}: permuted batch")


def test_moe_op_refuses_mismatched_weights(ops: Any) -> None:
    import paddle

    blk = Block("float32", 64, 32, 4, seed=1)
    h = paddle.zeros([2, 64], "float32")
    with pytest.raises(Exception, match="gate_up"):
        ops.fdx_moe(h, blk.t_router, [blk.t_dn[0]], [blk.t_dn[0]], 0, 4, 2, True, 0)
    with pytest.raises(Exception, match="top_k"):
        ops.fdx_moe(h, blk.t_router, blk.t_gu, blk.t_dn, 0, 4, 5, True, 0)
    packed = Block("int8", 64, 32, 4, seed=1)
    with pytest.raises(Exception, match="router"):  # the router is float32 [H, E] in every mode
        ops.fdx_moe(h, packed.t_gu[0], packed.t_gu, packed.t_dn, packed.kind, 4, 2, True, 0)
