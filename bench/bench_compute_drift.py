#!/usr/bin/env python
"""Accuracy drift of the packed compute modes (int8, bfloat16) against
float32 (the exact path).

Greedy decoding of the same chat prompts with ``--dtype float32`` and each
mode of ``--modes`` (one ``fdx.LLM`` each, prefix cache off): per prompt,
the index of the first differing token (``N`` = identical) and the largest
difference of the chosen token's logprob before it.  Not a timing: the
figures do not depend on machine load.

    .venv/bin/python bench/bench_compute_drift.py [--modes int8,bfloat16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.", "def fibonacci(n):",
    "Translate 'good morning' into Spanish, German and Italian.", "Name three colours.",
    "Translate 'good morning' into Spanish.", "1, 2, 3, 4,", "The quick brown fox", "Explain photosynthesis briefly.",
    "SELECT * FROM users WHERE", "List three prime numbers.", "Once upon a time, in a small village,",
    "What is 17 times 23?", "import numpy as np\n", "The mitochondria is", "Dear hiring manager,", "Rain falls on the",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", default="int8,bfloat16", help="compute modes to hold against float32")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import fdx
    from fdx import SamplingParams

    n = args.max_tokens
    res = {}
    for mode in ["float32", *modes]:
        llm = fdx.LLM(dtype=mode, num_kv_blocks=400, max_model_len=1024, enable_prefix_caching=False)
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0))
        res[mode] = [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
        del llm
    for mode in modes:
        rows = []
        print(f"\n{mode} against float32\n{'first diff':>10s} {'max |dlogprob|':>15s}  prompt")
        for i, p in enumerate(PROMPTS):
            (ta, la), (tb, lb) = res["float32"][i], res[mode][i]
            div = next((k for k in range(n) if ta[k] != tb[k]), n)
            md = max((abs(la[k] - lb[k]) for k in range(div)), default=0.0)
            rows.append((div, md))
            print(f"{div:10d} {md:15.4f}  {p!r}")
        divs = sorted(d for d, _ in rows)
        print(f"{mode}: identical {n}/{n} tokens: {sum(d == n for d in divs)} of {len(rows)} prompts; "
              f"median first difference at token {divs[len(divs) // 2]}; "
              f"max chosen-logprob difference before it: {max(m for _, m in rows):.4f}")


if __name__ == "__main__":
    main()
