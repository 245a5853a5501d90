"""bench/compare_peers: median-of-rounds selection and the fdx/peer ratio
table, from synthetic result files (no servers)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
from typing import Any

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "compare_peers")


@pytest.fixture(scope="module")
def cp() -> Any:
    loader = importlib.machinery.SourceFileLoader("compare_peers", _PATH)
    spec = importlib.util.spec_from_loader("compare_peers", loader)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    had = "FDX_COMPARE_NO_REEXEC" in os.environ
    os.environ["FDX_COMPARE_NO_REEXEC"] = "1"  # importing must never re-exec the test process
    try:
        loader.exec_module(mod)
    finally:
        if not had:
            del os.environ["FDX_COMPARE_NO_REEXEC"]
    return mod


def _write(d: Any, name: str, w: str, rnd: int, tput: float, ttft: float, itl: float) -> None:
    run = {"output_throughput": tput, "median_ttft_ms": ttft, "mean_itl_ms": itl, "failed": 0,
           "idle": {"checked": True, "idle": True, "busy_fraction": 0.02}}
    (d / f"{name}-{w}-r{rnd}.json").write_text(json.dumps({"runs": [run]}))


def test_median_round_and_ratios(cp: Any, tmp_path: Any) -> None:
    for rnd, t in enumerate((100.0, 300.0, 200.0)):
        _write(tmp_path, "fdx", "c4", rnd, t, 50.0 * (rnd + 1), 10.0)
    _write(tmp_path, "peer", "c4", 0, 100.0, 200.0, 40.0)
    _write(tmp_path, "fdx", "single", 0, 20.0, 10.0, 50.0)
    res = cp.collect(str(tmp_path), ["single", "c4", "c32"])
    assert set(res) == {"single", "c4"}
    assert res["c4"]["fdx"]["output_throughput"] == 200.0  # median of 100, 200, 300
    t = cp.table(res, "Peer skipped: test")
    row = next(line for line in t.splitlines() if line.startswith("| c4 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["200.0", "100.0", "**2.00**"]  # throughput ratio fdx / peer
    assert cells[6] == "0.75"  # TTFT 150 / 200
    assert cells[9] == "0.25"  # ITL 10 / 40
    single = next(line for line in t.splitlines() if line.startswith("| single "))
    assert "| - |" in single and "Peer skipped: test" in t


def test_vllm_dtype_is_its_best_for_the_cpu(cp: Any) -> None:
    """``--vllm-dtype auto``: float32 where AVX512-BF16 is missing (bf16 is
    emulated there); with it, both are probed and the faster one wins."""
    avx2_only = {"avx2", "fma", "f16c"}
    assert cp.vllm_dtype_candidates("auto", avx2_only) == ["float32"]
    assert cp.vllm_dtype_candidates("auto", avx2_only | {"avx512f"}) == ["float32"]
    both = cp.vllm_dtype_candidates("auto", avx2_only | {"avx512f", "avx512_bf16"})
    assert sorted(both) == ["bfloat16", "float32"]
    assert cp.vllm_dtype_candidates("float32", avx2_only | {"avx512_bf16"}) == ["float32"]
    assert cp.vllm_dtype_candidates("bfloat16", avx2_only) == ["bfloat16"]
    assert cp.faster_dtype({"bfloat16": 211.7, "float32": 132.3}) == "bfloat16"
    assert cp.faster_dtype({"bfloat16": 10.0, "float32": 21.2}) == "float32"
    assert cp.faster_dtype({"bfloat16": None, "float32": 21.2}) == "float32"
    with pytest.raises(RuntimeError):
        cp.faster_dtype({"bfloat16": None, "float32": None})


def test_summary_names_the_dtype_vllm_ran(cp: Any, tmp_path: Any) -> None:
    _write(tmp_path, "fdx", "c4", 0, 200.0, 100.0, 10.0)
    _write(tmp_path, "vllm", "c4", 0, 100.0, 200.0, 20.0)
    res = cp.collect(str(tmp_path), ["c4"])
    fp32 = cp.summary_table(res, [], "float32")
    assert "in float32" in fp32 and "bf16" not in fp32
    assert "in bfloat16" in cp.summary_table(res, [], "bfloat16")
    assert "vLLM CPU serves" not in cp.summary_table(res, [])  # vLLM did not run
