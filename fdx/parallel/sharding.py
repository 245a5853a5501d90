"""Which slice of each weight a tensor-parallel rank holds (Megatron-LM's layout).

With ``world`` ranks, rank ``r`` holds:

* **column-parallel** q/k/v and gate/up: its ``1/world`` of the output rows --
  query heads ``[r*H/N, (r+1)*H/N)``, KV heads ``[r*KV/N, (r+1)*KV/N)`` (so a
  local query head still reads the local KV head of its group), MLP rows
  ``[r*F/N, (r+1)*F/N)`` of both gate and up;
* **row-parallel** o and down: the matching ``1/world`` of the input columns;
  each rank's product is a partial sum, and one all-reduce after the layer
  adds them (``fdx.model.llama`` does it);
* **vocab-parallel** embedding and LM head: vocabulary rows
  ``[r*Vp, (r+1)*Vp)`` with ``Vp = ceil(V/N)`` (the last shard zero-padded).
  A rank embeds the ids in its range (zeros elsewhere; the all-reduce
  completes the rows exactly) and computes its logit columns; rank 0 gathers
  them and drops the padding;
* norms: every rank a full copy; the paged KV cache: its KV heads only.

A mixture-of-experts layer keeps its router whole on every rank (so every
rank routes every token alike) and splits its experts one of two ways:

* **expert parallel** (``--enable-expert-parallel``): rank ``r`` holds whole
  experts ``[r*E/N, (r+1)*E/N)`` (``ModelArgs.local_experts``), read from the
  checkpoint alone (the other experts' tensors are never read), and
  computes only their (token, slot) pairs; the others' rows are zero;
* **tensor parallel** (without the flag): every expert's gate/up rows
  ``[r*f/N, (r+1)*f/N)`` and the matching input columns of its down
  (Megatron-style, as the dense MLP).

Either way a rank's MLP output is a partial sum, completed by the same
all-reduce as the dense MLP's down.

A rank's shard is a :class:`~fdx.model.loader.Checkpoint` of the *local*
geometry (:func:`local_args`), so the model code that loads and runs it is
the TP=1 code.  GGUF block rows are sliced too: by rows always, by columns
where the split falls on block boundaries (else that weight's fp32 GEMV copy
is dropped and the rank uses the float weights).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import attrs
import numpy as np

from fdx.core.errors import ConfigError
from fdx.model.arch import ModelArgs
from fdx.model.loader import Checkpoint, LayerWeights

#: GGUF block types whose rows slice by column: type -> (elements, bytes) per block
_BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 0: (1, 4)}


@attrs.frozen
class TensorShard:
    """One rank's place in the group and the slice of the model it holds."""

    rank: int
    world: int
    #: the full model's geometry
    full: ModelArgs
    #: this rank's geometry (heads, KV heads, MLP or expert width and vocabulary rows
    #: divided; or, expert parallel, ``local_experts`` set)
    local: ModelArgs
    #: the first vocabulary row this rank holds
    vocab_start: int


def check_divisible(args: ModelArgs, world: int, expert_parallel: bool = False) -> None:
    """A one-line :class:`ConfigError` unless the model splits into ``world``
    ranks (``expert_parallel``: its experts whole, ``--enable-expert-parallel``)."""
    flag = f"--tensor-parallel-size {world}" + (" --enable-expert-parallel" if expert_parallel else "")
    if expert_parallel and not args.num_experts:
        raise ConfigError(f"--enable-expert-parallel: the model ({args.describe()}) has no experts; the flag applies "
                          f"to mixture-of-experts models only (Qwen3-MoE, Mixtral)")
    if not args.num_experts:
        mlp, hint = ("MLP width", args.intermediate_size), "MLP width"
    elif expert_parallel:
        mlp, hint = ("experts", args.num_experts), "the number of experts"
    else:
        mlp = ("expert width", args.moe_intermediate_size)
        hint = "the expert width (or add --enable-expert-parallel to divide the experts)"
    shared = (("shared expert width", args.shared_expert_size),) if args.shared_expert_size and not expert_parallel else ()
    if args.dense_layers and not expert_parallel:  # a mixture's dense layers (Qwen2-MoE's mlp_only_layers)
        shared += (("dense MLP width", args.intermediate_size),)
    bad = [f"{what} {n}" for what, n in (("attention heads", args.num_heads), ("KV heads", args.num_kv_heads), mlp,
                                         *shared) if n % world]
    if bad:
        raise ConfigError(f"{flag}: the model's {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible "
                          f"by {world} ({args.describe()}); choose a size that divides heads, KV heads and {hint}")


def local_args(args: ModelArgs, world: int, rank: int = 0, expert_parallel: bool = False) -> ModelArgs:
    """Rank ``rank``'s geometry (see the module docstring)."""
    check_divisible(args, world, expert_parallel)
    mlp: dict[str, Any] = {"intermediate_size": args.intermediate_size // world}
    if args.num_experts and expert_parallel:
        per = args.num_experts // world
        mlp = {"local_experts": (rank * per, per)}
    elif args.num_experts:
        mlp["moe_intermediate_size"] = args.moe_intermediate_size // world
        if args.shared_expert_size:  # Qwen2-MoE's shared expert: its width divided as the experts'
            mlp["shared_expert_size"] = args.shared_expert_size // world
    return attrs.evolve(args, num_heads=args.num_heads // world, num_kv_heads=args.num_kv_heads // world,
                        vocab_size=-(-args.vocab_size // world), **mlp)


def make_shard(args: ModelArgs, rank: int, world: int, expert_parallel: bool = False) -> TensorShard:
    loc = local_args(args, world, rank, expert_parallel)
    return TensorShard(rank, world, args, loc, rank * loc.vocab_size)


def held_experts(s: TensorShard) -> range | None:
    """The experts rank ``s.rank`` holds under expert parallelism (``None``: a part of every expert)."""
    le = s.local.local_experts
    return range(le[0], le[0] + le[1]) if le is not None else None


def _rows(w: np.ndarray | None, r: int, n: int) -> np.ndarray | None:
    return None if w is None else w[r * n : (r + 1) * n]


def _vocab_rows(w: np.ndarray, s: TensorShard) -> np.ndarray:
    """Rows ``[start, start + Vp)`` of a ``[V, ...]`` array, zero-padded past ``V``."""
    vp = s.local.vocab_size
    part = w[s.vocab_start : s.vocab_start + vp]
    if part.shape[0] == vp:
        return part
    pad = np.zeros((vp - part.shape[0],) + tuple(w.shape[1:]), dtype=w.dtype)
    return np.concatenate([part, pad], axis=0)


def _raw_cols(raw: tuple[np.ndarray, int], r: int, world: int, n_in: int) -> tuple[np.ndarray, int] | None:
    rows, kind = raw
    blk = _BLOCKS.get(kind)
    if blk is None or (n_in // world) % blk[0]:
        return None
    per = (n_in // world) // blk[0] * blk[1]
    return np.ascontiguousarray(rows[:, r * per : (r + 1) * per]), kind


def _shard_experts(lw: LayerWeights, s: TensorShard) -> dict[str, Any]:
    """A MoE layer's experts for rank ``s.rank``: its own whole ones (expert
    parallel; already so when the loader read only those), else every
    expert's slice of the expert width."""
    assert lw.e_gate is not None and lw.e_up is not None and lw.e_down is not None
    held = held_experts(s)
    if held is not None:
        if len(lw.e_gate) == len(held):  # the loader read only this rank's experts
            return _shard_shared(lw, s)
        cut = slice(held.start, held.stop)
        return dict(e_gate=lw.e_gate[cut], e_up=lw.e_up[cut], e_down=lw.e_down[cut], **_shard_shared(lw, s))
    r, f = s.rank, s.local.moe_intermediate_size
    return dict(e_gate=lw.e_gate[:, r * f : (r + 1) * f], e_up=lw.e_up[:, r * f : (r + 1) * f],
                e_down=lw.e_down[:, :, r * f : (r + 1) * f], **_shard_shared(lw, s))


def _shard_shared(lw: LayerWeights, s: TensorShard) -> dict[str, Any]:
    """Qwen2-MoE's shared expert on rank ``s.rank``: a slice of its width
    (tensor parallel: each rank's partial output times the same gate, the
    all-reduce sums them), or, expert parallel, whole on rank 0 and a zero
    down projection elsewhere (an exact 0 to the sum)."""
    if lw.s_down is None:
        return {}
    if held_experts(s) is not None:
        return {} if s.rank == 0 else dict(s_down=np.zeros_like(lw.s_down))
    r, f = s.rank, s.local.shared_expert_size
    return dict(s_gate=lw.s_gate[r * f : (r + 1) * f], s_up=lw.s_up[r * f : (r + 1) * f],
                s_down=lw.s_down[:, r * f : (r + 1) * f])


def shard_layer(lw: LayerWeights, s: TensorShard) -> LayerWeights:
    a, r, N = s.full, s.rank, s.world
    hq, hk, f = a.q_size // N, a.kv_size // N, a.intermediate_size // N
    col = {"wq": hq, "wk": hk, "wv": hk}  # output rows
    row = {"wo": a.q_size}  # input columns
    if lw.router is None:  # a dense MLP (also a mixture's dense layer)
        col.update(w_gate=f, w_up=f)
        row.update(w_down=a.intermediate_size)
    raw: dict[str, tuple[np.ndarray, int]] = {}
    for name, (blocks, kind) in lw.raw.items():
        if name in col:
            raw[name] = (blocks[r * col[name] : (r + 1) * col[name]], kind)
        elif name in row:
            cut = _raw_cols((blocks, kind), r, N, row[name])
            if cut is not None:
                raw[name] = cut
    if lw.router is not None:
        mlp = _shard_experts(lw, s)
    elif held_experts(s) is not None:  # expert parallel: a mixture's dense layer whole on rank 0, 0 elsewhere
        mlp = {} if r == 0 else dict(w_down=np.zeros_like(lw.w_down))
    else:
        mlp = dict(w_gate=_rows(lw.w_gate, r, f), w_up=_rows(lw.w_up, r, f), w_down=lw.w_down[:, r * f : (r + 1) * f])
    return attrs.evolve(
        lw,
        wq=_rows(lw.wq, r, hq), wk=_rows(lw.wk, r, hk), wv=_rows(lw.wv, r, hk),
        bq=_rows(lw.bq, r, hq), bk=_rows(lw.bk, r, hk), bv=_rows(lw.bv, r, hk),
        wo=lw.wo[:, r * hq : (r + 1) * hq],
        raw=raw,
        **mlp,
    )


def shard_checkpoint(ckpt: Checkpoint, s: TensorShard, on_layer: Callable[[], None] | None = None) -> Checkpoint:
    """Rank ``s.rank``'s part of ``ckpt`` (layers sliced one at a time as they are read)."""
    layers, held = ckpt.layers, held_experts(s)

    def shard_layers() -> Iterator[LayerWeights]:
        for lw in (layers() if held is None else layers(held)):
            yield shard_layer(lw, s)
            if on_layer is not None:
                on_layer()

    raw: Any = None
    if ckpt.lm_head_raw is not None:
        raw = (_vocab_rows(ckpt.lm_head_raw[0], s), ckpt.lm_head_raw[1])
    return attrs.evolve(
        ckpt, args=s.local, embed=_vocab_rows(ckpt.embed, s),
        lm_head=_vocab_rows(ckpt.lm_head, s) if ckpt.lm_head is not None else None,
        layers=shard_layers, lm_head_raw=raw,
    )
