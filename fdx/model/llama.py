"""The CPU runner's model of the Llama family (Llama, Qwen2, Qwen3, Mistral...:
the architectures of :mod:`fdx.model.arch`): its weights and its kernels,
:class:`CPUKernels`, over a paged KV cache.  What a layer computes is not
here: :meth:`LlamaModel.forward` runs the shared recipe,
:func:`fdx.model.decoder.decoder_forward`, with this model's kernels (the GPU
runner's model runs the same recipe with its own), a fixed, small number of
ops per layer:

``fused_rms_norm`` (+residual) -> one q/k/v matmul -> attention -> o matmul
-> ``fused_rms_norm`` (+residual) -> one gate/up matmul -> ``swiglu`` -> down
matmul.

In the packed modes (int8, bfloat16), the whole layer stack is one call of the
C++ op ``fdx_decoder_layers`` (fdx/csrc/paddle_ops.cc), which runs those
same kernels in the same order (bit-identical, without ~8 op dispatches a
layer); :attr:`LlamaModel.fused_layers` ``= False`` keeps the per-layer ops.
A model with per-head q/k RMSNorm (``ModelArgs.qk_norm``, Qwen3) always
takes the per-layer path: the recipe's norm runs between the q/k/v matmul and
the attention op (which applies RoPE), with the same row-wise RMSNorm op.
So does a mixture of experts (``ModelArgs.num_experts``, Qwen3-MoE,
Mixtral): the layer's MLP is a :class:`fdx.model.moe.MoeBlock` (one
``fdx_moe`` call: router, tokens grouped by expert, one GEMM pair per
expert), the rest of the layer unchanged; in float32 its other matmuls
(q/k/v, o, the head) are ``fdx_fgemm``, so a token's bits do not depend on
its batch in float32 either.

Gemma (``ModelArgs.gemma_fields``) takes the per-layer path too, with a few
local additions: the embedding scale, a norm on the attention and on the MLP
output (sandwich norms, the same RMSNorm op), GeGLU in place of SwiGLU
(Paddle's tanh GELU), and a soft-capped logit.  Soft-capped scores (Gemma 2)
are computed by the pure-Paddle attention (:attr:`LlamaModel.paddle_attention`);
sliding windows (each layer's ``Layer.window``: Gemma's, or Mistral's where
shorter than the context) and Gemma 3's second rope table are arguments of
the C++ attention op too.

Attention (RoPE, KV-cache write, paged causal attention) is either the C++
op ``fdx_paged_attention`` (fdx/csrc/) or an equivalent pure-Paddle fallback.
Both read K/V only through the per-sequence block tables.

Three compute modes (:attr:`LlamaModel.mode`):

* ``"int8"``: every matmul, the LM head included, is the C++ int8 GEMM
  ``fdx_qgemm`` over the GGUF's Q4/Q8 blocks (packed at load by
  :mod:`fdx.model.packed_weights`; float weights are quantized to Q8_0),
  with activations quantized per row to Q8.  One kernel serves every row
  count with a fixed per-element reduction order, and every other op of the
  step (norms, attention, SwiGLU, embedding) works row by row, so a
  request's logits are bit-identical whatever else is in the step.  No
  float32 copy of the weights is kept.
* ``"bfloat16"``: the same op and path with kind-16 weights: every matmul
  rounds its activations to bf16 and multiplies them with the weights
  rounded to bf16 at load, accumulating in fp32 (``vdpbf16ps`` where the
  CPU has AVX512-BF16, else an fma sequence specified to give the same
  bits); batch-invariant by the same construction.  Norms and attention
  stay float32; the KV cache is float32 by default, bfloat16 with
  ``--kv-cache-dtype bfloat16`` (int8 compute's default; the runner picks).
* ``"float32"``: float32 weights and maths; steps of at most
  ``quant_max_rows`` rows read the GGUF blocks through the fp32 GEMV
  ``fdx_qgemv`` (exactly the dequantized weights), larger ones use Paddle's
  matmul (MKL) -- the exact path the parity tests hold to a reference.

Cache layout per layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
(K at index 0, V at 1).  Weights are stored ``[in, out]`` (q/k in Hugging Face
order, NEOX "rotate_half" RoPE).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Protocol

import attrs
import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.incubate.nn.functional import fused_rms_norm

from fdx.core.errors import FdxError, ModelLoadError
from fdx.model.arch import ModelArgs, long_rope_after, rope_angles
from fdx.model.decoder import decoder_forward
from fdx.model.loader import Checkpoint, LayerWeights
from fdx.model.moe import MoeBlock, build_moe
from fdx.model.hugepages import HugePageArena
from fdx.model.packed_weights import PackedWeight, pack_bf16, pack_float, pack_gguf


class Collective(Protocol):
    """The tensor-parallel collectives the forward pass makes (:mod:`fdx.parallel.shm_comm`,
    :mod:`fdx.parallel.gloo_comm`)."""

    #: the address of the all-reduce handle the fused decoder-layer op calls (0: none, per-layer path)
    handle: int

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """The sum over ranks of ``x`` (the same bits on every rank)."""

    def gather(self, x: paddle.Tensor) -> paddle.Tensor | None:
        """Rank 0: every rank's ``x [rows, cols]`` side by side; others: ``None``."""

#: the compute modes (``--dtype``): see the module docstring
MODES = ("int8", "bfloat16", "float32")
#: the modes whose matmuls are all ``fdx_qgemm`` over packed weights
PACKED_MODES = ("int8", "bfloat16")


#: default row limit for the quantized GEMV path (``FDX_QUANT_MAX_ROWS``)
QUANT_MAX_ROWS = int(os.environ.get("FDX_QUANT_MAX_ROWS", "64"))


@attrs.define
class StepInputs:
    """Per-step tensors, built once per step (never per layer).

    ``meta[t] = (sequence index, position)`` of flattened token ``t``;
    ``tables[s]`` is sequence ``s``'s block table (padded with 0);
    ``sample_rows`` are the token rows whose logits are computed.
    ``positions``/``seq_of``/``ctx_lens``/``q_lens`` (numpy) feed the
    pure-Paddle attention fallback.
    """

    ids: paddle.Tensor
    meta: paddle.Tensor
    tables: paddle.Tensor
    sample_rows: paddle.Tensor | None
    positions: np.ndarray
    seq_of: np.ndarray
    q_starts: np.ndarray
    q_lens: np.ndarray
    ctx_lens: np.ndarray
    tables_np: np.ndarray
    fallback: dict[str, Any] = attrs.field(factory=dict)
    #: LongRoPE past its original context: per row, whether it takes the long
    #: factors (:attr:`fdx.model.runner_base.StepLayout.long_rope`); ``None``: no such model
    long_rope: np.ndarray | None = None


@attrs.define
class Layer:
    """One decoder layer's tensors.  float32 mode: the ``w_*`` ([in, out])
    and, where the GGUF has them, the ``q_*`` block rows for the fp32 GEMV.
    Packed modes (int8, bfloat16): only the packed ``p_*`` (the ``w_*`` are ``None``)."""

    attn_norm: paddle.Tensor
    w_qkv: paddle.Tensor | None
    b_qkv: paddle.Tensor | None
    w_o: paddle.Tensor | None
    ffn_norm: paddle.Tensor
    w_gate_up: paddle.Tensor | None
    w_down: paddle.Tensor | None
    # GGUF block-quantized copies for few-row steps: (uint8 [out, bytes], ggml type)
    q_qkv: tuple[paddle.Tensor, int] | None = None
    q_o: tuple[paddle.Tensor, int] | None = None
    q_gate_up: tuple[paddle.Tensor, int] | None = None
    q_down: tuple[paddle.Tensor, int] | None = None
    # packed modes: for fdx_qgemm
    p_qkv: PackedWeight | None = None
    p_o: PackedWeight | None = None
    p_gate_up: PackedWeight | None = None
    p_down: PackedWeight | None = None
    # per-head q/k RMSNorm weights [head_dim] (ModelArgs.qk_norm)
    q_norm: paddle.Tensor | None = None
    k_norm: paddle.Tensor | None = None
    # Gemma: sandwich norms [hidden] (ModelArgs.sandwich_norms), the attention window (0: global)
    post_attn_norm: paddle.Tensor | None = None
    post_ffn_norm: paddle.Tensor | None = None
    window: int = 0
    # mixture of experts: the layer's MLP (the w/q/p gate_up and down are then None)
    moe: MoeBlock | None = None


def check_shape(x: np.ndarray | None, shape: tuple[int, ...], what: str, path: str) -> None:
    """A one-line :class:`ModelLoadError` unless ``x`` has ``shape``."""
    if x is None or tuple(x.shape) != shape:
        got = None if x is None else tuple(x.shape)
        raise ModelLoadError(f"{path}: {what} has shape {got}, expected {shape}")


def check_layer(lw: LayerWeights, a: ModelArgs, i: int, path: str) -> None:
    """Layer ``i``'s weights have the shapes ``a`` says (both runners' models check this at load)."""
    h, q, kv, ff = a.hidden_size, a.q_size, a.kv_size, a.intermediate_size
    E, f = 0 if i in a.dense_layers else a.num_experts, a.moe_intermediate_size  # a dense layer: the MLP's
    n = a.local_experts[1] if a.local_experts is not None else E  # the experts this rank holds
    sf = a.shared_expert_size
    shared = (("s_gate", (sf, h)), ("s_up", (sf, h)), ("s_down", (h, sf)), ("s_gate_inp", (h,))) if sf else ()
    mlp = ((("router", (E, h)), ("e_gate", (n, f, h)), ("e_up", (n, f, h)), ("e_down", (n, h, f)), *shared) if E else
           (("w_gate", (ff, h)), ("w_up", (ff, h)), ("w_down", (h, ff))))
    for name, shape in (
        ("wq", (q, h)), ("wk", (kv, h)), ("wv", (kv, h)), ("wo", (h, q)), *mlp,
        ("attn_norm", (h,)), ("ffn_norm", (h,)),
        *((("q_norm", (a.head_dim,)), ("k_norm", (a.head_dim,))) if a.qk_norm else ()),
        *((("post_attn_norm", (h,)), ("post_ffn_norm", (h,))) if a.sandwich_norms else ()),
    ):
        check_shape(getattr(lw, name), shape, f"layer {i} {name}", path)


def qkv_bias(lw: LayerWeights, a: ModelArgs) -> np.ndarray | None:
    """The fused q|k|v bias (float32; zeros for a missing part), ``None`` without biases."""
    if lw.bq is None and lw.bk is None and lw.bv is None:
        return None
    zeros = np.zeros
    return np.concatenate([
        lw.bq if lw.bq is not None else zeros(a.q_size, np.float32),
        lw.bk if lw.bk is not None else zeros(a.kv_size, np.float32),
        lw.bv if lw.bv is not None else zeros(a.kv_size, np.float32),
    ]).astype(np.float32)


def _to_paddle(p: PackedWeight, arena: HugePageArena) -> PackedWeight:
    """A packed weight as a CPU tensor in ``arena``'s huge pages (each step streams every one)."""
    return PackedWeight(arena.tensor(p.data), p.kind, p.n_out)


def rope_table(args: ModelArgs, max_pos: int, local: bool = False, long: bool = False) -> np.ndarray:
    """``[max_pos, head_dim]``: cos in the first half, sin in the second
    (rope scaling applied: :func:`fdx.model.arch.rope_angles`; ``local``:
    the windowed layers' base; ``long``: LongRoPE's long factors)."""
    ang = rope_angles(args, max_pos, local, long)
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


class LlamaModel:
    """Weights + forward.  Not thread-safe; one instance per runner."""

    def __init__(self, args: ModelArgs, max_pos: int, native_ops: Any | None, mode: str = "float32",
                 comm: Collective | None = None, vocab_start: int = 0, vocab_size: int | None = None) -> None:
        """``comm`` (tensor parallelism): this rank holds a shard (``args`` is
        its local geometry: :mod:`fdx.parallel.sharding`), ``comm`` sums the
        row-parallel partial products and gathers the vocab-parallel logits;
        ``vocab_start`` is its first vocabulary row, ``vocab_size`` the full
        vocabulary (rank 0's logits are cut to it)."""
        if mode not in MODES:
            raise ValueError(f"compute mode {mode!r}: choose one of {', '.join(MODES)}")
        if mode in PACKED_MODES and native_ops is None:
            raise ModelLoadError(f"{mode} compute needs fdx's native CPU ops (not loaded here); use --dtype float32")
        self.args = args
        self.ops = native_ops
        self.mode = mode
        self.comm = comm
        self.vocab_start = vocab_start
        self.full_vocab = vocab_size or args.vocab_size
        self.max_pos = max_pos
        from fdx.model.native import has_avx512

        self.fused_norm = not paddle.get_device().startswith("cpu") or has_avx512()
        self.scale = args.attn_scale if args.attn_scale is not None else 1.0 / math.sqrt(args.head_dim)
        rt = rope_table(args, max_pos)
        half = args.head_dim // 2
        #: LongRoPE past its original context: each row rotated by its own
        #: factor set before the attention (``_long_cos`` / ``_long_sin``: the
        #: short then the long table, ``[2 * max_pos, head_dim]``, indexed by
        #: ``position + max_pos * long``), which then gets an identity table
        #: (cos 1, sin 0: ``x * 1 - y * 0`` is ``x`` exactly)
        self.long_rope = long_rope_after(args, max_pos) is not None
        if self.long_rope:
            lt = rope_table(args, max_pos, long=True)
            both = np.concatenate([rt, lt], axis=0)
            self._long_cos = paddle.to_tensor(np.concatenate([both[:, :half], both[:, :half]], axis=1))
            self._long_sin = paddle.to_tensor(np.concatenate([-both[:, half:], both[:, half:]], axis=1))
            rt = np.concatenate([np.ones_like(rt[:, :half]), np.zeros_like(rt[:, half:])], axis=1)
        self.rope = paddle.to_tensor(rt)
        self._no_residual = paddle.zeros([0], dtype="float32")
        # fallback tables: x*cos_full + roll(x, half)*sin_signed == rotate_half RoPE
        self._cos_full = paddle.to_tensor(np.concatenate([rt[:, :half], rt[:, :half]], axis=1))
        self._sin_signed = paddle.to_tensor(np.concatenate([-rt[:, half:], rt[:, half:]], axis=1))
        if args.rope_local_theta is not None:  # the windowed layers' rope base (Gemma 3)
            lt = rope_table(args, max_pos, local=True)
            self._rope_local = paddle.to_tensor(lt)  # the C++ op's table for the windowed layers
            self._cos_local = paddle.to_tensor(np.concatenate([lt[:, :half], lt[:, :half]], axis=1))
            self._sin_local = paddle.to_tensor(np.concatenate([-lt[:, half:], lt[:, half:]], axis=1))
        #: the attention is the pure-Paddle one: the C++ op has no soft-capping
        #: (its sliding window and rope table serve Mistral's and Gemma 3's layers)
        self.paddle_attention = bool(args.attn_softcap)
        self.layers: list[Layer] = []
        self._arena = HugePageArena()  # the packed weights' memory (fdx/model/hugepages.py)
        self.embed: paddle.Tensor | None = None
        self.final_norm: paddle.Tensor | None = None
        self.lm_head: paddle.Tensor | None = None  # [hidden, V] when untied
        self.q_lm_head: tuple[paddle.Tensor, int] | None = None
        self.p_lm_head: PackedWeight | None = None
        #: float32 with experts: every matmul is ``fdx_fgemm`` (fdx/csrc/moe.cc), whose
        #: rows keep their bits in any batch, as ``fdx_moe``'s experts do (MKL's do not)
        self.fgemm = (native_ops.fdx_fgemm if mode == "float32" and args.num_experts
                      and hasattr(native_ops, "fdx_fgemm") else None)
        #: steps with at most this many token rows use the quantized GEMV
        self.quant_max_rows = QUANT_MAX_ROWS if native_ops is not None and self.fgemm is None else 0
        #: packed modes: run every layer in one ``fdx_decoder_layers`` call (same
        #: kernels, same bits as the per-layer path, without ~8 op dispatches a
        #: layer); ``False`` keeps the per-layer path (tests compare the two)
        self.fused_layers = (native_ops is not None and hasattr(native_ops, "fdx_decoder_layers")
                             and not args.qk_norm  # the op has no q/k norm
                             and not args.gemma_fields  # nor any of Gemma's additions
                             and not args.num_experts  # nor experts (it does tensor parallelism's all-reduces)
                             and not self.long_rope  # nor per-row rope factors
                             and (comm is None or bool(comm.handle))  # shm's all-reduce only (gloo's handle is 0)
                             and os.environ.get("FDX_FUSED_LAYERS", "1") != "0")  # 0: the per-layer path (tests)
        #: the fused layers take the weights' addresses (``fdx_decoder_stack``) instead of
        #: 7 tensors a layer (``fdx_decoder_layers``: the same kernels and bits, ~230 us more a
        #: step in Paddle's argument conversion); FDX_DECODER_STACK=0 keeps the tensors (benchmarks)
        self.stack_by_address = (self.fused_layers and hasattr(native_ops, "fdx_decoder_stack")
                                 and os.environ.get("FDX_DECODER_STACK", "1") != "0")
        self._stack: tuple[Any, ...] | None = None
        #: (the stack, its weight addresses, widths) for ``fdx_decoder_stack`` (:meth:`_stack_args`)
        self._stack_ptrs: tuple[Any, list[int], list[int]] | None = None

    # ------------------------------------------------------------------ weights

    @property
    def loaded(self) -> bool:
        return self.embed is not None

    def load(self, ckpt: Checkpoint, progress: bool = True) -> None:
        """Convert a checkpoint (numpy, HF layout) into fused Paddle tensors."""
        a = self.args
        if ckpt.args != a:
            raise ModelLoadError(f"{ckpt.source.path}: architecture mismatch ({ckpt.args.describe()} != {a.describe()})")
        layers: list[Layer] = []
        self._arena = HugePageArena()  # the packed weights' memory (a new one: the old tensors keep theirs)
        it = ckpt.layers()
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, total=a.num_layers, desc=f"loading {ckpt.source.name}", unit="layer", leave=False)
        for lw in it:
            layers.append(self._convert_layer(lw, ckpt.source.path, len(layers)))
        if len(layers) != a.num_layers:
            raise ModelLoadError(f"{ckpt.source.path}: expected {a.num_layers} layers, got {len(layers)}")
        check_shape(ckpt.embed, (a.vocab_size, a.hidden_size), "embedding", ckpt.source.path)
        check_shape(ckpt.final_norm, (a.hidden_size,), "final norm", ckpt.source.path)
        self.layers = layers
        self._stack = self._stack_ptrs = None  # the fused op's lists point at the old layers
        self.embed = paddle.to_tensor(np.ascontiguousarray(ckpt.embed, dtype=np.float32))
        self.final_norm = paddle.to_tensor(ckpt.final_norm.astype(np.float32))
        self.lm_head = self.q_lm_head = self.p_lm_head = None
        if ckpt.lm_head is not None:
            check_shape(ckpt.lm_head, (a.vocab_size, a.hidden_size), "lm_head", ckpt.source.path)
        if self.mode == "bfloat16":
            self.p_lm_head = _to_paddle(pack_bf16(ckpt.lm_head if ckpt.lm_head is not None else ckpt.embed), self._arena)
            return
        if self.mode == "int8":
            if ckpt.lm_head_raw is not None and ckpt.lm_head_raw[1] in (2, 3, 8):
                self.p_lm_head = _to_paddle(pack_gguf(*ckpt.lm_head_raw), self._arena)
            else:
                self.p_lm_head = _to_paddle(pack_float(ckpt.lm_head if ckpt.lm_head is not None else ckpt.embed), self._arena)
            return
        if ckpt.lm_head is not None or self.fgemm is not None:  # fdx_fgemm: a [hidden, V] copy of a tied head
            head = ckpt.lm_head if ckpt.lm_head is not None else ckpt.embed
            self.lm_head = paddle.to_tensor(np.ascontiguousarray(head.T, dtype=np.float32))
        if ckpt.lm_head_raw is not None:
            self.q_lm_head = (paddle.to_tensor(ckpt.lm_head_raw[0]), ckpt.lm_head_raw[1])

    def release(self) -> None:
        """Drop every weight tensor (sleep)."""
        self.layers = []
        self.embed = None
        self.final_norm = None
        self.lm_head = None
        self.q_lm_head = None
        self.p_lm_head = None
        self._stack = self._stack_ptrs = None
        self._arena = HugePageArena()  # the old one's mappings go with the last tensor in them

    def release_scratch(self) -> int:
        """Free the buffers the C++ kernels keep between calls, grown to the
        largest step so far (``fdx_release_scratch``: ~27 KB a batched token
        for SmolLM2); the bytes freed.  The next step grows them again."""
        if self.ops is None or not hasattr(self.ops, "fdx_release_scratch"):
            return 0
        return int(self.ops.fdx_release_scratch(paddle.zeros([1], "float32")).numpy()[0])

    def _stack_args(self, caches: list[paddle.Tensor]) -> tuple[list[int], list[int], list[int], list[int]]:
        """``fdx_decoder_stack``'s weight addresses (7 a layer: attn_norm,
        w_qkv, b_qkv or 0, w_o, ffn_norm, w_gate_up, w_down), widths (E,
        W, Q, 2F), kinds and windows, made once from :meth:`_layer_stack`'s tensors -- which this
        keeps alive -- after one ``fdx_decoder_layers`` call with no rows has
        run every check on them."""
        stack = self._layer_stack()
        if self._stack_ptrs is None or self._stack_ptrs[0] is not stack:
            an, wq, bq, wo, fn, wgu, wd, kinds, windows = stack
            a = self.args
            self.ops.fdx_decoder_layers(  # the weights' checks (shapes, kinds), on no rows
                paddle.zeros([0, a.hidden_size], dtype="float32"), self.rope, paddle.zeros([0, 2], dtype="int32"),
                paddle.zeros([1, 1], dtype="int32"), an, wq, bq, wo, fn, wgu, wd, list(caches), kinds, a.num_heads,
                a.rms_eps, self.scale, 0, windows)
            ptrs = [p for i in range(len(an)) for p in (
                an[i].data_ptr(), wq[i].data_ptr(), bq[i].data_ptr() if int(bq[i].numel()) else 0, wo[i].data_ptr(),
                fn[i].data_ptr(), wgu[i].data_ptr(), wd[i].data_ptr())]
            dims = [a.hidden_size, int(wq[0].shape[0]) * 8, int(wo[0].shape[1]) * 32, int(wgu[0].shape[0]) * 8]
            self._stack_ptrs = (stack, ptrs, dims)
        return self._stack_ptrs[1], self._stack_ptrs[2], stack[7], stack[8]

    def _layer_stack(self) -> tuple[Any, ...]:
        """The per-layer lists ``fdx_decoder_layers`` takes (built once after load)."""
        if self._stack is None:
            empty = paddle.zeros([0], dtype="float32")
            Ls = self.layers
            self._stack = (
                [l.attn_norm for l in Ls], [l.p_qkv.data for l in Ls],  # type: ignore[union-attr]
                [l.b_qkv if l.b_qkv is not None else empty for l in Ls], [l.p_o.data for l in Ls],  # type: ignore[union-attr]
                [l.ffn_norm for l in Ls], [l.p_gate_up.data for l in Ls], [l.p_down.data for l in Ls],  # type: ignore[union-attr]
                [k for l in Ls for k in (l.p_qkv.kind, l.p_o.kind, l.p_gate_up.kind, l.p_down.kind)],  # type: ignore[union-attr]
                [l.window for l in Ls],
            )
        return self._stack

    def _convert_layer(self, lw: LayerWeights, path: str, i: int) -> Layer:
        a = self.args
        check_layer(lw, a, i, path)
        if self.mode in PACKED_MODES:
            return self._pack_layer(lw, i)
        w_qkv = np.concatenate([lw.wq, lw.wk, lw.wv], axis=0).T
        b_qkv = qkv_bias(lw, a)
        moe = build_moe(lw, a, self.mode, self.ops) if a.num_experts else None
        t = lambda x: paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32))  # noqa: E731

        def fuse(*names: str) -> tuple[paddle.Tensor, int] | None:
            parts = [lw.raw.get(n) for n in names]
            if any(p is None for p in parts) or len({p[1] for p in parts}) != 1:  # type: ignore[index]
                return None
            rows = np.concatenate([p[0] for p in parts], axis=0)  # type: ignore[index]
            return paddle.to_tensor(rows), parts[0][1]  # type: ignore[index]

        return Layer(
            attn_norm=t(lw.attn_norm),
            w_qkv=t(w_qkv),
            b_qkv=t(b_qkv) if b_qkv is not None else None,
            w_o=t(lw.wo.T),
            ffn_norm=t(lw.ffn_norm),
            w_gate_up=None if moe else t(np.concatenate([lw.w_gate, lw.w_up], axis=0).T),
            w_down=None if moe else t(lw.w_down.T),
            moe=moe,
            q_qkv=fuse("wq", "wk", "wv"),
            q_o=fuse("wo"),
            q_gate_up=fuse("w_gate", "w_up"),
            q_down=fuse("w_down"),
            **self._layer_extras(lw, i),
        )

    def _layer_extras(self, lw: LayerWeights, i: int) -> dict[str, Any]:
        """The optional parts of layer ``i``: q/k norms, sandwich norms, its window."""
        a = self.args
        t = lambda x: paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32))  # noqa: E731
        # Gemma's per-layer windows, else Mistral's one window (kept only where shorter than the context)
        w = a.layer_windows[i] if a.layer_windows else a.sliding_window or 0
        out: dict[str, Any] = {"window": w} if w and (a.layer_windows or w < self.max_pos) else {}
        if a.qk_norm:
            out.update(q_norm=t(lw.q_norm), k_norm=t(lw.k_norm))
        if a.sandwich_norms:
            out.update(post_attn_norm=t(lw.post_attn_norm), post_ffn_norm=t(lw.post_ffn_norm))
        return out

    def _pack_layer(self, lw: LayerWeights, i: int) -> Layer:
        """Packed modes: the layer's matmuls packed for ``fdx_qgemm`` -- bfloat16:
        the float weights rounded to bf16; int8: the GGUF's own blocks where
        q|k|v and gate|up share a kernel type, else the float weights
        quantized to Q8_0."""
        a = self.args
        b_qkv = qkv_bias(lw, a)

        def pack(*names: str) -> PackedWeight:
            if self.mode == "bfloat16":
                return _to_paddle(pack_bf16(np.concatenate([getattr(lw, n) for n in names], axis=0)), self._arena)
            parts = [lw.raw.get(n) for n in names]
            if all(p is not None for p in parts) and len({p[1] for p in parts}) == 1 and parts[0][1] in (2, 3, 8):  # type: ignore[index]
                return _to_paddle(pack_gguf(np.concatenate([p[0] for p in parts], axis=0), parts[0][1]),  # type: ignore[index]
                                  self._arena)
            return _to_paddle(pack_float(np.concatenate([getattr(lw, n) for n in names], axis=0)), self._arena)

        t = lambda x: paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32))  # noqa: E731
        moe = build_moe(lw, a, self.mode, self.ops) if a.num_experts else None
        return Layer(
            attn_norm=t(lw.attn_norm), w_qkv=None, b_qkv=t(b_qkv) if b_qkv is not None else None, w_o=None,
            ffn_norm=t(lw.ffn_norm), w_gate_up=None, w_down=None, moe=moe,
            p_qkv=pack("wq", "wk", "wv"), p_o=pack("wo"),
            p_gate_up=None if moe else pack("w_gate", "w_up"), p_down=None if moe else pack("w_down"),
            **self._layer_extras(lw, i),
        )

    # ------------------------------------------------------------------ forward

    def forward(self, step: StepInputs, caches: list[paddle.Tensor]) -> paddle.Tensor | None:
        """Run the step (:func:`fdx.model.decoder.decoder_forward` with this
        model's :class:`CPUKernels`); return logits ``[len(sample_rows), V]`` (or None)."""
        return decoder_forward(self, CPUKernels(self, step, caches), step.ids, step.sample_rows, caches)

    def _long_rope_fn(self, step: StepInputs, T: int) -> Callable[[paddle.Tensor], paddle.Tensor]:
        """LongRoPE past the original context: q and k of each row rotated by
        its sequence's factor set (rotate_half, as the fallback attention;
        the attention op then applies the identity table)."""
        a = self.args
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        longs = step.long_rope if step.long_rope is not None else np.zeros(T, dtype=bool)
        idx = paddle.to_tensor(step.positions.astype(np.int64) + self.max_pos * longs.astype(np.int64))
        cos = paddle.index_select(self._long_cos, idx).unsqueeze(1)  # [T, 1, D]
        sin = paddle.index_select(self._long_sin, idx).unsqueeze(1)
        n_qk, half = (H + KV) * D, D // 2

        def rotate(qkv: paddle.Tensor) -> paddle.Tensor:
            qk = qkv[:, :n_qk].reshape([T, H + KV, D])
            qk = qk * cos + paddle.roll(qk, shifts=half, axis=-1) * sin
            return paddle.concat([qk.reshape([T, n_qk]), qkv[:, n_qk:]], axis=-1)

        return rotate

    def _lm_head(self, h: paddle.Tensor, R: int, qgemm: Any) -> paddle.Tensor:
        if qgemm is not None:
            assert self.p_lm_head is not None
            return qgemm(h, self.p_lm_head.data, self.p_lm_head.kind, self.p_lm_head.n_out)
        if self.q_lm_head is not None and self.ops is not None and R <= self.quant_max_rows:
            return self.ops.fdx_qgemv(h, self.q_lm_head[0], self.q_lm_head[1])
        if self.lm_head is not None:
            return self.fgemm(h, self.lm_head) if self.fgemm is not None else paddle.matmul(h, self.lm_head)
        return paddle.matmul(h, self.embed, transpose_y=True)

    # ------------------------------------------------------------------ fallback

    def _fallback_attention(self, step: StepInputs, bs: int) -> Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor]:
        """Pure-Paddle RoPE + cache write + padded causal attention (same
        maths as the C++ op; index tensors built once per step)."""
        a = self.args
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        G = H // KV
        fb = step.fallback
        if not fb:
            T = len(step.positions)
            S = len(step.q_lens)
            qmax = int(step.q_lens.max())
            lmax = int(step.ctx_lens.max())
            pos = step.positions
            seq = step.seq_of
            tb = step.tables_np.astype(np.int64)
            blk = tb[seq, pos // bs]
            off = pos % bs
            kh = np.arange(KV)
            # rows of the flattened [2*NB*KV*BS, D] cache view
            write_rows = ((blk[:, None] * KV + kh[None, :]) * bs + off[:, None]).reshape(-1)
            j = np.arange(lmax)
            jb = tb[:, np.minimum(j // bs, tb.shape[1] - 1)]  # [S, lmax]
            read_rows = ((jb[:, None, :] * KV + kh[None, :, None]) * bs + (j % bs)[None, None, :]).reshape(-1)
            # padded query rows: token index per (s, qi); padding points at row 0
            rowmap = np.zeros((S, qmax), dtype=np.int64)
            qpos = np.full((S, qmax), -1, dtype=np.int64)
            for s in range(S):
                n0, n = int(step.q_starts[s]), int(step.q_lens[s])
                rowmap[s, :n] = np.arange(n0, n0 + n)
                qpos[s, :n] = pos[n0 : n0 + n]
            valid_idx = np.flatnonzero((qpos >= 0).reshape(-1))
            allowed = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < step.ctx_lens[:, None, None])

            def additive(ok: np.ndarray) -> paddle.Tensor:
                mask = np.where(ok, 0.0, -1e30).astype(np.float32)  # [S, qmax, lmax]
                return paddle.to_tensor(np.repeat(mask[:, :, None, :], G, axis=2).reshape(S, 1, qmax * G, lmax))

            # per window (0: global): a windowed query sees keys pos - window < j <= pos
            masks = {w: additive(allowed & (j[None, None, :] > qpos[:, :, None] - w) if w else allowed)
                     for w in {0, *(layer.window for layer in self.layers)}}
            if a.rope_local_theta is not None:
                fb.update(cos_l=paddle.index_select(self._cos_local, paddle.to_tensor(pos)).unsqueeze(1),
                          sin_l=paddle.index_select(self._sin_local, paddle.to_tensor(pos)).unsqueeze(1))
            fb.update(
                T=T, S=S, qmax=qmax, lmax=lmax,
                cos=paddle.index_select(self._cos_full, paddle.to_tensor(pos)).unsqueeze(1),
                sin=paddle.index_select(self._sin_signed, paddle.to_tensor(pos)).unsqueeze(1),
                write_rows=paddle.to_tensor(write_rows),
                read_rows=paddle.to_tensor(read_rows),
                rowmap=paddle.to_tensor(rowmap.reshape(-1)),
                valid_idx=paddle.to_tensor(valid_idx),
                masks=masks,
            )
        half = D // 2
        cap = a.attn_softcap
        local = a.rope_local_theta is not None

        def attend(qkv: paddle.Tensor, cache: paddle.Tensor, layer: Layer) -> paddle.Tensor:
            T, S, qmax, lmax = fb["T"], fb["S"], fb["qmax"], fb["lmax"]
            qk = qkv[:, : (H + KV) * D].reshape([T, H + KV, D])
            cos, sin = (fb["cos_l"], fb["sin_l"]) if local and layer.window else (fb["cos"], fb["sin"])
            qk = qk * cos + paddle.roll(qk, shifts=half, axis=-1) * sin
            q = qk[:, :H]
            k = qk[:, H:].reshape([T * KV, D])
            v = qkv[:, (H + KV) * D :].reshape([T * KV, D])
            flat = cache.reshape([-1, D])
            nkv = flat.shape[0] // 2
            paddle.scatter_(flat, fb["write_rows"], k, overwrite=True)
            paddle.scatter_(flat, fb["write_rows"] + nkv, v, overwrite=True)
            kk = paddle.index_select(flat, fb["read_rows"]).reshape([S, KV, lmax, D])
            vv = paddle.index_select(flat, fb["read_rows"] + nkv).reshape([S, KV, lmax, D])
            qp = paddle.index_select(q.reshape([T, H * D]), fb["rowmap"]).reshape([S, qmax, KV, G, D])
            qp = qp.transpose([0, 2, 1, 3, 4]).reshape([S, KV, qmax * G, D])
            sc = paddle.matmul(qp, kk, transpose_y=True) * self.scale
            if cap is not None:  # Gemma 2: soft-capped scores, before the mask
                sc = paddle.tanh(sc / cap) * cap
            sc = sc + fb["masks"][layer.window]
            o = paddle.matmul(F.softmax(sc, axis=-1), vv)  # [S, KV, qmax*G, D]
            o = o.reshape([S, KV, qmax, G, D]).transpose([0, 2, 1, 3, 4]).reshape([S * qmax, H * D])
            return paddle.index_select(o, fb["valid_idx"])

        return attend


#: each matmul's float32 weight, GGUF block copy and packed weight on a :class:`Layer`
_LINEAR = {w: (f"w_{w}", f"q_{w}", f"p_{w}") for w in ("qkv", "o", "gate_up", "down")}


class CPUKernels:
    """The CPU model's kernels of one step (:class:`fdx.model.decoder.DecoderKernels`):
    the native C++ ops where loaded (``fdx_add_rms_norm``, ``fdx_swiglu``,
    ``fdx_paged_attention``; ``fdx_qgemm`` over the packed weights in the
    int8/bfloat16 modes, ``fdx_qgemv`` over the GGUF blocks for few-row
    float32 steps, ``fdx_fgemm`` for a float32 mixture of experts), else
    Paddle's; the pure-Paddle attention for Gemma 2's soft-caps; and the
    whole layer stack in one ``fdx_decoder_layers`` call where the model
    allows it (:attr:`LlamaModel.fused_layers`)."""

    def __init__(self, model: LlamaModel, step: StepInputs, caches: list[paddle.Tensor]) -> None:
        a = model.args
        ops = model.ops
        self.model, self.step = model, step
        eps = a.rms_eps
        bs = int(caches[0].shape[3])
        attend: Callable[[paddle.Tensor, paddle.Tensor, Layer], paddle.Tensor]
        if ops is not None and not model.paddle_attention:
            op = ops.fdx_paged_attention
            H, KV = a.num_heads, a.num_kv_heads
            meta, tables, rope, scale = step.meta, step.tables, model.rope, model.scale
            rope_l = model._rope_local if a.rope_local_theta is not None else rope  # Gemma 3's windowed layers

            def attend(qkv: paddle.Tensor, cache: paddle.Tensor, layer: Layer) -> paddle.Tensor:
                return op(qkv, cache, rope_l if layer.window else rope, meta, tables, H, KV, bs, scale, layer.window)
        else:
            attend = model._fallback_attention(step, bs)
        self._attend = attend
        T = int(step.ids.shape[0])
        self.packed = model.mode in PACKED_MODES
        if self.packed and ops is None:
            raise FdxError(f"{model.mode} compute needs fdx's native CPU ops, which are not loaded")
        self._qgemv = ops.fdx_qgemv if ops is not None and T <= model.quant_max_rows else None
        self.moe_gemm = self._qgemm = ops.fdx_qgemm if self.packed else None
        self._fgemm = model.fgemm
        self._long_rope = model._long_rope_fn(step, T) if model.long_rope else None
        if ops is not None:
            add_norm_op, self.swiglu = ops.fdx_add_rms_norm, ops.fdx_swiglu
            no_residual = model._no_residual

            def add_norm(x: paddle.Tensor, res: paddle.Tensor | None, w: paddle.Tensor) -> Any:
                return add_norm_op(x, no_residual if res is None else res, w, eps)
        elif model.fused_norm:
            self.swiglu = F.swiglu

            def add_norm(x: paddle.Tensor, res: paddle.Tensor | None, w: paddle.Tensor) -> Any:
                if res is None:
                    return fused_rms_norm(x, w, None, eps, 1)[0], x
                return fused_rms_norm(x, w, None, eps, 1, residual=res)
        else:  # Paddle's CPU fused_rms_norm is AVX-512 only (SIGILL elsewhere)
            self.swiglu = F.swiglu

            def add_norm(x: paddle.Tensor, res: paddle.Tensor | None, w: paddle.Tensor) -> Any:
                if res is not None:
                    x = x + res
                return x * paddle.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + eps) * w, x
        self.rms_norm = add_norm

    def linear(self, h: paddle.Tensor, layer: Layer, which: str) -> paddle.Tensor:
        wn, qn, pn = _LINEAR[which]
        if self._qgemm is not None:
            p = getattr(layer, pn)
            return self._qgemm(h, p.data, p.kind, p.n_out)
        if self._fgemm is not None:
            return self._fgemm(h, getattr(layer, wn))
        q = getattr(layer, qn)
        if q is not None and self._qgemv is not None:
            return self._qgemv(h, q[0], q[1])
        return paddle.matmul(h, getattr(layer, wn))

    def attention(self, qkv: paddle.Tensor, cache: paddle.Tensor, layer: Layer, i: int) -> paddle.Tensor:
        if self._long_rope is not None:  # each row's own factor set, before the op's identity table
            qkv = self._long_rope(qkv)
        return self._attend(qkv, cache, layer)

    def lm_head(self, h: paddle.Tensor) -> paddle.Tensor:
        return self.model._lm_head(h, int(h.shape[0]), self._qgemm)

    def fused_stack(self, x: paddle.Tensor, caches: list[paddle.Tensor]) -> tuple[paddle.Tensor, paddle.Tensor] | None:
        m = self.model
        if not (self.packed and m.fused_layers):
            return None
        a, step, comm = m.args, self.step, m.comm
        tp = comm.handle if comm is not None else 0
        if m.stack_by_address:  # the weights as addresses: no 7 x L tensors to convert a step
            ptrs, dims, kinds, windows = m._stack_args(caches)
            return tuple(m.ops.fdx_decoder_stack(x, m.rope, step.meta, step.tables, list(caches), ptrs, dims, kinds,
                                                 a.num_heads, a.rms_eps, m.scale, tp, windows))
        an, wq, bq, wo, fn, wgu, wd, kinds, windows = m._layer_stack()
        x, residual = m.ops.fdx_decoder_layers(
            x, m.rope, step.meta, step.tables, an, wq, bq, wo, fn, wgu, wd, list(caches), kinds,
            a.num_heads, a.rms_eps, m.scale, tp, windows)
        return x, residual
