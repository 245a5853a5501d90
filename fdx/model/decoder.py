"""The decoder recipe, written once for every runner: what a Llama-family
layer computes, in what order, with each architecture's quirks
(:mod:`fdx.model.arch`'s ``ModelArgs``).  The device-specific parts (which
kernel does the RMSNorm, the GEMMs, RoPE + KV write + paged attention, the
KV layout, the weights' format) are a :class:`DecoderKernels` object that
the runner's model builds for each step: the CPU model's
(:class:`fdx.model.llama.CPUKernels`: native C++ ops over packed int8/bf16
or float32 weights) and the GPU runner's
(:class:`fdx.model.gpu_llama.GPUKernels`: Paddle's fused kernels, flash or
plain paged attention).  The device's kernels differ; the model does not.

Per step (``T`` token rows, every sequence's prefill chunk or decode token):

* the embedding (vocab-parallel under tensor parallelism: this rank's rows,
  zeros elsewhere, summed over the ranks), times Gemma's ``embed_scale``;
* per layer: RMSNorm(+residual) -> the q|k|v matmul (+ bias) -> Qwen3's
  per-head q/k RMSNorm -> attention (the kernel's: RoPE with the layer's
  table, the KV write, paged causal attention with the layer's sliding
  window and Gemma 2's score soft-cap) -> the o matmul -> all-reduce (a
  row-parallel layer) -> Gemma's post-attention norm -> RMSNorm(+residual)
  -> the MLP (gate|up, SwiGLU or Gemma's GeGLU, down) or the layer's
  :class:`fdx.model.moe.MoeBlock` -> all-reduce -> Gemma's post-MLP norm;
* the final RMSNorm of the sampled rows, the LM head (float32 logits),
  Gemma's final soft-cap, and rank 0's gather of the vocabulary shards.

A kernel set may run the whole layer stack as one call
(:meth:`DecoderKernels.fused_stack`: the CPU's ``fdx_decoder_layers``, the
same kernels in the same order, offered only for models whose recipe it
computes); otherwise the layer loop here runs.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import paddle
import paddle.nn.functional as F

from fdx.model.arch import ModelArgs


class DecoderLayer(Protocol):
    """The parts of a layer the recipe reads (the matmul weights are the kernels' business)."""

    attn_norm: Any
    b_qkv: Any | None
    ffn_norm: Any
    q_norm: Any | None
    k_norm: Any | None
    post_attn_norm: Any | None
    post_ffn_norm: Any | None
    moe: Any | None


class DecoderWeights(Protocol):
    """A runner's model as the recipe sees it."""

    args: ModelArgs
    layers: Sequence[Any]
    embed: Any
    final_norm: Any
    comm: Any
    vocab_start: int
    full_vocab: int


class DecoderKernels(Protocol):
    """One step's device kernels (built once per step, never per layer)."""

    #: the matmul a :class:`fdx.model.moe.MoeBlock` runs its experts with (``None``: its float path)
    moe_gemm: Any

    def rms_norm(self, x: paddle.Tensor, residual: paddle.Tensor | None, w: Any) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``(rms_norm(x + residual) * w, x + residual)`` (no residual: ``x``), the model's eps."""

    def linear(self, x: paddle.Tensor, layer: Any, which: str) -> paddle.Tensor:
        """``x @ W`` of the layer's ``which`` matmul: ``qkv``, ``o``, ``gate_up`` or ``down``."""

    def swiglu(self, gate_up: paddle.Tensor) -> paddle.Tensor:
        """``silu(gate) * up`` of a ``[T, 2F]`` gate|up product."""

    def attention(self, qkv: paddle.Tensor, cache: Any, layer: Any, i: int) -> paddle.Tensor:
        """Layer ``i``: RoPE of q and k (its table: local base, LongRoPE's per-row
        factors), k and v written to ``cache``, and the paged causal attention
        (its window, the score soft-cap) of every row: ``[T, H * D]``."""

    def lm_head(self, h: paddle.Tensor) -> paddle.Tensor:
        """The logits of the final-normed sampled rows (float32)."""

    def fused_stack(self, x: paddle.Tensor, caches: Sequence[Any]) -> tuple[paddle.Tensor, paddle.Tensor] | None:
        """Every layer in one call, ``(x, residual)``; ``None``: run the layer loop."""


def geglu(gate_up: paddle.Tensor) -> paddle.Tensor:
    """``gelu_tanh(gate) * up`` of a ``[T, 2F]`` gate|up product (Gemma's MLP;
    element-wise, so row by row as SwiGLU)."""
    gate, up = paddle.split(gate_up, 2, axis=-1)
    return F.gelu(gate, approximate=True) * up


def decoder_forward(m: DecoderWeights, k: DecoderKernels, ids: paddle.Tensor, sample_rows: paddle.Tensor | None,
                    caches: Sequence[Any]) -> paddle.Tensor | None:
    """One step: float32 logits ``[len(sample_rows), V]`` (``None``: no sampled
    rows, or a tensor-parallel rank other than 0)."""
    a = m.args
    H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
    T = int(ids.shape[0])
    comm = m.comm
    if comm is None:
        x = F.embedding(ids, m.embed)
    else:  # vocab-parallel: the rows of this rank's ids, zeros elsewhere; the sum completes them
        local = ids - m.vocab_start
        mine = paddle.logical_and(local >= 0, local < a.vocab_size)
        x = F.embedding(paddle.where(mine, local, paddle.zeros_like(local)), m.embed)
        x = comm.all_reduce(x * mine.astype(x.dtype).unsqueeze(1))
    if a.embed_scale is not None:  # Gemma: sqrt(hidden_size) in the activations' dtype, as transformers
        x = (x * a.embed_scale if x.dtype == paddle.float32 else
             x * paddle.to_tensor(a.embed_scale, dtype="float32").astype(x.dtype))
    mlp = geglu if a.mlp_act == "gelu_tanh" else k.swiglu
    norm = k.rms_norm
    residual = None
    stacked = k.fused_stack(x, caches)
    if stacked is not None:
        x, residual = stacked
    else:
        for i, (layer, cache) in enumerate(zip(m.layers, caches)):
            h, residual = norm(x, residual, layer.attn_norm)
            qkv = k.linear(h, layer, "qkv")
            if layer.b_qkv is not None:
                qkv = qkv + layer.b_qkv
            if layer.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k, before RoPE
                q, kk, v = paddle.split(qkv, [H * D, KV * D, KV * D], axis=-1)
                q = norm(q.reshape([T * H, D]), None, layer.q_norm)[0].reshape([T, H * D])
                kk = norm(kk.reshape([T * KV, D]), None, layer.k_norm)[0].reshape([T, KV * D])
                qkv = paddle.concat([q, kk, v], axis=-1)
            x = k.linear(k.attention(qkv, cache, layer, i), layer, "o")
            if comm is not None:  # row-parallel o: sum the ranks' partial products
                x = comm.all_reduce(x)
            if layer.post_attn_norm is not None:  # Gemma's sandwich norm, before the residual
                x = norm(x, None, layer.post_attn_norm)[0]
            h, residual = norm(x, residual, layer.ffn_norm)
            if layer.moe is not None:
                x = layer.moe(h, mlp, k.moe_gemm)
            else:
                x = k.linear(mlp(k.linear(h, layer, "gate_up")), layer, "down")
            if comm is not None:  # row-parallel down, or the ranks' experts (expert parallelism)
                x = comm.all_reduce(x)
            if layer.post_ffn_norm is not None:
                x = norm(x, None, layer.post_ffn_norm)[0]
    if sample_rows is None:
        return None
    if int(sample_rows.shape[0]) != T:
        x = paddle.index_select(x, sample_rows)
        residual = paddle.index_select(residual, sample_rows)
    h, _ = norm(x, residual, m.final_norm)
    logits = k.lm_head(h)
    if logits.dtype != paddle.float32:
        logits = logits.astype("float32")
    if a.final_softcap is not None:  # Gemma: element-wise, so per vocabulary shard too
        logits = paddle.tanh(logits / a.final_softcap) * a.final_softcap
    if comm is None:
        return logits
    full = comm.gather(logits)  # vocab-parallel: rank 0 gets every rank's columns (float32)
    return full[:, : m.full_vocab] if full is not None else None
