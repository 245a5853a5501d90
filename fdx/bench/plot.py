"""Plot result JSONs of ``fdx bench serve``: output throughput, TTFT and ITL
against concurrency, one line per server (per result file).

:func:`main` backs ``fdx bench plot A.json B.json -o out.png``.  matplotlib
is imported only here (extra ``plot``) and uses the Agg backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence


def load_results(paths: Sequence[str]) -> list[dict[str, Any]]:
    docs = []
    for p in paths:
        try:
            with open(p, encoding="utf-8") as f:
                doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not a result JSON ({exc.msg})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
            raise ValueError(f"{p}: not an 'fdx bench serve --json' result (no 'runs')")
        doc.setdefault("label", p)
        docs.append(doc)
    return docs


def plot_results(docs: Sequence[dict[str, Any]], out_path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plotting needs matplotlib (pip install 'fdx[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    all_x: set[int] = set()
    panels = (
        ("output_throughput", "output tokens/s", "Output throughput"),
        ("median_ttft_ms", "ms", "TTFT (median)"),
        ("mean_itl_ms", "ms", "Inter-token latency (mean)"),
    )
    for doc in docs:
        runs = [r for r in doc["runs"] if r.get("max_concurrency")]
        runs.sort(key=lambda r: r["max_concurrency"])
        xs = [r["max_concurrency"] for r in runs]
        all_x.update(xs)
        for ax, (key, _, _) in zip(axes, panels):
            ax.plot(xs, [r.get(key, 0.0) for r in runs], marker="o", label=str(doc["label"]))
    for ax, (key, unit, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(all_x))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, alpha=0.3)
        if key != "output_throughput":
            ax.set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fdx bench plot", description="Plot fdx bench serve result JSONs side by side.")
    p.add_argument("results", nargs="+", metavar="RESULT.json")
    p.add_argument("-o", "--output", default="bench.png", metavar="FILE.png")
    args = p.parse_args(argv)
    return plot_files(args.results, args.output)


def plot_files(paths: list[str], output: str) -> int:
    """Plot saved result JSONs into ``output``; an exit code (2 on a bad file)."""
    try:
        plot_results(load_results(paths), output)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
