"""Run every fdx C++ CPU op on fixed random inputs and save the output bits.

Used by tests/test_isa_bits.py, one subprocess per kernel set
(``FDX_NATIVE_ISA=avx2`` or ``avx512``), so the sets can be compared bit
for bit on a CPU that has both::

    FDX_NATIVE_ISA=avx2 python tests/isa_bits_probe.py /tmp/avx2.npz

The inputs come from fixed seeds and cover what the model runs (SmolLM2's
widths, every row-tile size of the GEMMs, attention over hundreds of keys)
and the tails of both lane counts (widths that are not multiples of 8 or
16).  Each output is saved under a name that says which op and case it is.
"""

from __future__ import annotations

import sys

import numpy as np


def _gguf_rows(rng: np.random.Generator, N: int, K: int, qtype: int) -> np.ndarray:
    nb = K // 32
    d = rng.uniform(0.005, 0.05, size=(N, nb)).astype(np.float16)
    if qtype == 8:
        q = rng.integers(0, 256, size=(N, nb, 32), dtype=np.uint8)
        raw = np.concatenate([d[..., None].view(np.uint8), q], axis=2)
    elif qtype == 3:
        m = rng.uniform(-0.3, 0.3, size=(N, nb)).astype(np.float16)
        raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8),
                              rng.integers(0, 256, size=(N, nb, 16), dtype=np.uint8)], axis=2)
    else:
        raw = np.concatenate([d[..., None].view(np.uint8), rng.integers(0, 256, size=(N, nb, 16), dtype=np.uint8)],
                             axis=2)
    return raw.reshape(N, -1)


def _activations(rng: np.random.Generator, M: int, K: int) -> np.ndarray:
    x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 30, size=(M, 1))).astype(np.float32)
    x[:, 5::97] *= 40.0  # a few outliers per row, as real activations have
    x[0, :32] = 0.0      # an all-zero block
    return x


def block_tables(rng: np.random.Generator, lens: tuple[int, ...], BS: int) -> tuple[np.ndarray, int]:
    """Block tables for sequences of ``lens`` tokens, their blocks shuffled
    over a cache of NB blocks (2 spare); returns (tables, NB)."""
    nblk = [(n + BS - 1) // BS for n in lens]
    NB = sum(nblk) + 2
    perm = rng.permutation(NB)
    tables = np.zeros((len(lens), max(nblk)), np.int32)
    k = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[k : k + n]
        k += n
    return tables, NB


def rope_table(P: int, D: int) -> np.ndarray:
    half = D // 2
    inv = 1.0 / (10000.0 ** (np.arange(half) * 2.0 / D))
    ang = np.arange(P)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def probe() -> dict[str, np.ndarray]:
    """Every op's outputs on the fixed inputs, by case name."""
    import paddle

    from fdx.model import native
    from fdx.model.packed_weights import pack_bf16, pack_float, pack_gguf

    ops = native.load_ops()
    if ops is None:
        raise SystemExit("fdx native ops are not loaded")
    T = paddle.to_tensor
    rng = np.random.default_rng(2027)
    out: dict[str, np.ndarray] = {"isa": np.array(native.loaded_isa())}

    # the int8 GEMM (kinds 4 and 8) and the bf16 GEMM (kind 16): every row tile, column tails
    for K, N in ((576, 1536 * 2 + 13), (1536, 576), (96, 37)):
        for qtype in (2, 3, 8):
            p = pack_gguf(_gguf_rows(rng, N, K, qtype), qtype)
            w = T(p.data)
            for M in (1, 2, 3, 4, 5, 9, 17, 70):  # 17, 70: AMX tiles of 16 rows + a vector tail where the CPU has AMX
                x = _activations(rng, M, K)
                out[f"qgemm_q{qtype}_K{K}_N{N}_M{M}"] = ops.fdx_qgemm(T(x), w, p.kind, p.n_out).numpy()
        p = pack_bf16((rng.standard_normal((N, K)) * 0.05).astype(np.float32))
        w = T(p.data)
        for M in (1, 2, 5, 6, 7, 13, 70):
            x = _activations(rng, M, K)
            out[f"qgemm_bf16_K{K}_N{N}_M{M}"] = ops.fdx_qgemm(T(x), w, 16, p.n_out).numpy()
    # the activation quantization on its own: x against the identity (Q8_0 of
    # the identity is exact: every row block is 127 * e_j with d = 1/127)
    K = 256
    eye = pack_float(np.eye(K, dtype=np.float32))
    x = _activations(rng, 7, K)
    out["quantize_rows"] = ops.fdx_qgemm(T(x), T(eye.data), eye.kind, eye.n_out).numpy()

    # the fp32 GEMV of the float32 mode (GGUF blocks)
    for qtype in (2, 3, 8):
        raw = _gguf_rows(rng, 77, 576, qtype)
        for M in (1, 3, 6):
            x = rng.standard_normal((M, 576)).astype(np.float32)
            out[f"qgemv_q{qtype}_M{M}"] = ops.fdx_qgemv(T(x), T(raw), qtype).numpy()

    # the element-wise ops: SmolLM2's widths and tails of both lane counts
    for H in (576, 5, 24, 579):
        x = (rng.standard_normal((4, H)) * 3).astype(np.float32)
        r = rng.standard_normal((4, H)).astype(np.float32)
        wn = rng.standard_normal(H).astype(np.float32)
        o, ro = ops.fdx_add_rms_norm(T(x), T(r), T(wn), 1e-5)
        out[f"add_rms_norm_H{H}"], out[f"add_rms_norm_res_H{H}"] = o.numpy(), ro.numpy()
        o, _ = ops.fdx_add_rms_norm(T(x), paddle.zeros([0], "float32"), T(wn), 1e-5)
        out[f"rms_norm_H{H}"] = o.numpy()
        g = (rng.standard_normal((4, 2 * H)) * 6).astype(np.float32)
        out[f"swiglu_F{H}"] = ops.fdx_swiglu(T(g)).numpy()

    # paged attention: SmolLM2's geometry over hundreds of keys, and one with tails
    for H, KV, D, BS, lens in ((9, 3, 64, 16, (300, 37, 5)), (8, 2, 36, 5, (70, 9))):
        W = (H + 2 * KV) * D
        tables, NB = block_tables(rng, lens, BS)
        rope = T(rope_table(max(lens) + 1, D))
        cache = paddle.zeros([2, NB, KV, BS, D], "float32")
        meta = np.array([(s, p) for s, n in enumerate(lens) for p in range(n)], np.int32)
        qkv = rng.standard_normal((len(meta), W)).astype(np.float32)
        o = ops.fdx_paged_attention(T(qkv), cache, rope, T(meta), T(tables), H, KV, BS, float(D) ** -0.5, 0)
        out[f"attention_D{D}_prefill"] = o.numpy()
        out[f"attention_D{D}_cache"] = cache.numpy()
        for window in (7, 50):  # sliding windows: shorter than a block of keys, and spanning several
            o = ops.fdx_paged_attention(T(qkv), cache, rope, T(meta), T(tables), H, KV, BS, float(D) ** -0.5, window)
            out[f"attention_D{D}_prefill_window{window}"] = o.numpy()
        # a bfloat16 cache: the rounding of the written keys and values, and their widening when read
        cb = paddle.zeros([2, NB, KV, BS, D], "bfloat16")
        o = ops.fdx_paged_attention(T(qkv), cb, rope, T(meta), T(tables), H, KV, BS, float(D) ** -0.5, 0)
        out[f"attention_D{D}_prefill_bf16_cache"] = o.numpy()
        out[f"attention_D{D}_bf16_cache"] = cb.astype("float32").numpy()

    # the mixture-of-experts op, every mode: routing, grouping, both GEMMs, the sums (and a rank's experts)
    E, H, F = 8, 128, 64
    router = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)
    gu = [(rng.standard_normal((2 * F, H)) / np.sqrt(H)).astype(np.float32) for _ in range(E)]
    dn = [(rng.standard_normal((H, F)) / np.sqrt(F)).astype(np.float32) for _ in range(E)]
    for mode, kind in (("f32", 0), ("int8", 8), ("bf16", 16)):
        if kind == 0:
            conv = lambda w: T(np.ascontiguousarray(w.T))  # noqa: E731
        else:
            conv = lambda w, pk=(pack_bf16 if kind == 16 else pack_float): T(pk(w).data)  # noqa: E731
        r = T(np.ascontiguousarray(router.T))  # the router is float32 in every mode
        g, d = [conv(w) for w in gu], [conv(w) for w in dn]
        for M in (1, 7, 40):
            x = (rng.standard_normal((M, H)) * 2).astype(np.float32)
            for renorm, first, n in ((True, 0, E), (False, 0, E), (True, 2, 3)):
                o, ids = ops.fdx_moe(T(x), r, g[first : first + n], d[first : first + n], kind, E, 2, renorm, first)
                out[f"moe_{mode}_M{M}_renorm{int(renorm)}_first{first}"] = o.numpy()
                out[f"moe_{mode}_M{M}_renorm{int(renorm)}_first{first}_ids"] = ids.numpy()

    # the fused decoder op, int8 (Q4_1 and Q8_0 layers) and bf16, with a prefill then a decode step
    E, H, KV, D, F, BS, NL = 128, 4, 2, 32, 96, 8, 2
    W = (H + 2 * KV) * D
    for mode in ("int8", "bf16"):
        def packed(n: int, k: int, i: int) -> object:
            if mode == "bf16":
                return pack_bf16((rng.standard_normal((n, k)) * k ** -0.5).astype(np.float32))
            return pack_gguf(_gguf_rows(rng, n, k, (3, 8)[i % 2]), (3, 8)[i % 2])

        layers = [(packed(W, E, 0), packed(E, H * D, 1), packed(2 * F, E, 2), packed(E, F, 3)) for _ in range(NL)]
        norms = [T((1 + 0.1 * rng.standard_normal(E)).astype(np.float32)) for _ in range(2 * NL)]
        empty = paddle.zeros([0], "float32")
        caches = [paddle.zeros([2, 16, KV, BS, D], "float32") for _ in range(NL)]
        rope = T(rope_table(64, D))
        tables = T(np.array([[3, 7, 1, 9], [0, 2, 4, 5]], np.int32))
        kinds = [lp.kind for ls in layers for lp in ls]  # type: ignore[attr-defined]
        for step, meta in enumerate(([(0, p) for p in range(21)] + [(1, p) for p in range(13)], [(0, 21), (1, 13)])):
            x = (rng.standard_normal((len(meta), E)) * 0.5).astype(np.float32)
            xo, res = ops.fdx_decoder_layers(
                T(x), rope, T(np.array(meta, np.int32)), tables, norms[:NL], [T(ls[0].data) for ls in layers],
                [empty] * NL, [T(ls[1].data) for ls in layers], norms[NL:], [T(ls[2].data) for ls in layers],
                [T(ls[3].data) for ls in layers], caches, kinds, H, 1e-5, float(D) ** -0.5, 0, [6, 0])
            out[f"decoder_layers_{mode}_step{step}"] = xo.numpy()
            out[f"decoder_layers_{mode}_step{step}_residual"] = res.numpy()

    # the sampling kernel (fdx/csrc/sampling.cc): plain, top_p (small and wide nucleus), top_k, min_p rows
    from fdx.model import native

    kernel = native.sampling_kernel()
    assert kernel is not None
    Vs = 49152 + 5  # a tail past the last full vector
    z = (rng.standard_normal((8, Vs)) * 1.5).astype(np.float32)
    z[np.arange(8)[:, None], rng.integers(0, Vs, (8, 4))] += np.float32(9)
    z[3, :100] = -np.inf
    for name, (tk, tp, mp, t) in {"plain": (0, 1.0, 0.0, 1.0), "top_p": (0, 0.9, 0.0, 0.8),
                                  "wide_top_p": (0, 0.95, 0.0, 2.5), "top_k": (40, 1.0, 0.0, 1.0),
                                  "all": (3000, 0.8, 0.001, 1.2)}.items():
        toks = [kernel(z, np.arange(8), np.full(8, 1 / t, np.float32), np.full(8, tk), np.full(8, tp),
                       np.full(8, mp, np.float32), np.full(8, u)) for u in (1e-9, 0.3, 0.77, 1.0)]
        out[f"sample_{name}"] = np.stack(toks)
    chosen, ids, vals = kernel.logprobs(z, np.arange(8), np.arange(8) * 1000, 20)
    out["logprobs_chosen"], out["logprobs_top_ids"], out["logprobs_top_vals"] = chosen, ids, vals
    return out


def main() -> None:
    out = probe()
    np.savez(sys.argv[1], **out)


if __name__ == "__main__":
    main()
