"""How closely the int8 default follows float32 (the exact path).

Teacher-forced on the parity prompts of tests/test_model_parity.py: float32
greedy-decodes 64 tokens per prompt, then both modes are fed each whole
sequence (chat prompt + those tokens) one token per step through the real
runner (paged KV cache, the C++ ops) and the top-1 token at every position
is compared (510 positions: every prompt and generated token that has a
successor).  Issue 27 asks for >= 99%.

Where the int8 error comes from (bench/bench_int8_error.py: the float32
runner with each matmul's input rounded through int8 blocks, the same
positions; the int8 weights ARE the GGUF's own Q4_1 / Q8_0 blocks, exactly
the weights float32 dequantizes, so all of the error is the Q8 quantization
of the activations): all matmuls 97.8%; one at a time, q|k|v 99.0%, gate|up
99.2%, down 99.2%, LM head 99.0%, o 100% -- so no single layer kept at
higher precision reaches 99%.  One activation scale per row instead of per
32-element block (what would let the AMX tiles sum over all of K) falls to
89.6%, and with per-channel int8 weights as well to 90.4%.  A grid centred
per block (``--schemes a8-center``) reaches 98.2-99.0% and cuts the mean
|dlogprob| by a third; but float32 itself decides 19 of the 510 positions
by a logit margin under 0.1, so at that error size 99% is a matter of which
near-ties flip (docs/PERFORMANCE.md, "A centred activation grid").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from runnerutil import run_greedy
from test_architectures import log_softmax, teacher_forced
from test_model_parity import PROMPTS

pytestmark = pytest.mark.slow
N_TOKENS = 64


def _runner(dtype: str) -> Any:
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    return PaddleModelRunner(make_config(num_kv_blocks=200, max_model_len=1024, dtype=dtype), CPUDevice())


def float32_references(n_tokens: int = N_TOKENS) -> tuple[Any, list[list[int]], list[np.ndarray]]:
    """The float32 runner, the parity sequences (chat prompt + its greedy
    ``n_tokens``) and float32's teacher-forced logits over them."""
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    fp32 = _runner("float32")
    seqs = [p + g for p, g in zip(prompts, run_greedy(fp32, prompts, n_tokens))]
    return fp32, seqs, [teacher_forced(fp32, s[:1], s[1:]) for s in seqs]


def top1_agreement(want: list[np.ndarray], got: list[np.ndarray]) -> tuple[int, int, float]:
    """(top-1 hits, positions, mean |delta logprob| of ``want``'s token)."""
    hits = total = 0
    dlp = []
    for w, g in zip(want, got):
        top = w.argmax(-1)
        hits += int((g.argmax(-1) == top).sum())
        total += len(top)
        rows = np.arange(len(top))
        dlp.append(np.abs(log_softmax(w)[rows, top] - log_softmax(g)[rows, top]))
    return hits, total, float(np.concatenate(dlp).mean())


@pytest.fixture(scope="module")
def agreement() -> tuple[int, int, float]:
    """(top-1 hits, positions, mean |delta logprob| of float32's token)."""
    fp32, seqs, want = float32_references()
    del fp32
    int8 = _runner("int8")
    assert int8.model.mode == "int8"
    return top1_agreement(want, [teacher_forced(int8, s[:1], s[1:]) for s in seqs])


def test_int8_stays_close_to_float32(agreement: tuple[int, int, float]) -> None:
    hits, total, dlp = agreement
    assert total > 500
    # measured 2026-12-03: see the report of the int8 branch (about 96-97%, mean |dlogprob| ~0.04)
    assert hits / total >= 0.95, f"int8 top-1 agreement with float32 {hits}/{total}"
    assert dlp < 0.08, f"mean |delta logprob| {dlp:.4f}"


@pytest.mark.xfail(strict=True, reason="issue 27: int8's Q8 activations reach ~96-97%, not 99% (see the module doc)")
def test_int8_agrees_with_float32_at_99_percent(agreement: tuple[int, int, float]) -> None:
    hits, total, _ = agreement
    assert hits / total >= 0.99, f"int8 top-1 agreement with float32 {hits}/{total} = {hits / total:.4f}"
