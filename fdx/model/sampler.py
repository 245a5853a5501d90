"""Batched token sampling over a step's logits (numpy, vectorized over rows).

Row ``i`` of ``logits`` belongs to ``requests[i]`` and is sampled with that
request's :class:`~fdx.core.messages.SamplingParams` only.  Pipeline per row,
in vLLM's order:

1. logprobs (if asked) from the log-softmax of the *raw* logits;
2. repetition penalty (prompt + output tokens, HF/vLLM: positive logits are
   divided, negative ones multiplied), then frequency/presence penalties
   (output tokens, OpenAI: ``logit -= f * count + p * (count > 0)``);
3. ``logit_bias`` (OpenAI): the bias is added to the (penalised) logit;
4. ``min_tokens``: eos ids and ``stop_token_ids`` get ``-inf`` while fewer
   than ``min_tokens`` tokens were generated;
5. structured outputs: the rows whose request has a grammar
   (``request.grammar``) keep only the tokens their matcher allows -- the
   matchers fill one ``int32`` bitmask for those rows only, unpacked and
   applied in one vectorized step (a complete grammar allows only eos);
6. greedy rows (``temperature < 1e-5``): argmax;
7. random rows: temperature, min_p (relative to the top probability),
   top_k, top_p (on the renormalised survivors), then inverse-CDF sampling
   over the survivors in vocabulary order with ONE uniform draw per token.
   Where fdx's native ops load, step 7 runs in C++ (fdx/csrc/sampling.cc,
   ``fdx_sample_rows``: O(V) a row, the rows over the OpenMP team; the
   runner passes it as ``native``), and so do step 1's logprobs
   (``fdx_logprobs_rows``: one log-sum-exp pass and a running top-k).
   Otherwise NumPy finds the survivors among the row's top 1024 (then
   8192) logits when they fit there -- decided from the row alone -- else
   by a full sort.  All of them give the same distribution (tests check
   each against a reference).

Invariants:

* a row's token depends only on its logits, params, its own tokens and its
  own generator -- never on the other rows of the batch;
* a seeded request keeps a ``numpy.random.Generator(PCG64(seed))`` in
  ``request.sampler_state`` and consumes exactly one uniform per sampled
  token, so the same seed gives the same tokens alone or in any batch;
  unseeded requests draw from the sampler's process-level generator;
* the all-greedy batch without penalties, logprobs, logit_bias, grammars or
  active min_tokens is a single argmax (a request without a grammar or a
  bias costs two attribute reads per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from fdx.core.messages import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from fdx.core.request import Request


class NativeSampling(Protocol):
    """What :class:`Sampler` calls for its random rows when given a native
    kernel (:class:`fdx.model.native.SamplingKernel`): tokens ``int64[len(rows)]``,
    row ``j`` drawn from ``raw[rows[j]]`` with its inverse temperature,
    top_k (0: off), top_p, min_p and uniform draw ``u[j]`` in (0, 1]."""

    def __call__(self, raw: np.ndarray, rows: np.ndarray, inv_t: np.ndarray, top_k: np.ndarray,
                 top_p: np.ndarray, min_p: np.ndarray, u: np.ndarray) -> np.ndarray: ...

    def logprobs(self, raw: np.ndarray, rows: np.ndarray, tokens: np.ndarray,
                 k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows' chosen-token logprobs ``[n]`` and their ``k`` best ``([n, k]`` ids, logprobs)."""
        ...

    def argmax(self, raw: np.ndarray) -> np.ndarray:
        """Each row's greedy token ``int64[n]``, as ``raw.argmax(axis=1)``."""
        ...

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).
GREEDY_EPS = 1e-5
#: top_p / min_p rows look for their surviving set among this many top
#: tokens, then among the next window's; rows whose set is larger still are
#: sampled densely (full sort).
_TOPP_WINDOWS = (1024, 8192)
#: rows with top_k up to this sample inside a window of their top_k tokens.
_MAX_TOPK_WINDOW = 1024
#: rows from which the greedy argmax runs natively (two threads): a decode
#: step's fresh logits, 32 rows: 395 against NumPy's 766 us; 8 rows: even;
#: one row: NumPy's 21 us against 80 (tests/test_sampler.py checks both).
_NATIVE_ARGMAX_ROWS = 16
#: block width of the two-level inverse CDF.
_CDF_BLOCK = 256


class SamplerState:
    """Per-request sampler state stored in ``Request.sampler_state``.

    ``gen`` is the request's own generator (``None`` when unseeded).  For
    requests with penalties only: ``counts[v]`` is how often token ``v``
    occurs among the first ``n_counted`` output tokens, ``in_prompt[v]``
    whether it is in the prompt, and ``ids`` the distinct tokens of prompt
    and counted output (the only logits penalties touch).
    """

    __slots__ = ("gen", "counts", "in_prompt", "ids", "n_counted", "n_grammar")

    def __init__(self, seed: int | None) -> None:
        self.gen: np.random.Generator | None = (
            np.random.Generator(np.random.PCG64(seed)) if seed is not None else None
        )
        self.counts: np.ndarray | None = None
        self.in_prompt: np.ndarray | None = None
        self.ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self.n_counted = 0
        self.n_grammar = 0  # output tokens the request's grammar matcher has accepted

    def penalty_tokens(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, output counts of ids)``, updated incrementally: O(new
        output tokens) per call after the first."""
        n = len(output_token_ids)
        if self.counts is None or self.counts.shape[0] != width or n < self.n_counted:
            self.counts = np.zeros(width, dtype=np.int32)
            self.in_prompt = np.zeros(width, dtype=bool)
            ids = np.asarray(prompt_token_ids, dtype=np.int64)
            self.in_prompt[ids[(ids >= 0) & (ids < width)]] = True
            self.ids = np.flatnonzero(self.in_prompt)
            self.n_counted = 0
        assert self.in_prompt is not None
        if n > self.n_counted:
            new = np.asarray(output_token_ids[self.n_counted :], dtype=np.int64)
            new = new[(new >= 0) & (new < width)]
            uniq = np.unique(new)
            fresh = uniq[(self.counts[uniq] == 0) & ~self.in_prompt[uniq]]
            np.add.at(self.counts, new, 1)
            if len(fresh):
                self.ids = np.concatenate([self.ids, fresh])
            self.n_counted = n
        return self.ids, self.counts[self.ids]


def sampler_state(req: Request) -> SamplerState:
    """The request's :class:`SamplerState`, created on first use."""
    st = req.sampler_state
    if not isinstance(st, SamplerState):
        st = SamplerState(req.params.seed)
        req.sampler_state = st
    return st



def uniform_draws(requests: Sequence[Request], rng: np.random.Generator) -> np.ndarray:
    """One draw in (0, 1] per request, in order: from the request's own
    generator when seeded, else one batch from ``rng`` (the process-level
    generator).  Shared by the NumPy and the device sampler, so a seeded
    request draws the same sequence on either."""
    u = np.empty(len(requests), dtype=np.float64)
    unseeded: list[int] = []
    for j, r in enumerate(requests):
        gen = sampler_state(r).gen
        if gen is None:
            unseeded.append(j)
        else:
            u[j] = gen.random()
    if unseeded:
        u[unseeded] = rng.random(len(unseeded))
    return 1.0 - u

def has_penalty(p: SamplingParams) -> bool:
    """Whether ``p`` asks for any repetition, presence or frequency penalty."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def min_tokens_active(req: Request) -> bool:
    """Whether ``req`` still has to generate tokens before eos/stop ids may be sampled."""
    return req.params.min_tokens > 0 and len(req.output_token_ids) < req.params.min_tokens


def min_tokens_blocked_ids(req: Request) -> set[int]:
    """The ids a row under ``min_tokens`` may not sample: its stop token ids,
    and its eos ids unless ``ignore_eos``."""
    ids = set(req.params.stop_token_ids)
    if not req.params.ignore_eos:
        ids.update(req.eos_token_ids)
    return ids


def _is_paddle(x: Any) -> bool:
    return type(x).__module__.startswith("paddle")


def logits_to_numpy(logits: Any) -> np.ndarray:
    """``logits`` as a float32 NumPy array: a CPU Paddle tensor's own memory
    (DLPack, no copy: ``Tensor.numpy()`` copies into fresh pages, 2.7 ms for
    32 x 49,152 logits, nearly all of it page faults; the array keeps the
    tensor alive and the sampler never writes it), else a copy."""
    if isinstance(logits, np.ndarray):
        arr = logits
    else:
        if _is_paddle(logits) and "float32" not in str(logits.dtype):
            logits = logits.astype("float32")
        if _is_paddle(logits) and logits.place.is_cpu_place():
            arr = np.from_dlpack(logits)
        else:
            arr = logits.numpy()
    if arr.ndim != 2:
        raise ValueError(f"logits must be 2-D [n, vocab], got shape {arr.shape}")
    return np.asarray(arr, dtype=np.float32)


class Sampler:
    """Samples one token per row of a logits matrix (see module docstring)."""

    def __init__(self, vocab_size: int, max_logprobs: int = 20, seed: int | None = None,
                 native: NativeSampling | None = None) -> None:
        """``native``: the C++ kernel for the random rows
        (:func:`fdx.model.native.sampling_kernel`); ``None`` samples them
        with NumPy (the same distribution)."""
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self._rng = np.random.default_rng(seed)
        self._native = native

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

        fast = True
        for r in requests:
            p = r.params
            if not (
                p.temperature < GREEDY_EPS
                and p.logprobs is None
                and not has_penalty(p)
                and not min_tokens_active(r)
                and r.grammar is None
                and not p.logit_bias
            ):
                fast = False
                break
        arr = logits_to_numpy(logits)
        if width > self.vocab_size:  # padded vocabulary: the padding is never sampled
            arr = arr[:, : self.vocab_size]
        if fast:  # on the CPU tensor's buffer: np.argmax beats paddle.argmax ~10x (bench_sampler)
            return self._argmax(arr), None
        return self._sample_full(arr, requests)

    # ------------------------------------------------------------ internals

    def _argmax(self, x: np.ndarray) -> np.ndarray:
        """Each row's greedy token: the same tokens from NumPy or the native
        rows, which take over from ``_NATIVE_ARGMAX_ROWS`` rows."""
        if self._native is not None and len(x) >= _NATIVE_ARGMAX_ROWS:
            return self._native.argmax(x)
        return x.argmax(axis=1).astype(np.int64)

    def _sample_full(
        self, raw: np.ndarray, requests: Sequence[Request]
    ) -> tuple[np.ndarray, list[TokenLogprob | None] | None]:
        n, width = raw.shape
        params = [r.params for r in requests]

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        pen_rows = [i for i, p in enumerate(params) if has_penalty(p)]
        mt_rows = [i for i, r in enumerate(requests) if min_tokens_active(r)]
        lb_rows = [i for i, p in enumerate(params) if p.logit_bias]
        gr_rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        temps = np.array([p.temperature for p in params], dtype=np.float32)
        greedy = temps < GREEDY_EPS

        x = _Patched(raw)
        if pen_rows:
            x.add(*self._penalty_patch(raw, requests, pen_rows))
        if lb_rows:
            x.add(*_bias_patch(x, requests, lb_rows))
        if mt_rows:
            x.add(*self._stop_token_patch(raw, requests, mt_rows))
        if gr_rows:
            x.mask(np.array(gr_rows, dtype=np.int64), grammar_masks([requests[i] for i in gr_rows], width))

        tokens = np.empty(n, dtype=np.int64)
        if greedy.any():
            g = np.flatnonzero(greedy)
            touched = x.touched()
            if touched.any():  # only rows with a patch or a mask are copied; the others argmax in place
                gt = g[touched[g]]
                tokens[gt] = x.take(gt).argmax(axis=1)
                g = g[~touched[g]]
            if len(g):
                tokens[g] = self._argmax(raw)[g] if 2 * len(g) >= n else self._argmax(raw[g])
        if not greedy.all():
            rnd = np.flatnonzero(~greedy)
            tokens[rnd] = self._sample_random(x, rnd, temps[rnd], requests)

        logprobs = self._logprobs(raw, tokens, params, lp_rows) if lp_rows else None
        return tokens, logprobs

    @staticmethod
    def _penalty_patch(
        x: np.ndarray, requests: Sequence[Request], rows: list[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Penalised values of the prompt/output tokens of each row, as a
        sparse patch ``(rows, cols, values)``."""
        width = x.shape[1]
        r_idx: list[np.ndarray] = []
        t_idx: list[np.ndarray] = []
        cnt: list[np.ndarray] = []
        rep: list[float] = []
        freq: list[float] = []
        pres: list[float] = []
        lens: list[int] = []
        for i in rows:
            r = requests[i]
            p = r.params
            ids, counts = sampler_state(r).penalty_tokens(r.prompt_token_ids, r.output_token_ids, width)
            t_idx.append(ids)
            cnt.append(counts)
            lens.append(len(ids))
            r_idx.append(np.full(len(ids), i, dtype=np.int64))
            rep.append(p.repetition_penalty)
            freq.append(p.frequency_penalty)
            pres.append(p.presence_penalty)
        if not sum(lens):
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        ri = np.concatenate(r_idx)
        ti = np.concatenate(t_idx)
        c = np.concatenate(cnt).astype(np.float32)
        vals = x[ri, ti]
        if any(v != 1.0 for v in rep):
            rp = np.repeat(np.array(rep, dtype=np.float32), lens)
            vals = np.where(vals > 0, vals / rp, vals * rp)
        if any(freq) or any(pres):
            f = np.repeat(np.array(freq, dtype=np.float32), lens)
            pr = np.repeat(np.array(pres, dtype=np.float32), lens)
            vals = vals - (f * c + pr * (c > 0))
        return ri, ti, vals.astype(np.float32)

    @staticmethod
    def _stop_token_patch(
        x: np.ndarray, requests: Sequence[Request], rows: list[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``-inf`` for the eos / stop token ids of rows under min_tokens."""
        width = x.shape[1]
        ri: list[int] = []
        ci: list[int] = []
        for i in rows:
            for t in min_tokens_blocked_ids(requests[i]):
                if 0 <= t < width:
                    ri.append(i)
                    ci.append(t)
        return np.array(ri, np.int64), np.array(ci, np.int64), np.full(len(ri), -np.inf, np.float32)

    def _uniforms(self, rows: np.ndarray, requests: Sequence[Request]) -> np.ndarray:
        """One draw in (0, 1] per row (see :func:`uniform_draws`)."""
        return uniform_draws([requests[i] for i in rows], self._rng)

    def _sample_random(
        self, x: _Patched, rows: np.ndarray, temps: np.ndarray, requests: Sequence[Request]
    ) -> np.ndarray:
        """Sample the non-greedy rows.  Rows with filters first try a window
        of their top candidates (exact whenever the surviving set fits in
        it; the decision depends on the row alone); the rest go dense."""
        width = x.raw.shape[1]
        params = [requests[i].params for i in rows]
        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        top_k[(top_k <= 0) | (top_k >= width)] = 0
        top_p = np.array([p.top_p for p in params], dtype=np.float64)
        min_p = np.array([p.min_p for p in params], dtype=np.float32)
        inv_t = (1.0 / temps).astype(np.float32)
        u = self._uniforms(rows, requests)

        if self._native is not None:
            return self._sample_native(x, rows, top_k, top_p, min_p, inv_t, u)
        tok = np.full(len(rows), -1, dtype=np.int64)
        filt = (top_k > 0) | (top_p < 1.0) | (min_p > 0)
        win = np.flatnonzero(filt & (top_k <= _MAX_TOPK_WINDOW))
        for window in _TOPP_WINDOWS:  # rows that do not fit retry in the next, wider window
            if not len(win):
                break
            tok[win] = _sample_windowed(
                x.take(rows[win]), top_k[win], top_p[win], min_p[win], inv_t[win], u[win], window
            )
            win = win[tok[win] < 0]
        plain = np.flatnonzero(~filt)
        if len(plain):
            tok[plain] = _inverse_cdf(_scaled_exp(x.take(rows[plain]), inv_t[plain]), u[plain])
        dense = np.flatnonzero(filt & (tok < 0))
        if len(dense):
            tok[dense] = _sample_dense(
                x.take(rows[dense]), top_k[dense], top_p[dense], min_p[dense], inv_t[dense], u[dense]
            )
        return tok

    def _sample_native(self, x: _Patched, rows: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                       min_p: np.ndarray, inv_t: np.ndarray, u: np.ndarray) -> np.ndarray:
        """The random rows in C++ (fdx/csrc/sampling.cc): rows no patch or
        mask touches straight from the raw logits, the others from their
        patched copies."""
        assert self._native is not None
        tok = np.empty(len(rows), dtype=np.int64)
        touched = x.touched()[rows]
        for sel, patched in ((np.flatnonzero(~touched), False), (np.flatnonzero(touched), True)):
            if len(sel):
                src = x.take(rows[sel]) if patched else x.raw
                idx = np.arange(len(sel)) if patched else rows[sel]
                tok[sel] = self._native(src, idx, inv_t[sel], top_k[sel], top_p[sel], min_p[sel], u[sel])
        return tok

    def _logprobs(
        self, raw: np.ndarray, tokens: np.ndarray, params: list[SamplingParams], rows: list[int]
    ) -> list[TokenLogprob | None]:
        ks = [min(max(params[i].logprobs or 0, 0), self.max_logprobs) for i in rows]
        kmax = min(max(ks), raw.shape[1])
        if self._native is not None:  # C++ (fdx/csrc/sampling.cc): one pass per row, rows in parallel
            chosen, top_ids, top_vals = self._native.logprobs(raw, np.asarray(rows, dtype=np.int64),
                                                              tokens[rows], kmax)
            return self._logprob_outputs(tokens, params, rows, ks, chosen, top_ids if kmax else None, top_vals)
        xl = raw[rows]  # a private copy: reused in place for the log-sum-exp below
        ar = np.arange(len(rows))
        chosen = xl[ar, tokens[rows]].astype(np.float64)
        top_ids = top_vals = None
        if kmax > 0:
            width = xl.shape[1]
            kmax = min(kmax, width)
            thr = np.partition(xl, width - kmax, axis=1)[:, width - kmax]
            part = np.empty((len(rows), kmax), dtype=np.int64)
            for j in range(len(rows)):  # partition + flatnonzero beats argpartition ~1.5x
                hit = np.flatnonzero(xl[j] >= thr[j])
                if len(hit) != kmax:  # ties at the edge
                    hit = np.argpartition(xl[j], width - kmax)[width - kmax :]
                part[j] = hit
            vals = np.take_along_axis(xl, part, axis=1)
            order = np.argsort(-vals, axis=1, kind="stable")
            top_ids = np.take_along_axis(part, order, axis=1)
            top_vals = np.take_along_axis(vals, order, axis=1).astype(np.float64)
        m = xl.max(axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0).astype(np.float32)
        xl -= m
        lse = m[:, 0] + np.log(np.exp(xl, out=xl).sum(axis=1, dtype=np.float64))
        chosen -= lse
        if top_vals is not None:
            top_vals -= lse[:, None]
        return self._logprob_outputs(tokens, params, rows, ks, chosen, top_ids, top_vals)

    @staticmethod
    def _logprob_outputs(tokens: np.ndarray, params: list[SamplingParams], rows: list[int], ks: list[int],
                         chosen: np.ndarray, top_ids: np.ndarray | None,
                         top_vals: np.ndarray | None) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(params)
        for j, i in enumerate(rows):
            top: tuple[tuple[int, float], ...] = ()
            if ks[j] and top_ids is not None and top_vals is not None:
                top = tuple(zip(top_ids[j, : ks[j]].tolist(), top_vals[j, : ks[j]].tolist()))
            out[i] = TokenLogprob(int(tokens[i]), float(chosen[j]), top)
        return out


class _Patched:
    """Raw logits plus sparse overrides (penalties, logit_bias, min_tokens
    masks), applied in order, then dense row masks (grammars), to the
    private copies that :meth:`take` hands out -- the raw array is never
    written."""

    def __init__(self, raw: np.ndarray) -> None:
        self.raw = raw
        self.patches: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.masks: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, allowed bool [len(rows), V])

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
        if len(rows):
            self.patches.append((rows, cols, vals))

    def touched(self) -> np.ndarray:
        """``bool[n]``: which rows a patch or a mask changes."""
        out = np.zeros(self.raw.shape[0], dtype=bool)
        for p in self.patches:
            out[p[0]] = True
        for r, _ in self.masks:
            out[r] = True
        return out

    def mask(self, rows: np.ndarray, allowed: np.ndarray) -> None:
        """Rows ``rows`` keep only the tokens where ``allowed`` is true (-inf elsewhere)."""
        self.masks.append((rows, allowed))

    def values(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """The patched values at ``(rows, cols)`` (a copy)."""
        width = self.raw.shape[1]
        v = self.raw[rows, cols].copy()
        key = rows * width + cols
        for r, c, pv in self.patches:
            pk = r * width + c
            order = np.argsort(pk, kind="stable")
            sk = pk[order]
            pos = np.minimum(np.searchsorted(sk, key), len(sk) - 1)
            hit = sk[pos] == key
            v[hit] = pv[order[pos[hit]]]
        return v

    def take(self, rows: np.ndarray) -> np.ndarray:
        sub = self.raw[rows]
        if self.patches or self.masks:
            local = np.full(self.raw.shape[0], -1, dtype=np.int64)
            local[rows] = np.arange(len(rows))
            for r, c, v in self.patches:
                lr = local[r]
                sel = lr >= 0
                sub[lr[sel], c[sel]] = v[sel]
            for r, allowed in self.masks:
                lr = local[r]
                sel = lr >= 0
                if sel.any():  # np.where: a boolean-index assignment over most of the row is ~10x slower
                    sub[lr[sel]] = np.where(allowed[sel], sub[lr[sel]], np.float32(-np.inf))
        return sub


def _bias_patch(x: _Patched, requests: Sequence[Request], rows: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``logit_bias`` added to the rows' (already penalised) logits, as a sparse patch."""
    width = x.raw.shape[1]
    ri: list[int] = []
    ci: list[int] = []
    bias: list[float] = []
    for i in rows:
        for t, b in requests[i].params.logit_bias:
            if 0 <= t < width:
                ri.append(i)
                ci.append(t)
                bias.append(b)
    r, c = np.array(ri, np.int64), np.array(ci, np.int64)
    return r, c, (x.values(r, c) + np.array(bias, np.float32)).astype(np.float32)


def grammar_masks(requests: Sequence[Request], width: int) -> np.ndarray:
    """``allowed[k, t]``: request ``k``'s grammar lets token ``t`` come next.
    Each matcher first accepts the output tokens it has not seen (those the
    scheduler appended since), then fills its row of one ``int32`` bitmask;
    the bitmask is unpacked for all rows at once."""
    words = -(-width // 32)
    bitmask = np.zeros((len(requests), words), dtype=np.int32)
    for k, r in enumerate(requests):
        g = r.grammar
        assert g is not None
        st, out = sampler_state(r), r.output_token_ids
        if st.n_grammar < len(out):
            g.accept(out[st.n_grammar :])
            st.n_grammar = len(out)
        g.fill_bitmask(bitmask, k)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=width, bitorder="little")
    return bits.view(bool)


def _scaled_exp(z: np.ndarray, inv_t: np.ndarray) -> np.ndarray:
    """``exp((z - max) / T)`` row-wise, in place on ``z`` (a private copy)."""
    m = z.max(axis=1, keepdims=True)
    z -= np.where(np.isfinite(m), m, 0.0)  # an all -inf row gives zeros, not NaN
    z *= inv_t[:, None]
    return np.exp(z, out=z)


def _inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Index ``i`` per row with ``cdf[i-1] < u * total <= cdf[i]`` over
    unnormalised ``probs`` in index order; ``u`` in [0, 1] (0 gives the first
    positive-probability index).  Two levels
    (block sums, then one block's cumsum) so only cheap reductions run over
    the whole vocabulary.  Never returns a zero-probability index when the
    row has mass."""
    n, width = probs.shape
    nb = -(-width // _CDF_BLOCK)
    if nb * _CDF_BLOCK != width:
        padded = np.zeros((n, nb * _CDF_BLOCK), dtype=probs.dtype)
        padded[:, :width] = probs
        probs = padded
    blocks = probs.reshape(n, nb, _CDF_BLOCK)
    bcum = np.cumsum(blocks.sum(axis=2, dtype=np.float64), axis=1)
    target = np.maximum(u, 1e-12) * bcum[:, -1]  # > 0: never stops on leading zeros
    ar = np.arange(n)
    blk = np.minimum(np.count_nonzero(bcum < target[:, None], axis=1), nb - 1)
    base = np.where(blk > 0, bcum[ar, blk - 1], 0.0)
    inner = blocks[ar, blk]
    lcum = base[:, None] + np.cumsum(inner, axis=1, dtype=np.float64)
    pos = np.minimum(np.count_nonzero(lcum < target[:, None], axis=1), _CDF_BLOCK - 1)
    for j in np.flatnonzero(inner[ar, pos] <= 0):  # rounding between the two levels
        nz = np.flatnonzero(inner[j] > 0)
        if len(nz):
            pos[j] = nz[np.minimum(np.searchsorted(nz, pos[j]), len(nz) - 1)]
    return np.minimum(blk * _CDF_BLOCK + pos, width - 1)


def _sample_windowed(
    z: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    inv_t: np.ndarray,
    u: np.ndarray,
    window: int,
) -> np.ndarray:
    """Sample rows among their top ``c_row`` logits (``top_k`` if set, else
    ``window``).  Returns -1 for rows whose surviving set may
    extend beyond their window (the caller samples them densely).  ``z`` is
    a private copy of the raw logits rows."""
    n, width = z.shape
    c_row = np.where(top_k > 0, top_k, min(window, width))
    c = int(c_row.max())
    ar = np.arange(n)
    m = z.max(axis=1)
    m = np.where(np.isfinite(m), m, 0.0)
    thr = np.partition(z, width - c, axis=1)[:, width - c]
    idx = np.empty((n, c), dtype=np.int64)
    for j in range(n):
        hit = np.flatnonzero(z[j] >= thr[j])
        if len(hit) != c:  # ties at the window edge
            hit = np.sort(np.argpartition(z[j], width - c)[width - c :])
        idx[j] = hit
    vz = np.take_along_axis(z, idx, axis=1)
    ev = np.exp((vz - m[:, None]) * inv_t[:, None])  # window probabilities, index order
    vals = -np.sort(-ev, axis=1)  # the same, descending
    in_row = np.arange(c)[None, :] < c_row[:, None]
    vals *= in_row  # positions beyond a row's own window do not exist for it
    cum = np.cumsum(vals, axis=1, dtype=np.float64)

    has_k = top_k > 0
    keep = c_row.copy()
    has_mp = min_p > 0
    n_mp = np.count_nonzero((vals >= min_p[:, None]) & in_row, axis=1)
    keep = np.where(has_mp, np.minimum(keep, np.maximum(n_mp, 1)), keep)
    bounded = has_k | (has_mp & (n_mp < c_row)) | (c_row >= width)
    total = cum[ar, keep - 1]
    loose = np.flatnonzero(~bounded & ~has_mp)  # top_p alone: needs the full mass
    if len(loose):
        total[loose] = _scaled_exp(z[loose], inv_t[loose]).sum(axis=1, dtype=np.float64)
    has_p = top_p < 1.0
    limit = top_p[:, None] * total[:, None]
    n_p = np.maximum(np.count_nonzero((cum - vals < limit) & in_row, axis=1), 1)
    fits = bounded | (cum[ar, keep - 1] >= top_p * total)
    keep = np.where(has_p, np.minimum(keep, n_p), keep)
    # survivors: window tokens at least as likely as the last kept one; sample
    # them in vocabulary order, like the dense path
    thr = vals[ar, keep - 1]
    ev *= ev >= thr[:, None]
    cum_i = np.cumsum(ev, axis=1, dtype=np.float64)
    target = u * cum_i[:, -1]
    pos = np.minimum(np.count_nonzero(cum_i < target[:, None], axis=1), c - 1)
    tok = idx[ar, pos]
    tok[(~bounded & has_mp) | (has_p & ~fits)] = -1
    return tok


def _sample_dense(
    z: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray, inv_t: np.ndarray, u: np.ndarray
) -> np.ndarray:
    """Filter over the whole vocabulary, then sample (the rare slow path)."""
    n, width = z.shape
    probs = _scaled_exp(z, inv_t)  # top probability == 1
    if (min_p > 0).any():
        probs *= probs >= min_p[:, None]
    act = np.flatnonzero(top_k > 0)
    if len(act):
        kk = top_k[act]
        kmax = int(kk.max())
        sub = probs[act]
        top = np.partition(sub, width - kmax, axis=1)[:, width - kmax :]
        top.sort(axis=1)  # ascending: the k-th largest is at kmax - k
        thr = top[np.arange(len(act)), kmax - kk]
        sub *= sub >= thr[:, None]
        probs[act] = sub
    act = np.flatnonzero(top_p < 1.0)
    if len(act):
        probs[act] = _top_p_filter(probs[act], top_p[act])
    return _inverse_cdf(probs, u)


def _top_p_filter(probs: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Zero (in place) the tokens outside each row's nucleus: keep the
    smallest set of highest-probability tokens whose mass reaches ``top_p``
    (at least one; ties with the last kept token are kept).  Full sort: only
    rows whose nucleus exceeds every window of :data:`_TOPP_WINDOWS` get
    here.  In ascending order the nucleus starts at the first index whose
    cumulative mass exceeds ``(1 - top_p) * total``."""
    asc = np.sort(probs, axis=1)
    start = _inverse_cdf(asc, np.clip(1.0 - top_p, 0.0, 1.0))
    thr = asc[np.arange(len(probs)), start]
    probs *= probs >= thr[:, None]
    return probs
