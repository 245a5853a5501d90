"""Weights in the layout of the int8 GEMM (csrc/qgemm.cc, ``fdx_qgemm``).

:func:`pack_gguf` turns a GGUF tensor's raw Q4_0 / Q4_1 / Q8_0 rows into the
kernel's packed form, and :func:`pack_float` quantizes any float32 matrix to
Q8_0 first (a checkpoint whose weights are not block-quantized).  Packing is
exact: the kernel sees the same integers and fp16 scales as the GGUF.

Packed form: ``uint8 [ceil(N/8), K/32, B]`` -- per group of 8 output columns
and block of 32 inputs, the quants laid out so that one 32-byte vector holds
4 consecutive inputs of the 8 columns (see csrc/qgemm.cc), then the fp16
scales: kind 4 (Q4_0/Q4_1, ``B = 160``: nibbles, ``d[8]``, ``m[8]``, with
``w = d*q + m``; Q4_0 becomes ``m = -8d``) and kind 8 (Q8_0, ``B = 272``:
signed bytes, ``d[8]``).  :func:`pack_bf16` rounds a float matrix to
bfloat16 instead (kind 16, ``B = 512``: 16 input pairs of 8 columns, a
column's pair in one dword, the even input in its low half), for the bf16
GEMM of the same op.
"""

from __future__ import annotations

import attrs
import numpy as np

#: ggml type ids the packer reads
Q4_0, Q4_1, Q8_0 = 2, 3, 8
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


@attrs.frozen
class PackedWeight:
    """A packed matrix for ``fdx_qgemm``: ``data`` (uint8, numpy or paddle),
    ``kind`` (4, 8 or 16) and ``n_out`` (the output features)."""

    data: object
    kind: int
    n_out: int


def blocks(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF rows ``uint8 [N, K/32 * bytes]`` -> quants ``[N, K/32, 32]``
    (uint8 0..15 for Q4, int8 for Q8), scales ``d`` and offsets ``m``
    (fp16 ``[N, K/32]``; ``None`` for Q8_0)."""
    bb = _BLOCK_BYTES.get(qtype)
    if bb is None:
        raise ValueError(f"ggml type {qtype} has no int8 kernel (Q4_0, Q4_1, Q8_0 do)")
    N = raw.shape[0]
    r = np.ascontiguousarray(raw).reshape(N, -1, bb)
    d = r[:, :, 0:2].copy().view(np.float16)[..., 0]
    if qtype == Q8_0:
        return r[:, :, 2:].view(np.int8), d, None
    if qtype == Q4_1:
        m = r[:, :, 2:4].copy().view(np.float16)[..., 0]
        packed = r[:, :, 4:]
    else:
        m = (d.astype(np.float32) * -8.0).astype(np.float16)  # exact: a power-of-two scale
        packed = r[:, :, 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # byte i: weights i and i + 16
    return q, d, m


def pack_blocks(q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> PackedWeight:
    """Quants and scales (as :func:`blocks` gives them) -> :class:`PackedWeight`."""
    N, nb, _ = q.shape
    G = -(-N // 8)
    pad = G * 8 - N
    if pad:
        q = np.concatenate([q, np.zeros((pad, nb, 32), q.dtype)])
        d = np.concatenate([d, np.zeros((pad, nb), np.float16)])
        if m is not None:
            m = np.concatenate([m, np.zeros((pad, nb), np.float16)])

    def scales(s: np.ndarray) -> np.ndarray:  # [G*8, nb] fp16 -> [G, nb, 16] bytes
        return np.ascontiguousarray(s.reshape(G, 8, nb).transpose(0, 2, 1)).view(np.uint8)

    if m is None:  # Q8: chunk c (4 inputs), byte 4*j + i = q[j][4c + i]
        qs = q.view(np.uint8).reshape(G, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 256)
        data = np.concatenate([qs, scales(d)], axis=2)
        return PackedWeight(np.ascontiguousarray(data), 8, N)
    # Q4: chunk c, byte 4*j + i = q[j][8c + i] | q[j][8c + 4 + i] << 4
    t = q.astype(np.uint8).reshape(G, 8, nb, 4, 2, 4).transpose(0, 2, 3, 1, 4, 5)  # [G, nb, c, j, h, i]
    qs = (t[:, :, :, :, 0, :] | (t[:, :, :, :, 1, :] << 4)).reshape(G, nb, 128)
    data = np.concatenate([qs, scales(d), scales(m)], axis=2)
    return PackedWeight(np.ascontiguousarray(data), 4, N)


def pack_gguf(raw: np.ndarray, qtype: int) -> PackedWeight:
    """Raw GGUF rows of a Q4_0 / Q4_1 / Q8_0 tensor -> :class:`PackedWeight`."""
    return pack_blocks(*blocks(raw, qtype))


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float ``[N, K]`` matrix (``K % 32 == 0``) -> Q8_0 quants and fp16 scales, as llama.cpp rounds them."""
    N, K = w.shape
    b = np.asarray(w, dtype=np.float32).reshape(N, K // 32, 32)
    d = (np.abs(b).max(axis=2) / 127.0).astype(np.float16)
    df = d.astype(np.float32)
    inv = np.divide(1.0, df, out=np.zeros_like(df), where=df > 0)
    q = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(np.int8)
    return q, d


def pack_float(w: np.ndarray) -> PackedWeight:
    """A float ``[N, K]`` matrix -> Q8_0 -> :class:`PackedWeight`."""
    q, d = quantize_q8_0(w)
    return pack_blocks(q, d, None)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the bfloat16 bit patterns (uint16) the kernel uses: round
    to nearest even, denormals to signed zero, NaN kept (quiet)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    r = np.where((u & 0x7F800000) == 0, (u >> 16) & 0x8000, r)
    r = np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
    return r.astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns -> the float32 values they encode (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def pack_bf16(w: np.ndarray) -> PackedWeight:
    """A float ``[N, K]`` matrix (``K % 32 == 0``) -> bfloat16 (:func:`bf16_round`), kind 16."""
    N, K = w.shape
    G, nb = -(-N // 8), K // 32
    bits = np.zeros((G * 8, K), np.uint16)
    bits[:N] = bf16_round(w)
    # [G, 8 cols, nb, 16 pairs, 2] -> [G, nb, pair, col, 2]: one dword per column and pair
    data = bits.reshape(G, 8, nb, 16, 2).transpose(0, 2, 3, 1, 4).reshape(G, nb, 256)
    return PackedWeight(np.ascontiguousarray(data).view(np.uint8), 16, N)


def dequantize(p: PackedWeight) -> np.ndarray:
    """The float32 ``[N, K]`` matrix a packed weight stands for (tests, drift checks)."""
    data = np.asarray(p.data)
    G, nb, _ = data.shape
    if p.kind == 16:
        bits = data.view(np.uint16).reshape(G, nb, 16, 8, 2).transpose(0, 3, 1, 2, 4).reshape(G * 8, nb * 32)
        return bf16_bits_to_f32(bits)[: p.n_out]
    if p.kind == 8:
        q = data[:, :, :256].view(np.int8).reshape(G, nb, 8, 8, 4).transpose(0, 3, 1, 2, 4).reshape(G * 8, nb, 32)
        d = data[:, :, 256:272].copy().view(np.float16).transpose(0, 2, 1).reshape(G * 8, nb)
        w = q.astype(np.float32) * d.astype(np.float32)[..., None]
    else:
        qs = data[:, :, :128].reshape(G, nb, 4, 8, 4)  # [G, nb, c, j, i]
        q = np.stack([qs & 0x0F, qs >> 4], axis=4)  # [G, nb, c, j, h, i]
        q = q.transpose(0, 3, 1, 2, 4, 5).reshape(G * 8, nb, 32)
        d = data[:, :, 128:144].copy().view(np.float16).transpose(0, 2, 1).reshape(G * 8, nb)
        m = data[:, :, 144:160].copy().view(np.float16).transpose(0, 2, 1).reshape(G * 8, nb)
        w = q.astype(np.float32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
    return w.reshape(G * 8, nb * 32)[: p.n_out]
