"""Batched sampling on the device, over paddle logits (the GPU runner's sampler).

Same parameters and order as :mod:`fdx.model.sampler` (the NumPy sampler of
the CPU runner), computed with Paddle ops where the logits live:

1. logprobs (if asked) from the log-softmax of the raw logits;
2. repetition / frequency / presence penalties, ``logit_bias`` and
   ``min_tokens`` masks, as a sparse patch scattered into a copy of the
   logits (the token ids and counts come from the request's incremental
   :class:`~fdx.model.sampler.SamplerState`, on the host); then the grammar
   rows' token masks (:func:`~fdx.model.sampler.grammar_masks`, filled on
   the host for those rows only);
3. greedy rows: ``argmax``;
4. random rows: temperature, min_p, top_k, then top_p on the renormalised
   survivors, over the row sorted by probability; then inverse-CDF sampling
   with ONE uniform per token (from the request's own seeded generator, or
   the sampler's), so a seeded request gives the same tokens alone or in
   any batch.  The distribution equals the NumPy sampler's; the token drawn
   for a given uniform may differ (sorted order vs vocabulary order).

Only the sampled ids (``int64[n]``), and the chosen/top-k logprobs of rows
that asked for them, are copied to the host -- never the logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from fdx.core.messages import TokenLogprob
from fdx.model.sampler import (
    GREEDY_EPS,
    grammar_masks,
    has_penalty,
    min_tokens_active,
    min_tokens_blocked_ids,
    sampler_state,
    uniform_draws,
)

if TYPE_CHECKING:
    from fdx.core.request import Request


class DeviceSampler:
    """Samples one token per row of a float32 paddle logits matrix."""

    def __init__(self, vocab_size: int, max_logprobs: int = 20, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self._rng = np.random.default_rng(seed)

    def sample(self, logits: Any, requests: Sequence[Request]) -> tuple[np.ndarray, list[TokenLogprob | None] | None]:
        """Token ids ``int64[n]`` and per-row logprobs (``None`` when no row
        asked).  ``logits`` is ``[n, V]`` with ``V >= vocab_size`` (padding
        columns are never sampled)."""
        import paddle

        n = len(requests)
        if n == 0:
            return np.zeros(0, dtype=np.int64), None
        if int(logits.shape[0]) != n:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {n} requests")
        if int(logits.shape[1]) > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        params = [r.params for r in requests]
        greedy = np.array([p.temperature < GREEDY_EPS for p in params])
        pen = [i for i, r in enumerate(requests) if has_penalty(r.params)]
        mt = [i for i, r in enumerate(requests) if min_tokens_active(r)]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        lb = [i for i, p in enumerate(params) if p.logit_bias]
        gr = [i for i, r in enumerate(requests) if r.grammar is not None]
        if greedy.all() and not pen and not mt and not lp_rows and not lb and not gr:
            return paddle.argmax(logits, axis=-1).numpy().astype(np.int64), None

        x = logits
        if pen or mt or lb:
            x = self._patched(logits, requests, pen, mt, lb)
        if gr:
            gi = paddle.to_tensor(np.array(gr, dtype=np.int64))
            allowed = paddle.to_tensor(grammar_masks([requests[i] for i in gr], int(x.shape[1])))
            sub = paddle.index_select(x, gi)
            sub = paddle.where(allowed, sub, paddle.full_like(sub, -np.inf))
            x = paddle.scatter(x, gi, sub, overwrite=True)
        tokens = paddle.zeros([n], dtype="int64")
        if greedy.any():
            g = np.flatnonzero(greedy)
            if len(g) == n:
                tokens = paddle.argmax(x, axis=-1).astype("int64")
            else:
                gi = paddle.to_tensor(g.astype(np.int64))
                tokens = paddle.scatter(tokens, gi, paddle.argmax(paddle.index_select(x, gi), axis=-1).astype("int64"))
        if not greedy.all():
            rnd = np.flatnonzero(~greedy)
            ri = paddle.to_tensor(rnd.astype(np.int64))
            picked = self._sample_random(paddle.index_select(x, ri), [requests[i] for i in rnd])
            tokens = paddle.scatter(tokens, ri, picked)
        logprobs = self._logprobs(logits, tokens, params, lp_rows) if lp_rows else None
        return tokens.numpy().astype(np.int64), logprobs

    # ------------------------------------------------------------ internals

    def _patched(self, logits: Any, requests: Sequence[Request], pen: list[int], mt: list[int],
                 lb: Sequence[int] = ()) -> Any:
        """A copy of ``logits`` with penalties, logit_bias and min_tokens masks applied."""
        import paddle

        n, width = int(logits.shape[0]), int(logits.shape[1])
        flat = logits.reshape([-1]).clone()
        if pen:
            idx, cnt, rep, fr, pr = [], [], [], [], []
            for i in pen:
                r = requests[i]
                ids, counts = sampler_state(r).penalty_tokens(r.prompt_token_ids, r.output_token_ids, width)
                idx.append(i * width + ids)
                cnt.append(counts)
                k = len(ids)
                rep.append(np.full(k, r.params.repetition_penalty, np.float32))
                fr.append(np.full(k, r.params.frequency_penalty, np.float32))
                pr.append(np.full(k, r.params.presence_penalty, np.float32))
            fi = np.concatenate(idx).astype(np.int64)
            if len(fi):
                t = paddle.to_tensor
                ti = t(fi)
                vals = paddle.gather(flat, ti)
                rp = t(np.concatenate(rep))
                vals = paddle.where(vals > 0, vals / rp, vals * rp)
                c = t(np.concatenate(cnt).astype(np.float32))
                vals = vals - (t(np.concatenate(fr)) * c + t(np.concatenate(pr)) * (c > 0).astype("float32"))
                flat = paddle.scatter(flat, ti, vals, overwrite=True)
        bias = [(i * width + t, b) for i in lb for t, b in requests[i].params.logit_bias if 0 <= t < width]
        if bias:
            ti = paddle.to_tensor(np.array([k for k, _ in bias], dtype=np.int64))
            add = paddle.to_tensor(np.array([b for _, b in bias], dtype=np.float32))
            flat = paddle.scatter(flat, ti, paddle.gather(flat, ti) + add, overwrite=True)
        if mt:
            cols: list[int] = []
            for i in mt:
                cols.extend(i * width + t for t in min_tokens_blocked_ids(requests[i]) if 0 <= t < width)
            if cols:
                ti = paddle.to_tensor(np.array(cols, dtype=np.int64))
                flat = paddle.scatter(flat, ti, paddle.full([len(cols)], -np.inf, dtype="float32"), overwrite=True)
        return flat.reshape([n, width])

    def _uniforms(self, requests: Sequence[Request]) -> np.ndarray:
        return uniform_draws(requests, self._rng)  # in (0, 1]

    def _sample_random(self, x: Any, requests: Sequence[Request]) -> Any:
        import paddle
        import paddle.nn.functional as F

        width = int(x.shape[1])
        ps = [r.params for r in requests]
        t = paddle.to_tensor
        inv_t = t(np.array([1.0 / p.temperature for p in ps], dtype=np.float32))
        probs = F.softmax(x * inv_t.unsqueeze(1), axis=-1)
        order = paddle.argsort(probs, axis=-1, descending=True)  # a full sort of each row
        sp = paddle.take_along_axis(probs, order, axis=1)
        keep = paddle.ones_like(sp)
        top_k = np.array([p.top_k if 0 < p.top_k < width else width for p in ps], dtype=np.int64)
        if (top_k < width).any():
            keep = keep * (paddle.arange(width, dtype="int64").unsqueeze(0) < t(top_k).unsqueeze(1)).astype("float32")
        min_p = np.array([p.min_p for p in ps], dtype=np.float32)
        if (min_p > 0).any():
            keep = keep * (sp >= sp[:, :1] * t(min_p).unsqueeze(1)).astype("float32")
        p1 = sp * keep
        top_p = np.array([p.top_p for p in ps], dtype=np.float32)
        if (top_p < 1.0).any():
            total = p1.sum(axis=-1, keepdim=True)
            cum = paddle.cumsum(p1, axis=-1)
            keep_p = ((cum - p1) < t(top_p).unsqueeze(1) * total).astype("float32")
            p1 = p1 * keep_p
        cdf = paddle.cumsum(p1, axis=-1)
        target = t(self._uniforms(requests).astype(np.float32)) * cdf[:, -1]
        pos = (cdf < target.unsqueeze(1)).astype("int64").sum(axis=-1)
        # never past the last token with mass (rounding at the top of the cdf)
        last = (p1 > 0).astype("int64").sum(axis=-1) - 1
        pos = paddle.minimum(pos, paddle.maximum(last, paddle.zeros_like(last)))
        return paddle.take_along_axis(order, pos.unsqueeze(1), axis=1).squeeze(1).astype("int64")

    def _logprobs(self, logits: Any, tokens: Any, params: list[Any], rows: list[int]) -> list[TokenLogprob | None]:
        import paddle
        import paddle.nn.functional as F

        ri = paddle.to_tensor(np.array(rows, dtype=np.int64))
        lp = F.log_softmax(paddle.index_select(logits, ri), axis=-1)
        chosen_ids = paddle.index_select(tokens, ri)
        chosen = paddle.take_along_axis(lp, chosen_ids.unsqueeze(1), axis=1).squeeze(1).numpy()
        ks = [min(max(params[i].logprobs or 0, 0), self.max_logprobs) for i in rows]
        kmax = min(max(ks), int(lp.shape[1]))
        top_v = top_i = None
        if kmax > 0:
            v, i = paddle.topk(lp, kmax, axis=-1)
            top_v, top_i = v.numpy(), i.numpy()
        ids = chosen_ids.numpy()
        out: list[TokenLogprob | None] = [None] * len(params)
        for j, i in enumerate(rows):
            top: tuple[tuple[int, float], ...] = ()
            if ks[j] and top_i is not None and top_v is not None:
                top = tuple(zip(top_i[j, : ks[j]].tolist(), top_v[j, : ks[j]].astype(float).tolist()))
            out[i] = TokenLogprob(int(ids[j]), float(chosen[j]), top)
        return out
