"""The engine: requests in, token ids out, one ``step()`` at a time.

``step()`` is schedule -> execute -> update.  Components are resolved by
name once, in :meth:`Engine.__init__`; the loop calls their plain methods.
Control methods (``pause``, ``sleep``, ...) live here, in the kernel, so no
plugin can bypass them; they are dispatched by name via :meth:`control`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from fdx.core.config import EngineConfig
from fdx.core.errors import FdxError, RequestError
from fdx.core.interfaces import ModelRunner, ScheduledBatch, Scheduler
from fdx.core.kv_cache import KVCacheManager
from fdx.core.messages import AddRequest, EngineStats, RequestOutput
from fdx.core.plugins import Plugins, get_plugins
from fdx.core.request import Request, Status

log = logging.getLogger("fdx.engine")


class ControlError(FdxError):
    """A control method failed; ``code`` is 400 (bad call) or 500."""

    def __init__(self, message: str, code: int = 500) -> None:
        super().__init__(message)
        self.code = code


def build_runner(config: EngineConfig, plugins: Plugins) -> ModelRunner:
    """Create the device (by name) and the model runner on it."""
    device = plugins.create("device", config.device)
    if not device.is_available():
        raise FdxError(f"device {config.device!r} is not available on this machine")
    device.configure_env(config.num_threads)
    from fdx.model.runner import PaddleModelRunner  # heavy: imports Paddle

    return PaddleModelRunner(config, device)


class Engine:
    """Owns the scheduler, the model runner and the paused/sleeping state."""

    def __init__(
        self,
        config: EngineConfig,
        plugins: Plugins | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        self.config = config
        self.plugins = plugins or get_plugins(config.disable_plugins)
        self.runner = runner or build_runner(config, self.plugins)
        self.kv = KVCacheManager(
            num_blocks=self.runner.num_kv_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler: Scheduler = self.plugins.create(
            "scheduler", config.scheduler, config=config, kv=self.kv
        )
        self.storage = None
        if config.cache_backend:
            from fdx.core.kv_storage import KVStorage

            backend = self.plugins.create("cache_backend", config.cache_backend, options=config.cache_backend_config)
            self.storage = KVStorage(backend, self.runner, self.kv)
            self.kv.storage = self.storage
        self.max_model_len = self.runner.max_model_len
        self.is_paused = False
        self.sleeping: set[str] = set()
        self.steps = 0
        # outputs produced outside step() (aborts, pause), flushed by the loop
        self._side_outputs: list[RequestOutput] = []

    # ------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request; a request that cannot run ends at once with an
        error output (never silently dropped)."""
        try:
            if self.is_paused:
                raise RequestError("engine is paused", 503)
            n = len(msg.prompt_token_ids)
            if n == 0:
                raise RequestError("prompt is empty", 400)
            if n + msg.params.max_tokens > self.max_model_len:
                raise RequestError(
                    f"prompt ({n} tokens) + max_tokens ({msg.params.max_tokens}) exceeds "
                    f"max_model_len ({self.max_model_len})",
                    400,
                )
            if self.scheduler.get(msg.request_id) is not None:
                raise RequestError(f"duplicate request id {msg.request_id!r}", 400)
        except RequestError as exc:
            self._side_outputs.append(
                RequestOutput(msg.request_id, (), "error", n_prompt(msg), error=str(exc), error_code=exc.code)
            )
            return
        req = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            params=msg.params,
            eos_token_ids=self.runner.eos_token_ids,
            max_model_len=self.max_model_len,
            arrival_time=msg.arrival_time,
        )
        self.scheduler.add_request(req)

    def abort(self, request_ids: Iterable[str], reason: str = "abort") -> list[Request]:
        """Abort requests; each gets a final output with its partial tokens."""
        removed = self.scheduler.abort(request_ids)
        for req in removed:
            self._finish_side(req, "abort", reason if reason != "abort" else None, 0)
        return removed

    def _finish_side(self, req: Request, finish_reason: str, error: str | None, code: int) -> None:
        req.status = Status.FINISHED
        req.finish_reason = finish_reason
        toks, lps = req.take_pending()
        self._side_outputs.append(
            RequestOutput(
                req.request_id,
                toks,
                finish_reason,
                req.num_prompt_tokens,
                req.num_cached_tokens,
                req.num_output_tokens,
                lps,
                error,
                code,
            )
        )

    def has_work(self) -> bool:
        return bool(self._side_outputs) or (not self.is_paused and self.scheduler.has_work())

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> update -> outputs."""
        outputs, self._side_outputs = self._side_outputs, []
        if self.is_paused:
            return outputs
        batch = self.scheduler.schedule()
        if batch:
            model_out = self.runner.execute(batch)
            self.scheduler.update(batch, model_out)
            self.steps += 1
        return outputs + self._collect(batch)

    def _collect(self, batch: ScheduledBatch) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for req in batch.failed:
            outs.append(
                RequestOutput(
                    req.request_id,
                    tuple(req.pending_token_ids),
                    "error",
                    req.num_prompt_tokens,
                    req.num_cached_tokens,
                    req.num_output_tokens,
                    error=str(req.extra.get("error", "request failed")),
                    error_code=int(req.extra.get("error_code", 500)),
                )
            )
        for seq in batch.seqs:
            req = seq.request
            if not req.pending_token_ids and req.finish_reason is None:
                continue
            toks, lps = req.take_pending()
            outs.append(
                RequestOutput(
                    req.request_id,
                    toks,
                    req.finish_reason,
                    req.num_prompt_tokens,
                    req.num_cached_tokens,
                    req.num_output_tokens,
                    lps,
                )
            )
        return outs

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
            weights_version=self.runner.weights_version,
        )

    # ------------------------------------------------------------------
    # control plane (dispatched by name)
    # ------------------------------------------------------------------

    def control(self, method: str, args: dict[str, Any]) -> Any:
        """Run control method ``method``; raises :class:`ControlError`
        (400 unknown method / bad args, 500 failure)."""
        handler: Callable[..., Any] | None = getattr(self, f"_control_{method}", None)
        if handler is None or not callable(handler):
            raise ControlError(f"unknown control method: {method}", 400)
        t0 = time.time()
        try:
            result = handler(**(args or {}))
        except ControlError:
            raise
        except TypeError as exc:
            raise ControlError(f"bad arguments for {method}: {exc}", 400) from exc
        except Exception as exc:  # noqa: BLE001
            log.exception("control method %s failed", method)
            raise ControlError(f"control method {method} failed: {type(exc).__name__}: {exc}", 500) from exc
        log.info("control %s done in %.3fs", method, time.time() - t0)
        return result

    def _control_pause(self) -> None:
        if self.is_paused:
            return None
        self.is_paused = True
        for req in self.scheduler.preempt_all():
            self._finish_side(req, "error", "request aborted: engine is paused", 503)
        self.kv.reset_prefix_cache()
        return None

    def _control_resume(self) -> None:
        if self.sleeping:
            raise ControlError(f"engine is sleeping ({','.join(sorted(self.sleeping))}); call wakeup", 400)
        self.is_paused = False
        return None

    def _control_is_paused(self) -> dict[str, bool]:
        return {"is_paused": self.is_paused}

    def _control_abort_requests(
        self, req_ids: list[str] | None = None, abort_all: bool = False
    ) -> dict[str, Any]:
        ids = list(req_ids or [])
        if abort_all:
            ids = self.scheduler.request_ids()
        removed = self.abort(ids)
        found = {r.request_id for r in removed}
        return {
            "aborted": [{"request_id": r.request_id, "output_token_count": r.num_output_tokens} for r in removed],
            "not_found": [i for i in ids if i not in found],
        }


def n_prompt(msg: AddRequest) -> int:
    return len(msg.prompt_token_ids)
