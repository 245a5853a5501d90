"""``ngram``: prompt-lookup speculation (no draft model).

The proposer looks for the request's last ``n`` tokens earlier in its own
prompt + output, for ``n`` from ``--prompt-lookup-max`` down to
``--prompt-lookup-min``; at the first ``n`` that matches, the tokens that
followed the most recent earlier occurrence with K tokens after it (else
the most recent one) are the drafts (up to K).  This
wins when the output copies from the context (summaries, code edits, RAG
answers quoting their sources) and costs one cheap lookup otherwise.

The match is vectorized NumPy: per ``n``, one comparison of the suffix
against every window of the history (``sliding_window_view``), so no Python
code runs per history token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Speculator

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register

_EMPTY = np.zeros(0, dtype=np.int64)


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Drafts after the most recent earlier occurrence of the longest
    suffix n-gram (``n_max >= n >= n_min``) of ``tokens`` that has ``k``
    tokens after it (else after the most recent one: in a loop of period
    p < k the latest occurrence is followed by fewer than k tokens); none
    when no suffix of those lengths occurs earlier."""
    L = len(tokens)
    if k <= 0:
        return _EMPTY
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # windows starting at 0 .. L-n-1: each has at least one token after it
        hist = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((hist == tokens[L - n :]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= L]  # prefer the most recent occurrence with k tokens after it
            start = int(full[-1] if len(full) else hits[-1]) + n
            return tokens[start : start + k].astype(np.int64, copy=False)
    return _EMPTY


class NgramSpeculator(Speculator):
    """See the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.n_min = config.prompt_lookup_min
        self.n_max = config.prompt_lookup_max

    def propose(self, token_ids: np.ndarray, k: int) -> np.ndarray:
        return ngram_propose(np.asarray(token_ids, dtype=np.int64), k, self.n_min, self.n_max)


@hookimpl
def fdx_register_speculators(register: Register) -> None:
    register("ngram", NgramSpeculator,
             description="prompt lookup: drafts copied from the request's own tokens after its last n-gram")
