"""Block accounting for the paged KV cache, in one place for every scheduler.

The pool has ``num_blocks`` blocks of ``block_size`` token positions.  A
request's block table is ``request.block_ids`` (the model runner writes the
KV of position ``p`` at slot ``block_ids[p // bs] * bs + p % bs``).

Every block is in exactly one of three states:

* **used**: referenced by >= 1 live request (``ref_cnt > 0``);
* **cached-evictable**: ``ref_cnt == 0`` but holds a full block registered in
  the prefix cache (kept in LRU order, evicted oldest first);
* **free**: ``ref_cnt == 0`` and holds nothing useful.

Prefix caching: a full block is keyed by a hash chain over token ids,
``h_i = hash((h_{i-1}, tuple(tokens of block i)))`` with ``h_{-1} =``
:data:`ROOT_HASH` (ints and tuples of ints hash identically in every Python
process, so the chain is also a stable storage key).  The chain is stored in
``request.block_hashes``.  Blocks are registered when they become full *and
computed* (:meth:`KVCacheManager.commit`); a registered block may be shared by
several requests through its reference count.  A prefix match never covers
the whole token list: the last token is always computed so the model samples.

Invariants (checked by :func:`fdx.testing.check_kv_invariants`):

* a block is never handed out twice (free list, evictable set and used set
  are disjoint and cover the pool);
* reference counts equal the number of block tables holding each block;
* a block shared by two tables is a registered (cached) block, or a full
  block shared by the beams of one beam search (:meth:`fork`);
* once every request is finished or aborted, ``free + evictable == total``.

Storage hooks (KV storage tier, :mod:`fdx.kv_storage`): when
``self.storage`` is not ``None`` the manager calls, and only in these places:

* in :meth:`get_computed_blocks`, after the device prefix match stopped
  short (at most once per admission attempt series: a request blocked at the
  head of the queue is not re-probed every step; :meth:`free`, i.e.
  preemption, re-arms it), ``storage.load_prefix(request, num_matched_blocks,
  allocate) -> int``.
  ``request.block_hashes[num_matched_blocks:]`` are the candidate hashes
  (already capped so the last token is never covered).  The storage finds
  how many leading candidates it holds, calls ``allocate(k)`` **at most once**
  to get up to ``k`` fresh device block ids (the list may be shorter when the
  pool is short), writes the KV of candidate ``j`` into the ``j``-th id, and
  returns how many leading ids it filled.  The manager registers those as
  cached blocks (hash ``request.block_hashes[num_matched_blocks + j]``) and
  frees the rest.  Matched device blocks are pinned during the call, so the
  allocation can never evict them.  The storage should catch its own I/O
  errors and return 0; an exception that escapes is logged and treated as
  0 (recompute), and the allocated blocks are freed.
* in :meth:`commit`, ``storage.on_block_full(block_id, block_hash)`` each time
  a block becomes full, computed and registered (its KV is valid on the
  device now; write-through point);
* in :meth:`_pop_free_block`, ``storage.on_block_evicted(block_id,
  block_hash)`` (optional method) just before a cached block is reused (its
  KV is still intact at that moment; write-back point).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from fdx.core.request import Request

log = logging.getLogger("fdx.kv")

#: parent hash of the first block of every chain
ROOT_HASH = 0x5F3759DF


class KVStorageHooks(Protocol):
    """What the manager calls on ``self.storage`` (see module docstring)."""

    def load_prefix(self, request: Request, num_matched_blocks: int, allocate: Callable[[int], list[int]]) -> int: ...

    def on_block_full(self, block_id: int, block_hash: int) -> None: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool: allocation, freeing, prefix matching/caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.storage: KVStorageHooks | None = None
        self.ref_cnt: list[int] = [0] * num_blocks
        #: hash registered for a block (``None``: not in the prefix cache)
        self.block_hash: list[int | None] = [None] * num_blocks
        #: hash -> block id of registered blocks
        self.cached: dict[int, int] = {}
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        #: ref-0 registered blocks, LRU order (first = evicted first)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: request -> number of leading blocks already committed (by object: a beam's rows share its id)
        self._committed: dict[Request, int] = {}
        self.num_used_blocks = 0
        # counters (tokens, like vLLM's prefix_cache_queries / hits)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------
    # capacity
    # ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out (free + cached-evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return cdiv(num_tokens, self.block_size)

    def num_blocks_needed(self, request: Request, num_new_tokens: int, computed: list[int] | None = None) -> int:
        """Fresh blocks :meth:`allocate` would take (computed blocks that are
        now evictable count too, since taking them removes them from the
        free pool)."""
        n_comp = len(computed) if computed else 0
        total = cdiv(request.num_computed_tokens + n_comp * self.block_size + num_new_tokens, self.block_size)
        fresh = max(0, total - len(request.block_ids) - n_comp)
        if computed:
            fresh += sum(1 for b in computed if self.ref_cnt[b] == 0)
        return fresh

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed: list[int] | None = None, watermark: int = 0
    ) -> bool:
        return self.num_blocks_needed(request, num_new_tokens, computed) + watermark <= self.num_free_blocks

    # ------------------------------------------------------------------
    # allocation
    # ------------------------------------------------------------------

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed: list[int] | None = None,
        watermark: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` more positions of ``request``.

        ``computed`` (admission only) are the prefix blocks returned by
        :meth:`get_computed_blocks`: they are appended to the block table,
        ``num_computed_tokens`` / ``num_cached_tokens`` are set from them and
        the prefix counters are updated.  Pass ``[]`` for an admission
        without a match, ``None`` for a request already running.

        Returns False (changing nothing) when fewer than the needed blocks
        plus ``watermark`` are available.
        """
        if computed is None and watermark == 0:
            # fast path (decode): room left in the last block
            if request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size:
                return True
        if not self.can_allocate(request, num_new_tokens, computed, watermark):
            return False
        if computed is not None:
            assert not request.block_ids and request.num_computed_tokens == 0, "admission of a request holding blocks"
            n_hit = len(computed) * self.block_size
            self.prefix_queries += request.num_tokens
            self.prefix_hits += n_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(n_hit, request.num_prompt_tokens)
            for b in computed:
                self._touch(b)
            request.block_ids.extend(computed)
            request.num_computed_tokens = n_hit
            self._committed[request] = len(computed)
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        for _ in range(total - len(request.block_ids)):
            b = self._pop_free_block()
            self.ref_cnt[b] = 1
            self.num_used_blocks += 1
            request.block_ids.append(b)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so a request's tail is
        evicted before its head) and reset its KV progress."""
        for b in reversed(request.block_ids):
            self._release(b)
        request.block_ids.clear()
        request.num_computed_tokens = 0
        request.storage_probed = False
        self._committed.pop(request, None)

    def fork(self, src: Request, dst: Request) -> int | None:
        """Give ``dst`` (holding no blocks) the KV of ``src``'s computed
        positions, copy on write: full blocks are shared (ref counts), a
        partial last block gets a fresh block for ``dst``, returned so the
        caller has the runner copy ``src``'s last block into it (``None``
        when every block is full).  May evict a cached block; the caller
        checks :attr:`num_free_blocks` first."""
        assert not dst.block_ids, "fork into a request holding blocks"
        n = src.num_computed_tokens
        n_full = n // self.block_size
        for b in src.block_ids[:n_full]:
            self._touch(b)
        dst.block_ids = src.block_ids[:n_full]
        dst.block_hashes = src.block_hashes[:n_full]
        dst.num_computed_tokens = n
        self._committed[dst] = min(self._committed.get(src, 0), n_full)
        if n_full * self.block_size == n:
            return None
        b = self._pop_free_block()
        self.ref_cnt[b] = 1
        self.num_used_blocks += 1
        dst.block_ids.append(b)
        return b

    def trim(self, request: Request) -> None:
        """Release the tail blocks past those holding the request's
        ``num_computed_tokens`` positions (allocated for speculative drafts
        that were rejected).  Those blocks were never committed (committing
        covers computed positions only), so no rejected token is ever in
        the prefix cache."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        while len(request.block_ids) > keep:
            self._release(request.block_ids.pop())

    def _touch(self, b: int) -> None:
        if self.ref_cnt[b] == 0:
            self._evictable.pop(b)
            self.num_used_blocks += 1
        self.ref_cnt[b] += 1

    def _release(self, b: int) -> None:
        self.ref_cnt[b] -= 1
        assert self.ref_cnt[b] >= 0, f"block {b} released twice"
        if self.ref_cnt[b] == 0:
            self.num_used_blocks -= 1
            if self.block_hash[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def _pop_free_block(self) -> int:
        """A block with no content worth keeping (evicts the LRU cached one
        when the free list is empty)."""
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)
        h = self.block_hash[b]
        assert h is not None
        storage = self.storage
        if storage is not None:
            hook = getattr(storage, "on_block_evicted", None)
            if hook is not None:
                hook(b, h)
        del self.cached[h]
        self.block_hash[b] = None
        self.num_evictions += 1
        return b

    # ------------------------------------------------------------------
    # prefix caching
    # ------------------------------------------------------------------

    def block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        """Token ids of block ``i`` of ``request`` (prompt + output)."""
        bs = self.block_size
        lo, hi = i * bs, (i + 1) * bs
        p = request.prompt_token_ids
        np_ = len(p)
        if hi <= np_:
            return tuple(p[lo:hi])
        o = request.output_token_ids
        if lo >= np_:
            return tuple(o[lo - np_ : hi - np_])
        return tuple(p[lo:]) + tuple(o[: hi - np_])

    def ensure_hashes(self, request: Request, n_blocks: int) -> list[int]:
        """Extend ``request.block_hashes`` to cover ``n_blocks`` full blocks."""
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), n_blocks):
            parent = hash((parent, self.block_tokens(request, i)))
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest run of cached blocks matching the request's tokens (never
        the whole token list).  No references are taken: pass the result to
        :meth:`allocate` in the same scheduling pass.  Asks the storage tier
        to extend the match when one is attached.  A request asking for
        prompt logprobs computes its whole prompt (none from a cache)."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        hashes = self.ensure_hashes(request, max_blocks)
        blocks: list[int] = []
        for h in hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        if self.storage is not None and len(blocks) < max_blocks and not request.storage_probed:
            # once per admission: a request blocked at the head of the queue
            # must not hit the storage tier every step (free() re-arms it)
            request.storage_probed = True
            blocks.extend(self._load_from_storage(request, blocks, max_blocks))
        return blocks

    def _load_from_storage(self, request: Request, matched: list[int], max_blocks: int) -> list[int]:
        """The one call into ``storage.load_prefix``; returns the extra
        registered blocks (ref 0, evictable) continuing ``matched``."""
        assert self.storage is not None
        n0 = len(matched)
        taken: list[int] = []

        def allocate(k: int) -> list[int]:
            assert not taken, "load_prefix may call allocate only once"
            k = max(0, min(k, max_blocks - n0, self.num_free_blocks))
            for _ in range(k):
                b = self._pop_free_block()
                self.ref_cnt[b] = 1
                self.num_used_blocks += 1
                taken.append(b)
            return list(taken)

        for b in matched:  # pin: the allocation must not evict them
            self._touch(b)
        try:
            filled = int(self.storage.load_prefix(request, n0, allocate))
        except Exception:  # noqa: BLE001 - a storage bug must not leak blocks or kill the engine
            log.exception("storage load_prefix failed for %s; recomputing", request.request_id)
            filled = 0
        finally:
            for b in matched:
                self._release(b)
        filled = max(0, min(filled, len(taken)))
        out: list[int] = []
        for j, b in enumerate(taken):
            if j < filled:
                h = request.block_hashes[n0 + j]
                existing = self.cached.get(h)
                if existing is None:
                    self.cached[h] = b
                    self.block_hash[b] = h
                    out.append(b)
                else:
                    out.append(existing)
            self._release(b)
        return out

    def commit(self, request: Request) -> None:
        """Register the request's blocks that became full and computed (call
        after ``num_computed_tokens`` advanced)."""
        if not self.enable_prefix_caching:
            return
        start = self._committed.get(request, 0)
        n_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if n_full <= start:
            return
        hashes = self.ensure_hashes(request, n_full)
        storage = self.storage
        for i in range(start, n_full):
            b = request.block_ids[i]
            h = hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
                if storage is not None:
                    storage.on_block_full(b, h)
        self._committed[request] = n_full

    def reset_prefix_cache(self) -> bool:
        """Forget every registered block (evictable ones become free; used
        ones stay with their requests, unregistered)."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        for h, b in self.cached.items():
            self.block_hash[b] = None
        self.cached.clear()
        return True
