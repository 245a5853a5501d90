"""The engine: requests in, token ids out, one ``step()`` at a time.

``step()`` is schedule -> execute -> update.  Components are resolved by
name once, in :meth:`Engine.__init__`; the loop calls their plain methods.
Control methods (``pause``, ``sleep``, ...) live here, in the kernel, so no
plugin can bypass them; they are dispatched by name via :meth:`control`.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import logging
import time
from typing import Any, Callable, Iterable

from fdx.core.config import EngineConfig, split_device
from fdx.core.errors import FdxError, ModelLoadError, RequestError
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
    device.configure_env(config.num_threads)
    name = config.model_runner or device.default_runner
    return plugins.create("model_runner", name, config=config, device=device)


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
            now = time.time()
            for seq in batch.seqs:
                if seq.request.first_scheduled_time is None:
                    seq.request.first_scheduled_time = now
            model_out = self.runner.execute(batch)
            self.scheduler.update(batch, model_out)
            self.steps += 1
            if self.storage is not None:
                self.storage.flush()  # copy this step's newly full blocks out for the storage tier
        return outputs + self._collect(batch)

    def close(self) -> None:
        """Release external resources at shutdown: the KV storage tier
        writes what it has queued (bounded wait) and disconnects."""
        if self.storage is not None:
            try:
                self.storage.close()
            except Exception:  # noqa: BLE001 - shutdown must go on
                log.exception("closing the KV storage tier failed")

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
            qt = None
            if not req.queue_time_sent and req.first_scheduled_time is not None:
                qt = max(0.0, req.first_scheduled_time - req.arrival_time)
                req.queue_time_sent = True
            outs.append(
                RequestOutput(
                    req.request_id,
                    toks,
                    req.finish_reason,
                    req.num_prompt_tokens,
                    req.num_cached_tokens,
                    req.num_output_tokens,
                    lps,
                    queue_time=qt,
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
            num_batched_tokens=int(s.get("num_scheduled_tokens", 0)),
            num_generated_tokens=int(s.get("num_generated_tokens", 0)),
            storage_puts=int(st.get("puts", 0)),
        )

    # ------------------------------------------------------------------
    # control plane (dispatched by name)
    # ------------------------------------------------------------------
    #
    # Invariants of the control methods:
    # * they run between two steps (the engine loop calls them), never
    #   inside one, so they never see a half-applied batch;
    # * every request they end gets exactly one final output, flushed by the
    #   next step(): an error (code 503) for pause, ``finish_reason="abort"``
    #   with the partial tokens for abort_requests; its blocks are freed;
    # * ``sleeping`` non-empty implies ``is_paused`` (nothing runs without
    #   weights or KV cache): resume refuses while something sleeps, wakeup
    #   resumes once nothing does;
    # * a failed sleep/wakeup leaves the tag marked asleep, so the engine
    #   stays paused and a retried wakeup restores it (runner restore is
    #   idempotent).

    def control(self, method: str, args: dict[str, Any] | None) -> Any:
        """Run control method ``method`` with keyword ``args``.

        Raises :class:`ControlError`: 400 for an unknown method, bad
        arguments or a refused call (e.g. update_weights while running),
        500 when the method itself fails (the message says why)."""
        handler: Callable[..., Any] | None = None
        if isinstance(method, str) and method.isidentifier():
            handler = getattr(self, f"_control_{method}", None)
        if handler is None or not callable(handler):
            raise ControlError(f"unknown control method: {method}", 400)
        kwargs = dict(args or {})
        try:
            inspect.signature(handler).bind(**kwargs)
        except TypeError as exc:
            raise ControlError(f"bad arguments for {method}: {exc}", 400) from None
        t0 = time.time()
        try:
            result = handler(**kwargs)
        except ControlError:
            raise
        except RequestError as exc:
            raise ControlError(str(exc), exc.code) from exc
        except Exception as exc:  # noqa: BLE001
            log.exception("control method %s failed", method)
            raise ControlError(f"control method {method} failed: {type(exc).__name__}: {exc}", 500) from exc
        log.info("control %s done in %.3fs", method, time.time() - t0)
        return result

    def _control_pause(self) -> dict[str, Any]:
        """Stop admitting work; end every running and waiting request with
        an error (503), free their blocks, reset the prefix cache.  Pausing
        twice is a no-op.  Both v0 and v1 go through ``preempt_all``, which
        removes every request at once (v0 cannot recompute, so draining and
        dropping are the same there)."""
        if self.is_paused:
            return {"is_paused": True, "num_aborted": 0}
        self.is_paused = True
        ended = self.scheduler.preempt_all()
        for req in ended:
            if req.finish_reason == "error":  # already failed in the scheduler: keep its own error
                self._finish_side(req, "error", str(req.extra.get("error", "request failed")),
                                  int(req.extra.get("error_code", 500)))
            else:
                self._finish_side(req, "error", "request aborted: engine is paused", 503)
        self.kv.reset_prefix_cache()
        if ended:
            log.info("paused: %d request(s) ended", len(ended))
        return {"is_paused": True, "num_aborted": len(ended)}

    def _control_resume(self) -> dict[str, Any]:
        """Admit work again (no-op when not paused); refused while sleeping."""
        if self.sleeping:
            raise ControlError(
                f"engine is sleeping ({','.join(sorted(self.sleeping))}): call wakeup, not resume", 400
            )
        self.is_paused = False
        return {"is_paused": False}

    def _control_is_paused(self) -> dict[str, Any]:
        return {"is_paused": self.is_paused, "sleeping": sorted(self.sleeping)}

    def _control_sleep(self, tags: str | list[str] | None = None) -> dict[str, Any]:
        """Pause (implicitly), then free the memory of ``tags`` (``weight``,
        ``kv_cache``; default both).  Already sleeping tags are skipped."""
        wanted = parse_tags(tags)
        self._control_pause()
        todo = [t for t in wanted if t not in self.sleeping]
        before = process_rss()
        if todo:
            self.sleeping.update(todo)  # before release: a failed release still needs a wakeup
            self.runner.release(todo)
        after = process_rss()
        log.info("sleep %s: RSS %.1f -> %.1f MiB", ",".join(todo) or "-", before / 2**20, after / 2**20)
        return {"sleeping": sorted(self.sleeping), "released": todo, "rss_before": before, "rss_after": after}

    def _control_wakeup(self, tags: str | list[str] | None = None) -> dict[str, Any]:
        """Reload what sleep freed (``tags``, default all sleeping), then
        resume once nothing is left asleep (like the seed, a wakeup with
        nothing asleep just resumes)."""
        wanted = parse_tags(tags) if tags not in (None, "", []) else list(SLEEP_TAGS)
        todo = [t for t in SLEEP_TAGS if t in wanted and t in self.sleeping]
        if todo:
            self.runner.restore(todo)
            self.sleeping.difference_update(todo)
        if not self.sleeping:
            self.is_paused = False
        return {"restored": todo, "sleeping": sorted(self.sleeping), "is_paused": self.is_paused}

    def _control_update_weights(self, path: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Load a checkpoint with the running model's architecture and
        shapes; only while paused and awake.  ``version`` (default: the
        path) is recorded and shown by /v1/models.  A bad checkpoint is a
        400 naming the mismatch; the old weights stay in place."""
        if not self.is_paused:
            raise ControlError("update_weights needs a paused engine: call pause first", 400)
        if "weight" in self.sleeping:
            raise ControlError("weights are asleep: call wakeup (tag 'weight') before update_weights", 400)
        if not isinstance(path, str) or not path:
            raise ControlError("update_weights needs 'path' (a .gguf file or a Hugging Face folder)", 400)
        ver = path if version is None or version == "" else str(version)
        try:
            self.runner.load_weights(path, ver)
        except ModelLoadError as exc:
            raise ControlError(f"update_weights: {exc}", 400) from exc
        self.kv.reset_prefix_cache()  # KV computed by the old weights is invalid
        trim_heap()  # the old weights' memory goes back to the OS (RSS does not grow per swap)
        return {"version": self.runner.weights_version, "path": path}

    def _control_abort_requests(
        self, req_ids: list[str] | str | None = None, abort_all: bool = False
    ) -> dict[str, Any]:
        """Abort requests by engine id (or all); each gets a final output
        with its partial tokens (``finish_reason="abort"``)."""
        if req_ids is None:
            req_ids = []
        elif isinstance(req_ids, str):
            req_ids = [req_ids]
        if not isinstance(req_ids, (list, tuple)) or not all(isinstance(i, str) for i in req_ids):
            raise ControlError("abort_requests: 'req_ids' must be a list of strings", 400)
        asked = list(dict.fromkeys(req_ids))
        ids = self.scheduler.request_ids() if abort_all else asked
        removed = self.abort(ids)
        found = {r.request_id for r in removed}
        return {
            "aborted": [{"request_id": r.request_id, "output_token_count": r.num_output_tokens} for r in removed],
            "not_found": [] if abort_all else [i for i in asked if i not in found],
        }


def n_prompt(msg: AddRequest) -> int:
    return len(msg.prompt_token_ids)


SLEEP_TAGS = ("weight", "kv_cache")


def parse_tags(tags: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """``"weight,kv_cache"``, a list, or ``None``/``""`` (= all) -> the
    validated tags, deduplicated, in :data:`SLEEP_TAGS` order.  Raises
    :class:`ControlError` (400) naming any unknown tag."""
    if tags is None or tags == "" or tags == []:
        return list(SLEEP_TAGS)
    if isinstance(tags, str):
        items = tags.split(",")
    elif isinstance(tags, (list, tuple)) and all(isinstance(t, str) for t in tags):
        items = list(tags)
    else:
        raise ControlError(f"tags must be a comma-separated string or a list of strings, got {tags!r}", 400)
    out = {t.strip() for t in items if t.strip()}
    bad = sorted(t for t in out if t not in SLEEP_TAGS)
    if bad:
        raise ControlError(f"unsupported tag(s) {', '.join(bad)} in {tags!r}; expected one of {', '.join(SLEEP_TAGS)}", 400)
    if not out:
        return list(SLEEP_TAGS)
    return [t for t in SLEEP_TAGS if t in out]


def trim_heap() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc
    ``malloc_trim``); Paddle's CPU allocator frees into the C heap, which
    otherwise keeps them resident."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def process_rss() -> int:
    """Resident set size of this process in bytes (0 if unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
