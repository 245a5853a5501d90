"""Which dp replica takes a request: least loaded, with prefix affinity.

Pure logic (no sockets), used by :class:`fdx.plugins.deployments.dp_replicas.ReplicaSet`.

* **Load** of a replica is the tokens it holds or still has to run for the
  requests this API process has in flight on it: for each, its prompt
  tokens not served from the prefix cache plus its output so far (what the
  API knows at once, before the replica's next heartbeat).
* **Prefix affinity**: a prompt's first full KV blocks (``block_size``
  tokens each, at most ``max_blocks``) are hashed as a chain, like the
  engines' prefix cache.  Each routed request records its chain hashes ->
  replica in a bounded LRU table; a new request looks up its longest
  recorded prefix and goes to that replica, *unless* it is much busier
  than the least-loaded one: its load exceeds the least load by more than
  the matched tokens (the recompute moving would cost) plus
  ``slack_tokens``.
* Otherwise the least-loaded live replica wins; ties go to the replica
  that was given the fewest requests, so an idle set still spreads groups.
* Entries of a replica that restarted (its cache is empty) are ignored: each
  entry keeps the replica's generation.

This is the seam for other placements (a Redis global queue across
machines, an external router): :meth:`PrefixAffinityRouter.choose` takes the
prompt and the live replicas' loads and returns a rank.
"""

from __future__ import annotations

import collections
from typing import Sequence

import attrs


@attrs.frozen
class Choice:
    """A routing decision: the rank, the tokens of the prompt's prefix the
    router expects cached there, and why (``affinity`` or ``load``)."""

    rank: int
    matched_tokens: int
    reason: str


def prefix_hashes(ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Chain hashes of the prompt's first full blocks (at most ``max_blocks``)."""
    out = []
    h = 0
    n = min(len(ids) // block_size, max_blocks)
    for k in range(n):
        h = hash((h, tuple(ids[k * block_size:(k + 1) * block_size])))
        out.append(h)
    return out


class PrefixAffinityRouter:
    """Least loaded with prefix affinity, over ``size`` replicas."""

    def __init__(self, size: int, block_size: int, *, max_blocks: int = 256, slack_tokens: int = 2048,
                 capacity: int = 1 << 16) -> None:
        self.size = size
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.slack_tokens = slack_tokens
        self.capacity = capacity
        self.table: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()
        self.generation = [0] * size
        self.given = [0] * size

    def replica_restarted(self, rank: int) -> None:
        """Replica ``rank`` came back with an empty prefix cache."""
        self.generation[rank] += 1

    def choose(self, prompt: Sequence[int], loads: dict[int, int]) -> Choice:
        """The replica for ``prompt``; ``loads`` maps each live rank to its
        load in tokens (a rank missing from it is not considered)."""
        if not loads:
            raise ValueError("no live replica")
        hashes = prefix_hashes(prompt, self.block_size, self.max_blocks)
        least = min(loads, key=lambda r: (loads[r], self.given[r], r))
        sticky, matched = None, 0
        for k, h in enumerate(hashes):
            entry = self.table.get(h)
            if entry is None or entry[1] != self.generation[entry[0]]:
                break
            if entry[0] in loads:
                sticky, matched = entry[0], (k + 1) * self.block_size
        if sticky is not None and loads[sticky] - loads[least] <= matched + self.slack_tokens:
            choice = Choice(sticky, matched, "affinity")
        else:
            choice = Choice(least, 0, "load")
        self._record(hashes, choice.rank)
        return choice

    def _record(self, hashes: list[int], rank: int) -> None:
        self.given[rank] += 1
        entry = (rank, self.generation[rank])
        for h in hashes:
            self.table[h] = entry
            self.table.move_to_end(h)
        while len(self.table) > self.capacity:
            self.table.popitem(last=False)
