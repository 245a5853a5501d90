"""Per-request timings and the arithmetic that turns them into a report.

Pure logic (no I/O, no clock): the client fills one :class:`RequestResult`
per request from ``time.perf_counter()`` stamps; :func:`compute_metrics`
aggregates them.

Definitions (the same as vLLM's ``benchmark_serving``, so figures compare):

* **TTFT**: request sent -> first chunk that carries generated text.
* **ITL**: every gap between two successive text-carrying chunks (a chunk
  that carries several tokens counts as one gap).
* **TPOT** (per request, only when ``output_tokens > 1``):
  ``(e2el - ttft) / (output_tokens - 1)``.
* **E2EL**: request sent -> stream finished.
* **Throughput**: tokens of *successful* requests divided by the wall
  duration of the whole run (first send -> last completion).
* **Goodput**: successful requests meeting *every* given SLO, per second.
  An SLO on a metric a request does not have (TPOT of a 1-token answer) is
  treated as met.
* **Percentiles**: linear interpolation (``numpy.percentile`` default).

Invariant: all times are in seconds inside this module; reports add ``_ms``
fields in milliseconds.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import attrs
import numpy as np

#: metric name -> SLO key accepted by ``--goodput``
SLO_METRICS = ("ttft", "tpot", "e2el", "itl")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@attrs.define
class RequestResult:
    """What one request produced.  Mutable while the stream is read."""

    success: bool = False
    prompt_len: int = 0  # tokens sent (dataset's count, replaced by usage when the server reports it)
    output_tokens: int = 0  # generated tokens (usage, or chunks counted)
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = attrs.field(factory=list)
    start: float = 0.0  # perf_counter at send (relative to the run start once finished)
    error: str = ""
    generated_text: str = ""
    usage_reported: bool = False  # token counts came from the server's ``usage``
    chunks: int = 0  # text-carrying chunks seen

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile; 0.0 for an empty sequence."""
    if len(values) == 0:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """``{"mean", "median", "std", "p50", "p99", ...}`` in the input's unit."""
    arr = np.asarray(values, dtype=np.float64)
    out: dict[str, float] = {
        "mean": float(arr.mean()) if arr.size else 0.0,
        "median": float(np.median(arr)) if arr.size else 0.0,
        "std": float(arr.std()) if arr.size else 0.0,
    }
    for q in percentiles:
        out[f"p{_pct_name(q)}"] = percentile(arr, q)
    return out


def _pct_name(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q).rstrip("0")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (ms -> s).

    Raises ``ValueError`` with a one-line message on bad input."""
    slos: dict[str, float] = {}
    for item in items or ():
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"--goodput expects METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, got {part!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput {name}: {value!r} is not a number of milliseconds") from None
            if ms <= 0:
                raise ValueError(f"--goodput {name}: must be > 0 ms, got {value}")
            slos[name] = ms / 1000.0
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    for name, limit in slos.items():
        if name == "ttft" and r.ttft > limit:
            return False
        if name == "e2el" and r.e2el > limit:
            return False
        if name == "tpot":
            t = r.tpot
            if t is not None and t > limit:
                return False
        if name == "itl" and r.itl and max(r.itl) > limit:
            return False
    return True


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    *,
    slos: dict[str, float] | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """Aggregate a run.  ``duration`` is the wall time of the run in seconds."""
    pcts = tuple(percentiles)
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    dur = max(float(duration), 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.e2el for r in ok]
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": float(duration),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": output_tokens / dur,
        "total_token_throughput": (input_tokens + output_tokens) / dur,
        "usage_reported": bool(ok) and all(r.usage_reported for r in ok),
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for k, v in summarize(vals, pcts).items():
            out[f"{k}_{name}_ms"] = v * 1000.0
    if slos:
        good = sum(1 for r in ok if meets_slos(r, slos))
        out["goodput_slos_ms"] = {k: v * 1000.0 for k, v in slos.items()}
        out["good_requests"] = good
        out["request_goodput"] = good / dur
    if failed:
        errors: dict[str, int] = {}
        for r in failed:
            key = (r.error or "unknown error")[:200]
            errors[key] = errors.get(key, 0) + 1
        out["errors"] = errors
    return out
