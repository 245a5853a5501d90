"""The component interfaces the kernel calls directly.

Plugins implement these ABCs; the kernel resolves one implementation of each
kind by name at start-up and then calls plain methods (no pluggy dispatch on
the hot path).  Docstrings state the invariants implementations must keep.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import attrs
import numpy as np

from fdx.core.grammar import GrammarBackend, GrammarMatcher  # noqa: F401 - re-exported: the kernel's interfaces
from fdx.core.messages import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.kv_cache import KVCacheManager
    from fdx.core.request import Request


# --------------------------------------------------------------------------
# Step data
# --------------------------------------------------------------------------


@attrs.define
class ScheduledSeq:
    """``num_new_tokens`` tokens of ``request`` run this step, starting at
    position ``request.num_computed_tokens`` (read before the step).

    Speculative decoding: ``draft_token_ids`` (K proposed tokens, see
    :class:`Speculator`) follow the request's one uncomputed token, and
    ``num_new_tokens == 1 + K``; the runner computes logits at all K + 1
    positions and verifies the drafts (:attr:`ModelOutput.spec_token_ids`).
    """

    request: Request
    num_new_tokens: int
    draft_token_ids: list[int] = attrs.field(factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so the
        model samples the request's next token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens >= r.num_tokens


@attrs.define
class ScheduledBatch:
    """What one step runs.

    ``seqs`` run in the forward pass.  ``preempted`` lost their blocks this
    step (they will be recomputed later).  ``failed`` were ended by the
    scheduler without running (through :meth:`Request.fail
    <fdx.core.request.Request.fail>`: ``finish_reason == "error"``,
    ``error`` and ``error_code`` set, blocks already freed, removed from the
    scheduler), e.g. v0 running out of blocks.  ``emitted`` got new tokens
    (or finished: then already out of the scheduler, blocks freed) without
    running this step -- a splitwise decode instance's first tokens,
    sampled by the prefill instance: their pending tokens and finish
    reason are sent like those of ``seqs``.
    """

    seqs: list[ScheduledSeq] = attrs.field(factory=list)
    preempted: list[Request] = attrs.field(factory=list)
    failed: list[Request] = attrs.field(factory=list)
    emitted: list[Request] = attrs.field(factory=list)
    #: ``(src, dst)`` KV blocks the runner copies before the forward (a forked beam's partial last block)
    block_copies: list[tuple[int, int]] = attrs.field(factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@attrs.define
class ModelOutput:
    """Result of one forward pass.

    ``token_ids[i]`` is the token sampled for ``batch.seqs[i]``, or ``-1``
    when that seq did not sample (a non-final prefill chunk).
    ``logprobs[i]`` is set only for seqs that sampled and asked for logprobs.
    ``spec_token_ids[i]`` (seqs with drafts): the accepted drafts then the
    target's own token at the first mismatch (or after the last draft);
    ``token_ids[i]`` is its first element.  ``None`` (or a seq missing
    from it) means no draft was accepted: only ``token_ids[i]`` counts.
    """

    token_ids: np.ndarray
    logprobs: list[TokenLogprob | None] | None = None
    spec_token_ids: dict[int, list[int]] | None = None


# --------------------------------------------------------------------------
# Scheduler
# --------------------------------------------------------------------------


class Scheduler(abc.ABC):
    """Decides which tokens run each step, and owns the requests' KV blocks
    through the shared :class:`~fdx.core.kv_cache.KVCacheManager`.

    Invariants:

    * a KV block is owned by at most one running request (or shared
      read-only through the prefix cache by reference count);
    * once every request is finished or aborted, all blocks are free or
      cached-evictable;
    * every request added is eventually returned finished by :meth:`update`,
      returned by :meth:`abort` / :meth:`preempt_all`, or put in
      ``ScheduledBatch.failed`` -- none is lost;
    * at most ``config.max_num_seqs`` requests run in one step, and a step's
      ``num_tokens`` is at most ``config.max_num_batched_tokens``.

    Every method is called from the engine thread only.  An exception ends
    only what it touches: from :meth:`add_request` that request, from
    :meth:`update` the step's requests, from :meth:`schedule` every live
    request (each with an error output, code 500); the engine goes on, and
    removes the ended requests through :meth:`abort`.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING)."""

    @abc.abstractmethod
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work and allocate its blocks."""

    @abc.abstractmethod
    def update(self, batch: ScheduledBatch, output: ModelOutput) -> None:
        """Apply a step's results: advance ``num_computed_tokens``, append
        sampled tokens (``Request.append_token``, which sets
        ``finish_reason``), and remove the requests that finished, freeing
        their blocks.  The engine reads each seq's new tokens and finish
        reason from the requests themselves.  Seqs whose request is no
        longer RUNNING (ended by the engine during the step) are skipped."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Remove these requests (any state) and free their blocks at once.
        Unknown ids are ignored.  Returns the removed requests."""

    @abc.abstractmethod
    def preempt_all(self) -> list[Request]:
        """Remove every running and waiting request, freeing all their
        blocks (used by pause).  Returns them."""

    @abc.abstractmethod
    def get(self, request_id: str) -> Request | None:
        """The live request with this id, if any."""

    @abc.abstractmethod
    def request_ids(self) -> list[str]:
        """Ids of every live (waiting or running) request."""

    @property
    @abc.abstractmethod
    def num_running(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int: ...

    def has_work(self) -> bool:
        return self.num_running + self.num_waiting > 0

    def stats(self) -> dict[str, int]:
        """Counters for /metrics: at least ``num_preemptions``."""
        return {}

    def pollables(self) -> list[Any]:
        """ZMQ sockets (or file descriptors) the engine process polls along
        with its input channel: readable means :meth:`has_work` may have
        turned true (a splitwise scheduler's KV connector).  Default none."""
        return []


# --------------------------------------------------------------------------
# Model runner (a plugin kind: fdx_register_model_runners, built on the device)
# --------------------------------------------------------------------------


class ModelRunner(abc.ABC):
    """Runs forward passes over the paged KV cache and samples.

    Invariants: attention reads keys/values only through each request's
    ``block_ids``; a request's sampling depends only on its own params,
    tokens and seed, never on the rest of the batch.

    Failure contract: :meth:`execute` may raise.  The engine then re-runs
    the batch's seqs in smaller batches (halves, down to single seqs) to
    find the requests that fail alone, so re-running a chunk must be safe:
    it rewrites the same KV slots with the same tokens.

    Threading contract: every method is called from the engine thread only
    (the KV storage tier copies blocks on that thread too), never two at
    once.  ``device`` is the :class:`Device` the runner was built on.
    """

    device: Device | None = None
    #: ranks the model is split over (``--tensor-parallel-size``); a runner
    #: that cannot split leaves it at 1 and the engine refuses a larger size
    tensor_parallel_size: int = 1
    #: the pids of its other ranks' processes
    rank_pids: tuple[int, ...] = ()
    #: the dtype of the KV pool it keeps (``float32``, ``bfloat16``, ...): a
    #: ``--kv-cache-dtype`` other than ``auto`` must name it, and a runner
    #: that does not say (``""``) is refused any but ``auto`` -- the flag
    #: must not pass silently through a runner that ignores it
    kv_cache_dtype: str = ""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    weights_version: str

    @abc.abstractmethod
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one mixed prefill/decode step and sample."""

    @abc.abstractmethod
    def kv_fingerprint(self) -> str:
        """Identity of the KV layout + weights (model, version, dtype, block
        size, layer/head geometry); storage keys are salted with it."""

    @abc.abstractmethod
    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Copy whole blocks (all layers, K and V) out as bytes."""

    @abc.abstractmethod
    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Inverse of :meth:`read_kv_blocks`."""

    @abc.abstractmethod
    def release(self, tags: Sequence[str]) -> None:
        """Free memory for ``tags`` (``weight``, ``kv_cache``) -- sleep."""

    @abc.abstractmethod
    def restore(self, tags: Sequence[str]) -> None:
        """Reload what :meth:`release` freed -- wakeup."""

    @abc.abstractmethod
    def load_weights(self, path: str, version: str) -> None:
        """Swap weights for a checkpoint of identical architecture/shapes."""

    def close(self) -> None:
        """Release what outlives the process's memory (worker processes) at shutdown."""


# --------------------------------------------------------------------------
# Speculator (speculative decoding without a draft model)
# --------------------------------------------------------------------------


class Speculator(abc.ABC):
    """Proposes draft tokens for a decoding request
    (``fdx_register_speculators``, ``--speculative NAME``); the scheduler
    asks it, the model runner verifies the drafts in the request's own
    forward rows (K + 1 query positions), accepting the longest prefix equal
    to the target's greedy tokens.

    Invariants: :meth:`propose` returns at most ``k`` ids in
    ``[0, vocab)``, depends only on ``token_ids`` (deterministic, no state
    shared between requests), never mutates its input, and is cheap
    (vectorized: no Python loop over the history).  Drafts are hints: a
    bad one costs compute, never output.  Threading contract: the engine
    thread only.
    """

    @abc.abstractmethod
    def propose(self, token_ids: np.ndarray, k: int) -> np.ndarray:
        """Up to ``k`` draft tokens (``int64``, possibly none) to follow
        ``token_ids`` (``int64[L]``: the request's prompt + output)."""


# --------------------------------------------------------------------------
# Device
# --------------------------------------------------------------------------


@attrs.frozen
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


class Device(abc.ABC):
    """A device (cpu, cuda, xpu, iluvatar) over Paddle; device plugins live
    in ``fdx/plugins/hardware/``.

    :meth:`configure_env` runs before Paddle is imported in the process;
    everything else may import Paddle.
    """

    name: str = ""
    #: the model runner (a ``fdx_register_model_runners`` name) used when
    #: ``--model-runner`` is not given
    default_runner: str = "cpu"

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this device can run here (must not raise)."""

    def configure_env(self, num_threads: int | None = None) -> None:
        """Set environment variables (threads, vendor switches) before Paddle
        is imported.  Default: nothing."""

    @abc.abstractmethod
    def paddle_place(self) -> str:
        """The Paddle device string: ``cpu``, ``gpu:0``, ``xpu:0``, ..."""

    @abc.abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """``(total_bytes, available_bytes)`` of the memory KV lives in."""

    @abc.abstractmethod
    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[Any]:
        """Allocate per-layer KV tensors for ``spec`` (zeroed)."""

    def attention_backend(self) -> str:
        """Name of the attention implementation the model should use."""
        return "paddle"

    def linear_backend(self) -> str:
        """Name of the linear (GEMM) implementation the model should use."""
        return "paddle"

    def trim_memory(self) -> None:
        """Hand memory freed by Python and the framework back to the system
        (after sleep or a weight swap).  Default: a garbage collection."""
        import gc

        gc.collect()

    def process_rss(self) -> int:
        """Host memory resident in this process, in bytes (0: unknown)."""
        return 0


# --------------------------------------------------------------------------
# Tokenizer and token processor (front end)
# --------------------------------------------------------------------------


class Tokenizer(Protocol):
    eos_token_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_vars: Any) -> str: ...

    def id_to_token(self, token_id: int) -> str: ...


@attrs.define
class TextDelta:
    """Text produced by :meth:`TokenStream.feed`.  ``stopped`` is True when a
    stop string matched: ``text`` is then cut before it and the request must
    end with finish reason ``stop``; ``tokens`` then counts the fed ids up
    to the one that completed the stop string (``None``: all of them), so
    the ids after it (several tokens in one output: speculative decoding)
    are not reported."""

    text: str
    stopped: bool = False
    tokens: int | None = None


class TokenStream(abc.ABC):
    """Incremental detokenizer for one request."""

    @abc.abstractmethod
    def feed(self, token_ids: Sequence[int], finished: bool) -> TextDelta:
        """Consume new token ids; return the text that became final.  When
        ``finished`` is true, flush everything held back."""


class TokenProcessor(abc.ABC):
    """Turns token ids into text for each request (runs in the front end)."""

    def __init__(self, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config

    @abc.abstractmethod
    def open_stream(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> TokenStream:
        """Start detokenizing a new request."""

    def token_text(self, token_id: int) -> str:
        """Text of a single token (for logprobs)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


# --------------------------------------------------------------------------
# Tool parser (tool calling); the grammar contracts are in fdx.core.grammar
# --------------------------------------------------------------------------


@attrs.frozen
class ToolCallDelta:
    """A piece of tool call ``index`` of one choice: ``name`` on its first
    piece only; ``arguments`` the next characters of its JSON arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


class ToolCallStream(Protocol):
    """One choice's output split into content and tool calls, incrementally."""

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """Consume new output text; return the content text that became final
        and the tool-call pieces found.  ``finished``: flush everything."""


class ToolParser(abc.ABC):
    """Finds tool calls in model output (``fdx_register_tool_parsers``,
    ``--tool-call-parser``).  One instance serves every request of the API
    process (its event loop thread); per-choice state lives in the streams.
    A non-streaming reply feeds the whole text once, ``finished=True``."""

    @abc.abstractmethod
    def open_stream(self) -> ToolCallStream:
        """Start parsing one choice."""


# --------------------------------------------------------------------------
# Cache backend (stores KV blocks for the KV storage tier)
# --------------------------------------------------------------------------


class CacheBackend(abc.ABC):
    """A KV block store beyond the device pool (host memory, files, Redis,
    Mooncake), driven by the engine's KV storage tier
    (:mod:`fdx.kv_storage`).  Keys are strings of
    ``[0-9a-z_]``; values are opaque bytes (the tier adds and checks
    checksums).  The backend owns capacity and eviction.

    Threading contract: methods are called from two threads, possibly at
    the same time -- the engine thread (``exists_batch``, ``get_batch`` to
    load a prefix; ``stats``; ``close`` at shutdown, after the writer
    thread stopped) and the tier's one writer thread (``put_batch``,
    ``health``).  So every method must be thread-safe; ``put_batch`` is
    never called twice at once.  ``clear`` is for tools and tests; the
    engine never calls it.  Loads run on the
    engine loop and should be bounded in time (a timeout, then raise).

    Methods may raise on I/O failure: the tier counts the error, marks the
    backend down (nothing touches it from the engine thread until
    ``health()`` answers True again) and degrades to recompute.
    """

    name: str = ""

    @abc.abstractmethod
    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values for ``keys`` (``None`` for a miss), in order."""

    @abc.abstractmethod
    def put_batch(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store values (overwrite allowed; may evict others)."""

    @abc.abstractmethod
    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters: at least ``hits``, ``misses``, ``puts``, ``bytes``."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the backend is reachable."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Drop every stored block."""

    def close(self) -> None:
        """Release connections and files."""


# --------------------------------------------------------------------------
# KV connector (splitwise: moves prompt KV from a prefill to a decode instance)
# --------------------------------------------------------------------------


class KVConnector(abc.ABC):
    """Moves small typed messages, and the KV blocks that go with them,
    between engine instances (``--kv-connector NAME``; built by the engine
    with ``factory(config=..., runner=...)``, driven by the splitwise
    scheduler).

    Every instance listens at :attr:`address` (what ``/v1/splitwise/info``
    announces as ``kv_addr``); a peer is named by its address.

    Invariants:

    * messages from one peer arrive in the order sent, each at most once;
      the KV sent with a message is complete when :meth:`recv` returns the
      message (never a partial block set);
    * the KV is read from the sender's blocks inside :meth:`send` (the
      blocks may be reused as soon as it returns) and written into the
      receiver's blocks only by :meth:`load`, into the blocks the receiver
      names then -- so a receiver that dropped the request in between
      never has blocks overwritten; ``load(kv, ())`` releases a KV without
      writing it (e.g. removes its objects from a store);
    * a peer that went away (process gone, connection lost) is reported
      once by :meth:`lost_peers`; what was in flight to or from it is
      lost, and the caller ends those requests;
    * :meth:`send` never waits long on the peer: it raises
      ``ConnectionError`` when the peer cannot be reached.

    Threading contract: every method is called from the engine thread only
    (KV is read and written through the model runner, which is
    engine-thread only); a connector may run I/O threads of its own.
    """

    address: str = ""
    runner: ModelRunner | None = None  # the model runner whose KV blocks it moves

    @abc.abstractmethod
    def send(self, peer: str, msg: Any, block_ids: Sequence[int] = ()) -> int:
        """Send ``msg`` (a splitwise wire message) to ``peer``, with the KV
        of local ``block_ids`` (in order).  Returns the KV bytes sent."""

    @abc.abstractmethod
    def recv(self) -> list[tuple[str, Any, Any]]:
        """Messages that arrived, without waiting: ``(peer, msg, kv)``;
        ``kv`` is ``None`` or an opaque handle for :meth:`load` / :meth:`drop`."""

    @abc.abstractmethod
    def load(self, kv: Any, block_ids: Sequence[int]) -> int:
        """Write a received KV into local ``block_ids`` (as many as were
        sent; none: just release it) and release it; returns the bytes
        written."""

    @abc.abstractmethod
    def lost_peers(self) -> list[str]:
        """Peers lost since the last call."""

    def pollables(self) -> list[Any]:
        """Sockets or fds readable when :meth:`recv` may return something."""
        return []

    def stats(self) -> dict[str, float]:
        """Counters: at least ``bytes_sent``, ``bytes_received``."""
        return {}

    def close(self) -> None:
        """Stop listening and release connections."""
