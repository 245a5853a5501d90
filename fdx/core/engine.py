"""The engine: requests in, token ids out, one ``step()`` at a time.

``step()`` is schedule -> execute -> update -> outputs.  Components are
resolved by name once, in :meth:`Engine.__init__`; the loop calls their
plain methods.  The control methods (``pause``, ``sleep``, ...) are in
:mod:`fdx.engine_control`, dispatched by :meth:`Engine.control`.

Failure isolation -- no request can end the engine:

* :meth:`Engine.add_request` checks the prompt and the sampling params
  (:func:`fdx.core.request.check_request`); a bad request ends at once with
  an error output (400), one the scheduler fails to queue with a 500.
* When the runner fails on a batch, the batch is split in halves and re-run
  until each failure is pinned to single requests: those end with an error
  (500), the others go on.  Re-running a chunk rewrites the same KV slots
  with the same tokens; a seeded request in the failed batch may have drawn
  its sample in the failed attempt, so its generator moves on by one draw.
* Any other exception in a step (scheduler, update) ends the step's
  requests -- or, when ``schedule()`` itself failed, every live request --
  with an error (500) and frees their blocks; it is logged with its
  traceback and the engine serves the next step.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import numpy as np

from fdx.config import EngineConfig, split_device
from fdx.core.errors import ControlError, FdxError
from fdx.core.interfaces import Device, ModelOutput, ModelRunner, ScheduledBatch, ScheduledSeq, Scheduler
from fdx.core.kv_cache import KVCacheManager
from fdx.core.messages import AddRequest, EngineStats, RequestOutput, TokenLogprob
from fdx.core.plugins import Plugins, get_plugins
from fdx.core.request import Request, Status, check_request

__all__ = ["ControlError", "Engine", "build_runner"]

log = logging.getLogger("fdx.engine")


def build_runner(config: EngineConfig, plugins: Plugins) -> ModelRunner:
    """Create the device (by name), then the model runner on it (by name:
    ``--model-runner``, else the device's ``default_runner``)."""
    name, index = split_device(config.device)  # "cuda:1" -> the cuda plugin, index 1
    if index is None:
        device = plugins.create("device", name)
    else:
        try:
            device = plugins.create("device", name, index=index)
        except TypeError:
            raise FdxError(f"--device {config.device}: the {name} device takes no index") from None
    if not device.is_available():
        why = getattr(device, "unavailable_reason", None)
        raise FdxError(f"device {config.device!r} is not available on this machine" + (f": {why()}" if why else ""))
    device.configure_env(config.rank_threads)
    name = config.model_runner or device.default_runner
    runner: ModelRunner = plugins.create("model_runner", name, config=config, device=device)
    if runner.tensor_parallel_size != config.tensor_parallel_size:  # a runner that cannot split leaves it at 1
        raise FdxError(f"--tensor-parallel-size {config.tensor_parallel_size}: the {name} model runner cannot split")
    if config.kv_cache_dtype != "auto" and runner.kv_cache_dtype != config.kv_cache_dtype:
        raise FdxError(f"--kv-cache-dtype {config.kv_cache_dtype}: the {name} model runner "
                       + (f"keeps its KV cache in {runner.kv_cache_dtype}" if runner.kv_cache_dtype
                          else "does not implement it (it does not name its KV cache's dtype)")
                       + "; leave it at auto")
    return runner


class Engine:
    """Owns the scheduler, the model runner and the paused/sleeping state."""

    def __init__(self, config: EngineConfig, plugins: Plugins | None = None, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.plugins = plugins or get_plugins(config.disable_plugins)
        self.runner = runner or build_runner(config, self.plugins)
        self.device: Device | None = getattr(self.runner, "device", None)  # None: a runner built without one
        self.kv = KVCacheManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        extra: dict[str, Any] = {}  # splitwise: the KV connector the scheduler drives
        if config.kv_connector:
            extra["connector"] = self.plugins.create("kv_connector", config.kv_connector, config=config,
                                                     runner=self.runner)
        if config.speculative:  # proposes draft tokens for the scheduler; the runner verifies them
            extra["speculator"] = self.plugins.create("speculator", config.speculative, config=config)
        self.scheduler: Scheduler = self.plugins.create("scheduler", config.scheduler, config=config, kv=self.kv,
                                                        **extra)
        self.connector = extra.get("connector")
        self.grammar: Any = None  # the GrammarBackend (--grammar-backend), built for the first structured request
        self.storage = None
        if config.cache_backend:
            from fdx.kv_storage import KVStorage

            backend = self.plugins.create("cache_backend", config.cache_backend, options=config.cache_backend_config)
            self.storage = self.kv.storage = KVStorage(backend, self.runner, self.kv)
        self.max_model_len = self.runner.max_model_len
        self.is_paused = False
        self.sleeping: set[str] = set()
        self.steps = 0
        self.controls: Any = None  # the control plane, built on the first control call
        # outputs produced outside the step's batch (aborts, failures), flushed by step()
        self._side_outputs: list[RequestOutput] = []

    # ------------------------------------------------------------------ requests

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request; one that cannot run ends at once with an error
        output (never silently dropped, never raised)."""
        error = "engine is paused" if self.is_paused else check_request(msg, self.max_model_len, self.runner.vocab_size,
                                                                        self.config.max_logprobs)
        if error is None and self.scheduler.get(msg.request_id) is not None:
            error = f"duplicate request id {msg.request_id!r}"
        grammar, spec = None, msg.params.structured
        if error is None and spec is not None:
            try:  # compiled once per spec, off this thread; the API process checked it first (400 naming the field)
                grammar = self.grammar_backend().matcher_async(spec)
            except Exception as exc:  # noqa: BLE001 - a bad spec (or backend) fails this request only
                error = f"structured output ({spec.kind}): {exc}"
        if error is not None:
            code = 503 if self.is_paused else 400
            self._side_outputs.append(RequestOutput(msg.request_id, (), "error", len(msg.prompt_token_ids),
                                                    error=error, error_code=code))
            return
        req = Request(msg.request_id, list(msg.prompt_token_ids), msg.params, self.runner.eos_token_ids,
                      self.max_model_len, msg.arrival_time, kv_transfer=msg.kv_transfer_params, grammar=grammar,
                      trace_context=msg.trace_context)
        try:
            self.scheduler.add_request(req)
        except Exception as exc:  # noqa: BLE001 - a plugin failing on one request ends that request
            log.exception("scheduler failed to queue request %s", req.request_id)
            self._end([req], f"the scheduler failed on this request: {exc}", 500)

    def grammar_backend(self) -> Any:
        """The :class:`GrammarBackend` (``--grammar-backend``), made on first use."""
        kw = {"config": self.config, "vocab_size": self.runner.vocab_size}
        self.grammar = self.grammar or self.plugins.create("grammar_backend", self.config.grammar_backend, **kw)
        return self.grammar

    def abort(self, request_ids: Iterable[str], reason: str = "abort") -> list[Request]:
        """Abort requests; each gets a final output with its partial tokens."""
        try:
            removed = self.scheduler.abort(request_ids)
        except Exception:  # noqa: BLE001 - a scheduler bug must not end the engine
            log.exception("scheduler failed to abort %s", list(request_ids))
            return []
        for req in removed:
            self.finish(req, "abort", reason if reason != "abort" else None, 0)
        return removed

    def finish(self, req: Request, finish_reason: str, error: str | None, code: int) -> None:
        """End ``req`` (already out of the scheduler) with a final output."""
        req.status = Status.FINISHED
        req.finish_reason = finish_reason
        toks, lps = req.take_pending()
        self._side_outputs.append(RequestOutput(req.request_id, toks, finish_reason, req.num_prompt_tokens,
                                                req.num_cached_tokens, req.num_output_tokens, lps, error, code))

    def _end(self, reqs: Iterable[Request], error: str, code: int) -> None:
        """End these live requests with an error, freeing their blocks."""
        reqs = list(reqs)
        try:
            self.scheduler.abort([r.request_id for r in reqs])
        except Exception:  # noqa: BLE001
            log.exception("scheduler failed to remove %d failed request(s)", len(reqs))
        for req in reqs:
            self.kv.free(req)  # no-op when the scheduler already freed them
            self.finish(req, "error", error, code)

    def has_work(self) -> bool:
        return bool(self._side_outputs) or (not self.is_paused and self.scheduler.has_work())

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> update -> outputs."""
        batch = ScheduledBatch()
        try:
            if not self.is_paused:
                batch = self.scheduler.schedule()
                if batch:
                    self.scheduler.update(batch, self._execute(batch))
        except Exception as exc:  # noqa: BLE001 - a broken step ends its requests, never the engine
            self._fail_step(batch, exc)
        return self._outputs(batch)

    def _execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run the batch; requests that fail alone are ended and dropped from it."""
        now = time.time()
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        self.steps += 1
        try:
            return self.runner.execute(batch)
        except Exception:  # noqa: BLE001
            log.exception("model runner failed on a batch of %d seq(s); isolating the failure", len(batch.seqs))
        mid = len(batch.seqs) // 2
        rows = self._isolate(batch.seqs[:mid]) + self._isolate(batch.seqs[mid:])  # (seq, token, logprob) that ran
        batch.seqs = [seq for seq, _, _ in rows]
        lps = [lp for _, _, lp in rows]
        return ModelOutput(np.array([tok for _, tok, _ in rows], dtype=np.int64), lps if any(lps) else None)

    def _isolate(self, seqs: list[ScheduledSeq]) -> list[tuple[ScheduledSeq, int, TokenLogprob | None]]:
        """Re-run ``seqs``, halving on failure; a seq that fails alone ends its request."""
        try:
            out = self.runner.execute(ScheduledBatch(seqs)) if seqs else ModelOutput(np.zeros(0, dtype=np.int64))
            return [(s, int(out.token_ids[i]), out.logprobs[i] if out.logprobs else None) for i, s in enumerate(seqs)]
        except Exception as exc:  # noqa: BLE001
            if len(seqs) > 1:
                return self._isolate(seqs[: len(seqs) // 2]) + self._isolate(seqs[len(seqs) // 2 :])
            req = seqs[0].request
            log.error("request %s fails alone in the model runner: %s: %s", req.request_id, type(exc).__name__, exc)
            self._end([req], f"the engine failed to run this request: {exc}", 500)
            return []

    def _fail_step(self, batch: ScheduledBatch, exc: Exception) -> None:
        log.error("engine step failed", exc_info=exc)
        reqs = [s.request for s in batch.seqs] if batch.seqs else self.scheduler_requests()
        self._end([r for r in reqs if r.status is not Status.FINISHED], f"the engine failed on this step: {exc}", 500)
        batch.seqs = [s for s in batch.seqs if s.request.finish_reason != "error"]

    def scheduler_requests(self) -> list[Request]:
        """Every live request of the scheduler (those whose id it still knows)."""
        try:
            return [r for r in map(self.scheduler.get, self.scheduler.request_ids()) if r is not None]
        except Exception:  # noqa: BLE001
            log.exception("scheduler failed to list its requests")
            return []

    def _outputs(self, batch: ScheduledBatch) -> list[RequestOutput]:
        outs, self._side_outputs = self._side_outputs, []
        for req in batch.failed:
            outs.append(RequestOutput(req.request_id, tuple(req.pending_token_ids), "error", req.num_prompt_tokens,
                                      req.num_cached_tokens, req.num_output_tokens,
                                      error=req.error or "request failed", error_code=req.error_code or 500))
        for req in [s.request for s in batch.seqs] + batch.emitted:
            if not req.pending_token_ids and req.finish_reason is None:
                continue
            toks, lps = req.take_pending()
            qt = None
            if not req.queue_time_sent and req.first_scheduled_time is not None:
                qt = max(0.0, req.first_scheduled_time - req.arrival_time)
                req.queue_time_sent = True
            outs.append(RequestOutput(req.request_id, toks, req.finish_reason, req.num_prompt_tokens,
                                      req.num_cached_tokens, req.num_output_tokens, lps, queue_time=qt,
                                      prompt_logprobs=req.take_prompt_logprobs(), beams=req.beams))
        if self.storage is not None and batch:
            self.storage.flush()  # copy this step's newly full blocks out for the storage tier
        return outs

    # ------------------------------------------------------------------ state

    def control(self, method: str, args: dict[str, Any] | None) -> Any:
        """Run control method ``method`` (see :mod:`fdx.engine_control`);
        raises :class:`ControlError` with an HTTP-like code."""
        if self.controls is None:
            from fdx.engine_control import ControlPlane

            self.controls = ControlPlane(self)
        return self.controls.call(method, args)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        st = self.storage.stats() if self.storage is not None else {}
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            storage_hits=int(st.get("hits", 0)),
            storage_errors=int(st.get("errors", 0)),
            num_preemptions=int(s.get("num_preemptions", 0)),
            steps=self.steps,
            is_paused=self.is_paused,
            weights_version=self.runner.weights_version, expert_tokens=getattr(self.runner, "expert_tokens", tuple)(),
            num_batched_tokens=int(s.get("num_scheduled_tokens", 0)),
            num_generated_tokens=int(s.get("num_generated_tokens", 0)),
            storage_puts=int(st.get("puts", 0)),
            num_admitted=int(s.get("num_admitted", 0)),
            splitwise=getattr(self.scheduler, "splitwise_stats", lambda: None)(),
            speculative=getattr(self.scheduler, "spec_decode_stats", lambda: None)(),
        )

    def close(self) -> None:
        """Release external resources at shutdown: the KV storage tier
        writes what it has queued (bounded wait) and disconnects; the KV
        connector stops listening."""
        if self.connector is not None:
            self.connector.close()
        if self.storage is not None:
            try:
                self.storage.close()
            except Exception:  # noqa: BLE001 - shutdown must go on
                log.exception("closing the KV storage tier failed")
        self.runner.close()  # last: the storage tier may still read blocks
