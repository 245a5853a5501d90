"""Human-readable report of one run (the layout of vLLM's benchmark, so
figures are easy to compare by eye)."""

from __future__ import annotations

from typing import Any, Sequence

from fdx.bench.metrics import _pct_name

_W = 60


def _line(name: str, value: Any, fmt: str = "{:<46}{:>14}") -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return fmt.format(name, value)


def format_report(run: dict[str, Any], *, label: str = "", pcts: Sequence[float] = (50.0, 90.0, 99.0)) -> str:
    conc = run.get("max_concurrency")
    title = f" {label} | concurrency {conc if conc else 'unbounded'} | rate {run.get('request_rate')} "
    out = [title.center(_W, "=")]
    idle = run.get("idle") or {}
    if idle.get("checked"):
        out.append(_line("Machine idle before run:", f"{'yes' if idle['idle'] else 'NO'} ({idle['busy_fraction'] * 100:.0f}%)"))
    during = run.get("cpu_during_run") or {}
    if during.get("checked"):
        text = f"{during['busy_fraction'] * 100:.0f}% busy"
        if "others_cores" in during:
            text += f", others {during['others_cores']:.2f} cores"
        out.append(_line("CPU during run:", text))
    out += [
        _line("Successful requests:", run["completed"]),
        _line("Failed requests:", run["failed"]),
        _line("Benchmark duration (s):", run["duration_s"]),
        _line("Total input tokens:", run["total_input_tokens"]),
        _line("Total generated tokens:", run["total_output_tokens"]),
        _line("Token counts from server usage:", "yes" if run.get("usage_reported") else "no (chunks)"),
        _line("Request throughput (req/s):", run["request_throughput"]),
        _line("Output token throughput (tok/s):", run["output_throughput"]),
        _line("Total token throughput (tok/s):", run["total_token_throughput"]),
    ]
    if "request_goodput" in run:
        slos = ", ".join(f"{k}<={v:g}ms" for k, v in run["goodput_slos_ms"].items())
        out.append(_line(f"Request goodput (req/s) [{slos}]:", run["request_goodput"], "{:<46}{:>14}"))
        out.append(_line("Requests meeting every SLO:", run["good_requests"]))
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        out.append(f" {title} ".center(_W, "-"))
        out.append(_line(f"Mean {name.upper()} (ms):", run[f"mean_{name}_ms"]))
        if 50.0 not in [float(q) for q in pcts]:
            out.append(_line(f"Median {name.upper()} (ms):", run[f"median_{name}_ms"]))
        for q in pcts:
            out.append(_line(f"P{_pct_name(q)} {name.upper()} (ms):", run[f"p{_pct_name(q)}_{name}_ms"]))
    if run.get("errors"):
        out.append(" Errors ".center(_W, "-"))
        for msg, n in run["errors"].items():
            out.append(f"{n:>5} x {msg}")
    out.append("=" * _W)
    return "\n".join(out)
