"""What a tensor-parallel model runner does besides its model: the part both
the ``cpu`` and the ``gpu`` runners share (:class:`TensorParallelRunner`).

* start-up: check the model divides, take this rank's shard geometry
  (:mod:`fdx.parallel.sharding`), then rank 0 starts the group
  (:class:`fdx.parallel.group.RankGroup`) and a worker joins its collectives;
  every rank loads only its shard, and rank 0 waits for every rank's ready;
* each step: rank 0 sends the step's layout to the workers and runs its own
  forward (:meth:`forward_shard`, the subclass's); a broken group ends the
  engine (the supervisor restarts the whole group);
* control calls (sleep/wakeup, update_weights, KV block I/O) act on every
  rank, in the order of the steps; a KV block's bytes are the ranks' shards
  in rank order.

With ``--tensor-parallel-size 1`` none of this is used: ``group`` is
``None`` and every method is the :class:`PagedRunnerBase` one.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

from fdx.config import EngineConfig
from fdx.core.errors import FdxError
from fdx.model.runner_base import PagedRunnerBase, StepLayout

if TYPE_CHECKING:
    from fdx.parallel.group import RankGroup, RankLink
    from fdx.parallel.sharding import TensorShard


class TensorParallelRunner(PagedRunnerBase):
    """See the module docstring.  A subclass calls :meth:`_take_shard` after
    opening the checkpoint, :meth:`_join_group` after sizing its KV pool,
    :meth:`_group_ready` once its pool is allocated, and implements
    :meth:`forward_shard`."""

    shard: TensorShard | None = None
    group: RankGroup | None = None
    #: this rank's collectives (``shm``, ``gloo`` or ``nccl``; ``None`` at TP=1)
    comm: Any = None

    def _take_shard(self, config: EngineConfig, link: RankLink | None) -> None:
        """The model splits into ``--tensor-parallel-size`` ranks (else a one-line
        :class:`ConfigError`); this rank's geometry becomes :attr:`kv_args`."""
        self.tensor_parallel_size = world = int(config.tensor_parallel_size)
        ep = bool(config.enable_expert_parallel)
        if world > 1 or ep:
            from fdx.parallel.sharding import check_divisible, make_shard

            check_divisible(self.args, world, ep)  # an indivisible model, or experts asked of a dense one, fail here
            if world > 1:
                self.shard = make_shard(self.args, link.rank if link else 0, world, ep)
                self.kv_args = self.shard.local

    def _join_group(self, ckpt: Any, link: RankLink | None, on_layer: Callable[[], None] | None,
                    device_id: int | None = None) -> Any:
        """Rank 0: start the other ranks (they load while this one does);
        a worker: join the group's collectives (``device_id``: nccl's device
        of this rank).  Returns this rank's shard of ``ckpt``."""
        from fdx.parallel.group import RankGroup, worker_comm
        from fdx.parallel.sharding import shard_checkpoint

        assert self.shard is not None
        if link is None:
            cfg = self.config.replace(num_kv_blocks=self.num_kv_blocks)  # every rank sizes its pool alike
            self.group = RankGroup.start(cfg, self.config.rank_threads or 1, device_id)
            self.comm = self.group.comm
            self.group.start_progress(self.args.num_layers, self.source.name)
            on_layer = self.group.on_layer
        else:
            self.comm = worker_comm(link, device_id)
        return shard_checkpoint(ckpt, self.shard, on_layer)

    def _group_ready(self) -> None:
        """Rank 0: wait for every worker's ready (or name the one that failed)."""
        if self.group is not None:
            self.group.wait_ready()
            self.rank_pids = tuple(self.group.pids[1:])

    def _my_part(self, ckpt: Any) -> Any:
        if self.shard is None:
            return ckpt
        from fdx.parallel.sharding import shard_checkpoint

        return shard_checkpoint(ckpt, self.shard)

    def _kv_extra(self) -> str:
        """What, besides the shared parts and the split, makes this runner's blocks its own ("": nothing)."""
        return ""

    def kv_fingerprint(self) -> str:
        base = super().kv_fingerprint()
        extra = self._kv_extra() + (
            f"|tp={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else "")  # a block is N shards
        if not extra:
            return base
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
        raise NotImplementedError

    # ------------------------------------------------------------------ every rank
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
