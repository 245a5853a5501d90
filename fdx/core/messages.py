"""Wire messages between the front end and the engine.

Every class here is a frozen attrs class.  They travel through one private
cattrs converter (``cattrs.preconf.msgpack``) configured with a tagged union
over :data:`Message`, so :func:`encode` / :func:`decode` round-trip any of
them.  Sequences are tuples so that messages stay hashable and immutable.
"""

from __future__ import annotations

from typing import Any, Union

import attrs
import msgpack
from cattrs.preconf.msgpack import make_converter
from cattrs.strategies import configure_tagged_union


# --------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------


@attrs.frozen
class StructuredOutput:
    """A grammar the output must match (structured outputs).  ``kind`` is
    ``json`` (``spec``: a JSON schema, as JSON text), ``json_object`` (any
    JSON object; no spec), ``regex``, ``choice`` (``spec``: a JSON list of
    strings) or ``grammar`` (a Lark or GBNF grammar).  The grammar backend
    (``--grammar-backend``) compiles it once per distinct value."""

    kind: str
    spec: str = ""


#: ``SamplingParams.prompt_logprobs`` asking for the whole vocabulary at every prompt position (vLLM's -1)
ALL_LOGPROBS = -1
#: the longest prompt whose prompt logprobs may cover the whole vocabulary: each position is one entry per
#: vocabulary token (49,152 for SmolLM2): about 3.7 MB of JSON and 0.7 s per position on the CPU
MAX_ALL_LOGPROBS_PROMPT = 32


@attrs.frozen
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy.  ``top_k <= 0`` disables top-k;
    ``top_p == 1`` and ``min_p == 0`` disable those filters.  ``logprobs``
    is the number of top alternatives to report per token (``None``: no
    logprobs at all; ``0``: only the chosen token's).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    #: the output must match this grammar (``None``: free text)
    structured: StructuredOutput | None = None
    #: ``(token id, bias)`` pairs added to the logits before sampling (OpenAI ``logit_bias``)
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: top alternatives of each prompt token's logprob (``None``: none computed; such a request skips the prefix
    #: cache; :data:`ALL_LOGPROBS`: the whole vocabulary, for prompts of at most :data:`MAX_ALL_LOGPROBS_PROMPT` tokens)
    prompt_logprobs: int | None = None
    #: beam search with this many beams (0: off); HF's ``length_penalty`` and ``early_stopping``
    #: (``"true"``, ``"false"`` or ``"never"``), see :mod:`fdx.plugins.schedulers.beam`
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: str = "false"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def beam_candidates(self, width: int, num_stop_ids: int) -> int:
        """HF's ``beams_to_keep``: enough candidates a step that ``width`` of them
        continue even when each beam's stop ids are among its best."""
        return max(2, 1 + num_stop_ids) * width


# --------------------------------------------------------------------------
# Front end -> engine
# --------------------------------------------------------------------------


@attrs.frozen
class KVTransferParams:
    """Splitwise handoff of one request (FastDeploy's ``disaggregate_info``).

    On the AddRequest a decode instance's front end sends its engine:
    ``prefill_addr`` (the prefill instance's ``kv_addr``, its KV connector)
    and ``prefill_url`` (its HTTP base URL, for logs).  On the AddRequest
    the decode engine then sends the prefill engine over the connector (the
    prefill job): also ``decode_addr`` (where to reply), ``block_ids`` (the
    decode instance's preallocated destination blocks for prompt blocks
    ``num_cached_blocks`` onwards; the leading ones it already holds from
    its prefix cache are not sent).  The prefill engine answers with a
    :class:`RequestOutput`: the first token (and its logprob) with the KV
    of those blocks, or an error and no KV.
    """

    prefill_addr: str = ""
    prefill_url: str = ""
    decode_addr: str = ""
    block_ids: tuple[int, ...] = ()
    num_cached_blocks: int = 0


@attrs.frozen
class AddRequest:
    """Submit one sequence (one choice: ``n`` is expanded by the front end).
    With ``kv_transfer_params`` a decode instance has the prompt computed
    by that prefill instance and decodes only.  ``trace_context``: the W3C
    ``traceparent`` of the request's span (``--otlp-traces-endpoint``,
    :mod:`fdx.tracing`; empty: not traced)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    kv_transfer_params: KVTransferParams | None = None
    trace_context: str = ""


@attrs.frozen
class AbortRequest:
    """Abort requests by id; unknown ids are ignored."""

    request_ids: tuple[str, ...]
    reason: str = "abort"


@attrs.frozen
class ControlRequest:
    """Call engine control method ``method`` (``pause``, ``sleep``, ...)."""

    call_id: str
    method: str
    args: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Shutdown:
    """Ask the engine process to exit."""

    reason: str = ""


# --------------------------------------------------------------------------
# Engine -> front end
# --------------------------------------------------------------------------


@attrs.frozen
class TokenLogprob:
    """The chosen token's logprob and the top alternatives ``(id, logprob)``;
    ``rank``: the token's 1-based rank in the vocabulary (0: not computed)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0


@attrs.frozen
class BeamSequence:
    """One of a beam-search request's best sequences: its generated tokens,
    their summed logprob and its score (``sum / len ** length_penalty``)."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: str


@attrs.frozen
class RequestOutput:
    """New tokens of one request since its last output.

    ``finish_reason`` is ``None`` while the request runs, then one of
    ``stop``, ``length``, ``abort`` or ``error``.  For ``error`` the
    ``error`` field says why and ``error_code`` is an HTTP status.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None
    error_code: int = 0
    #: seconds from arrival to the request's first scheduling; sent once, with
    #: the request's first output
    queue_time: float | None = None
    #: logprobs of prompt tokens 1.. (``params.prompt_logprobs``), sent once, with the first output
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    #: a beam-search request's best sequences, best first (with its final output only)
    beams: tuple[BeamSequence, ...] | None = None


@attrs.frozen
class SplitwiseStats:
    """A splitwise instance's role, connector address (``kv_addr``) and
    cumulative handoff counters.  ``handoff_buckets[i]`` counts handoffs
    that took at most ``fdx.plugins.schedulers.splitwise.HANDOFF_BUCKETS[i]``
    seconds (on D: preallocation to KV inserted; on P: job received to KV
    sent).  ``recomputed_prompt_tokens``: prompt tokens of handed-off
    requests that D computed itself (0 unless D preempted one)."""

    role: str
    address: str = ""
    handoffs: int = 0
    failed: int = 0
    kv_bytes: int = 0
    handoff_seconds: float = 0.0
    handoff_buckets: tuple[int, ...] = ()
    recomputed_prompt_tokens: int = 0


@attrs.frozen
class SpecDecodeStats:
    """Cumulative speculative-decoding counters (vLLM's ``spec_decode_*``):
    verification rounds (``num_drafts``), draft tokens proposed and run,
    and drafts accepted; ``accepted_per_pos[j]`` counts drafts accepted at
    position ``j``."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()


@attrs.frozen
class EngineStats:
    """A snapshot of the engine for /metrics and /health."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    storage_hits: int = 0
    storage_errors: int = 0
    num_preemptions: int = 0
    steps: int = 0
    is_paused: bool = False
    weights_version: str = ""
    num_batched_tokens: int = 0  # cumulative tokens run (prefill + decode)
    num_generated_tokens: int = 0  # cumulative tokens sampled
    storage_puts: int = 0  # cumulative KV blocks written to the storage backend (put completed)
    num_admitted: int = 0  # cumulative requests the scheduler took to run (engine-side admissions)
    splitwise: SplitwiseStats | None = None  # only on a --splitwise-role instance
    speculative: SpecDecodeStats | None = None  # only with --speculative
    expert_tokens: tuple[tuple[int, str, int], ...] = ()  # a MoE model: (expert, rank, pairs routed), summed over layers

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@attrs.frozen
class OutputBatch:
    """Everything one engine step produced, sent as one message."""

    outputs: tuple[RequestOutput, ...]
    stats: EngineStats | None = None


@attrs.frozen
class ControlReply:
    """Reply to :class:`ControlRequest`; ``code`` is 200, 400 or 500."""

    call_id: str
    code: int
    result: Any = None
    error: str | None = None


@attrs.frozen
class Heartbeat:
    """Sent every ``heartbeat_interval`` by the engine's heartbeat thread.

    ``steps`` counts the engine loop's finished steps; ``busy_s`` is how long
    the loop has been inside its current unit of work (a step, a control
    call, taking inputs), 0 while it waits for input.  A ``busy_s`` above
    ``--step-timeout`` means a hung step.  ``pid`` tells a restarted
    engine's beats from a stale one's.
    """

    time: float
    stats: EngineStats
    pid: int = 0
    steps: int = 0
    busy_s: float = 0.0


@attrs.frozen
class EngineReady:
    """The engine loaded its model and is ready for requests."""

    pid: int
    num_kv_blocks: int
    max_model_len: int
    model_name: str
    weights_version: str = ""
    #: the pids of the worker ranks of a tensor-parallel model (rank 1 first)
    rank_pids: tuple[int, ...] = ()


@attrs.frozen
class EngineFailed:
    """The engine could not start or crashed; ``message`` is one line;
    ``pid`` is the failing engine's (0: unknown)."""

    message: str
    details: str = ""
    pid: int = 0


Message = Union[
    SamplingParams,
    AddRequest,
    AbortRequest,
    ControlRequest,
    Shutdown,
    TokenLogprob,
    RequestOutput,
    EngineStats,
    OutputBatch,
    ControlReply,
    Heartbeat,
    EngineReady,
    EngineFailed,
]

MESSAGE_TYPES: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]

_converter = make_converter()
configure_tagged_union(Message, _converter, tag_name="_t")


_converter.register_structure_hook(Any, lambda v, _: v)


# An OutputBatch is the message of every engine step: its outputs travel as
# rows, not maps.  A plain output (no logprobs, no beams) is the row of its
# scalar fields in _ROW order, built and read positionally (no key strings
# packed, unpacked or looked up per output); any other output is cattrs' map.
_ROW = ("request_id", "new_token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens",
        "num_output_tokens", "error", "error_code", "queue_time")
# RequestOutput's positional order: the row's, logprobs after num_output_tokens, then the nested fields
# (adding or moving a field must update _ROW, _output_row and _output_of: the wire format)
assert [f.name for f in attrs.fields(RequestOutput)] == [*_ROW[:6], "logprobs", *_ROW[6:], "prompt_logprobs", "beams"]
_BATCH_TAG = "OutputBatch"


def _output_row(o: RequestOutput) -> Any:
    if o.logprobs is None and o.prompt_logprobs is None and o.beams is None:
        return (o.request_id, o.new_token_ids, o.finish_reason, o.num_prompt_tokens, o.num_cached_tokens,
                o.num_output_tokens, o.error, o.error_code, o.queue_time)
    return _converter.unstructure(o, RequestOutput)


def _output_of(row: Any) -> RequestOutput:
    if type(row) is list:  # _ROW's fields: logprobs (None) goes after num_output_tokens
        return RequestOutput(row[0], tuple(row[1]), *row[2:6], None, *row[6:])
    return _converter.structure(row, RequestOutput)


def encode(msg: Message) -> bytes:
    """Serialize any :data:`Message` to msgpack bytes."""
    if type(msg) is OutputBatch:
        stats = None if msg.stats is None else _converter.unstructure(msg.stats, EngineStats)
        return msgpack.packb({"_t": _BATCH_TAG, "outputs": [_output_row(o) for o in msg.outputs], "stats": stats})
    return _converter.dumps(msg, Message)  # type: ignore[arg-type]


def decode(data: bytes) -> Message:
    """Inverse of :func:`encode`."""
    d = msgpack.unpackb(data)
    if type(d) is dict and d.get("_t") == _BATCH_TAG and len(d) == 3:
        stats = d["stats"]
        return OutputBatch(tuple([_output_of(r) for r in d["outputs"]]),
                           None if stats is None else _converter.structure(stats, EngineStats))
    return _converter.structure(d, Message)  # type: ignore[arg-type]
