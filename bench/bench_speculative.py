"""Speculative decoding (``--speculative ngram``) against plain decoding, side by side.

    .venv/bin/python bench/bench_speculative.py [--dtype int8] [--k 4] [--output-len 64] [--repeat 3] \
        [--prompt-lookup-max 4] [--prompt-lookup-min 1]

Two engines in this process (``fdx.LLM``, the embedded model), one with
speculation off and one with ``--speculative ngram --num-speculative-tokens
K``.  Single stream: one greedy request at a time; each round runs the same
request on one engine then the other, alternating which goes first, and
after a warm-up round the medians over ``--repeat`` rounds are printed.
Two workloads: ``summarize`` (a chat asking to repeat an article: the
output copies the prompt) and ``random`` (random token ids, ``ignore_eos``:
nothing to copy).  Printed per workload: output tok/s of each, the ratio
on / off (> 1 favours speculation), the acceptance rate (accepted / drafted
tokens) and the tokens emitted per verification round.  The outputs are
checked identical.

Timings on a shared machine are noisy: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

ARTICLE = (
    "The city council approved a plan on Tuesday to build a new public library on Main Street. The library "
    "will cost 12 million dollars, open in March 2027 and hold 40,000 books, a children's wing and a cafe. "
    "Mayor Ana Ruiz said the project will create 80 jobs and that construction starts in the spring. Critics "
    "on the council said the money should go to road repairs instead, but the vote passed seven to two."
)


def _workloads(llm: Any, output_len: int) -> dict[str, tuple[list[int], Any]]:
    import fdx

    tok = llm.tokenizer
    chat = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{ARTICLE}"}]
    summarize = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
    rng = random.Random(0)
    rand = [rng.randrange(200, 40000) for _ in range(len(summarize))]
    return {
        "summarize": (summarize, fdx.SamplingParams(temperature=0, max_tokens=output_len)),
        "random": (rand, fdx.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)),
    }


def _run(llm: Any, prompt: list[int], params: Any) -> tuple[float, list[int]]:
    t = time.perf_counter()
    res = llm.generate([prompt], params)[0]
    return time.perf_counter() - t, list(res.token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    import fdx

    # no prefix cache: every round prefills its prompt again, on both engines alike
    kw = dict(dtype=a.dtype, num_kv_blocks=128, max_model_len=1024, enable_prefix_caching=False)
    engines = {
        "off": fdx.LLM(**kw),
        "on": fdx.LLM(speculative="ngram", num_speculative_tokens=a.k, prompt_lookup_max=a.prompt_lookup_max,
                      prompt_lookup_min=a.prompt_lookup_min, **kw),
    }
    work = _workloads(engines["off"], a.output_len)
    print(f"dtype={a.dtype} K={a.k} prompt_lookup={a.prompt_lookup_min}..{a.prompt_lookup_max} "
          f"output_len={a.output_len} repeat={a.repeat} (single stream, greedy)")
    print(f"{'workload':<10} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'accept':>7} {'tok/round':>9}")
    for name, (prompt, params) in work.items():
        times: dict[str, list[float]] = {"off": [], "on": []}
        outs: dict[str, list[int]] = {}
        st0 = engines["on"].engine.stats().speculative
        for rnd in range(a.repeat + 1):  # round 0 warms up
            order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
            for which in order:
                dt, toks = _run(engines[which], prompt, params)
                outs[which] = toks
                if rnd:
                    times[which].append(len(toks) / dt)
        st1 = engines["on"].engine.stats().speculative
        assert st0 is not None and st1 is not None
        drafted = st1.num_draft_tokens - st0.num_draft_tokens
        accepted = st1.num_accepted_tokens - st0.num_accepted_tokens
        rounds = st1.num_drafts - st0.num_drafts
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        same = "" if outs["off"] == outs["on"] else "  OUTPUT DIFFERS"
        print(f"{name:<10} {off:>10.1f} {on:>10.1f} {on / off:>6.2f}x {accepted / max(1, drafted):>6.0%} "
              f"{(accepted + rounds) / max(1, rounds):>9.2f}{same}")


if __name__ == "__main__":
    main()
