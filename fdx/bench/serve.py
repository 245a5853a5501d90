"""``fdx bench serve``: load-test any OpenAI-compatible server (fdx,
llama.cpp's ``llama-server``, vLLM) over streaming HTTP.

Entry point :func:`main` (``argv`` without the program name) returns an exit
status: 0 when every timed request succeeded, 1 when some failed, 2 on bad
arguments or an unreachable server.  It never imports Paddle.

One *run* sends ``--num-prompts`` requests, arriving as a Poisson process at
``--request-rate`` (``inf``: all at once), at most ``--max-concurrency`` in
flight.  ``--sweep-concurrency 1,4,16`` repeats the run once per
concurrency.  Before every run the machine is sampled for a second and the
report says whether it was idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import sys
import time
from typing import Any, Sequence

from fdx.bench import datasets as ds
from fdx.bench.metrics import RequestResult, compute_metrics, parse_goodput

DEFAULT_INPUT_LEN = 192
DEFAULT_OUTPUT_LEN = 128


def build_parser(prog: str = "fdx bench serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark an OpenAI-compatible server (fdx, llama.cpp's llama-server, vLLM) with streaming requests.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    g.add_argument("--label", default=None, help="name of this server in the JSON and plots (default: the model name @ host:port)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    g.add_argument(
        "--prompt-format",
        default="auto",
        choices=["auto", "ids", "text"],
        help="send /v1/completions prompts as token ids or text; auto probes whether the server takes ids",
    )

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "jsonl"])
    g.add_argument("--dataset-path", default=None, help="jsonl file (one prompt per line) for --dataset jsonl")
    g.add_argument("--tokenizer", default="smollm2", help="tokenizer: 'smollm2', a .gguf file or a Hugging Face folder")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--random-input-len", type=int, default=DEFAULT_INPUT_LEN)
    g.add_argument("--random-output-len", type=int, default=DEFAULT_OUTPUT_LEN)
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths drawn uniformly from len*[1-r, 1+r]")
    g.add_argument("--random-output-range-ratio", type=float, default=None,
                   help="the same for output lengths (default: --random-range-ratio)")
    g.add_argument("--shared-prefix-groups", type=int, default=4)
    g.add_argument("--shared-prefix-len", type=int, default=512, help="tokens in each group's system prompt")
    g.add_argument("--shared-prefix-suffix-len", type=int, default=32, help="tokens in each request's own question")
    g.add_argument("--output-len", type=int, default=None, help="max_tokens for jsonl prompts that give none")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson arrivals); inf: all at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: unbounded)")
    g.add_argument("--sweep-concurrency", default=None, help="comma list, e.g. 1,4,16,32: one run per concurrency")
    g.add_argument("--warmup", type=int, default=1, help="untimed requests sent before each run")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-idle-check", action="store_true", help="skip sampling /proc/stat before each run")
    g.add_argument("--server-pid", type=int, action="append", default=[], metavar="PID",
                   help="the server's PID (repeatable, local servers only): report the CPU other processes "
                   "used during the run, excluding the server's process tree")
    g.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each run, wait up to S seconds for the machine to be idle")

    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50")
    g.add_argument("--percentiles", default="50,90,99", help="comma list of percentiles to report")
    g.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write the results as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="plot throughput and TTFT/ITL vs concurrency")
    g.add_argument(
        "--plot-from",
        nargs="+",
        default=None,
        metavar="RESULT.json",
        help="with --plot: draw these result files (one line per server) instead of running",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------


async def run_once(
    samples: Sequence[ds.SampleRequest],
    opts: Any,
    *,
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    progress: bool,
    desc: str = "",
) -> tuple[list[RequestResult], float]:
    """Send ``samples``; returns the results (in sample order) and the wall
    duration in seconds.  ``result.start`` becomes relative to the run start."""
    import aiohttp
    import numpy as np

    from fdx.bench.client import connector, send_request

    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(samples), desc=desc or "requests", unit="req", leave=False, file=sys.stderr)

    async with aiohttp.ClientSession(connector=connector()) as session:

        async def one(s: ds.SampleRequest) -> RequestResult:
            if sem is None:
                r = await send_request(session, s, opts)
            else:
                async with sem:
                    r = await send_request(session, s, opts)
            if bar is not None:
                bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for s in samples:
            tasks.append(asyncio.create_task(one(s)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    for r in results:
        r.start = max(0.0, r.start - t0)
    return list(results), duration


def _make_samples(args: argparse.Namespace, tok: Any, vocab: Any, n: int, seed: int, nonce: str) -> list[ds.SampleRequest]:
    if args.dataset == "random":
        return ds.random_dataset(
            tok, n, args.random_input_len, args.random_output_len, args.random_range_ratio, seed=seed, nonce=nonce,
            vocab=vocab, output_range_ratio=args.random_output_range_ratio,
        )
    if args.dataset == "shared-prefix":
        return ds.shared_prefix_dataset(
            tok,
            n,
            args.shared_prefix_groups,
            args.shared_prefix_len,
            args.shared_prefix_suffix_len,
            args.random_output_len,
            seed=seed,
            nonce=nonce,
            vocab=vocab,
        )
    return ds.jsonl_dataset(args.dataset_path, n, tok, args.output_len)


def _chat_lengths(samples: list[ds.SampleRequest], tok: Any) -> list[ds.SampleRequest]:
    """For the chat endpoint the prompt length includes the chat template."""
    import attrs

    if tok is None or not getattr(tok, "chat_template", None):
        return samples
    out = []
    for s in samples:
        try:
            n = len(tok.encode_chat(s.chat_messages()))
        except Exception:  # noqa: BLE001 - estimate only; the server's usage wins
            n = s.prompt_len
        out.append(attrs.evolve(s, prompt_len=n))
    return out


def _validate(args: argparse.Namespace) -> list[int | None]:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if args.dataset == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path FILE")
    if args.plot_from and not args.plot:
        raise ValueError("--plot-from needs --plot FILE.png")
    if args.sweep_concurrency:
        try:
            conc = [int(x) for x in args.sweep_concurrency.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"--sweep-concurrency expects a comma list of integers, got {args.sweep_concurrency!r}") from None
        if not conc or any(c < 1 for c in conc):
            raise ValueError("--sweep-concurrency values must be >= 1")
        return list(conc)
    return [args.max_concurrency]


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--percentiles expects a comma list of numbers, got {text!r}") from None
    if not vals or any(not 0 < v <= 100 for v in vals):
        raise ValueError("--percentiles values must be in (0, 100]")
    return vals


async def _run(args: argparse.Namespace) -> int:
    from fdx.bench.client import RequestOptions, accepts_token_ids, get_models
    from fdx.bench.machine import CpuSampler, describe_idle, idle_check, machine_info
    from fdx.bench.report import format_report

    concurrencies = _validate(args)
    slos = parse_goodput(args.goodput)
    pcts = _percentiles(args.percentiles)

    try:
        models = await get_models(args.base_url, args.api_key)
    except Exception as exc:  # noqa: BLE001
        if args.model is None:
            print(f"error: cannot reach {args.base_url}/v1/models: {exc or type(exc).__name__}", file=sys.stderr)
            return 2
        models = []
    model = args.model or (models[0] if models else None)
    if model is None:
        print(f"error: {args.base_url}/v1/models lists no model; pass --model", file=sys.stderr)
        return 2

    tok = None
    vocab = None
    if args.dataset != "jsonl" or args.tokenizer:
        try:
            tok = ds.load_tokenizer(args.tokenizer)
            if args.dataset != "jsonl":
                vocab = ds.WordVocab(tok)
        except Exception as exc:  # noqa: BLE001 - ModelLoadError and friends: one line
            if args.dataset != "jsonl":
                print(f"error: tokenizer {args.tokenizer!r}: {exc}", file=sys.stderr)
                return 2
            tok = None

    opts = RequestOptions(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=model,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        api_key=args.api_key,
        timeout=args.timeout,
    )
    use_ids = False
    if args.endpoint == "/v1/completions" and args.dataset != "jsonl":
        if args.prompt_format == "ids":
            use_ids = True
        elif args.prompt_format == "auto":
            probe = ds.random_dataset(tok, 1, 8, 1, seed=args.seed + 999, vocab=vocab)[0]
            use_ids = await accepts_token_ids(opts, list(probe.token_ids or ()))
    import attrs

    opts = attrs.evolve(opts, use_token_ids=use_ids)
    host = args.base_url.split("://", 1)[-1].rstrip("/")
    label = args.label or f"{model}@{host}"

    print(
        f"server {args.base_url} model {model!r} endpoint {args.endpoint} "
        f"prompts as {'token ids' if use_ids else 'text'}; dataset {args.dataset}",
        file=sys.stderr,
    )
    runs: list[dict[str, Any]] = []
    any_failed = False
    for k, conc in enumerate(concurrencies):
        nonce = secrets.token_hex(4)
        seed = args.seed + 7919 * k
        samples = _make_samples(args, tok, vocab, args.num_prompts, seed, nonce)
        if args.endpoint == "/v1/chat/completions":
            samples = _chat_lengths(samples, tok)
        if args.warmup:
            wsamples = _make_samples(args, tok, vocab, args.warmup, seed + 1, nonce + "w")
            wres, _ = await run_once(
                wsamples, opts, request_rate=math.inf, max_concurrency=conc, seed=seed, progress=False
            )
            if not any(r.success for r in wres):
                print(f"error: every warm-up request failed: {wres[0].error}", file=sys.stderr)
                return 2
        idle: dict[str, Any] = {"checked": False}
        if not args.no_idle_check:
            idle = idle_check(1.0)
            deadline = time.monotonic() + args.wait_idle
            waited = 0
            while idle.get("checked") and not idle["idle"] and time.monotonic() < deadline:
                if waited % 10 == 0:
                    print(describe_idle(idle) + f" -- waiting up to {args.wait_idle:.0f} s", file=sys.stderr)
                waited += 1
                await asyncio.sleep(1.0)
                idle = idle_check(1.0)
            print(describe_idle(idle), file=sys.stderr)
        sampler = None
        if not args.no_idle_check:
            sampler = CpuSampler(frozenset(args.server_pid))
            sampler.start()
        results, duration = await run_once(
            samples,
            opts,
            request_rate=args.request_rate,
            max_concurrency=conc,
            seed=seed,
            progress=not args.no_progress,
            desc=f"c={conc if conc else 'inf'}",
        )
        during = sampler.stop() if sampler is not None else {"checked": False}
        metrics = compute_metrics(results, duration, slos=slos, percentiles=pcts)
        run = {
            "max_concurrency": conc,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "num_prompts": args.num_prompts,
            "idle": idle,
            "cpu_during_run": during,
            **metrics,
            "per_request": [
                {
                    "sent_prompt_len": s.prompt_len,
                    "max_tokens": s.output_len,
                    "prompt_len": r.prompt_len,
                    "output_tokens": r.output_tokens,
                    "ttft_ms": r.ttft * 1000.0,
                    "e2el_ms": r.e2el * 1000.0,
                    "start_s": r.start,
                    "chunks": r.chunks,
                    "success": r.success,
                    "error": r.error,
                }
                for s, r in zip(samples, results)
            ],
        }
        runs.append(run)
        any_failed = any_failed or metrics["failed"] > 0
        print(format_report(run, label=label, pcts=pcts))

    doc = {
        "label": label,
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "prompt_format": "ids" if use_ids else "text",
        "dataset": {
            "name": args.dataset,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            "random_output_range_ratio": args.random_output_range_ratio,
            "shared_prefix_groups": args.shared_prefix_groups,
            "shared_prefix_len": args.shared_prefix_len,
            "shared_prefix_suffix_len": args.shared_prefix_suffix_len,
            "path": args.dataset_path,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
        },
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
    }
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json_path}", file=sys.stderr)
    if args.plot:
        from fdx.bench.plot import plot_results

        plot_results([doc], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if any_failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot_from:
        if not args.plot:
            parser.error("--plot-from needs --plot FILE.png")
        from fdx.bench.plot import plot_files

        return plot_files(args.plot_from, args.plot)
    try:
        return asyncio.run(_run(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # python -m fdx.bench.serve
    sys.exit(main())
