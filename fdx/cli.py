"""The ``fdx`` command line: ``serve``, ``plugins``, ``bench serve``, ``router``.

Importing this module (and running ``--help`` or ``plugins``) never imports
Paddle; plugin modules register factories and keep heavy imports inside them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from fdx.core.errors import FdxError


def _add_serve_options(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", help="'smollm2' (default, the embedded SmolLM2-135M-Instruct GGUF), a .gguf file or a Hugging Face folder")
    m.add_argument("--served-model-name", help="model name reported by the API (default: --model)")
    m.add_argument("--dtype", help="compute dtype (the KV cache's: --kv-cache-dtype): auto (default: int8 compute on the CPU where fdx's C++ ops load, else float32; bfloat16 or float16 on GPUs), int8 (CPU: batch-invariant int8 GEMMs), bfloat16 (CPU: bf16 GEMMs, vdpbf16ps with AVX512-BF16, else fmas; GPUs), float16, float32")
    m.add_argument("--max-model-len", type=int, help="longest prompt + output, in tokens")
    m.add_argument("--seed", type=int, help="default sampling seed")
    m.add_argument("--generation-config", metavar="auto|vllm|PATH",
                   help="sampling defaults of requests that leave a field out: auto (default: the model folder's "
                        "generation_config.json, or fdx's defaults for a known model such as smollm2), vllm (none: "
                        "the OpenAI defaults), or a generation_config.json file or a folder holding one")
    m.add_argument("--override-generation-config", metavar="JSON",
                   help="sampling defaults on top of --generation-config, e.g. '{\"temperature\": 0.5}' (keys: "
                        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)")

    s = p.add_argument_group("server")
    s.add_argument("--host", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8000)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    s.add_argument("--control-api-key",
                   help="key the control routes (/v1/pause, /v1/sleep, /v1/update_weights, ...) require as "
                        "'Authorization: Bearer KEY' (default: --api-key)")
    s.add_argument("--allowed-weights-dir", dest="allowed_weights_dirs", action="append", metavar="DIR",
                   help="update_weights may load checkpoints from inside DIR; repeatable "
                        "(default: none, update_weights is refused)")
    s.add_argument("--max-request-bytes",
                   help="largest request body, e.g. 4M; a bigger one gets 413 before it is read (default 4M)")
    s.add_argument("--max-waiting", type=int, help="requests queued before 429 (default 1024)")
    s.add_argument("--max-logprobs", type=int, help="largest logprobs/top_logprobs allowed (default 20)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true", default=None,
                   help="logprobs name each token 'token_id:<id>' unless a request sets "
                        "return_tokens_as_token_ids false (vLLM's flag)")
    s.add_argument("--log-level", help="debug, info, warning, error")
    s.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export OpenTelemetry traces over OTLP/HTTP (protobuf) to URL, e.g. "
                        "http://127.0.0.1:4318/v1/traces (default: off; a client's traceparent is continued; "
                        "needs pip install 'fdx[tracing]'; docs/TRACING.md)")

    v = p.add_argument_group("engine supervision")
    v.add_argument("--max-engine-restarts", type=int,
                   help="restart a crashed or hung engine at most this many times per --restart-window, "
                        "then exit non-zero (default 5; 0: exit at the first crash)")
    v.add_argument("--restart-window", type=float, help="seconds over which engine restarts are counted (default 300)")
    v.add_argument("--step-timeout", type=float,
                   help="seconds one unit of engine work (a step, or a control call such as update_weights) "
                        "may run, or the engine stay silent, before it counts as hung and is killed and "
                        "restarted (default 120)")

    c = p.add_argument_group("scheduling and KV cache")
    c.add_argument("--max-num-seqs", type=int, help="max sequences per step (default 64)")
    c.add_argument("--max-num-batched-tokens", type=int, help="token budget per step (default 512)")
    c.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    c.add_argument("--num-kv-blocks", type=int, help="KV blocks in the device pool (default: from --kv-cache-memory)")
    c.add_argument("--kv-cache-dtype", metavar="auto|float32|bfloat16",
                   help="the KV cache's dtype: auto (default: on the CPU bfloat16 with int8 compute, float32 with "
                        "bfloat16 and float32 compute; on GPUs the compute dtype), float32, or bfloat16 (CPU: "
                        "int8 or bfloat16 compute; half the bytes, faster decode)")
    c.add_argument("--kv-cache-memory", help="KV pool size, e.g. 2G (default 1G)")
    c.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None)
    c.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")

    k = p.add_argument_group("components (chosen by name; see `fdx plugins`)")
    k.add_argument("--deployment",
                   help="deployment plugin: how fdx serve lays out its processes (default: single; dp with "
                        "--scheduler dp; splitwise with --num-prefill/--num-decode; dp+splitwise: --data-parallel-size "
                        "prefill and decode instances behind the router; see `fdx plugins`)")
    k.add_argument("--scheduler", help="scheduler plugin (default v1; dp: --data-parallel-size replicas)")
    k.add_argument("--data-parallel-size", type=int,
                   help="with --scheduler dp: engine processes (replicas) behind the one API server, each "
                        "with its own batch policy, KV cache and --num-threads threads (default 1); with "
                        "--deployment dp+splitwise: prefill and decode instances of each role")
    k.add_argument("--tensor-parallel-size", "-tp", type=int,
                   help="split the model over N ranks (worker processes) on this host (or --nnodes hosts), "
                        "Megatron-style: each "
                        "holds 1/N of the heads, MLP and vocabulary and of the KV cache; the ranks share "
                        "--num-threads (default 1; see docs/PARALLELISM.md)")
    k.add_argument("--enable-expert-parallel", "-ep", action="store_true", default=None,
                   help="a mixture-of-experts model (Qwen3-MoE, Mixtral): divide the experts whole among the "
                        "--tensor-parallel-size ranks (the number of experts must divide; attention stays "
                        "tensor-parallel); without it each expert is split as the dense MLP. A dense model "
                        "refuses it; harmless at size 1 (see docs/PARALLELISM.md)")
    k.add_argument("--tp-backend", choices=("auto", "shm", "gloo", "nccl"),
                   help="the collectives between the tensor-parallel ranks: shm (shared memory, one host; the cpu "
                        "runner's), gloo (Paddle's, any hosts, host tensors), nccl (Paddle's, the gpu runner on "
                        "CUDA GPUs), auto (default: cpu runner: shm on one node, gloo across --nnodes; gpu runner: "
                        "nccl on GPUs, gloo on the CPU place)")
    k.add_argument("--nnodes", type=int,
                   help="hosts the --tensor-parallel-size ranks span, tp/nnodes each (default 1; Paddle's launcher "
                        "conventions; every node runs the same fdx serve command with its --node-rank)")
    k.add_argument("--node-rank", type=int,
                   help="this host's place among --nnodes: 0 runs the API server and rank 0, the others a node "
                        "agent that starts their ranks (default 0)")
    k.add_argument("--master-addr", help="with --nnodes: node 0's address, where rank 0 listens")
    k.add_argument("--master-port", type=int,
                   help="with --nnodes: rank 0's control port on --master-addr (the gloo store takes the next one)")
    k.add_argument("--tp-start-timeout", type=float,
                   help="seconds to wait for every tensor-parallel rank to load its shard (default 600)")
    k.add_argument("--dp-local-scheduler",
                   help="with --scheduler dp: the batch policy every replica runs, v1 (default) or v0")
    k.add_argument("--dp-backend", choices=("local", "redis"),
                   help="with --scheduler dp: local (this node's replicas, default) or redis (a global queue "
                        "shared by every node on --redis-url)")
    k.add_argument("--redis-url", help="with --dp-backend redis: the Redis of the global queue, redis://HOST:PORT")
    k.add_argument("--dp-cluster", help="with --dp-backend redis: the cluster's name; keys are fdx:<name>:... "
                                        "(default 'default')")
    k.add_argument("--dp-instance-name", help="with --dp-backend redis: this node's name (default HOST:PORT)")
    k.add_argument("--dp-request-ttl", type=float,
                   help="with --dp-backend redis: seconds a request may wait in the queue for an instance (default 900)")
    k.add_argument("--dp-capacity", type=int,
                   help="with --dp-backend redis: requests this node takes from the queue at once (default "
                        "--max-num-seqs x --data-parallel-size; 0: a front end that runs none)")
    k.add_argument("--splitwise-role", choices=("prefill", "decode"),
                   help="with --scheduler splitwise: this instance computes prompts (prefill) or decodes "
                        "requests whose prompt a prefill instance computed (decode); see docs/SPLITWISE.md")
    k.add_argument("--splitwise-local-scheduler",
                   help="with --scheduler splitwise: the batch policy for the instance's own work (default v1)")
    k.add_argument("--splitwise-handoff-timeout", type=float,
                   help="seconds a decode instance waits for the prompt's KV before the request fails (default 300)")
    k.add_argument("--kv-connector", help="KV connector plugin moving prompt KV from prefill to decode (default zmq)")
    k.add_argument("--kv-connector-port", type=int, help="TCP port the KV connector listens on (default: any free)")
    k.add_argument("--kv-connector-config", help="JSON object passed to the KV connector")
    k.add_argument("--num-prefill", type=int,
                   help="with --scheduler splitwise and no --splitwise-role: run this many prefill instances, "
                        "--num-decode decode instances and the router (on --port) as managed children")
    k.add_argument("--num-decode", type=int, help="with --num-prefill: decode instances to run")
    k.add_argument("--token-processor", help="token processor plugin (default 'default')")
    k.add_argument("--grammar-backend", help="grammar backend of structured outputs (default 'llguidance')")
    k.add_argument("--tool-call-parser", help="tool-call parser of chat completions with tools (default 'hermes')")
    k.add_argument("--speculative", metavar="NAME",
                   help="speculative decoding proposer (e.g. ngram: prompt lookup, no draft model); drafts are "
                        "verified in the same forward pass, greedy requests only, output unchanged (default: off)")
    k.add_argument("--num-speculative-tokens", type=int, help="with --speculative: draft tokens per step (default 3)")
    k.add_argument("--prompt-lookup-max", type=int, help="with --speculative ngram: longest n-gram matched (default 4)")
    k.add_argument("--prompt-lookup-min", type=int, help="with --speculative ngram: shortest n-gram matched (default 1)")
    k.add_argument("--cache-backend", help="cache backend plugin for the KV storage tier (default: none)")
    k.add_argument("--cache-backend-config", help="JSON object passed to the cache backend")
    k.add_argument("--device", help="device plugin, NAME or NAME:INDEX (default cpu; e.g. cuda:1 for the second GPU)")
    k.add_argument("--model-runner", help="model runner plugin (default: the device's own, e.g. 'cpu' for --device cpu)")
    k.add_argument("--num-threads", type=int, help="compute threads (default: all cores; with --scheduler dp: per replica)")
    k.add_argument("--disable-plugin", dest="disable_plugins", action="append", metavar="NAME",
                   help="do not load this plugin (entry-point or distribution name); repeatable")


def _early_disabled(argv: Sequence[str]) -> list[str]:
    """``--disable-plugin`` values, read before plugins load (they decide
    which plugins may add CLI options)."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a == "--disable-plugin" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith("--disable-plugin="):
            out.append(a.split("=", 1)[1])
    return out


def build_parser(plugins: Any | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fdx", description="fdx: a plugin-oriented LLM serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server and the engine")
    _add_serve_options(serve)
    if plugins is not None:
        plugins.hook.fdx_add_cli_options(parser=serve)
    plist = sub.add_parser("plugins", help="list installed plugins and the components they register")
    plist.add_argument("--disable-plugin", dest="disable_plugins", action="append", metavar="NAME",
                       help="do not load this plugin; repeatable")
    sub.add_parser("router", help="OpenAI front end over splitwise prefill/decode instances (fdx router --help)",
                   add_help=False)
    bench = sub.add_parser("bench", help="benchmarks", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    for verb, text in (("chat", "chat with a running server (fdx chat --help)"),
                       ("complete", "complete prompts on a running server (fdx complete --help)"),
                       ("run-batch", "run an OpenAI Batch file offline (fdx run-batch -i IN.jsonl -o OUT.jsonl)")):
        sub.add_parser(verb, help=text, add_help=False)
    return parser


def config_from_args(args: argparse.Namespace, plugins: Any) -> Any:
    """Validated config: flags + env, plugin adjustments, names checked."""
    from fdx.config import from_args

    cfg = from_args(args)
    for override in plugins.hook.fdx_adjust_config(config=cfg, args=args):
        if override:
            cfg = cfg.replace(**override)
    check_component_names(cfg, plugins)
    return cfg


def check_component_names(cfg: Any, plugins: Any) -> None:
    """Fail early, listing the choices, for an unknown component name."""
    plugins.registry("scheduler").get(cfg.scheduler)
    if cfg.scheduler == "dp":
        plugins.registry("scheduler").get(cfg.dp_local_scheduler)
    plugins.registry("token_processor").get(cfg.token_processor)
    plugins.registry("grammar_backend").get(cfg.grammar_backend)
    plugins.registry("tool_parser").get(cfg.tool_call_parser)
    from fdx.config import split_device

    plugins.registry("device").get(split_device(cfg.device)[0])
    if cfg.model_runner:
        plugins.registry("model_runner").get(cfg.model_runner)
    if cfg.cache_backend:
        plugins.registry("cache_backend").get(cfg.cache_backend)
    if cfg.kv_connector:
        plugins.registry("kv_connector").get(cfg.kv_connector)
    if cfg.speculative:
        plugins.registry("speculator").get(cfg.speculative)
    if cfg.scheduler == "splitwise":
        plugins.registry("scheduler").get(cfg.splitwise_local_scheduler)


def cmd_plugins(plugins: Any) -> int:
    rows = []
    for kind, reg in plugins.registries.items():
        for name in reg.names():
            e = reg.get(name)
            rows.append((kind, name, e.source.name, e.source.distribution, e.source.version, e.description))
    widths = [max(len(str(r[i])) for r in rows + [("KIND", "NAME", "PLUGIN", "DISTRIBUTION", "VERSION", "")]) for i in range(5)]
    head = ("KIND", "NAME", "PLUGIN", "DISTRIBUTION", "VERSION", "DESCRIPTION")
    for r in [head, *sorted(rows)]:
        print("  ".join(str(r[i]).ljust(widths[i]) for i in range(5)) + "  " + str(r[5]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:
            return _bench(argv[1:])
        if argv[:1] in (["chat"], ["complete"]):  # clients of a running server (fdx/client_cli.py)
            from fdx.client_cli import main as client_main

            return client_main(argv[0], argv[1:])
        if argv[:1] == ["run-batch"]:  # offline, through fdx.LLM (fdx/run_batch.py)
            from fdx.run_batch import main as batch_main

            return batch_main(argv[1:])
        if argv[:1] == ["router"]:  # splitwise front end (docs/SPLITWISE.md); no plugins, no Paddle
            from fdx.router.main import main as router_main

            return router_main(argv[1:])
        from fdx.core.plugins import get_plugins

        plugins = get_plugins(_early_disabled(argv))
        parser = build_parser(plugins)
        args = parser.parse_args(argv)
        if args.command == "plugins":
            return cmd_plugins(plugins)
        if args.command == "serve":
            # serve never compiles the C++ ops: an install-time build (or a cached one) or the fallback
            os.environ.setdefault("FDX_NATIVE_BUILD", "0")
            cfg = config_from_args(args, plugins)
            from fdx.deploy.launcher import serve
            from fdx.model.loader import load_tokenizer

            load_tokenizer(cfg.model)  # a missing/corrupt model fails here, in one line, before any process starts
            return serve(cfg, plugins)  # the deployment (--deployment) decides the processes
        parser.print_help()
        return 0
    except FdxError as exc:
        if exc.details:
            print(exc.details.rstrip(), file=sys.stderr)
        print(f"fdx: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fdx bench serve|plot [options]   (see `fdx bench serve --help`)")
        return 0
    if argv[0] == "serve":
        from fdx.bench.serve import main as bench_main

        return bench_main(argv[1:])
    if argv[0] == "plot":
        from fdx.bench.plot import main as plot_main

        return plot_main(argv[1:])
    print(f"fdx: error: unknown bench command {argv[0]!r}; choices: serve, plot", file=sys.stderr)
    return 2


def entry() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())


if __name__ == "__main__":
    entry()
