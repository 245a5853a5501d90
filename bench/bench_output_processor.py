"""Cost per generated token of the shared output path (``fdx.output_processor``).

    .venv/bin/python bench/bench_output_processor.py [--tokens 2000] [--repeat 5]

Streams a ~N-token mixed text one token per engine output through
:meth:`OutputProcessor.process` (detokenize + stop strings + a typed
event), and, as the baseline measured in the same run, through the bare
``TokenStream.feed`` of the same default token processor.  Prints
microseconds per token and the ratio to the baseline (the machine may be
shared: compare the ratios).
"""

from __future__ import annotations

import argparse
from typing import Callable

from fdx.core.messages import RequestOutput, SamplingParams, TokenLogprob
from fdx.core.plugins import get_plugins
from fdx.model.loader import load_tokenizer
from fdx.output_processor import OutputProcessor

from bench_token_processor import per_token, sample_ids  # same mixed text and timing as that bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(None)
    proc = get_plugins().create("token_processor", "default", tokenizer=tok, config=None)
    outputs = OutputProcessor(proc)
    ids = sample_ids(tok, args.tokens)
    n = len(ids)
    stops = ("###END###", "\n\nUser:")
    msgs = [RequestOutput("r", (t,), None, 3, 0, k + 1) for k, t in enumerate(ids)]
    msgs_lp = [RequestOutput("r", (t,), None, 3, 0, k + 1, (TokenLogprob(t, -0.5, ((t, -0.5),)),))
               for k, t in enumerate(ids)]

    def bare(stop: tuple[str, ...]) -> Callable[[], None]:
        def go() -> None:
            s = proc.open_stream([1, 2, 3], SamplingParams(stop=stop))
            for m in msgs:
                s.feed(m.new_token_ids, False)
            s.feed((), True)

        return go

    def shared(stop: tuple[str, ...], batch: list[RequestOutput]) -> Callable[[], None]:
        def go() -> None:
            st = outputs.open("r", 0, 0, [1, 2, 3], SamplingParams(stop=stop))
            for m in batch:
                outputs.process(st, m)
            outputs.process(st, RequestOutput("r", (), "length", 3, 0, n))

        return go

    rows = []
    for label, stop in (("no stop strings", ()), ("2 stop strings", stops)):
        base = per_token(bare(stop), n, args.repeat)
        rows.append((f"TokenStream.feed, {label}", base, base))
        rows.append((f"OutputProcessor.process, {label}", per_token(shared(stop, msgs), n, args.repeat), base))
        rows.append((f"  + logprobs, {label}", per_token(shared(stop, msgs_lp), n, args.repeat), base))
    print(f"{n} tokens, 1 token per engine output")
    for name, t, base in rows:
        print(f"  {name:<42} {t * 1e6:8.2f} us/token  {t / base:6.2f}x")


if __name__ == "__main__":
    main()
