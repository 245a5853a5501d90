"""The GPU runner's model of the Llama family (every architecture of
:mod:`fdx.model.arch`): half-precision weights and KV, and its kernels
(:class:`GPUKernels`: Paddle's fused kernels where the device has them, plain
Paddle elsewhere) for the shared recipe, :func:`fdx.model.decoder.decoder_forward`,
which the CPU model runs with its own kernels.

Weights live on the device in the runner's dtype (bfloat16, float16, or
float32 for the CPU-place fallback).  GGUF quantized tensors are dequantized
to float32 on the host by the loader and cast on the device; the raw quant
blocks the CPU runner keeps for its C++ GEMV are never uploaded (no kernel
here reads them).

One :meth:`GPULlama.forward` runs every token of a step (flattened to ``T``
rows) through the recipe, per layer: RMSNorm(+residual) -> one q/k/v matmul -> RoPE -> KV write
-> paged attention -> o matmul -> RMSNorm(+residual) -> one gate/up matmul ->
SwiGLU -> down matmul.  RMSNorm, RoPE and SwiGLU are the fused or plain ops
chosen by :func:`fdx.model.fused_kernels.probe_kernels`.

KV cache: per layer one flat ``[2 * num_blocks * num_kv_heads * block_size,
head_dim]`` tensor (row ``((kv * NB + block) * KV + head) * BS + slot``, the
``[2, NB, KV, BS, D]`` layout of the CPU runner, flattened once at
allocation).  New K/V are scattered to their slots; attention reads K/V only
through the block tables, in :class:`AttnGroup`\\ s planned on the host once
per step:

* ``varlen`` groups gather each sequence's context rows and call the
  variable-length flash kernel (**GPU-only**; ``flash_attn_unpadded``);
* ``plain`` groups run a padded, masked attention in plain Paddle (any
  place; softmax in float32) -- the path the CPU tests exercise.

A mixture-of-experts layer (Qwen3-MoE, Mixtral) is the CPU model's own
:class:`fdx.model.moe.MoeBlock`, built by the same ``build_moe`` and cast to
the runner's dtype: its float32 path is plain Paddle (router, top-k, one
gate/up and down matmul per expert over its rows), so it runs on any place.

Tensor parallelism (``comm``, :mod:`fdx.model.tp_runner`): ``args`` is the
rank's local geometry (:mod:`fdx.parallel.sharding`), the embedding
vocab-parallel (this rank's rows, zeros for other ids, summed over the
ranks), one all-reduce after o and one after down (the row-parallel partial
sums), and rank 0 gathers the ranks' logit columns before the device
sampler (the others return ``None``).  The all-reduce and the gather are
``comm``'s: Paddle's nccl on GPUs, gloo on the CPU place.

LongRoPE past its original context (Phi-3): each row's cos/sin come from
the short or the long factors' rows, as its sequence's
:attr:`fdx.model.runner_base.StepLayout.long_rope` says (the CPU model's rule).

Gemma (``ModelArgs.gemma_fields``) adds, as the CPU model does: the
embedding scale (in the weights' dtype, as transformers), the sandwich
norms, GeGLU, the windowed layers' own rope tables (Gemma 3) and the final
soft-cap (on the float32 logits).  Soft-capped scores and sliding windows
are computed only by the ``plain`` groups (the flash kernel has neither), so
such a model plans every sequence there (:attr:`GPULlama.plain_attention`),
with one mask per window.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import numpy as np

from fdx.core.errors import ModelLoadError
from fdx.model.arch import ModelArgs, long_rope_after, rope_angles
from fdx.model.fused_kernels import Kernels
from fdx.model.decoder import decoder_forward
from fdx.model.llama import check_layer, check_shape, qkv_bias
from fdx.model.moe import MoeBlock, build_moe


@attrs.define
class AttnGroup:
    """Sequences attended together.  ``rows``: their token rows in the step
    (``None``: all rows, in order).  ``kind`` is ``varlen`` or ``plain``."""

    kind: str
    rows: Any | None
    causal: bool = True
    # varlen
    read_rows: Any = None
    cu_q: Any = None
    cu_k: Any = None
    max_q: int = 0
    max_k: int = 0
    # plain
    pad_rows: Any = None  # [S*KV*lmax] cache rows (padded contexts)
    rowmap: Any = None  # [S*qmax] token row per padded query slot
    valid: Any = None  # padded query slots that are real tokens
    mask: Any = None  # [S, 1, qmax*G, lmax] additive
    window_masks: Any = None  # {window: mask} of the windowed layers (Gemma)
    S: int = 0
    qmax: int = 0
    lmax: int = 0


@attrs.define
class GPUStep:
    """Per-step device tensors (built once per step, never per layer)."""

    ids: Any
    cos: Any  # [T, 1, D]
    sin: Any
    write_rows: Any  # [T*KV] K rows; V rows are + half
    groups: list[AttnGroup]
    sample_rows: Any | None
    num_tokens: int
    cos_local: Any = None  # the windowed layers' tables (ModelArgs.rope_local_theta)
    sin_local: Any = None


@attrs.define
class GPULayer:
    attn_norm: Any
    w_qkv: Any
    b_qkv: Any | None
    w_o: Any
    ffn_norm: Any
    w_gate_up: Any  # None in a mixture-of-experts layer
    w_down: Any
    moe: MoeBlock | None = None  # a mixture-of-experts layer's router and experts (fdx.model.moe)
    q_norm: Any | None = None  # per-head q/k RMSNorm [head_dim] (ModelArgs.qk_norm)
    k_norm: Any | None = None
    post_attn_norm: Any | None = None  # Gemma's sandwich norms (ModelArgs.sandwich_norms)
    post_ffn_norm: Any | None = None


def rope_tables(args: ModelArgs, max_pos: int, local: bool = False,
                long: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``([cos, cos], [sin, sin])`` rows ``[max_pos, head_dim]`` (float32), rope
    scaling applied (:func:`fdx.model.arch.rope_angles`, as the CPU model;
    ``local``: the windowed layers' base; ``long``: LongRoPE's long factors)."""
    ang = rope_angles(args, max_pos, local, long)
    cos, sin = np.cos(ang), np.sin(ang)
    return (np.concatenate([cos, cos], axis=1).astype(np.float32),
            np.concatenate([sin, sin], axis=1).astype(np.float32))


class GPULlama:
    """Weights + forward on one Paddle place.  Not thread-safe."""

    def __init__(self, args: ModelArgs, max_pos: int, dtype: str, kernels: Kernels, comm: Any = None,
                 vocab_start: int = 0, vocab_size: int | None = None) -> None:
        """``comm``: tensor parallelism (see the module docstring); ``vocab_start``
        is this rank's first vocabulary row, ``vocab_size`` the full vocabulary."""
        import paddle

        self.args = args
        self.comm = comm
        self.vocab_start = vocab_start
        self.full_vocab = vocab_size or args.vocab_size
        self.dtype = dtype
        self.kernels = kernels
        self.max_pos = max_pos
        self.scale = args.attn_scale if args.attn_scale is not None else 1.0 / math.sqrt(args.head_dim)
        cos, sin = rope_tables(args, max_pos)
        #: LongRoPE past its original context: the tables hold the short then the
        #: long factors' rows (``[2 * max_pos, head_dim]``), a row's index is
        #: ``position + max_pos * long`` (:attr:`fdx.model.runner_base.StepLayout.long_rope`)
        self.long_rope = long_rope_after(args, max_pos) is not None
        if self.long_rope:
            lc, ls = rope_tables(args, max_pos, long=True)
            cos, sin = np.concatenate([cos, lc]), np.concatenate([sin, ls])
        self.cos = paddle.to_tensor(cos).astype(dtype)
        self.sin = paddle.to_tensor(sin).astype(dtype)
        self.cos_local = self.sin_local = None
        if args.rope_local_theta is not None:
            cos, sin = rope_tables(args, max_pos, local=True)
            self.cos_local, self.sin_local = paddle.to_tensor(cos).astype(dtype), paddle.to_tensor(sin).astype(dtype)
        #: each layer's sliding window (0: global): Gemma's, or Mistral's one
        #: window where shorter than the context (empty: none)
        w = args.sliding_window
        self.layer_windows = args.layer_windows or ((w,) * args.num_layers if w and w < max_pos else ())
        #: soft-capped scores or sliding windows: every sequence in a ``plain`` group
        self.plain_attention = bool(args.attn_softcap or any(self.layer_windows))
        self.layers: list[GPULayer] = []
        self.embed: Any | None = None
        self.final_norm: Any | None = None
        self.lm_head: Any | None = None  # [hidden, V] when untied
        #: GGUF tensors dequantized at the last load (their raw blocks stay on the host)
        self.dequantized = 0

    # ------------------------------------------------------------------ weights

    @property
    def loaded(self) -> bool:
        return self.embed is not None

    def _t(self, x: np.ndarray) -> Any:
        import paddle

        t = paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32))
        return t if self.dtype == "float32" else t.astype(self.dtype)

    def load(self, ckpt: Any, progress: bool = True) -> None:
        """Convert a checkpoint (numpy float32, HF layout) into fused device
        tensors in the runner's dtype.  Raw GGUF quant blocks are dropped.
        The new weights replace the old ones only once all are built, so a
        failed load leaves the model as it was."""
        a = self.args
        if ckpt.args != a:
            raise ModelLoadError(f"{ckpt.source.path}: architecture mismatch ({ckpt.args.describe()} != {a.describe()})")
        layers: list[GPULayer] = []
        dq = 0
        it = ckpt.layers()
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, total=a.num_layers, desc=f"loading {ckpt.source.name} ({self.dtype})", unit="layer", leave=False)
        for lw in it:
            i = len(layers)
            check_layer(lw, a, i, ckpt.source.path)
            dq += len(lw.raw)
            lw.raw = {}  # never uploaded: no kernel of this runner reads quant blocks
            b_qkv = qkv_bias(lw, a)
            moe = self._moe(lw) if a.num_experts else None
            layers.append(GPULayer(
                attn_norm=self._t(lw.attn_norm),
                w_qkv=self._t(np.concatenate([lw.wq, lw.wk, lw.wv], axis=0).T),
                b_qkv=self._t(b_qkv) if b_qkv is not None else None,
                w_o=self._t(lw.wo.T),
                ffn_norm=self._t(lw.ffn_norm),
                w_gate_up=None if moe else self._t(np.concatenate([lw.w_gate, lw.w_up], axis=0).T),
                w_down=None if moe else self._t(lw.w_down.T),
                moe=moe,
                q_norm=self._t(lw.q_norm) if a.qk_norm else None,
                k_norm=self._t(lw.k_norm) if a.qk_norm else None,
                post_attn_norm=self._t(lw.post_attn_norm) if a.sandwich_norms else None,
                post_ffn_norm=self._t(lw.post_ffn_norm) if a.sandwich_norms else None,
            ))
        if len(layers) != a.num_layers:
            raise ModelLoadError(f"{ckpt.source.path}: expected {a.num_layers} layers, got {len(layers)}")
        check_shape(ckpt.embed, (a.vocab_size, a.hidden_size), "embedding", ckpt.source.path)
        check_shape(ckpt.final_norm, (a.hidden_size,), "final norm", ckpt.source.path)
        lm_head = None
        if ckpt.lm_head is not None:
            check_shape(ckpt.lm_head, (a.vocab_size, a.hidden_size), "lm_head", ckpt.source.path)
            lm_head = self._t(ckpt.lm_head.T)
        embed, final_norm = self._t(ckpt.embed), self._t(ckpt.final_norm)
        self.layers, self.embed, self.final_norm, self.lm_head = layers, embed, final_norm, lm_head
        if ckpt.lm_head_raw is not None:
            dq += 1
        self.dequantized = dq

    def _moe(self, lw: Any) -> MoeBlock:
        """A layer's router and experts: the CPU model's :class:`MoeBlock`
        (its float32 path is plain Paddle, so it runs on any place), its
        tensors cast to the runner's dtype."""
        blk = build_moe(lw, self.args, "float32")
        if self.dtype != "float32":
            blk.router = blk.router.astype(self.dtype)
            blk.w_gate_up = [w.astype(self.dtype) for w in blk.w_gate_up]
            blk.w_down = [w.astype(self.dtype) for w in blk.w_down]
            for f in ("s_gate_up", "s_down", "s_gate"):  # Qwen2-MoE's shared expert
                if getattr(blk, f) is not None:
                    setattr(blk, f, getattr(blk, f).astype(self.dtype))
        return blk

    def release(self) -> None:
        """Drop every weight tensor (sleep)."""
        self.layers = []
        self.embed = None
        self.final_norm = None
        self.lm_head = None

    # ------------------------------------------------------------------ forward

    def forward(self, step: GPUStep, caches: Sequence[Any]) -> Any | None:
        """Run the step (:func:`fdx.model.decoder.decoder_forward` with this
        model's :class:`GPUKernels`); return float32 logits ``[len(sample_rows), V]`` (or None)."""
        return decoder_forward(self, GPUKernels(self, step), step.ids, step.sample_rows, caches)

    def _attention(self, step: GPUStep, q: Any, cache: Any, half: int, window: int = 0) -> Any:
        """``[T, H*D]`` attention output of every token row."""
        import paddle

        a = self.args
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        T = step.num_tokens
        outs = []
        for g in step.groups:
            qg = q if g.rows is None else paddle.index_select(q, g.rows)
            if g.kind == "varlen":
                kg = paddle.index_select(cache, g.read_rows).reshape([-1, KV, D])
                vg = paddle.index_select(cache, g.read_rows + half).reshape([-1, KV, D])
                o = self.kernels.varlen_attention(qg, kg, vg, g.cu_q, g.cu_k, g.max_q, g.max_k, self.scale, g.causal)
                outs.append(o.reshape([-1, H * D]))
            else:
                outs.append(self._plain_attention(g, qg, cache, half, window))
        if len(step.groups) == 1 and step.groups[0].rows is None:
            return outs[0]
        out = paddle.zeros([T, H * D], dtype=q.dtype)
        for g, o in zip(step.groups, outs):
            paddle.scatter_(out, g.rows, o, overwrite=True)
        return out

    def _plain_attention(self, g: AttnGroup, q: Any, cache: Any, half: int, window: int = 0) -> Any:
        """Padded causal attention over the group's block tables (plain
        Paddle; scores and softmax in float32; Gemma: the scores soft-capped,
        a windowed layer's own mask)."""
        import paddle
        import paddle.nn.functional as F

        a = self.args
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        G = H // KV
        S, qmax, lmax = g.S, g.qmax, g.lmax
        kk = paddle.index_select(cache, g.pad_rows).reshape([S, KV, lmax, D])
        vv = paddle.index_select(cache, g.pad_rows + half).reshape([S, KV, lmax, D])
        qp = paddle.index_select(q.reshape([-1, H * D]), g.rowmap).reshape([S, qmax, KV, G, D])
        qp = qp.transpose([0, 2, 1, 3, 4]).reshape([S, KV, qmax * G, D])
        sc = paddle.matmul(qp, kk, transpose_y=True)
        if sc.dtype != paddle.float32:
            sc = sc.astype("float32")
        cap = self.args.attn_softcap
        if cap is None:
            p = F.softmax(sc * self.scale + (g.window_masks[window] if window else g.mask), axis=-1)
        else:
            sc = sc * self.scale
            p = F.softmax(paddle.tanh(sc / cap) * cap + (g.window_masks[window] if window else g.mask), axis=-1)
        if vv.dtype != paddle.float32:
            p = p.astype(vv.dtype)
        o = paddle.matmul(p, vv)  # [S, KV, qmax*G, D]
        o = o.reshape([S, KV, qmax, G, D]).transpose([0, 2, 1, 3, 4]).reshape([S * qmax, H * D])
        return paddle.index_select(o, g.valid)


class GPUKernels:
    """The GPU runner's kernels of one step (:class:`fdx.model.decoder.DecoderKernels`):
    the RMSNorm, RoPE and SwiGLU :func:`fdx.model.fused_kernels.probe_kernels`
    chose (fused or plain), Paddle's matmul over the weights in the runner's
    dtype, and the attention of :meth:`GPULlama._attention` over the flat
    paged cache (K/V scattered to their rows first)."""

    moe_gemm = None  # a MoeBlock's float path (plain Paddle, any place)

    def __init__(self, model: GPULlama, step: GPUStep) -> None:
        self.model, self.step = model, step
        self.kernels, self.eps = model.kernels, model.args.rms_eps
        self.swiglu = model.kernels.swiglu
        self.windows = model.layer_windows

    def rms_norm(self, x: Any, residual: Any | None, w: Any) -> tuple[Any, Any]:
        return self.kernels.rms_norm(x, w, self.eps, residual)

    def linear(self, h: Any, layer: GPULayer, which: str) -> Any:
        import paddle

        return paddle.matmul(h, getattr(layer, "w_" + which))

    def attention(self, qkv: Any, cache: Any, layer: GPULayer, i: int) -> Any:
        import paddle

        m, step = self.model, self.step
        H, KV, D = m.args.num_heads, m.args.num_kv_heads, m.args.head_dim
        T = step.num_tokens
        window = self.windows[i] if self.windows else 0
        q, k, v = paddle.split(qkv, [H * D, KV * D, KV * D], axis=-1)
        cos, sin = (step.cos_local, step.sin_local) if window and step.cos_local is not None else (step.cos, step.sin)
        q, k = self.kernels.rope(q.reshape([T, H, D]), k.reshape([T, KV, D]), cos, sin)
        half = int(cache.shape[0]) // 2
        paddle.scatter_(cache, step.write_rows, k.reshape([T * KV, D]), overwrite=True)
        paddle.scatter_(cache, step.write_rows + half, v.reshape([T * KV, D]), overwrite=True)
        return m._attention(step, q, cache, half, window)

    def lm_head(self, h: Any) -> Any:
        import paddle

        m = self.model
        if m.lm_head is not None:
            return paddle.matmul(h, m.lm_head)
        return paddle.matmul(h, m.embed, transpose_y=True)

    def fused_stack(self, x: Any, caches: Sequence[Any]) -> None:
        return None


# --------------------------------------------------------------------------
# host-side planning (numpy; once per step)
# --------------------------------------------------------------------------


def plan_groups(
    kernels: Kernels, q_lens: np.ndarray, starts: np.ndarray, tables: np.ndarray,
    num_kv_heads: int, block_size: int, group_size: int, plain_only: bool = False,
    windows: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Split a step's sequences into attention groups (as numpy dicts; the
    runner uploads them).  With a bottom-right-causal flash kernel: one
    ``varlen`` group.  With a top-left one: decode rows (causal off) and
    chunks from position 0 go to flash, the rest to ``plain``.  Without
    flash, or ``plain_only`` (Gemma's caps and windows): one ``plain`` group,
    with a mask per non-zero entry of ``windows`` too."""
    S = len(q_lens)
    q_starts = np.zeros(S, dtype=np.int64)
    np.cumsum(q_lens[:-1], out=q_starts[1:])
    if kernels.varlen_attention is None or plain_only:
        return [_plain(np.arange(S), None, q_lens, starts, q_starts, tables, num_kv_heads, block_size, group_size,
                       windows)]
    if kernels.causal_alignment == "bottom_right":
        return [_varlen(np.arange(S), None, q_lens, starts, q_starts, tables, num_kv_heads, block_size, True)]
    out = []
    decode = np.flatnonzero(q_lens == 1)
    fresh = np.flatnonzero((q_lens > 1) & (starts == 0))
    rest = np.flatnonzero((q_lens > 1) & (starts > 0))
    for seqs, causal in ((decode, False), (fresh, True)):
        if len(seqs):
            out.append(_varlen(seqs, _rows(seqs, q_starts, q_lens), q_lens, starts, q_starts, tables,
                               num_kv_heads, block_size, causal))
    if len(rest):
        out.append(_plain(rest, _rows(rest, q_starts, q_lens), q_lens, starts, q_starts, tables,
                          num_kv_heads, block_size, group_size))
    if len(out) == 1:
        out[0]["rows"] = None  # every row, in order
    return out


def _rows(seqs: np.ndarray, q_starts: np.ndarray, q_lens: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(q_starts[s], q_starts[s] + q_lens[s]) for s in seqs]).astype(np.int64)


def _context_rows(tb: np.ndarray, ctx: np.ndarray, KV: int, bs: int) -> np.ndarray:
    """Cache rows ``[sum(ctx) * KV]`` of each sequence's positions 0..ctx-1."""
    seq = np.repeat(np.arange(len(ctx)), ctx)
    j = np.arange(int(ctx.sum())) - np.repeat(np.cumsum(ctx) - ctx, ctx)
    blk = tb[seq, j // bs]
    return ((blk[:, None] * KV + np.arange(KV)[None, :]) * bs + (j % bs)[:, None]).reshape(-1)


def _varlen(seqs: np.ndarray, rows: np.ndarray | None, q_lens: np.ndarray, starts: np.ndarray,
            q_starts: np.ndarray, tables: np.ndarray, KV: int, bs: int, causal: bool) -> dict[str, Any]:
    ql, ctx = q_lens[seqs], starts[seqs] + q_lens[seqs]
    return dict(
        kind="varlen", rows=rows, causal=causal,
        read_rows=_context_rows(tables[seqs].astype(np.int64), ctx, KV, bs),
        cu_q=np.concatenate([[0], np.cumsum(ql)]).astype(np.int32),
        cu_k=np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32),
        max_q=int(ql.max()), max_k=int(ctx.max()),
    )


def _plain(seqs: np.ndarray, rows: np.ndarray | None, q_lens: np.ndarray, starts: np.ndarray,
           q_starts: np.ndarray, tables: np.ndarray, KV: int, bs: int, G: int,
           windows: tuple[int, ...] = ()) -> dict[str, Any]:
    S = len(seqs)
    ql, st = q_lens[seqs], starts[seqs]
    ctx = st + ql
    qmax, lmax = int(ql.max()), int(ctx.max())
    tb = tables[seqs].astype(np.int64)
    j = np.arange(lmax)
    jb = tb[:, np.minimum(j // bs, tb.shape[1] - 1)]  # [S, lmax]
    pad_rows = ((jb[:, None, :] * KV + np.arange(KV)[None, :, None]) * bs + (j % bs)[None, None, :]).reshape(-1)
    # the group's token rows are numbered 0.. in the order of ``rows``
    local_start = np.zeros(S, dtype=np.int64)
    np.cumsum(ql[:-1], out=local_start[1:])
    rowmap = np.zeros((S, qmax), dtype=np.int64)
    qpos = np.full((S, qmax), -1, dtype=np.int64)
    for i in range(S):
        n = int(ql[i])
        rowmap[i, :n] = np.arange(local_start[i], local_start[i] + n)
        qpos[i, :n] = np.arange(st[i], st[i] + n)
    valid = np.flatnonzero((qpos >= 0).reshape(-1))
    allowed = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < ctx[:, None, None])

    def additive(ok: np.ndarray) -> np.ndarray:
        mask = np.where(ok, 0.0, -1e30).astype(np.float32)
        return np.repeat(mask[:, :, None, :], G, axis=2).reshape(S, 1, qmax * G, lmax)

    # a windowed query sees keys pos - window < j <= pos (as the CPU model)
    wm = {w: additive(allowed & (j[None, None, :] > qpos[:, :, None] - w)) for w in set(windows) - {0}}
    return dict(kind="plain", rows=rows, pad_rows=pad_rows, rowmap=rowmap.reshape(-1), valid=valid,
                mask=additive(allowed), S=S, qmax=qmax, lmax=lmax, window_masks=wm or None)

