"""What structured outputs cost, and that requests without them pay nothing.

    .venv/bin/python bench/bench_grammar.py [--reps 3] [--tokens 32] [--baseline-ref REF]

Runs the real engine in this process (the embedded SmolLM2 on the ``cpu``
runner), 16 concurrent greedy requests (c = 16, ``ignore_eos`` so the batch
stays 16 rows), and times every decode step.

1. **No grammar, before vs after.**  The only per-token code the grammar
   machinery touches is the batched sampler (the engine reads one more
   attribute per *request*).  "Before" is the same engine with its sampler
   swapped for the sampler module of ``--baseline-ref`` (default: the parent
   of the first commit that added ``fdx/plugins/grammar``), loaded from git
   -- the code path with no grammar or ``logit_bias`` hook at all; "after"
   is the current sampler.  The runner's sampler is switched every decode
   step (before, after, before, ...; the order flips each batch) over
   ``--reps`` batches of the same engine, model and prompts, so machine
   load falls on both alike; printed: ms/step and decode tokens/s of each,
   the throughput ratio after/before as the median over adjacent step
   pairs (must be >= 0.97), and the sampler call alone, alternating.
2. **Cost per step with grammars.**  The same batch with 0, 1 and 16 of the
   16 requests under a JSON schema (an array of short strings with
   ``minItems`` 64, so no grammar completes within the run): mean ms per
   decode step and the extra ms per step over 0 grammars, plus the mask
   work alone (matchers' bitmask fill + unpack + apply) for 1 and 16 rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 8}}
TOPICS = ["the sea", "a city", "music", "trees", "the moon", "bread", "rivers", "winter", "cats", "trains",
          "coffee", "mountains", "books", "rain", "gardens", "stars"]


def baseline_sampler_module(ref: str | None) -> Any:
    if ref is None:
        first = subprocess.run(["git", "log", "--format=%H", "--reverse", "--", "fdx/plugins/grammar"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()[0]
        ref = first + "^"
    src = subprocess.run(["git", "show", f"{ref}:fdx/model/sampler.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("fdx_sampler_before", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    print(f"baseline sampler: fdx/model/sampler.py at {ref} "
          f"({subprocess.run(['git', 'rev-parse', '--short', ref], cwd=ROOT, capture_output=True, text=True).stdout.strip()})")
    return mod


def add_batch(llm: Any, tokens: int, n_grammar: int, tag: str) -> None:
    """16 greedy requests (``ignore_eos``), the first ``n_grammar`` under the schema; prefilled."""
    from fdx.core.messages import AddRequest, SamplingParams, StructuredOutput

    eng = llm.engine
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    for i, topic in enumerate(TOPICS):
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Write about {topic}."}])
        p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                           structured=spec if i < n_grammar else None)
        eng.add_request(AddRequest(f"{tag}-{i}", tuple(llm.tokenizer.encode(text)), p, time.time()))
    live = [r for r in map(eng.scheduler.get, eng.scheduler.request_ids()) if r is not None]
    while eng.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in live):
        eng.step()


def decode_interleaved(llm: Any, tokens: int, samplers: list[Any], tag: str) -> list[list[float]]:
    """Decode one c=16 batch, the runner's sampler switched every step
    round-robin over ``samplers``: seconds of each step, per sampler (the
    same requests and batch, so machine load falls on all alike)."""
    eng = llm.engine
    add_batch(llm, tokens, 0, tag)
    times: list[list[float]] = [[] for _ in samplers]
    k = 0
    while eng.has_work():
        eng.runner.sampler = samplers[k % len(samplers)]
        t0 = time.perf_counter()
        eng.step()
        times[k % len(samplers)].append(time.perf_counter() - t0)
        k += 1
    for t in times:
        if t:
            t.pop()  # the last steps only flush
    return times


def sampler_ab(before: Any, after: Any, calls: int) -> tuple[float, float]:
    """Median seconds of one ``sample`` call of each sampler on the same 16
    greedy no-grammar rows, the two alternating call by call."""
    from fdx.core.messages import SamplingParams
    from fdx.core.request import Request

    reqs = [Request(f"q{i}", [1, 2, 3], SamplingParams(temperature=0, ignore_eos=True)) for i in range(16)]
    x = np.random.default_rng(1).normal(size=(16, after.vocab_size)).astype(np.float32)
    tb, ta = [], []
    for _ in range(calls):
        for s, out in ((before, tb), (after, ta)):
            t0 = time.perf_counter()
            s.sample(x, reqs)
            out.append(time.perf_counter() - t0)
    return statistics.median(tb), statistics.median(ta)


def engine_ms_per_step(llm: Any, tokens: int, n_grammar: int, tag: str) -> float:
    eng = llm.engine
    add_batch(llm, tokens, n_grammar, tag)
    times = []
    while eng.has_work():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[:-1])


def sampler_ms_per_step(llm: Any, ks: tuple[int, ...], steps: int) -> dict[int, float]:
    """ms per ``Sampler.sample`` call over 16 rows of real-width logits, with
    k rows under the schema (real llguidance matchers walking valid JSON:
    each step's tokens are appended, so each matcher accepts one token per
    step); the k configurations alternate step by step."""
    from fdx.core.messages import SamplingParams, StructuredOutput
    from fdx.core.request import Request
    from fdx.plugins.grammar.llguidance_backend import LLGuidanceBackend

    width = llm.engine.runner.vocab_size
    sampler = llm.engine.runner.sampler
    backend = LLGuidanceBackend(llm.config, width)
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    batches = {}
    for k in ks:
        reqs = []
        for i in range(16):
            r = Request(f"s{k}-{i}", [1], SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True))
            if i < k:
                r.grammar = backend.matcher(spec)
            reqs.append(r)
        batches[k] = reqs
    rng = np.random.default_rng(0)
    out: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(steps):
        x = rng.normal(size=(16, width)).astype(np.float32)
        for k in ks:
            t0 = time.perf_counter()
            toks, _ = sampler.sample(x, batches[k])
            out[k].append(time.perf_counter() - t0)
            for r, t in zip(batches[k], toks):
                r.output_token_ids.append(int(t))
    return {k: 1000 * statistics.median(v) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--baseline-ref", default=None)
    ap.add_argument("--sampler-steps", type=int, default=60)
    a = ap.parse_args()

    import fdx

    before_mod = baseline_sampler_module(a.baseline_ref)
    llm = fdx.LLM(max_num_seqs=16, max_model_len=512, num_kv_blocks=512)
    runner = llm.engine.runner
    after = runner.sampler
    before = before_mod.Sampler(after.vocab_size, after.max_logprobs, seed=0)
    decode_interleaved(llm, 8, [before, after], "warm")

    tb: list[float] = []
    ta: list[float] = []
    pairs: list[float] = []
    for rep in range(a.reps):
        b, x = decode_interleaved(llm, a.tokens, [before, after] if rep % 2 == 0 else [after, before], f"ab{rep}")
        if rep % 2:
            b, x = x, b
        pairs += [b_ / a_ for b_, a_ in zip(b, x)]  # adjacent steps: the same 16 rows, one position apart
        tb += b
        ta += x
    sb, sa = statistics.median(tb), statistics.median(ta)
    print(f"\nc=16, no grammar, {a.tokens} tokens/request, samplers alternating step by step, {a.reps} batches:")
    print(f"  before (baseline sampler)  {1000 * sb:7.2f} ms/step  = {16 / sb:6.1f} decode tokens/s  ({len(tb)} steps)")
    print(f"  after  (current sampler)   {1000 * sa:7.2f} ms/step  = {16 / sa:6.1f} decode tokens/s  ({len(ta)} steps)")
    r = statistics.median(pairs)
    print(f"  throughput after / before = {r:.3f} (median over {len(pairs)} adjacent step pairs; ratio of the "
          f"medians {sb / sa:.3f})  {'OK (within 3%)' if r >= 0.97 else 'OVER 3%'}")
    sb, sa = sampler_ab(before, after, a.sampler_steps * 5)
    print(f"  the sampler call alone (16 greedy rows x {after.vocab_size}, alternating): before {1e6 * sb:.1f} us, "
          f"after {1e6 * sa:.1f} us, after / before = {sa / sb:.3f}")

    print(f"\ncost per step with grammars (JSON schema {json.dumps(SCHEMA)}):")
    ms = sampler_ms_per_step(llm, (0, 1, 16), a.sampler_steps)
    for k in (0, 1, 16):
        extra = "" if k == 0 else f"  (+{ms[k] - ms[0]:.2f} ms per step for {k} grammar row{'s' if k > 1 else ''})"
        print(f"  sampler, 16 rows, {k:2d} with a grammar: {ms[k]:7.2f} ms/step{extra}")
    e = {k: engine_ms_per_step(llm, a.tokens, k, f"e{k}") for k in (0, 1, 16)}
    for k in (0, 1, 16):
        print(f"  whole engine step, c=16, {k:2d} grammar requests: {e[k]:7.1f} ms/step (x{e[k] / e[0]:.3f}; "
              f"one run each, as loaded as the machine is)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
