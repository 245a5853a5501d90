"""The grammar contracts (structured outputs): a request's
:class:`GrammarMatcher` and the :class:`GrammarBackend` that compiles specs
into matchers.  Apart from :mod:`fdx.core.interfaces` (which re-exports
them) because :class:`fdx.core.request.Request` holds a matcher and the
interfaces take requests: this way neither imports the other."""

from __future__ import annotations

import abc
from typing import Protocol, Sequence

import numpy as np

from fdx.core.messages import StructuredOutput


class GrammarMatcher(Protocol):
    """One request's position in its grammar (``Request.grammar``).

    The sampler brings it up to date before each of the request's samples:
    it feeds :meth:`accept` the output tokens it has not seen yet (those the
    scheduler appended; the sampler counts them, so a re-run step, a
    preemption or a moved request never advances it twice), then calls
    :meth:`fill_bitmask`.  Once the grammar is complete (or broken) only the
    eos ids are allowed.  Threading contract: the engine thread only.

    A matcher from :meth:`GrammarBackend.matcher_async` may also be
    *pending* while its grammar compiles off the engine thread: it then has
    ``pending`` (true until the compile ends), ``error`` (why it failed, or
    ``None``) and ``wait(timeout)``.  Schedulers keep such a request out of
    the batch until it is not pending, and end it with ``error`` (400).
    """

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance over tokens the request produced (a refused token breaks the matcher)."""

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write row ``row`` of an ``int32[n, ceil(V / 32)]`` bitmask: bit
        ``t % 32`` of word ``t // 32`` set when token ``t`` may come next."""


class GrammarBackend(abc.ABC):
    """Compiles :class:`~fdx.core.messages.StructuredOutput` specs and makes
    matchers (``fdx_register_grammar_backends``, ``--grammar-backend``).
    Invariant: a spec is compiled once, then cached (by its value), so a
    matcher for a known spec costs a copy.  The API process calls
    :meth:`matcher` to refuse a bad spec (400) from worker threads, the
    engine from its thread: it must be thread-safe."""

    @abc.abstractmethod
    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (compiled once per
        spec); raises ``ValueError`` saying what is wrong with the spec."""

    def warm(self) -> None:
        """Do the one-time work (e.g. a tokenizer index) now: each process
        calls it in a thread at start-up, so no request waits on it."""

    def matcher_async(self, spec: StructuredOutput) -> GrammarMatcher:
        """The engine's call: :meth:`matcher` without waiting for a compile
        (a new spec gets a *pending* matcher, see :class:`GrammarMatcher`),
        so a new schema never stalls the other streams.  Default: :meth:`matcher`."""
        return self.matcher(spec)
