"""Batched token sampling over a step's logits (numpy, vectorized over rows).

Row ``i`` of ``logits`` belongs to ``requests[i]`` and is sampled with that
request's :class:`~fdx.core.messages.SamplingParams` only.  Pipeline per row,
in vLLM's order:

1. logprobs (if asked) from the log-softmax of the *raw* logits;
2. repetition penalty (prompt + output tokens, HF/vLLM: positive logits are
   divided, negative ones multiplied), then frequency/presence penalties
   (output tokens, OpenAI: ``logit -= f * count + p * (count > 0)``);
3. ``min_tokens``: eos ids and ``stop_token_ids`` get ``-inf`` while fewer
   than ``min_tokens`` tokens were generated;
4. greedy rows (``temperature < 1e-5``): argmax;
5. random rows: temperature, min_p (relative to the top probability),
   top_k, top_p (on the renormalised survivors), then inverse-CDF sampling
   with ONE uniform draw per generated token.

Invariants:

* a row's token depends only on its logits, params, its own tokens and its
  own generator -- never on the other rows of the batch;
* a seeded request keeps a ``numpy.random.Generator(PCG64(seed))`` in
  ``request.sampler_state`` and consumes exactly one uniform per sampled
  token, so the same seed gives the same tokens alone or in any batch;
  unseeded requests draw from the sampler's process-level generator;
* the all-greedy batch without penalties, logprobs or active min_tokens is a
  single argmax (done by Paddle on the tensor itself when given one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from fdx.core.messages import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from fdx.core.request import Request

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).
GREEDY_EPS = 1e-5
#: top_p first looks for its nucleus among this many top tokens; rows whose
#: nucleus is larger fall back to a full sort.
_TOPP_CANDIDATES = 256


class SamplerState:
    """Per-request sampler state stored in ``Request.sampler_state``.

    ``gen`` is the request's own generator (``None`` when unseeded).
    ``counts[v]`` is how often token ``v`` occurs among the first
    ``n_counted`` output tokens (allocated only for requests with
    penalties).  ``prompt_mask[v]`` says whether ``v`` is in the prompt
    (only for repetition penalty).
    """

    __slots__ = ("gen", "counts", "prompt_mask", "n_counted")

    def __init__(self, seed: int | None) -> None:
        self.gen: np.random.Generator | None = (
            np.random.Generator(np.random.PCG64(seed)) if seed is not None else None
        )
        self.counts: np.ndarray | None = None
        self.prompt_mask: np.ndarray | None = None
        self.n_counted = 0

    def output_counts(self, output_token_ids: Sequence[int], width: int) -> np.ndarray:
        """Token counts of the output so far (updated incrementally)."""
        n = len(output_token_ids)
        if self.counts is None or self.counts.shape[0] != width or n < self.n_counted:
            self.counts = np.zeros(width, dtype=np.int32)
            self.n_counted = 0
        if n > self.n_counted:
            new = np.asarray(output_token_ids[self.n_counted :], dtype=np.int64)
            new = new[(new >= 0) & (new < width)]
            np.add.at(self.counts, new, 1)
            self.n_counted = n
        return self.counts

    def prompt(self, prompt_token_ids: Sequence[int], width: int) -> np.ndarray:
        """Presence mask of the prompt tokens (built once)."""
        if self.prompt_mask is None or self.prompt_mask.shape[0] != width:
            m = np.zeros(width, dtype=bool)
            ids = np.asarray(prompt_token_ids, dtype=np.int64)
            m[ids[(ids >= 0) & (ids < width)]] = True
            self.prompt_mask = m
        return self.prompt_mask


def _state(req: Request) -> SamplerState:
    st = req.sampler_state
    if not isinstance(st, SamplerState):
        st = SamplerState(req.params.seed)
        req.sampler_state = st
    return st


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_active(req: Request) -> bool:
    return req.params.min_tokens > 0 and len(req.output_token_ids) < req.params.min_tokens


def _is_paddle(x: Any) -> bool:
    return type(x).__module__.startswith("paddle")


def _to_numpy(logits: Any) -> np.ndarray:
    if isinstance(logits, np.ndarray):
        arr = logits
    else:
        if _is_paddle(logits) and "float32" not in str(logits.dtype):
            logits = logits.astype("float32")
        arr = logits.numpy()
    if arr.ndim != 2:
        raise ValueError(f"logits must be 2-D [n, vocab], got shape {arr.shape}")
    return np.asarray(arr, dtype=np.float32)


class Sampler:
    """Samples one token per row of a logits matrix (see module docstring)."""

    def __init__(self, vocab_size: int, max_logprobs: int = 20, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self._rng = np.random.default_rng(seed)

    # ------------------------------------------------------------------ API

    def sample(
        self, logits: Any, requests: Sequence[Request]
    ) -> tuple[np.ndarray, list[TokenLogprob | None] | None]:
        """Token ids ``int64[n]`` and per-row logprobs (``None`` when no row
        asked for them).  ``logits`` is a float ``[n, V]`` paddle tensor or
        numpy array; ``V`` may exceed ``vocab_size`` (padding columns are
        never sampled)."""
        n = len(requests)
        shape = tuple(logits.shape)
        if len(shape) != 2 or shape[0] != n:
            raise ValueError(f"logits shape {shape} does not match {n} requests")
        if n == 0:
            return np.zeros(0, dtype=np.int64), None
        width = int(shape[1])

        fast = width <= self.vocab_size
        for r in requests:
            p = r.params
            if not (
                p.temperature < GREEDY_EPS
                and p.logprobs is None
                and not _has_penalty(p)
                and not _min_tokens_active(r)
            ):
                fast = False
                break
        if fast:
            if _is_paddle(logits):
                import paddle

                return paddle.argmax(logits, axis=-1).numpy().astype(np.int64), None
            return np.asarray(logits).argmax(axis=1).astype(np.int64), None

        return self._sample_full(_to_numpy(logits), requests)

    # ------------------------------------------------------------ internals

    def _sample_full(
        self, raw: np.ndarray, requests: Sequence[Request]
    ) -> tuple[np.ndarray, list[TokenLogprob | None] | None]:
        n, width = raw.shape
        params = [r.params for r in requests]

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        pen_rows = [i for i, p in enumerate(params) if _has_penalty(p)]
        mt_rows = [i for i, r in enumerate(requests) if _min_tokens_active(r)]
        temps = np.array([p.temperature for p in params], dtype=np.float32)
        greedy = temps < GREEDY_EPS

        x = raw
        if pen_rows or mt_rows or width > self.vocab_size:
            x = raw.copy()
            if width > self.vocab_size:
                x[:, self.vocab_size :] = -np.inf
            if pen_rows:
                self._apply_penalties(x, requests, pen_rows)
            if mt_rows:
                self._mask_stop_tokens(x, requests, mt_rows)

        tokens = np.empty(n, dtype=np.int64)
        if greedy.any():
            g = np.flatnonzero(greedy)
            tokens[g] = x[g].argmax(axis=1) if len(g) < n else x.argmax(axis=1)
        if not greedy.all():
            rnd = np.flatnonzero(~greedy)
            tokens[rnd] = self._sample_random(x, rnd, temps[rnd], requests)

        logprobs = self._logprobs(raw, tokens, params, lp_rows) if lp_rows else None
        return tokens, logprobs

    def _apply_penalties(self, x: np.ndarray, requests: Sequence[Request], rows: list[int]) -> None:
        width = x.shape[1]
        counts = np.empty((len(rows), width), dtype=np.int32)
        rep = np.ones(len(rows), dtype=np.float32)
        freq = np.zeros(len(rows), dtype=np.float32)
        pres = np.zeros(len(rows), dtype=np.float32)
        rep_rows: list[int] = []
        prompt_masks: list[np.ndarray] = []
        for j, i in enumerate(rows):
            r = requests[i]
            p = r.params
            st = _state(r)
            counts[j] = st.output_counts(r.output_token_ids, width)
            rep[j], freq[j], pres[j] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
            if p.repetition_penalty != 1.0:
                rep_rows.append(j)
                prompt_masks.append(st.prompt(r.prompt_token_ids, width))
        sub = x[rows]
        seen = counts > 0
        if rep_rows:
            rs = sub[rep_rows]
            mask = seen[rep_rows] | np.stack(prompt_masks)
            rp = rep[rep_rows, None]
            sub[rep_rows] = np.where(mask, np.where(rs > 0, rs / rp, rs * rp), rs)
        if freq.any() or pres.any():
            sub -= freq[:, None] * counts + pres[:, None] * seen
        x[rows] = sub

    @staticmethod
    def _mask_stop_tokens(x: np.ndarray, requests: Sequence[Request], rows: list[int]) -> None:
        width = x.shape[1]
        ri: list[int] = []
        ci: list[int] = []
        for i in rows:
            r = requests[i]
            ids = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                ids.update(r.eos_token_ids)
            for t in ids:
                if 0 <= t < width:
                    ri.append(i)
                    ci.append(t)
        if ri:
            x[ri, ci] = -np.inf

    def _sample_random(
        self, x: np.ndarray, rows: np.ndarray, temps: np.ndarray, requests: Sequence[Request]
    ) -> np.ndarray:
        k_rows = len(rows)
        width = x.shape[1]
        z = x[rows] if k_rows < x.shape[0] else x.copy()
        z /= temps[:, None]
        z -= z.max(axis=1, keepdims=True)
        probs = np.exp(z, out=z)  # unnormalised, top probability == 1

        params = [requests[i].params for i in rows]
        min_p = np.array([p.min_p for p in params], dtype=np.float32)
        if (min_p > 0).any():
            probs[probs < min_p[:, None]] = 0.0

        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        act = np.flatnonzero((top_k > 0) & (top_k < width))
        if len(act):
            kk = top_k[act]
            kmax = int(kk.max())
            sub = probs[act]
            top = np.partition(sub, width - kmax, axis=1)[:, width - kmax :]
            top.sort(axis=1)  # ascending: the k-th largest is at kmax - k
            thr = top[np.arange(len(act)), kmax - kk]
            sub[sub < thr[:, None]] = 0.0
            probs[act] = sub

        top_p = np.array([p.top_p for p in params], dtype=np.float64)
        act = np.flatnonzero(top_p < 1.0)
        if len(act):
            probs[act] = _top_p_filter(probs[act], top_p[act])

        u = np.empty(k_rows, dtype=np.float64)
        unseeded: list[int] = []
        for j, i in enumerate(rows):
            gen = _state(requests[i]).gen
            if gen is None:
                unseeded.append(j)
            else:
                u[j] = gen.random()
        if unseeded:
            u[unseeded] = self._rng.random(len(unseeded))
        cdf = np.cumsum(probs, axis=1, dtype=np.float64)
        target = (1.0 - u) * cdf[:, -1]  # in (0, total]: never lands on a zero-probability token
        tok = np.count_nonzero(cdf < target[:, None], axis=1)
        return np.minimum(tok, width - 1)

    def _logprobs(
        self, raw: np.ndarray, tokens: np.ndarray, params: list[SamplingParams], rows: list[int]
    ) -> list[TokenLogprob | None]:
        xl = raw[rows]
        m = xl.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(xl - m).sum(axis=1, dtype=np.float64))
        chosen = xl[np.arange(len(rows)), tokens[rows]] - lse
        ks = [min(max(params[i].logprobs or 0, 0), self.max_logprobs) for i in rows]
        kmax = max(ks)
        top_ids = top_vals = None
        if kmax > 0:
            width = xl.shape[1]
            kmax = min(kmax, width)
            part = np.argpartition(xl, width - kmax, axis=1)[:, width - kmax :]
            vals = np.take_along_axis(xl, part, axis=1)
            order = np.argsort(-vals, axis=1, kind="stable")
            top_ids = np.take_along_axis(part, order, axis=1)
            top_vals = np.take_along_axis(vals, order, axis=1) - lse[:, None]
        out: list[TokenLogprob | None] = [None] * len(params)
        for j, i in enumerate(rows):
            top: tuple[tuple[int, float], ...] = ()
            if ks[j] and top_ids is not None and top_vals is not None:
                top = tuple(zip(top_ids[j, : ks[j]].tolist(), top_vals[j, : ks[j]].tolist()))
            out[i] = TokenLogprob(int(tokens[i]), float(chosen[j]), top)
        return out


def _top_p_filter(probs: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Zero the tokens outside each row's nucleus: keep the smallest set of
    highest-probability tokens whose mass reaches ``top_p`` (at least one;
    ties with the last kept token are kept)."""
    n, width = probs.shape
    total = probs.sum(axis=1, dtype=np.float64)
    thr = np.empty(n, dtype=np.float32)
    c = min(width, _TOPP_CANDIDATES)
    cand = np.partition(probs, width - c, axis=1)[:, width - c :]
    cand = -np.sort(-cand, axis=1)
    cum = np.cumsum(cand, axis=1, dtype=np.float64) / total[:, None]
    ok = (cum[:, -1] >= top_p) | (c == width)
    for rows, desc, cs in ((np.flatnonzero(ok), cand, cum), (np.flatnonzero(~ok), None, None)):
        if not len(rows):
            continue
        if desc is None:
            desc = -np.sort(-probs[rows], axis=1)
            cs = np.cumsum(desc, axis=1, dtype=np.float64) / total[rows, None]
        else:
            desc, cs = desc[rows], cs[rows]
        before = cs - desc / total[rows, None]  # mass strictly above each token
        keep = np.maximum(np.count_nonzero(before < top_p[rows, None], axis=1), 1)
        thr[rows] = desc[np.arange(len(rows)), keep - 1]
    probs[probs < thr[:, None]] = 0.0
    return probs
