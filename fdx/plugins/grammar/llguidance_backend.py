"""The ``llguidance`` grammar backend (``--grammar-backend llguidance``, the
default): structured outputs through Microsoft's llguidance (a Rust engine on
PyPI with no Python dependencies; xgrammar needs torch, transformers and
triton, which fdx does not install).

One :class:`LLGuidanceBackend` per process: the model's tokenizer as an
``llguidance.LLTokenizer`` (built on the first compile, about 0.5 s), and a
bounded LRU of compiled grammars keyed by the
:class:`~fdx.core.messages.StructuredOutput` -- each entry a pristine
``LLMatcher`` whose ``deep_copy()`` starts a request.  The engine's
:meth:`~LLGuidanceBackend.matcher_async` compiles a new spec on one worker
thread (llguidance releases the GIL while it compiles) and returns a
:class:`PendingMatcher` at once, so the step loop keeps running the other
requests; the API process's :meth:`~LLGuidanceBackend.matcher` (the 400
check) compiles in its caller.  JSON is generated
compact (``", "`` and ``": "`` separators, no free whitespace), so a small
model cannot wander off into whitespace.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import threading
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from fdx.core.hookspecs import Register, hookimpl
from fdx.core.interfaces import GrammarBackend, GrammarMatcher

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.messages import StructuredOutput

#: JSON compile options: compact separators, no free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: distinct compiled grammars kept per process
CACHE_SIZE = 256


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError("structured outputs need the llguidance package (pip install llguidance, or fdx's "
                          "'grammar' extra)") from None
    return llguidance


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec``; ``ValueError`` for a bad spec or kind."""
    llg = _llg()

    kind = spec.kind
    if kind == "json":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        return str(llg.LLMatcher.grammar_from_json_schema(json.dumps(closed_objects(schema)), defaults=JSON_OPTIONS))
    if kind == "json_object":
        return str(llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS))
    if kind == "regex":
        return str(llg.LLMatcher.grammar_from_regex(spec.spec))
    if kind == "choice":
        try:
            choices = json.loads(spec.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"choice must be a JSON list of strings: {exc}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return str(llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))
    if kind == "grammar":
        return str(llg.grammar_from("grammar", spec.spec))  # Lark, or GBNF converted to Lark
    raise ValueError(f"unknown structured output kind {kind!r} (json, json_object, regex, choice, grammar)")


#: keywords whose values are data, not sub-schemas
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})


def closed_objects(schema: Any, closable: bool = True) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object
    schema that lists ``properties`` and says nothing about other keys
    (no ``additionalProperties``, ``patternProperties`` or
    ``unevaluatedProperties``): the default of vLLM's xgrammar backend
    (its strict mode).  JSON Schema's own default lets any other key in, and
    a small model given that freedom adds keys until ``max_tokens`` (a
    generation that runs for minutes and ends as broken JSON).  The parts of
    an ``allOf`` stay open (closing each would refuse the others' keys)."""
    if isinstance(schema, list):
        return [closed_objects(x, closable) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else closed_objects(v, k != "allOf")) for k, v in schema.items()}
    if "properties" in schema and isinstance(schema["properties"], dict):
        out["properties"] = {k: closed_objects(v) for k, v in schema["properties"].items()}
        if closable and not any(k in schema for k in ("additionalProperties", "patternProperties",
                                                      "unevaluatedProperties")):
            out["additionalProperties"] = False
    return out


class LLGuidanceMatcher(GrammarMatcher):
    """A request's ``LLMatcher``; complete or broken -> only eos may follow."""

    def __init__(self, matcher: Any, eos_ids: Sequence[int]) -> None:
        self._m = matcher
        self._eos = np.asarray(sorted(eos_ids), dtype=np.int64)

    def accept(self, token_ids: Sequence[int]) -> None:
        m = self._m
        if not m.is_error() and not m.is_stopped():
            m.consume_tokens([int(t) for t in token_ids])  # a refused token puts it in its error state

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        m = self._m
        v = bitmask[row]
        if m.is_error() or m.is_stopped():
            v[:] = 0
            words = v.view(np.uint32)
            np.bitwise_or.at(words, self._eos >> 5, (np.uint32(1) << (self._eos & 31).astype(np.uint32)))
            return
        m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)

    @property
    def done(self) -> bool:
        """The grammar is complete (or broken)."""
        return bool(self._m.is_error() or self._m.is_stopped())


class PendingMatcher(GrammarMatcher):
    """A request's matcher while its grammar compiles on the backend's worker
    thread (the contract in :class:`fdx.core.interfaces.GrammarMatcher`):
    the scheduler admits the request once :attr:`pending` is false, and
    from then on it is the :class:`LLGuidanceMatcher` it wraps."""

    def __init__(self, future: cf.Future[Any], backend: LLGuidanceBackend) -> None:
        self._future = future
        self._backend = backend
        self._m: LLGuidanceMatcher | None = None

    @property
    def pending(self) -> bool:
        return not self._future.done()

    @property
    def error(self) -> str | None:
        exc = self._future.exception() if self._future.done() else None
        return None if exc is None else str(exc) or type(exc).__name__

    def wait(self, timeout: float) -> None:
        cf.wait([self._future], timeout)

    def _matcher(self) -> LLGuidanceMatcher:
        if self._m is None:
            self._m = self._backend.copy(self._future.result())
        return self._m

    def accept(self, token_ids: Sequence[int]) -> None:
        self._matcher().accept(token_ids)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher().fill_bitmask(bitmask, row)

    @property
    def done(self) -> bool:
        return self._matcher().done


class LLGuidanceBackend(GrammarBackend):
    """See the module docstring."""

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = int(vocab_size)
        self._lock = threading.Lock()
        self._tok: Any = None
        self._eos: tuple[int, ...] = ()
        self._cache: collections.OrderedDict[StructuredOutput, Any] = collections.OrderedDict()
        self.compiles = 0  # cache misses (for tests and benchmarks)
        self._pool: cf.ThreadPoolExecutor | None = None  # matcher_async's worker, made on first use
        self._inflight: dict[StructuredOutput, cf.Future[Any]] = {}

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from fdx.model.loader import load_tokenizer

            llg = _llg()

            tok = load_tokenizer(self.config.model)
            to_json = getattr(tok, "to_json", None)  # the Hugging Face tokenizer behind fdx's ModelTokenizer
            if to_json is None:
                raise ValueError("the llguidance backend needs a Hugging Face tokenizers tokenizer")
            self._eos = tuple(sorted(tok.eos_token_ids))
            self._tok = llg.LLTokenizer(to_json(), n_vocab=self.vocab_size, eos_token=list(self._eos))
        return self._tok

    def warm(self) -> None:
        """Build the llguidance tokenizer (about 0.5 s, holding the GIL) now;
        nothing without the llguidance package (a structured request says so)."""
        try:
            _llg()
        except ImportError:
            return
        with self._lock:
            self._tokenizer()

    def compile(self, spec: StructuredOutput) -> Any:
        """The pristine ``LLMatcher`` of ``spec`` (cached); ``ValueError`` for a bad spec."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            tok = self._tokenizer()
        llg = _llg()
        text = grammar_text(spec)  # outside the lock: llguidance releases the GIL while it compiles
        m = llg.LLMatcher(tok, text, log_level=0)
        if m.is_error():
            raise ValueError(_one_line(m.get_error()))
        with self._lock:
            self.compiles += 1
            self._cache[spec] = m
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return m

    def copy(self, template: Any) -> LLGuidanceMatcher:
        """A request's matcher from a compiled ``template``."""
        with self._lock:  # the cached matcher is shared by every thread: copy it one at a time
            return LLGuidanceMatcher(template.deep_copy(), self._eos)

    def matcher(self, spec: StructuredOutput) -> LLGuidanceMatcher:
        return self.copy(self.compile(spec))

    def matcher_async(self, spec: StructuredOutput) -> GrammarMatcher:
        with self._lock:
            cached = spec in self._cache
            fut = None if cached else self._inflight.get(spec)
            if not cached and fut is None:
                if self._pool is None:
                    self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="fdx-grammar")
                fut = self._inflight[spec] = self._pool.submit(self._compile_inflight, spec)
        return self.matcher(spec) if cached else PendingMatcher(fut, self)  # type: ignore[arg-type]

    def _compile_inflight(self, spec: StructuredOutput) -> Any:
        try:
            return self.compile(spec)
        finally:
            with self._lock:
                self._inflight.pop(spec, None)


def _one_line(msg: str) -> str:
    lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
    return "; ".join(lines[:3])[:500] or "invalid grammar"


@hookimpl
def fdx_register_grammar_backends(register: Register) -> None:
    def factory(config: EngineConfig, vocab_size: int) -> LLGuidanceBackend:
        return LLGuidanceBackend(config, vocab_size)

    register("llguidance", factory,
             description="structured outputs (JSON schema, regex, choice, Lark/GBNF) through llguidance")
