"""Paddle's fused kernels used by the GPU runner, each with a plain-Paddle
fallback and a start-up self-check.

Each op has two implementations with one signature:

* ``rms_norm(x, w, eps, residual) -> (normed, new_residual)``:
  ``paddle.incubate.nn.functional.fused_rms_norm`` (GPU, XPU, CPU) or plain
  Paddle ops computed in float32;
* ``rope(q, k, cos, sin) -> (q, k)`` (rotate-half / NEOX order, tables
  ``[T, 1, D]`` holding ``[cos, cos]`` and ``[sin, sin]``):
  ``fused_rotary_position_embedding`` (**GPU-only** in Paddle 3.x: the CPU
  build registers no kernel) or plain Paddle;
* ``swiglu(x) -> silu(x[:, :F]) * x[:, F:]``: ``paddle.incubate...swiglu``
  or plain Paddle;
* ``varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)``:
  ``paddle.nn.functional.flash_attention.flash_attn_unpadded``
  (variable-length FlashAttention-2, **GPU-only**, float16/bfloat16 only,
  grouped-query heads natively).  It has no drop-in fallback here; the model
  uses its padded paged attention instead (see ``fdx.model.gpu_llama``).

:func:`probe_kernels` runs every fused op once on small random inputs on the
target place and dtype and compares it with the plain version.  An op that
raises (no kernel for that place/dtype) or disagrees is switched off, with
the reason kept for the start-up log line -- so a device whose Paddle build
lacks a kernel (XPU, Iluvatar) says so and runs the plain op.  For the
flash kernel the probe also finds how its causal mask is aligned when the
query is shorter than the keys: ``bottom_right`` (FlashAttention >= 2.1: a
query at chunk offset ``i`` sees keys ``<= k_len - q_len + i``; one call
serves a whole mixed step) or ``top_left`` (older builds: only decode rows
and chunks that start at position 0 can use it).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import attrs
import numpy as np

log = logging.getLogger("fdx.model")

#: names accepted by ``FDX_GPU_DISABLE_FUSED`` (comma-separated) and by a
#: device's ``unsupported_fused_ops``
FUSED_OPS = ("rms_norm", "rope", "swiglu", "flash_attn")


# --------------------------------------------------------------------------
# plain implementations (any place, any float dtype)
# --------------------------------------------------------------------------


def rms_norm_plain(x: Any, w: Any, eps: float, residual: Any | None = None) -> tuple[Any, Any]:
    """``(rms_norm(x + residual) * w, x + residual)``; the norm in float32."""
    import paddle

    if residual is not None:
        x = x + residual
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    normed = x32 * paddle.rsqrt((x32 * x32).mean(axis=-1, keepdim=True) + eps)
    if x.dtype != paddle.float32:
        normed = normed.astype(x.dtype)
    return normed * w, x


def rms_norm_fused(x: Any, w: Any, eps: float, residual: Any | None = None) -> tuple[Any, Any]:
    from paddle.incubate.nn.functional import fused_rms_norm

    if residual is None:
        return fused_rms_norm(x, w, None, eps, 1)[0], x
    out = fused_rms_norm(x, w, None, eps, 1, residual=residual)
    return out[0], out[1]


def rope_plain(q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin``."""
    import paddle

    def rot(x: Any) -> Any:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + paddle.concat([-x2, x1], axis=-1) * sin

    return rot(q), rot(k)


def rope_fused(q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
    from paddle.incubate.nn.functional import fused_rotary_position_embedding

    T, D = int(q.shape[0]), int(q.shape[-1])
    oq, ok, _ = fused_rotary_position_embedding(
        q.unsqueeze(0), k.unsqueeze(0), None,
        sin=sin.reshape([1, T, 1, D]), cos=cos.reshape([1, T, 1, D]),
        use_neox_rotary_style=False,  # False = rotate_half (Hugging Face order)
    )
    return oq.squeeze(0), ok.squeeze(0)


def swiglu_plain(x: Any) -> Any:
    import paddle
    import paddle.nn.functional as F

    a, b = paddle.chunk(x, 2, axis=-1)
    return F.silu(a) * b


def swiglu_fused(x: Any) -> Any:
    from paddle.incubate.nn.functional import swiglu

    return swiglu(x)


def varlen_attention_fused(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, scale: float, causal: bool
) -> Any:
    """``q [Tq, H, D]``, ``k``/``v [Tk, KV, D]`` packed by sequence."""
    from paddle.nn.functional.flash_attention import flash_attn_unpadded

    out, _ = flash_attn_unpadded(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=causal, training=False)
    return out


def repeat_kv_heads(fn: Callable[..., Any], group: int) -> Callable[..., Any]:
    """``fn`` for a kernel build without grouped-query heads: K/V heads are
    repeated ``group`` times (``[T, KV, D] -> [T, KV * group, D]``) first."""
    import paddle

    def call(q: Any, k: Any, v: Any, *rest: Any) -> Any:
        return fn(q, paddle.repeat_interleave(k, group, axis=1), paddle.repeat_interleave(v, group, axis=1), *rest)

    return call


def varlen_attention_reference(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, scale: float, causal: bool,
    alignment: str = "bottom_right",
) -> Any:
    """A slow loop-per-sequence reference of :func:`varlen_attention_fused`
    (float32 maths).  Used by the probe and, in tests, to stand in for the
    GPU kernel on the CPU with either causal alignment."""
    import paddle
    import paddle.nn.functional as F

    cq = [int(x) for x in np.asarray(cu_q.numpy() if hasattr(cu_q, "numpy") else cu_q)]
    ck = [int(x) for x in np.asarray(cu_k.numpy() if hasattr(cu_k, "numpy") else cu_k)]
    H, KV = int(q.shape[1]), int(k.shape[1])
    G = H // KV
    outs = []
    for s in range(len(cq) - 1):
        qs = q[cq[s] : cq[s + 1]].astype("float32")  # [n, H, D]
        ks = k[ck[s] : ck[s + 1]].astype("float32")  # [m, KV, D]
        vs = v[ck[s] : ck[s + 1]].astype("float32")
        n, m = int(qs.shape[0]), int(ks.shape[0])
        ks = paddle.repeat_interleave(ks, G, axis=1).transpose([1, 0, 2])  # [H, m, D]
        vs = paddle.repeat_interleave(vs, G, axis=1).transpose([1, 0, 2])
        sc = paddle.matmul(qs.transpose([1, 0, 2]), ks, transpose_y=True) * scale  # [H, n, m]
        if causal:
            shift = m - n if alignment == "bottom_right" else 0
            allowed = np.arange(m)[None, :] <= (np.arange(n)[:, None] + shift)
            sc = sc + paddle.to_tensor(np.where(allowed, 0.0, -1e30).astype(np.float32))
        o = paddle.matmul(F.softmax(sc, axis=-1), vs).transpose([1, 0, 2])  # [n, H, D]
        outs.append(o.astype(q.dtype))
    return paddle.concat(outs, axis=0)


# --------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------


@attrs.define
class Kernels:
    """The implementation chosen for each op, and why fused ones are off.

    ``varlen_attention`` is ``None`` when the flash kernel is unusable;
    ``causal_alignment`` says how it treats ``causal`` with q shorter than k.
    """

    rms_norm: Callable[..., Any] = rms_norm_plain
    rope: Callable[..., Any] = rope_plain
    swiglu: Callable[..., Any] = swiglu_plain
    varlen_attention: Callable[..., Any] | None = None
    causal_alignment: str = "bottom_right"
    fused: list[str] = attrs.field(factory=list)
    off: dict[str, str] = attrs.field(factory=dict)

    def describe(self) -> str:
        parts = [f"{n}=fused" for n in self.fused]
        parts += [f"{n}=plain ({why})" for n, why in self.off.items()]
        if "flash_attn" in self.fused:
            parts[self.fused.index("flash_attn")] = f"flash_attn=fused ({self.causal_alignment} causal)"
        return ", ".join(parts)


def _close(a: Any, b: Any, dtype: str) -> bool:
    x = np.asarray(a.astype("float32").numpy(), dtype=np.float64)
    y = np.asarray(b.astype("float32").numpy(), dtype=np.float64)
    tol = 1e-4 if dtype == "float32" else 3e-2
    return x.shape == y.shape and bool(np.all(np.abs(x - y) <= tol * (1.0 + np.abs(y))))


def _why(exc: BaseException) -> str:
    if isinstance(exc, _Unsupported):
        return str(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "not registered" in first or "NotFound" in first:
        return "no kernel for this place/dtype in this Paddle build"
    return f"{type(exc).__name__}: {first[:120]}"


def probe_kernels(
    dtype: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    disabled: Iterable[str] = (),
    device_reasons: dict[str, str] | None = None,
) -> Kernels:
    """Check each fused op on the current Paddle place in ``dtype`` (see the
    module docstring).  ``disabled`` ops (``FDX_GPU_DISABLE_FUSED``) and the
    device's ``device_reasons`` (op -> why it is gated off) are not tried."""
    import paddle

    k = Kernels()
    gated = dict(device_reasons or {})
    for name in disabled:
        gated.setdefault(name, "disabled by FDX_GPU_DISABLE_FUSED")
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> Any:
        return paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    def attempt(name: str, check: Callable[[], bool]) -> bool:
        if name in gated:
            k.off[name] = gated[name]
            return False
        try:
            ok = check()
        except Exception as exc:  # noqa: BLE001 - a probe reports, never raises
            k.off[name] = _why(exc)
            return False
        if not ok:
            k.off[name] = "disagrees with the plain op on the self-check"
            return False
        k.fused.append(name)
        return True

    x, w, r = rand(4, 64), rand(64), rand(4, 64)
    if attempt("rms_norm", lambda: all(
        _close(a, b, dtype) for a, b in zip(rms_norm_fused(x, w, 1e-5, r), rms_norm_plain(x, w, 1e-5, r))
    ) and _close(rms_norm_fused(x, w, 1e-5)[0], rms_norm_plain(x, w, 1e-5)[0], dtype)):
        k.rms_norm = rms_norm_fused

    T, D = 5, head_dim
    q, kk = rand(T, num_heads, D), rand(T, num_kv_heads, D)
    ang = rng.uniform(0, 6.28, (T, 1, D // 2))
    cos = paddle.to_tensor(np.concatenate([np.cos(ang)] * 2, axis=-1).astype(np.float32)).astype(dtype)
    sin = paddle.to_tensor(np.concatenate([np.sin(ang)] * 2, axis=-1).astype(np.float32)).astype(dtype)
    if attempt("rope", lambda: all(
        _close(a, b, dtype) for a, b in zip(rope_fused(q, kk, cos, sin), rope_plain(q, kk, cos, sin))
    )):
        k.rope = rope_fused

    g = rand(3, 128)
    if attempt("swiglu", lambda: _close(swiglu_fused(g), swiglu_plain(g), dtype)):
        k.swiglu = swiglu_fused

    def flash_check() -> bool:
        if dtype == "float32":
            raise _Unsupported("needs float16/bfloat16")
        # three sequences: prefill (3/3), decode (1/5), chunk with a prefix (2/4)
        ql, kl = [3, 1, 2], [3, 5, 4]
        cu_q = paddle.to_tensor(np.concatenate([[0], np.cumsum(ql)]).astype(np.int32))
        cu_k = paddle.to_tensor(np.concatenate([[0], np.cumsum(kl)]).astype(np.int32))
        qq = rand(sum(ql), num_heads, D)
        kv_k, kv_v = rand(sum(kl), num_kv_heads, D), rand(sum(kl), num_kv_heads, D)
        sc = 1.0 / float(np.sqrt(D))
        fused = varlen_attention_fused
        try:
            got = fused(qq, kv_k, kv_v, cu_q, cu_k, 3, 5, sc, True)
        except Exception:  # noqa: BLE001 - a build without grouped-query heads
            if num_heads == num_kv_heads:
                raise
            fused = repeat_kv_heads(varlen_attention_fused, num_heads // num_kv_heads)
            got = fused(qq, kv_k, kv_v, cu_q, cu_k, 3, 5, sc, True)
        k.varlen_attention = fused
        want = varlen_attention_reference(qq, kv_k, kv_v, cu_q, cu_k, 3, 5, sc, True)
        if _close(got, want, dtype):
            k.causal_alignment = "bottom_right"
            return True
        # an older build: causal aligned top-left; usable for decode rows
        # (causal=False) and for chunks starting at position 0 (q == k)
        top = varlen_attention_reference(qq, kv_k, kv_v, cu_q, cu_k, 3, 5, sc, True, alignment="top_left")
        nocausal = fused(qq, kv_k, kv_v, cu_q, cu_k, 3, 5, sc, False)
        want_nc = varlen_attention_reference(qq, kv_k, kv_v, cu_q, cu_k, 3, 5, sc, False)
        if _close(got, top, dtype) and _close(nocausal, want_nc, dtype):
            k.causal_alignment = "top_left"
            return True
        return False

    if not attempt("flash_attn", flash_check):
        k.varlen_attention = None
    return k


class _Unsupported(Exception):
    pass
