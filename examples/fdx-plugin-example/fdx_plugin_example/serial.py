"""A scheduler that runs one request at a time (built only on fdx's kernel
interfaces: ``Scheduler`` and ``KVCacheManager``)."""

from __future__ import annotations

from collections import deque
from typing import Iterable

from fdx.core.interfaces import ModelOutput, ScheduledBatch, ScheduledSeq, Scheduler
from fdx.core.request import Request, Status


class SerialScheduler(Scheduler):
    """FIFO, batch size one.  Invariant: at most one request holds blocks."""

    def __init__(self, config, kv) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, kv)
        self.waiting: deque[Request] = deque()
        self.current: Request | None = None
        self.max_running_seen = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.current is None and self.waiting:
            req = self.waiting[0]
            if self.kv.blocks_for(req.num_prompt_tokens + req.params.max_tokens) > self.kv.num_blocks:
                self.waiting.popleft()
                req.fail("request needs more KV blocks than the pool holds", 400)
                batch.failed.append(req)
                return batch
            computed = self.kv.get_computed_blocks(req)
            if not self.kv.allocate(req, 0, computed):
                return batch
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.current = req
        req = self.current
        if req is None:
            return batch
        num_new = min(req.num_tokens - req.num_computed_tokens, self.config.max_num_batched_tokens)
        if not self.kv.allocate(req, num_new):
            raise RuntimeError("serial scheduler: KV pool exhausted by a single request")
        batch.seqs.append(ScheduledSeq(req, num_new))
        self.max_running_seen = max(self.max_running_seen, 1)
        return batch

    def update(self, batch: ScheduledBatch, output: ModelOutput) -> None:
        for i, seq in enumerate(batch.seqs):
            req = seq.request
            if req.status is not Status.RUNNING:
                continue
            req.num_computed_tokens += seq.num_new_tokens
            tok = int(output.token_ids[i])
            lp = output.logprobs[i] if output.logprobs is not None else None
            reason = req.append_token(tok, lp) if tok >= 0 else None
            self.kv.commit(req)
            if reason is not None:
                self._remove(req)

    def _remove(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.kv.free(req)
        if self.current is req:
            self.current = None

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        ids = set(request_ids)
        out = [r for r in self.waiting if r.request_id in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        if self.current is not None and self.current.request_id in ids:
            out.append(self.current)
            self._remove(self.current)
        return out

    def preempt_all(self) -> list[Request]:
        return self.abort(self.request_ids())

    def get(self, request_id: str) -> Request | None:
        for r in self.live():
            if r.request_id == request_id:
                return r
        return None

    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.live()]

    def live(self) -> list[Request]:
        return ([self.current] if self.current is not None else []) + list(self.waiting)

    @property
    def num_running(self) -> int:
        return 1 if self.current is not None else 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
