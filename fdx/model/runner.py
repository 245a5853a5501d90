"""The Paddle model runner: one mixed prefill/decode forward per step over
the paged KV cache, then sampling.

Invariants (from :class:`fdx.core.interfaces.ModelRunner`):

* every token of the step runs in ONE forward pass (flattened rows);
* new K/V go to slot ``block_ids[pos // bs] * bs + pos % bs`` of their
  request, and attention reads K/V only through the block tables;
* a request's sampled token depends only on its own logits, params and
  generator (the sampler is row-independent).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from fdx.config import EngineConfig
from fdx.core.errors import FdxError, ModelLoadError
from fdx.core.interfaces import Device
from fdx.model.runner_base import PagedRunnerBase, StepLayout

if TYPE_CHECKING:
    from fdx.parallel.gloo_comm import GlooComm
    from fdx.parallel.group import RankGroup, RankLink
    from fdx.parallel.sharding import TensorShard
    from fdx.parallel.shm_comm import ShmComm

log = logging.getLogger("fdx.model")


#: ``--dtype`` names the cpu runner accepts -> the compute mode they ask for
#: (``auto``: int8 where it can run, else float32)
CPU_DTYPES = {"auto": "int8", "int8": "int8", "bfloat16": "bfloat16", "bf16": "bfloat16",
              "float32": "float32", "fp32": "float32"}


def requested_compute(requested: str | None) -> str:
    """The compute mode ``--dtype`` asks for; a one-line error listing the
    choices for a name the cpu runner does not know."""
    mode = CPU_DTYPES.get((requested or "auto").lower())
    if mode is None:
        raise ModelLoadError(f"--dtype {requested}: the Paddle CPU runner supports auto, int8, bfloat16, float32")
    return mode


def resolve_compute(requested: str, ops: Any, args: Any) -> str:
    """The compute mode (``"int8"``/``"bfloat16"``/``"float32"``, see
    :mod:`fdx.model.llama`) for ``--dtype``: ``float32``/``fp32``; ``int8``
    or ``bfloat16``/``bf16`` (need the native ops and layer widths that are
    multiples of 32: otherwise a one-line error); ``auto`` = int8 where it
    can run, else float32."""
    mode = requested_compute(requested)
    if mode == "float32":
        return mode
    why = None
    if ops is None:
        why = "fdx's native CPU ops are not loaded (FDX_NATIVE_OPS=0, no AVX2/AVX-512, or no compiler)"
    elif any(d % 32 for d in (args.hidden_size, args.q_size, args.intermediate_size)):
        why = "the layer widths are not multiples of 32"
    if why is None:
        return mode
    if (requested or "auto").lower() != "auto":
        raise ModelLoadError(f"--dtype {requested}: {why}; use --dtype float32")
    return "float32"


class PaddleModelRunner(PagedRunnerBase):
    """The ``cpu`` runner: float32 KV, :class:`LlamaModel` in int8, bfloat16 or
    float32 compute (``--dtype``; C++ ops where the device has them), the NumPy
    sampler.  What it shares with the ``gpu`` runner is in
    :class:`PagedRunnerBase`."""

    #: the C++ ops read int32 block tables
    table_dtype = np.int32
    #: LlamaModel's attention (the C++ op or the pure-Paddle one) takes each layer's window
    honours_sliding_window = True
    #: LlamaModel rotates each row by its own LongRoPE factor set (StepLayout.long_rope)
    honours_long_rope = True

    def __init__(self, config: EngineConfig, device: Device, link: RankLink | None = None,
                 on_layer: Callable[[], None] | None = None) -> None:
        """``link``: this process is worker rank ``link.rank`` of a
        tensor-parallel group (:mod:`fdx.parallel.worker`; ``on_layer``
        reports each loaded layer).  Without it and with
        ``--tensor-parallel-size N > 1``, this is rank 0: it starts the
        group's other ranks (:class:`fdx.parallel.group.RankGroup`)."""
        from fdx.logs import import_paddle_quietly

        import_paddle_quietly()  # after the device set the threads; its start-up notices go to the log at debug
        import paddle

        from fdx.model.llama import LlamaModel
        from fdx.model.sampler import Sampler

        self.config = config
        self.device = device
        paddle.set_device(device.paddle_place())
        paddle.disable_static()
        requested_compute(config.dtype)  # an unknown name fails before the checkpoint opens
        self.dtype = "float32"  # the KV pool's dtype
        ckpt = self._open_checkpoint(config)
        #: tensor parallelism: ranks, this rank's shard, rank 0's group, this rank's collectives
        self.tensor_parallel_size = world = int(config.tensor_parallel_size)
        self.shard: TensorShard | None = None
        self.group: RankGroup | None = None
        self.comm: ShmComm | GlooComm | None = None
        ep = bool(config.enable_expert_parallel)
        if world > 1 or ep:
            from fdx.parallel.sharding import check_divisible, make_shard

            check_divisible(self.args, world, ep)  # an indivisible model, or experts asked of a dense one, fail here
        if world > 1:
            self.shard = make_shard(self.args, link.rank if link else 0, world, ep)
            self.kv_args = self.shard.local

        ops = None
        if device.attention_backend() == "native":
            from fdx.model.native import load_ops

            ops = load_ops()
        self.attention_impl = "native" if ops is not None else "paddle"
        #: "int8", "bfloat16" or "float32" (see fdx.model.llama)
        self.compute = resolve_compute(config.dtype, ops, self.kv_args)
        self._size_kv_pool()
        if self.shard is not None:
            ckpt = self._join_group(ckpt, link, on_layer)
        self.model = LlamaModel(self.kv_args, self.max_model_len, ops, self.compute, comm=self.comm,
                                vocab_start=self.shard.vocab_start if self.shard else 0, vocab_size=self.vocab_size)
        if self.model.paddle_attention:  # Gemma 2's soft-caps: the pure-Paddle attention
            self.attention_impl = "paddle"
        with paddle.no_grad():
            self.model.load(ckpt, progress=self.shard is None)
        del ckpt
        self.caches: list[Any] | None = self._allocate()
        if self.group is not None:
            self.group.wait_ready()
            self.rank_pids = tuple(self.group.pids[1:])
        self.sampler = Sampler(self.vocab_size, config.max_logprobs, seed=config.seed)
        log.info(
            "model %s (%s) on %s: %d KV blocks x %d tokens, attention=%s, compute=%s",
            self.source.name, self.args.describe(), device.paddle_place(), self.num_kv_blocks, self.block_size,
            self.attention_impl, self.compute,
        )

    def _join_group(self, ckpt: Any, link: RankLink | None, on_layer: Callable[[], None] | None) -> Any:
        """Rank 0: start the other ranks (they load while this one does);
        a worker: join the group's collectives.  Returns this rank's shard of ``ckpt``."""
        from fdx.parallel.group import RankGroup, worker_comm
        from fdx.parallel.sharding import shard_checkpoint

        assert self.shard is not None
        if link is None:
            cfg = self.config.replace(num_kv_blocks=self.num_kv_blocks)  # every rank sizes its pool alike
            self.group = RankGroup.start(cfg, self.config.rank_threads or 1)
            self.comm = self.group.comm
            self.group.start_progress(self.args.num_layers, self.source.name)
            on_layer = self.group.on_layer
        else:
            self.comm = worker_comm(link)
        return shard_checkpoint(ckpt, self.shard, on_layer)

    def _my_part(self, ckpt: Any) -> Any:
        if self.shard is None:
            return ckpt
        from fdx.parallel.sharding import shard_checkpoint

        return shard_checkpoint(ckpt, self.shard)

    def kv_fingerprint(self) -> str:
        """int8 compute writes other K/V values than float32 compute: its
        blocks get their own fingerprint (float32 keeps the shared one)."""
        base = super().kv_fingerprint()
        extra = ("" if self.compute == "float32" else f"|compute={self.compute}") + (
            f"|tp={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else "")  # a block is N shards
        if not extra:
            return base
        import hashlib

        return hashlib.sha256(f"{base}{extra}".encode()).hexdigest()[:32]

    # ------------------------------------------------------------------ step

    def _forward(self, layout: StepLayout) -> Any:
        if self.group is None:
            return self.forward_shard(layout)
        self.group.send(("step", layout))
        try:
            return self.forward_shard(layout)
        except Exception as exc:  # noqa: BLE001 - a rank died, hung or failed (the other ranks are inside
            self.group.fatal(exc)  # this step's collectives): the supervisor restarts the whole group
            raise

    def forward_shard(self, layout: StepLayout) -> Any:
        """This rank's forward of the step (every rank runs it; only rank 0's returns logits)."""
        import paddle

        from fdx.model.llama import StepInputs

        tables, positions, seq_of = layout.tables, layout.positions, layout.seq_of
        meta = np.stack([seq_of.astype(np.int32), positions.astype(np.int32)], axis=1)
        rows = layout.rows
        step = StepInputs(
            ids=paddle.to_tensor(np.asarray(layout.ids, dtype=np.int64)),
            meta=paddle.to_tensor(meta),
            tables=paddle.to_tensor(tables),
            sample_rows=paddle.to_tensor(rows) if len(rows) else None,
            positions=positions,
            seq_of=seq_of,
            q_starts=layout.q_starts,
            q_lens=layout.q_lens,
            ctx_lens=layout.starts + layout.q_lens,
            tables_np=tables,
            long_rope=layout.long_rope,
        )
        with paddle.no_grad():
            return self.model.forward(step, self.caches)

    # ------------------------------------------------------------------ KV blocks

    def _kv_views(self) -> list[Any]:
        """``[2, NB, KV, BS, D]`` per layer viewed as ``[2 * NB, KV*BS*D]``."""
        assert self.caches is not None
        return [c.reshape([2 * self.num_kv_blocks, -1]) for c in self.caches]

    def _block_rows(self, ids: np.ndarray) -> np.ndarray:
        return np.stack([ids, ids + self.num_kv_blocks], axis=1)[:, :, None]

    # ------------------------------------------------------------------ every rank (tensor parallelism)
    # Rank 0 sends the call to the workers first, does its own part, then
    # collects theirs: the ranks work at the same time, in the order of the steps.

    def _on_all(self, method: str, *args: Any) -> Any:
        assert self.group is not None
        self.group.send(("call", method, args))
        try:
            mine = getattr(super(), method)(*args)
        finally:
            theirs = self.group.collect(method)
        return mine, theirs

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """With tensor parallelism a block's bytes are the ranks' shards in rank order."""
        if self.group is None:
            return super().read_kv_blocks(block_ids)
        mine, theirs = self._on_all("read_kv_blocks", list(block_ids))
        return [b"".join(parts) for parts in zip(mine, *theirs)]

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        if self.group is None:
            return super().write_kv_blocks(block_ids, payloads)
        n, N = self.bytes_per_block, self.tensor_parallel_size
        for p in payloads:
            if len(p) != n * N:
                raise FdxError(f"KV payload has {len(p)} bytes, expected {n * N} ({N} shards of {n})")
        ids = list(block_ids)
        self.group.send_each([("call", "write_kv_blocks", (ids, [bytes(p[r * n : (r + 1) * n]) for p in payloads]))
                              for r in range(1, N)])
        try:
            super().write_kv_blocks(ids, [p[:n] for p in payloads])
        finally:
            self.group.collect("write_kv_blocks")

    def copy_kv_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if self.group is not None:
            self.group.send(("cast", "copy_kv_blocks", (list(pairs),)))
        super().copy_kv_blocks(pairs)

    def release(self, tags: Sequence[str]) -> None:
        if self.group is None:
            return super().release(tags)
        self._on_all("release", list(tags))

    def restore(self, tags: Sequence[str]) -> None:
        if self.group is None:
            return super().restore(tags)
        self._on_all("restore", list(tags))

    def load_weights(self, path: str, version: str) -> None:
        if self.group is None:
            return super().load_weights(path, version)
        self._on_all("load_weights", path, version)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

