"""The engine's control plane: ``pause``, ``resume``, ``sleep``, ``wakeup``,
``update_weights``, ``abort_requests``, ``is_paused`` and ``reset_prefix_cache``, dispatched by name
through :meth:`fdx.core.engine.Engine.control` (the HTTP routes are in
:mod:`fdx.server.control`).

It is not part of the loop, so it lives outside the kernel, but it is fdx's
own code, not a plugin: no plugin can bypass or replace it.  It drives the
engine only through its public state (``is_paused``, ``sleeping``,
``scheduler``, ``runner``, ``kv``, ``device``, ``finish``, ``abort``).
Invariants:

* control methods run between two steps (the engine loop calls them), never
  inside one, so they never see a half-applied batch;
* every request they end gets exactly one final output, flushed by the next
  ``Engine.step()``: an error (code 503) for pause, ``finish_reason="abort"``
  with the partial tokens for abort_requests; its blocks are freed;
* ``engine.sleeping`` non-empty implies ``engine.is_paused`` (nothing runs
  without weights or KV cache): resume refuses while something sleeps,
  wakeup resumes once nothing does;
* a failed sleep/wakeup leaves the tag marked asleep, so the engine stays
  paused and a retried wakeup restores it (runner restore is idempotent).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from fdx.core.errors import ControlError, ModelLoadError, RequestError

if TYPE_CHECKING:
    from fdx.core.interfaces import Device, ModelRunner, Scheduler
    from fdx.core.kv_cache import KVCacheManager
    from fdx.core.request import Request


class ControlledEngine(Protocol):
    """What the control plane reads and changes of the engine
    (:class:`fdx.core.engine.Engine`, which builds it on the first call):
    typed here so this module needs nothing from ``fdx.core.engine``."""

    is_paused: bool
    sleeping: set[str]
    scheduler: Scheduler
    runner: ModelRunner
    kv: KVCacheManager
    device: Device | None

    def finish(self, req: Request, finish_reason: str, error: str | None, code: int) -> None: ...

    def abort(self, request_ids: Iterable[str], reason: str = "abort") -> list[Request]: ...

log = logging.getLogger("fdx.engine")

__all__ = ["ControlError", "ControlPlane", "SLEEP_TAGS", "parse_tags"]

SLEEP_TAGS = ("weight", "kv_cache")
#: the control state a restarted engine takes back, in its IPC directory (written after every change)
STATE_FILE = "engine_state.json"
#: the methods that change it
STATEFUL = frozenset({"pause", "resume", "sleep", "wakeup", "update_weights"})


class ControlPlane:
    """The control methods of one :class:`~fdx.core.engine.Engine`; method
    ``m`` of the API is :meth:`ControlPlane.m`."""

    METHODS = ("pause", "resume", "is_paused", "sleep", "wakeup", "update_weights", "abort_requests",
               "reset_prefix_cache")

    def __init__(self, engine: ControlledEngine, state_path: str | None = None) -> None:
        self.engine = engine
        #: where the control state is kept (``None``: nowhere, e.g. ``fdx.LLM``)
        self.state_path = state_path
        #: ``(path, version)`` of the last update_weights (``None``: the served model's own)
        self.weights: tuple[str, str] | None = None

    def call(self, method: str, args: dict[str, Any] | None) -> Any:
        """Run control method ``method`` with keyword ``args``.

        Raises :class:`ControlError`: 400 for an unknown method, bad
        arguments or a refused call (e.g. update_weights while running),
        500 when the method itself fails (the message says why)."""
        if method not in self.METHODS:
            raise ControlError(f"unknown control method: {method}", 400)
        handler: Callable[..., Any] = getattr(self, method)
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
        if method in STATEFUL:
            self.save_state()
        return result

    # -- state that survives a restart ------------------------------------

    def save_state(self) -> None:
        """Write paused / sleeping / weights to :attr:`state_path`
        (atomically), so the supervisor's next engine comes back the same."""
        if self.state_path is None:
            return
        eng = self.engine
        state = {"is_paused": eng.is_paused, "sleeping": sorted(eng.sleeping),
                 "weights": None if self.weights is None else {"path": self.weights[0], "version": self.weights[1]}}
        tmp = f"{self.state_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
        os.replace(tmp, self.state_path)

    def restore_state(self) -> dict[str, Any] | None:
        """A restarted engine (before it says ready): take back the state
        its predecessor saved -- its weights (update_weights), then asleep
        or paused.  Returns the state restored, ``None`` if there was none."""
        if self.state_path is None or not os.path.exists(self.state_path):
            return None
        with open(self.state_path, encoding="utf-8") as f:
            state = json.load(f)
        weights = state.get("weights")
        if weights or state.get("is_paused") or state.get("sleeping"):
            self.pause()
        if weights:
            self.update_weights(weights["path"], weights["version"])
        if state.get("sleeping"):
            self.sleep(state["sleeping"])
        elif not state.get("is_paused"):
            self.resume()
        log.warning("restarted engine restored its control state: paused=%s sleeping=%s weights=%s",
                    self.engine.is_paused, ",".join(sorted(self.engine.sleeping)) or "-",
                    weights["version"] if weights else "(the served model)")
        return state

    def pause(self) -> dict[str, Any]:
        """Stop admitting work; end every running and waiting request with
        an error (503), free their blocks, reset the prefix cache.  Pausing
        twice is a no-op.  Both v0 and v1 go through ``preempt_all``, which
        removes every request at once (v0 cannot recompute, so draining and
        dropping are the same there)."""
        eng = self.engine
        if eng.is_paused:
            return {"is_paused": True, "num_aborted": 0}
        eng.is_paused = True
        ended = eng.scheduler.preempt_all()
        for req in ended:
            if req.finish_reason == "error":  # already failed in the scheduler: keep its own error
                eng.finish(req, "error", req.error or "request failed", req.error_code or 500)
            else:
                eng.finish(req, "error", "request aborted: engine is paused", 503)
        eng.kv.reset_prefix_cache()
        if ended:
            log.info("paused: %d request(s) ended", len(ended))
        return {"is_paused": True, "num_aborted": len(ended)}

    def resume(self) -> dict[str, Any]:
        """Admit work again (no-op when not paused); refused while sleeping."""
        eng = self.engine
        if eng.sleeping:
            raise ControlError(f"engine is sleeping ({','.join(sorted(eng.sleeping))}): call wakeup, not resume", 400)
        eng.is_paused = False
        return {"is_paused": False}

    def is_paused(self) -> dict[str, Any]:
        return {"is_paused": self.engine.is_paused, "sleeping": sorted(self.engine.sleeping)}

    def reset_prefix_cache(self) -> dict[str, Any]:
        """Forget every cached prefix block (vLLM's ``/reset_prefix_cache``);
        running requests keep their blocks.  Works while serving."""
        self.engine.kv.reset_prefix_cache()
        return {"reset": True}

    def sleep(self, tags: str | list[str] | None = None) -> dict[str, Any]:
        """Pause (implicitly), then free the memory of ``tags`` (``weight``,
        ``kv_cache``; default both).  Already sleeping tags are skipped."""
        eng = self.engine
        wanted = parse_tags(tags)
        self.pause()
        todo = [t for t in wanted if t not in eng.sleeping]
        rss = eng.device.process_rss if eng.device is not None else lambda: 0
        before = rss()
        if todo:
            eng.sleeping.update(todo)  # before release: a failed release still needs a wakeup
            eng.runner.release(todo)
        after = rss()
        log.info("sleep %s: RSS %.1f -> %.1f MiB", ",".join(todo) or "-", before / 2**20, after / 2**20)
        return {"sleeping": sorted(eng.sleeping), "released": todo, "rss_before": before, "rss_after": after}

    def wakeup(self, tags: str | list[str] | None = None) -> dict[str, Any]:
        """Reload what sleep freed (``tags``, default all sleeping), then
        resume once nothing is left asleep (like the seed, a wakeup with
        nothing asleep just resumes)."""
        eng = self.engine
        wanted = parse_tags(tags)
        todo = [t for t in wanted if t in eng.sleeping]
        if todo:
            eng.runner.restore(todo)
            eng.sleeping.difference_update(todo)
        if not eng.sleeping:
            eng.is_paused = False
        return {"restored": todo, "sleeping": sorted(eng.sleeping), "is_paused": eng.is_paused}

    def update_weights(self, path: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Load a checkpoint with the running model's architecture and
        shapes; only while paused and awake.  ``version`` (default: the
        path) is recorded and shown by /v1/models.  A bad checkpoint is a
        400 naming the mismatch; the old weights stay in place."""
        eng = self.engine
        if not eng.is_paused:
            raise ControlError("update_weights needs a paused engine: call pause first", 400)
        if "weight" in eng.sleeping:
            raise ControlError("weights are asleep: call wakeup (tag 'weight') before update_weights", 400)
        if not isinstance(path, str) or not path:
            raise ControlError("update_weights needs 'path' (a .gguf file or a Hugging Face folder)", 400)
        ver = path if version is None or version == "" else str(version)
        try:
            eng.runner.load_weights(path, ver)
        except ModelLoadError as exc:
            raise ControlError(f"update_weights: {exc}", 400) from exc
        eng.kv.reset_prefix_cache()  # KV computed by the old weights is invalid
        if eng.device is not None:
            eng.device.trim_memory()  # the old weights' memory goes back to the OS (RSS does not grow per swap)
        self.weights = (path, eng.runner.weights_version)
        return {"version": eng.runner.weights_version, "path": path}

    def abort_requests(self, req_ids: list[str] | str | None = None, abort_all: bool = False) -> dict[str, Any]:
        """Abort requests by engine id (or all); each gets a final output
        with its partial tokens (``finish_reason="abort"``)."""
        if req_ids is None:
            req_ids = []
        elif isinstance(req_ids, str):
            req_ids = [req_ids]
        if not isinstance(req_ids, (list, tuple)) or not all(isinstance(i, str) for i in req_ids):
            raise ControlError("abort_requests: 'req_ids' must be a list of strings", 400)
        asked = list(dict.fromkeys(req_ids))
        ids = self.engine.scheduler.request_ids() if abort_all else asked
        removed = self.engine.abort(ids)
        found = {r.request_id for r in removed}
        return {
            "aborted": [{"request_id": r.request_id, "output_token_count": r.num_output_tokens} for r in removed],
            "not_found": [] if abort_all else [i for i in asked if i not in found],
        }


def parse_tags(tags: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """``"weight,kv_cache"``, a list, or ``None``/``""`` (= all) -> the
    validated tags, deduplicated, in :data:`SLEEP_TAGS` order.  Raises
    :class:`ControlError` (400) naming any unknown tag."""
    if isinstance(tags, str):
        items = tags.split(",")
    elif tags is None or (isinstance(tags, (list, tuple)) and all(isinstance(t, str) for t in tags)):
        items = list(tags or ())
    else:
        raise ControlError(f"tags must be a comma-separated string or a list of strings, got {tags!r}", 400)
    out = {t.strip() for t in items if t.strip()}
    bad = sorted(t for t in out if t not in SLEEP_TAGS)
    if bad:
        raise ControlError(f"unsupported tag(s) {', '.join(bad)} in {tags!r}; expected one of {', '.join(SLEEP_TAGS)}", 400)
    return [t for t in SLEEP_TAGS if t in out or not out]


def restore_control_state(engine: Any, run_dir: str) -> None:
    """A supervisor's restart comes back paused / asleep / on the weights its
    predecessor had (saved in ``run_dir``); failing that, it stays paused."""
    engine.controls = ControlPlane(engine, os.path.join(run_dir, STATE_FILE))
    try:
        engine.controls.restore_state()
    except Exception:  # noqa: BLE001 - e.g. the updated checkpoint is gone: serve nothing until told
        log.exception("could not restore the control state; the engine stays paused")
        engine.is_paused = True
