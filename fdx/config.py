"""One validated, frozen configuration object for the whole engine.

Built from CLI flags (:func:`from_args`) or keyword arguments
(:func:`make_config`, used by ``fdx.LLM``).  Each field knows its flag, so a
bad value produces a one-line :class:`ConfigError` that names the flag.
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

from fdx.core.errors import ConfigError
from fdx.generation_config import check_mode, parse_override


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(inst: Any, att: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{_flag(att.name)} must be > 0, got {value}")


def _non_negative(inst: Any, att: attrs.Attribute, value: Any) -> None:
    if value is not None and value < 0:
        raise ConfigError(f"{_flag(att.name)} must be >= 0, got {value}")


def split_device(spec: str) -> tuple[str, int | None]:
    """``--device`` as ``(plugin name, index)``: ``"cuda:1"`` -> ``("cuda", 1)``,
    ``"cpu"`` -> ``("cpu", None)``.  A malformed index is a one-line error."""
    name, sep, idx = str(spec).strip().partition(":")
    if not sep:
        return name, None
    if not name or not idx.isdigit():
        raise ConfigError(f"--device {spec}: expected NAME or NAME:INDEX, INDEX a non-negative integer (e.g. cuda:0)")
    return name, int(idx)


#: ``--kv-cache-dtype`` values (vLLM's flag): ``auto`` lets the runner pick
#: (the CPU: bfloat16 with int8 compute, else float32; GPUs: the compute dtype)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def _kv_cache_dtype(inst: Any, att: attrs.Attribute, value: str) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"{_flag(att.name)} {value}: unknown; choose one of {', '.join(KV_CACHE_DTYPES)}")


def _device(inst: Any, att: attrs.Attribute, value: str) -> None:
    split_device(value)


def _port(inst: Any, att: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{_flag(att.name)} must be a TCP port (0-65535), got {value}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything the engine and the server need to start."""

    # model
    model: str = "smollm2"
    served_model_name: str | None = None
    dtype: str = "auto"  # the runner decides: int8 (else float32) on the CPU, bfloat16/float16 on GPUs
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    seed: int = 0
    #: sampling defaults: ``auto`` (the model's generation_config.json or fdx's
    #: defaults for a known model), ``vllm`` (none) or a path (fdx/generation_config.py)
    generation_config: str = "auto"
    #: ``--override-generation-config``: sampling defaults on top (checked keys)
    override_generation_config: dict[str, Any] = attrs.field(factory=dict)

    # server
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=_port)
    api_key: str | None = None
    max_waiting: int = attrs.field(default=1024, validator=_positive)
    max_logprobs: int = attrs.field(default=20, validator=_non_negative)
    #: vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:<id>" unless a request says otherwise
    return_tokens_as_token_ids: bool = False
    request_timeout: float = attrs.field(default=600.0, validator=_positive)
    #: a request body larger than this is refused with 413 before it is parsed
    max_request_bytes: int = attrs.field(default=4 << 20, validator=_positive)
    #: guards the control routes (/v1/pause, ...); default: ``api_key``
    control_api_key: str | None = None
    #: update_weights loads only from inside these directories (none: refused)
    allowed_weights_dirs: tuple[str, ...] = ()

    # scheduling
    max_num_seqs: int = attrs.field(default=64, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=512, validator=_positive)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    # KV cache
    block_size: int = attrs.field(default=16, validator=_positive)
    num_kv_blocks: int | None = attrs.field(default=None, validator=_positive)
    kv_cache_memory: int = attrs.field(default=1 << 30, validator=_positive)  # bytes
    #: the KV pool's dtype (``KV_CACHE_DTYPES``); bfloat16 halves the bytes
    #: decode attention reads (the CPU runner's default with int8 compute)
    kv_cache_dtype: str = attrs.field(default="auto", validator=_kv_cache_dtype)

    # components (chosen by name from the registries)
    #: how ``fdx serve`` lays out its processes (``None``: implied by the flags,
    #: :func:`fdx.deploy.deployment.deployment_name`)
    deployment: str | None = None
    scheduler: str = "v1"
    #: ``--scheduler dp``: engine replicas behind the one API process
    data_parallel_size: int = attrs.field(default=1, validator=_positive)
    #: ranks one model is split over (tensor parallelism, fdx/parallel/); 1: in-process
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    #: the collectives between the ranks: ``shm`` (one host, fdx/csrc/tp_comm.cc; the cpu runner's),
    #: ``gloo`` (Paddle's, any hosts), ``nccl`` (Paddle's, the gpu runner on GPUs); ``auto`` (resolved
    #: by make_config): the cpu runner shm on one node, gloo across nodes; the gpu runner nccl on
    #: GPUs, gloo on the CPU place
    tp_backend: str = "auto"
    #: hosts the ranks span (Paddle's launcher conventions: ``--nnodes``, ``--node-rank``,
    #: ``--master-addr``/``--master-port``); node 0 runs the API and rank 0, the others a
    #: node agent (fdx/plugins/deployments/tp_node.py)
    nnodes: int = attrs.field(default=1, validator=_positive)
    node_rank: int = attrs.field(default=0, validator=_non_negative)
    master_addr: str | None = None
    master_port: int | None = None
    #: seconds rank 0 waits for every other rank to load its shard and say ready
    tp_start_timeout: float = attrs.field(default=600.0, validator=_positive)
    #: a mixture of experts' experts divided whole among the tensor-parallel
    #: ranks (vLLM's flag; fdx/parallel/sharding.py); a dense model refuses it
    enable_expert_parallel: bool = False
    #: ``--scheduler dp``: the batch policy each replica runs
    dp_local_scheduler: str = "v1"
    #: this engine's replica (set by the launcher for each dp engine)
    dp_rank: int = attrs.field(default=0, validator=_non_negative)
    #: ``--scheduler dp``: ``local`` (this node's replicas) or ``redis`` (a
    #: global queue across nodes, fdx/plugins/deployments/dp_global_queue.py)
    dp_backend: str = "local"
    redis_url: str | None = None
    #: Redis keys are ``fdx:<dp_cluster>:...``
    dp_cluster: str = "default"
    #: the node's name in the cluster (default ``HOST:PORT``)
    dp_instance_name: str | None = None
    #: seconds a queued request may wait for an instance to pick it up
    dp_request_ttl: float = attrs.field(default=900.0, validator=_positive)
    #: requests this node takes from the queue at once (default
    #: ``max_num_seqs * data_parallel_size``; 0: a front end only)
    dp_capacity: int | None = attrs.field(default=None, validator=attrs.validators.optional(_non_negative))
    #: ``--scheduler splitwise``: this instance's role, ``prefill`` or ``decode``
    splitwise_role: str | None = None
    #: ``--scheduler splitwise``: the batch policy the instance runs for its own work
    splitwise_local_scheduler: str = "v1"
    #: seconds a decode instance waits for a prefill instance's KV before the request fails (503)
    splitwise_handoff_timeout: float = attrs.field(default=300.0, validator=_positive)
    #: KV connector plugin of a splitwise instance (default ``zmq`` with a role)
    kv_connector: str | None = None
    #: TCP port the KV connector listens on (0: any free port; /v1/splitwise/info tells it)
    kv_connector_port: int = attrs.field(default=0, validator=_non_negative)
    kv_connector_config: dict[str, Any] = attrs.field(factory=dict)
    #: ``--scheduler splitwise`` without a role: the managed one-machine topology, this many
    #: prefill and decode instances and the router as children of ``fdx serve`` (fdx/router/topology.py)
    num_prefill: int = attrs.field(default=0, validator=_non_negative)
    num_decode: int = attrs.field(default=0, validator=_non_negative)
    token_processor: str = "default"
    #: grammar backend of structured outputs (``--grammar-backend``)
    grammar_backend: str = "llguidance"
    #: tool-call parser of chat completions with ``tools`` (``--tool-call-parser``)
    tool_call_parser: str = "hermes"
    #: speculative decoding: the proposer (``--speculative ngram``; ``None``: off)
    speculative: str | None = None
    #: draft tokens proposed (and verified in the same forward) per decode step
    num_speculative_tokens: int = attrs.field(default=3, validator=_positive)
    #: ``ngram``: the longest / shortest suffix n-gram looked up in the request's tokens
    prompt_lookup_max: int = attrs.field(default=4, validator=_positive)
    prompt_lookup_min: int = attrs.field(default=1, validator=_positive)
    cache_backend: str | None = None
    cache_backend_config: dict[str, Any] = attrs.field(factory=dict)
    device: str = attrs.field(default="cpu", validator=_device)  # NAME or NAME:INDEX
    #: ``None``: the device's :attr:`~fdx.core.interfaces.Device.default_runner`
    model_runner: str | None = None
    num_threads: int | None = attrs.field(default=None, validator=_positive)
    disable_plugins: tuple[str, ...] = ()
    #: values of options that plugins added through ``fdx_add_cli_options``
    #: (argparse ``dest`` -> value); they travel to every process with the config
    plugin_options: dict[str, Any] = attrs.field(factory=dict)

    # plumbing
    ipc_dir: str | None = None
    heartbeat_interval: float = attrs.field(default=0.5, validator=_positive)
    heartbeat_timeout: float = attrs.field(default=3.0, validator=_positive)
    #: a step (or any unit of the engine loop) running this long, or engine
    #: silence this long, is a hang: the engine is killed and restarted
    step_timeout: float = attrs.field(default=120.0, validator=_positive)
    #: the supervisor restarts a dead engine at most this many times per
    #: ``restart_window`` seconds, then ``fdx serve`` exits non-zero
    max_engine_restarts: int = attrs.field(default=5, validator=_non_negative)
    restart_window: float = attrs.field(default=300.0, validator=_positive)
    log_level: str = "info"
    log_stats_interval: float = 10.0
    #: OTLP/HTTP (protobuf) endpoint the spans of every process go to (``None``: tracing off; docs/TRACING.md)
    otlp_traces_endpoint: str | None = None

    @property
    def rank_threads(self) -> int | None:
        """Compute threads of one process of the model: ``--num-threads``
        (default every core), shared by the ``--tensor-parallel-size`` ranks."""
        if self.tensor_parallel_size == 1:
            return self.num_threads
        return max(1, (self.num_threads or os.cpu_count() or 1) // self.ranks_per_node)

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks on each of the ``--nnodes`` hosts."""
        return max(1, self.tensor_parallel_size // self.nnodes)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def replace(self, **changes: Any) -> EngineConfig:
        return make_config(**{**attrs.asdict(self, recurse=False), **changes})


FIELDS = {a.name for a in attrs.fields(EngineConfig)}


def make_config(**kwargs: Any) -> EngineConfig:
    """Build a config from keyword arguments; unknown keys are an error."""
    unknown = set(kwargs) - FIELDS
    if unknown:
        raise ConfigError(f"unknown config option(s): {', '.join(sorted(unknown))}")
    if isinstance(kwargs.get("cache_backend_config"), str):
        raw = kwargs["cache_backend_config"]
        try:
            kwargs["cache_backend_config"] = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--cache-backend-config is not valid JSON: {exc}") from None
        if not isinstance(kwargs["cache_backend_config"], dict):
            raise ConfigError("--cache-backend-config must be a JSON object")
    if isinstance(kwargs.get("kv_connector_config"), str):
        try:
            kwargs["kv_connector_config"] = json.loads(kwargs["kv_connector_config"] or "{}")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--kv-connector-config is not valid JSON: {exc}") from None
        if not isinstance(kwargs["kv_connector_config"], dict):
            raise ConfigError("--kv-connector-config must be a JSON object")
    if "override_generation_config" in kwargs:
        kwargs["override_generation_config"] = parse_override(kwargs["override_generation_config"])
    if kwargs.get("generation_config") is not None:
        check_mode(kwargs["generation_config"])
        if kwargs["generation_config"] not in ("auto", "vllm"):  # a path: the same file in every child process
            kwargs["generation_config"] = os.path.abspath(os.path.expanduser(kwargs["generation_config"]))
    if kwargs.get("splitwise_role") and not kwargs.get("kv_connector"):
        kwargs["kv_connector"] = "zmq"
    if kwargs.get("deployment") == DP_SPLITWISE:  # its instances run the splitwise scheduler
        kwargs.setdefault("scheduler", "splitwise")
    if isinstance(kwargs.get("disable_plugins"), list):
        kwargs["disable_plugins"] = tuple(kwargs["disable_plugins"])
    if isinstance(kwargs.get("allowed_weights_dirs"), str):  # FDX_ALLOWED_WEIGHTS_DIRS=dir1:dir2
        kwargs["allowed_weights_dirs"] = [d for d in kwargs["allowed_weights_dirs"].split(os.pathsep) if d]
    if isinstance(kwargs.get("allowed_weights_dirs"), list):
        kwargs["allowed_weights_dirs"] = tuple(os.path.abspath(d) for d in kwargs["allowed_weights_dirs"])
    for d in kwargs.get("allowed_weights_dirs") or ():
        if not os.path.isdir(d):
            raise ConfigError(f"--allowed-weights-dir {d!r} is not a directory")
    if isinstance(kwargs.get("max_request_bytes"), str):
        kwargs["max_request_bytes"] = parse_bytes(kwargs["max_request_bytes"], "--max-request-bytes")
    if isinstance(kwargs.get("kv_cache_memory"), str):
        kwargs["kv_cache_memory"] = parse_bytes(kwargs["kv_cache_memory"], "--kv-cache-memory")
    try:
        cfg = EngineConfig(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.deployment == DP_SPLITWISE:
        _check_dp_splitwise(cfg)
    elif cfg.data_parallel_size > 1 and cfg.scheduler != "dp":
        raise ConfigError(f"--data-parallel-size {cfg.data_parallel_size} needs --scheduler dp (replicas behind one "
                          f"API server) or --deployment {DP_SPLITWISE} (that many prefill and decode instances)")
    cfg = _check_nodes(cfg)
    if cfg.dp_backend not in ("local", "redis"):
        raise ConfigError(f"--dp-backend must be local or redis, got {cfg.dp_backend!r}")
    if cfg.dp_backend == "redis" and (cfg.scheduler != "dp" or not cfg.redis_url):
        raise ConfigError("--dp-backend redis needs --scheduler dp and --redis-url redis://HOST:PORT")
    if cfg.redis_url and not cfg.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"--redis-url must be redis://HOST:PORT (or rediss://, unix://), got {cfg.redis_url!r}")
    if cfg.otlp_traces_endpoint:
        from fdx.tracing import check_endpoint

        check_endpoint(cfg.otlp_traces_endpoint)
    if cfg.splitwise_role not in (None, "prefill", "decode"):
        raise ConfigError(f"--splitwise-role must be prefill or decode, got {cfg.splitwise_role!r}")
    if (cfg.splitwise_role or cfg.kv_connector) and cfg.scheduler != "splitwise":
        raise ConfigError("--splitwise-role and --kv-connector need --scheduler splitwise")
    if cfg.splitwise_local_scheduler in ("splitwise", "dp"):
        raise ConfigError("--splitwise-local-scheduler must name a batch policy (v1, v0, ...)")
    if (cfg.num_prefill or cfg.num_decode) and cfg.deployment != DP_SPLITWISE:
        if cfg.scheduler != "splitwise" or cfg.splitwise_role is not None:
            raise ConfigError("--num-prefill/--num-decode need --scheduler splitwise and no --splitwise-role")
        if not (cfg.num_prefill and cfg.num_decode):
            raise ConfigError("--num-prefill and --num-decode must both be >= 1")
    if cfg.dp_local_scheduler == "dp":
        raise ConfigError("--dp-local-scheduler must name a batch policy (v1, v0, ...), not dp")
    if cfg.speculative and cfg.scheduler != "v1":
        raise ConfigError(f"--speculative needs --scheduler v1, got --scheduler {cfg.scheduler}")
    if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        raise ConfigError(f"--prompt-lookup-min ({cfg.prompt_lookup_min}) must be <= --prompt-lookup-max "
                          f"({cfg.prompt_lookup_max})")
    if cfg.max_num_batched_tokens < cfg.block_size:
        raise ConfigError(
            f"--max-num-batched-tokens ({cfg.max_num_batched_tokens}) must be >= --block-size ({cfg.block_size})"
        )
    return cfg


#: the deployment of several prefill and decode instances behind the router
#: (fdx/plugins/deployments/dp_splitwise.py), whose flags are checked here
DP_SPLITWISE = "dp+splitwise"


def _check_dp_splitwise(cfg: EngineConfig) -> None:
    """``--deployment dp+splitwise``: splitwise instances, no role, no
    replicas inside an instance; one-line errors naming the choices."""
    if cfg.scheduler != "splitwise":
        raise ConfigError(f"--deployment {DP_SPLITWISE} runs --scheduler splitwise instances, got --scheduler "
                          f"{cfg.scheduler}; for replicas of one engine use --deployment dp (--scheduler dp)")
    if cfg.splitwise_role is not None:
        raise ConfigError(f"--deployment {DP_SPLITWISE} starts its own prefill and decode instances: drop "
                          f"--splitwise-role {cfg.splitwise_role} (or serve one instance with --deployment single)")
    if cfg.dp_backend != "local":
        raise ConfigError(f"--deployment {DP_SPLITWISE} runs on one machine: --dp-backend must be local")


def dp_splitwise_counts(cfg: EngineConfig) -> tuple[int, int]:
    """``(prefill, decode)`` instances of ``--deployment dp+splitwise``:
    ``--num-prefill``/``--num-decode`` when given, else ``--data-parallel-size`` each."""
    return cfg.num_prefill or cfg.data_parallel_size, cfg.num_decode or cfg.data_parallel_size


def _check_nodes(cfg: EngineConfig) -> EngineConfig:
    """The tensor-parallel backend and the several-hosts flags: one-line errors; ``auto`` resolved."""
    if cfg.tp_backend not in ("auto", "shm", "gloo", "nccl"):
        raise ConfigError(f"--tp-backend {cfg.tp_backend!r}: choose auto, shm (the ranks of one host over shared "
                          "memory), gloo (Paddle's, ranks on any hosts) or nccl (Paddle's, the gpu runner on GPUs)")
    tp, n = cfg.tensor_parallel_size, cfg.nnodes
    dev = split_device(cfg.device)[0]
    gpu_runner = cfg.model_runner == "gpu" or (not cfg.model_runner and dev != "cpu")  # an accelerator's default
    if tp > 1 and gpu_runner and cfg.tp_backend == "shm":
        raise ConfigError("--tp-backend shm: shared memory is the cpu runner's all-reduce; the gpu runner's ranks use "
                          "nccl on GPUs or gloo on the CPU place (or auto)")
    if tp > 1 and cfg.tp_backend == "nccl" and (not gpu_runner or dev == "cpu"):
        raise ConfigError(f"--tp-backend nccl: NCCL joins the gpu runner's ranks on CUDA GPUs, not the "
                          f"{cfg.model_runner or dev} runner on --device {cfg.device}; use gloo or shm (or auto)")
    if cfg.node_rank >= n:
        raise ConfigError(f"--node-rank {cfg.node_rank} must be below --nnodes {n}")
    if n > 1:
        if tp % n:
            raise ConfigError(f"--nnodes {n}: --tensor-parallel-size {tp} must be a multiple of it "
                              "(each node runs the same number of ranks)")
        if cfg.tp_backend == "shm":
            raise ConfigError(f"--tp-backend shm: shared memory joins the ranks of one host, not --nnodes {n}; "
                              "use gloo (or auto)")
        if not cfg.master_addr or not cfg.master_port:
            raise ConfigError(f"--nnodes {n} needs --master-addr and --master-port (node 0's address, where "
                              "rank 0 listens)")
        if cfg.data_parallel_size > 1 or cfg.scheduler in ("dp", "splitwise"):
            raise ConfigError(f"--nnodes {n}: several hosts run one tensor-parallel group; --scheduler "
                              f"{cfg.scheduler} over several nodes is not supported")
    if cfg.tp_backend == "auto":
        pick = ("gloo" if dev == "cpu" else "nccl") if gpu_runner else "gloo" if n > 1 else "shm"
        cfg = attrs.evolve(cfg, tp_backend=pick)
    return cfg


def parse_bytes(text: str, flag: str) -> int:
    """``"2G"``, ``"512MiB"``, ``"1000000"`` -> bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise ConfigError(f"{flag} must be a size like 2G or 512M, got {text!r}") from None
    if value <= 0:
        raise ConfigError(f"{flag} must be > 0, got {text!r}")
    return value


def from_args(args: Any) -> EngineConfig:
    """Build the config from an ``argparse.Namespace``; only known fields
    are taken, and ``None`` values keep the defaults (environment variables
    ``FDX_<FIELD>`` fill flags that were not given)."""
    values: dict[str, Any] = {}
    extra = {k: v for k, v in vars(args).items() if k not in FIELDS and k != "command" and v is not None}
    if extra:
        values["plugin_options"] = extra
    for name in FIELDS:
        env = os.environ.get("FDX_" + name.upper())
        if env is not None:
            values[name] = _coerce_env(name, env)
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    return make_config(**values)


def _coerce_env(name: str, value: str) -> Any:
    field = attrs.fields_dict(EngineConfig)[name]
    default = field.default
    if name in ("kv_cache_memory", "max_request_bytes"):
        return value  # a size like 4M: make_config parses it
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int) and not isinstance(default, bool):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"FDX_{name.upper()} must be an integer, got {value!r}") from None
    if isinstance(default, float):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"FDX_{name.upper()} must be a number, got {value!r}") from None
    return value
