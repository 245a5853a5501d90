"""A mixture-of-experts MLP block (Qwen3-MoE, Mixtral) for :class:`fdx.model.llama.LlamaModel`.

Per layer: router logits ``h @ W_router^T`` ``[T, E]`` -> softmax over the
``E`` experts -> the top ``k`` (highest first) -> when
``ModelArgs.norm_topk_prob``, those ``k`` weights divided by their sum
(Mixtral's "softmax over the selected logits" is exactly this) -> each
token's output is ``sum_j w_j * SwiGLU_{e_j}(h)``, the experts' SwiGLU the
dense MLP's (one gate|up matmul, ``swiglu``, one down matmul).

One native call.  With the native ops loaded, the whole block -- router
GEMM, softmax, top-k and its normalisation, the pairs grouped by expert,
each held expert's gate|up GEMM, SwiGLU and down GEMM over all its rows,
the weighted slot sums -- is one ``fdx_moe`` call (fdx/csrc/moe.cc), which
also returns every token's picked experts for the load count.  Without
them (:meth:`MoeBlock.grouped`): the step's ``T * k`` (token, slot) pairs
are sorted by expert (one stable ``argsort``), each expert with rows runs
one gate|up and one down matmul over all of them, the outputs are weighted,
put back in (token, slot) order with one ``index_select`` and the ``k``
slots added in slot order -- a Python loop over the experts, never over
tokens.

The router stays float32 in every mode (as vLLM and FastDeploy keep the
gate unquantized), and so does the shared expert's ``[hidden, 1]`` gate:
an int8 or bf16 router's error flips near-tied expert choices, and a
flipped expert changes the token's whole MLP output (measured on the
random Qwen3-MoE: int8 top-1 against float32 91/96 with a Q8_0 router, the
logits moved by up to 1.9 where a choice flipped).  The router is ``E``
columns, a small share of the block's work.

Qwen2-MoE adds a shared expert (``ModelArgs.shared_expert_size``): every
token also runs one more SwiGLU (the same ops, its own width), scaled by
``sigmoid(h . w)`` of its ``[hidden]`` gate (one more matmul, ``[hidden, 1]``),
and added after the routed experts' sum (transformers' order).

A dense layer of a mixture (``ModelArgs.dense_layers``: Qwen2/3-MoE's
``mlp_only_layers`` and ``decoder_sparse_step``) is a block with ``dense``
set: no router and no experts, its MLP the dense SwiGLU of
``intermediate_size`` (held in the shared expert's fields, with no gate),
as transformers' ``Qwen2MoeMLP``; its :attr:`MoeBlock.routed` stays 0.

Expert parallelism (``ModelArgs.local_experts``, fdx/parallel/sharding.py).
A rank holds experts ``[first, first + n)`` only; the router is whole, so
every rank picks the same experts for every token, and a rank computes
only the pairs whose expert it holds (the others' rows are zeros).  Its
output is then a partial sum, which the layer's all-reduce completes (in
rank order; for top-2 the sum is the one-rank sum exactly, as ``a + 0 = a``
and two terms commute).

Load.  :attr:`MoeBlock.routed` counts the (token, slot) pairs routed to
each expert, every step's tokens included, for ``/metrics``
(``fdx:moe_expert_tokens``).

Batch invariance.  ``fdx_moe`` computes every token from its own row only:
in the packed modes (int8, bfloat16) every expert GEMM is ``fdx_qgemm``'s
kernel, whose result for a row does not depend on the other rows of the
call (fdx/csrc/qgemm.cc); the router's GEMM (every mode) and float32's
expert GEMMs are moe.cc's own fma chains (``fdx_fgemm``), one per element
in input order, whatever the row count;
softmax, top-k, SwiGLU, the weighting and the slot sums are row-wise.  So a
token's output is the same bits whichever tokens share its step or its
experts, in all three modes, and with both kernel sets.  (The pure-Paddle
fallback's float32 matmuls are MKL's, whose result for a row changes with
the row count.)
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import numpy as np
import paddle
import paddle.nn.functional as F

from fdx.model.arch import ModelArgs
from fdx.model.loader import LayerWeights
from fdx.model.packed_weights import PackedWeight, pack_bf16, pack_float


@attrs.define
class MoeBlock:
    """One layer's router and experts.  ``router`` ``[hidden, E]``, float32
    in every mode; float32: per expert ``w_gate_up`` ``[hidden, 2 * width]``
    / ``w_down`` ``[width, hidden]``; packed modes: the ``p_*`` for
    ``fdx_qgemm`` instead (the float lists are empty).  Immutable after load; not thread-safe to
    call concurrently (like the model)."""

    top_k: int
    renormalize: bool
    #: the router's experts (all ``E``, whichever this rank holds)
    num_routed: int
    #: the global index of this block's first expert (expert parallelism)
    first: int = 0
    router: paddle.Tensor | None = None
    w_gate_up: list[paddle.Tensor] = attrs.field(factory=list)
    w_down: list[paddle.Tensor] = attrs.field(factory=list)
    p_gate_up: list[PackedWeight] = attrs.field(factory=list)
    p_down: list[PackedWeight] = attrs.field(factory=list)
    #: a dense layer (the module docstring): ``s_gate_up`` / ``s_down`` (or packed) only
    dense: bool = False
    #: the native ``fdx_moe`` op (fdx/csrc/moe.cc), or ``None``: the pure-Paddle path
    op: Any | None = None
    #: with the native ops: ``fdx_fgemm`` for the float32 matmuls (row-invariant): the
    #: pure-Paddle router's and the shared expert's gate, and in float32 its other two
    fgemm: Any | None = None
    #: the shared expert (Qwen2-MoE): gate|up and down (float32, or packed) and its
    #: gate ``[hidden, 1]`` (float32 in every mode); all ``None`` without one
    s_gate_up: paddle.Tensor | None = None
    s_down: paddle.Tensor | None = None
    s_gate: paddle.Tensor | None = None
    ps_gate_up: PackedWeight | None = None
    ps_down: PackedWeight | None = None
    #: (token, slot) pairs routed to each of the ``num_routed`` experts so far
    routed: np.ndarray = attrs.field(init=False, default=attrs.Factory(
        lambda self: np.zeros(self.num_routed, dtype=np.int64), takes_self=True))
    _op_args: tuple[Any, ...] | None = attrs.field(init=False, default=None, repr=False)

    @property
    def num_experts(self) -> int:
        """The experts this block holds."""
        return len(self.w_gate_up) or len(self.p_gate_up)

    def __call__(self, h: paddle.Tensor, swiglu: Callable[[paddle.Tensor], paddle.Tensor],
                 qgemm: Any | None) -> paddle.Tensor:
        """The block's output ``[T, hidden]`` for the normed hidden states ``h``
        (``qgemm``: the packed modes' op, ``None`` in float32): the routed
        experts in one ``fdx_moe`` call where the native ops are loaded, else
        the pure-Paddle path (:meth:`grouped`); then the shared expert, if any."""

        def linear(x: paddle.Tensor, w: paddle.Tensor | None, p: PackedWeight | None) -> paddle.Tensor:
            if qgemm is not None and p is not None:
                return qgemm(x, p.data, p.kind, p.n_out)
            return self.fgemm(x, w) if self.fgemm is not None else paddle.matmul(x, w)  # float32

        shared = (None if self.s_gate_up is None and self.ps_gate_up is None else
                  linear(swiglu(linear(h, self.s_gate_up, self.ps_gate_up)), self.s_down, self.ps_down))
        if self.dense:
            assert shared is not None
            return shared
        out = self.grouped(h, swiglu, linear) if self.op is None else self._native(h)
        if shared is None:
            return out
        # Paddle's CPU sigmoid takes a scalar path for the elements past the last
        # full vector (other bits, measured on a [T, 1] input): 16 copies of each
        # row's gate put every element in a full vector, whatever T
        g = linear(h, self.s_gate, None)  # [T, 1], float32
        gate = F.sigmoid(paddle.expand(g, [int(g.shape[0]), 16]))[:, :1]
        return out + gate * shared

    def _native(self, h: paddle.Tensor) -> paddle.Tensor:
        """The routed experts' weighted sum in one ``fdx_moe`` call (fdx/csrc/moe.cc)."""
        if self._op_args is None:  # the weights never change after load: their lists are built once
            if self.p_gate_up:
                self._op_args = (self.router, [p.data for p in self.p_gate_up], [p.data for p in self.p_down],
                                 self.p_gate_up[0].kind)
            else:
                self._op_args = (self.router, self.w_gate_up, self.w_down, 0)
        router, gate_up, down, kind = self._op_args
        out, ids = self.op(h, router, gate_up, down, kind, self.num_routed, self.top_k, self.renormalize, self.first)
        self.routed += np.bincount(ids.numpy().reshape(-1), minlength=self.num_routed)
        return out

    def grouped(self, h: paddle.Tensor, swiglu: Callable[[paddle.Tensor], paddle.Tensor],
                linear: Callable[..., paddle.Tensor]) -> paddle.Tensor:
        """The routed experts' weighted sum ``[T, hidden]``, pure Paddle (no
        native ops): the same routing and sums, a loop over the experts (never
        over tokens)."""
        qgemm = bool(self.p_gate_up)
        T, k = int(h.shape[0]), self.top_k
        probs = F.softmax(linear(h, self.router, None), axis=-1)  # the router in float32
        weights, experts = paddle.topk(probs, k, axis=-1)  # [T, k], highest first
        if self.renormalize:
            total = weights[:, 0:1]
            for j in range(1, k):  # a fixed order per row
                total = total + weights[:, j : j + 1]
            weights = weights / total
        flat = experts.numpy().reshape(-1)  # slot j of token t at t * k + j
        routed = np.bincount(flat, minlength=self.num_routed)
        self.routed += routed
        lo, n_held = self.first, self.num_experts
        counts = routed[lo : lo + n_held]  # this rank's experts' rows
        # expert parallelism: the pairs of this rank's experts (None: it holds every expert)
        pairs = None if n_held == self.num_routed else np.flatnonzero((flat >= lo) & (flat < lo + n_held))
        order = (np.argsort(flat, kind="stable") if pairs is None
                 else pairs[np.argsort(flat[pairs], kind="stable")])
        if not order.size:  # none of this rank's experts was picked
            return paddle.zeros_like(h)
        x = paddle.index_select(h, paddle.to_tensor(order // k))  # the pairs' rows, grouped by expert
        w_sorted = paddle.index_select(weights.reshape([-1]), paddle.to_tensor(order)).unsqueeze(1)
        outs, start = [], 0
        for e in np.flatnonzero(counts):
            n = int(counts[e])
            xe = x[start : start + n]
            pg = self.p_gate_up[e] if qgemm else None
            pd = self.p_down[e] if qgemm else None
            wg = self.w_gate_up[e] if not qgemm else None
            wd = self.w_down[e] if not qgemm else None
            outs.append(linear(swiglu(linear(xe, wg, pg)), wd, pd))
            start += n
        y = (paddle.concat(outs, axis=0) if len(outs) > 1 else outs[0]) * w_sorted
        inverse = np.empty_like(order) if pairs is None else np.full(flat.size, order.size)
        inverse[order] = np.arange(order.size)
        if pairs is not None:  # another rank's pair reads this zero row
            y = paddle.concat([y, paddle.zeros([1, int(y.shape[1])], dtype=y.dtype)], axis=0)
        y = paddle.index_select(y, paddle.to_tensor(inverse)).reshape([T, k, -1])  # (token, slot) order
        out = y[:, 0]
        for j in range(1, k):  # slot order, whatever the batch
            out = out + y[:, j]
        return out


def build_moe(lw: LayerWeights, args: ModelArgs, mode: str, ops: Any | None = None) -> MoeBlock:
    """A layer's :class:`MoeBlock` in compute mode ``mode`` (``float32``,
    ``int8``: the float weights quantized to Q8_0, ``bfloat16``: rounded);
    ``ops``: the native op module (its ``fdx_moe`` runs the block)."""
    first = args.local_experts[0] if args.local_experts is not None else 0
    blk = MoeBlock(top_k=args.num_experts_per_tok, renormalize=args.norm_topk_prob, num_routed=args.num_experts,
                   first=first, op=getattr(ops, "fdx_moe", None), dense=lw.router is None)
    if blk.op is not None:
        blk.fgemm = getattr(ops, "fdx_fgemm", None)
    if blk.dense:  # a dense layer: its SwiGLU in the shared expert's fields, no gate
        assert lw.w_gate is not None and lw.w_up is not None and lw.w_down is not None
        lw = attrs.evolve(lw, router=np.zeros((0, lw.w_gate.shape[1]), np.float32), e_gate=[], e_up=[], e_down=[],
                          s_gate=lw.w_gate, s_up=lw.w_up, s_down=lw.w_down, s_gate_inp=None)
    assert lw.router is not None and lw.e_gate is not None and lw.e_up is not None and lw.e_down is not None
    gate_up = [np.concatenate([g, u], axis=0) for g, u in zip(lw.e_gate, lw.e_up)]  # [2 * width, hidden]
    t = lambda x: paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32))  # noqa: E731
    blk.router = t(lw.router.T)  # float32 in every mode (the module docstring)
    if lw.s_gate_inp is not None:
        blk.s_gate = t(lw.s_gate_inp.reshape(-1, 1))
    if mode == "float32":
        blk.w_gate_up = [t(w.T) for w in gate_up]
        blk.w_down = [t(w.T) for w in lw.e_down]
        if lw.s_gate is not None:
            blk.s_gate_up = t(np.concatenate([lw.s_gate, lw.s_up], axis=0).T)
            blk.s_down = t(lw.s_down.T)
        return blk
    pack = pack_bf16 if mode == "bfloat16" else pack_float

    def p(w: np.ndarray) -> PackedWeight:
        q = pack(w)
        return PackedWeight(paddle.to_tensor(q.data), q.kind, q.n_out)

    blk.p_gate_up = [p(w) for w in gate_up]
    blk.p_down = [p(w) for w in lw.e_down]
    if lw.s_gate is not None:
        blk.ps_gate_up = p(np.concatenate([lw.s_gate, lw.s_up], axis=0))
        blk.ps_down = p(lw.s_down)
    return blk
