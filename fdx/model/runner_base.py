"""What the ``cpu`` and ``gpu`` model runners share: :class:`PagedRunnerBase`
(checkpoint and tokenizer facts, KV pool sizing, the step's flattened
layout and the sampling of its last rows, the KV fingerprint, KV block I/O
as bytes, sleep/wakeup and weight swaps) and :class:`StepLayout`.

A subclass loads its model, sets ``dtype``, ``model``, ``sampler`` and
``caches``, and supplies the device-specific pieces: :meth:`_forward` (one
step's forward over a :class:`StepLayout`), :meth:`_allocate` (a fresh KV
pool), :meth:`_kv_views` and :meth:`_block_rows` (how block ids map to rows
of the per-layer 2-D cache views that block I/O reads and writes).
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from fdx.core.errors import FdxError, ModelLoadError
from fdx.core.interfaces import KVCacheSpec, ModelOutput, ModelRunner, ScheduledBatch
from fdx.core.messages import ALL_LOGPROBS, TokenLogprob
from fdx.model.arch import long_rope_after
from fdx.model.packed_weights import bf16_bits_to_f32

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.interfaces import Device, ScheduledSeq
    from fdx.model.loader import Checkpoint

log = logging.getLogger("fdx.model")

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def take_rows(logits: Any, sel: np.ndarray) -> Any:
    """Rows ``sel`` of a step's logits (a NumPy array or a Paddle tensor, kept where it is)."""
    if isinstance(logits, np.ndarray):
        return logits[sel]
    import paddle

    return paddle.index_select(logits, paddle.to_tensor(sel, place=logits.place))



def _prompt_k(asked: int | None, vocab: int, max_logprobs: int) -> int:
    """How many top alternatives a prompt position of a request gets: the
    whole vocabulary for :data:`ALL_LOGPROBS`, else at most ``--max-logprobs``."""
    if asked == ALL_LOGPROBS:
        return vocab
    return min(asked or 0, max_logprobs, vocab)


class StepLayout:
    """A step's sequences flattened to rows (host arrays, built once per step).

    ``ids[T]`` the new tokens of all sequences back to back; per sequence
    ``q_lens``, ``starts`` (tokens already computed), ``q_starts`` (first
    row), ``samples`` (whether its last row is sampled) and ``tables``
    (``[S, max blocks]`` block ids, zero-padded); per row ``seq_of`` and
    ``positions``; ``rows`` the rows whose logits the forward computes: the
    sampled rows, then (``prompt``: ``(seq, first position, count)`` per
    sequence asking for prompt logprobs) those rows' prompt rows.
    ``num_drafts`` (``None`` when no seq has drafts): speculative draft
    tokens per sequence; a sampling sequence with K > 0 drafts has its last
    K + 1 rows in ``rows``.
    ``long_rope`` (``None`` unless a LongRoPE model can see sequences past
    ``original_max_position_embeddings``): per row, whether its sequence
    takes the long factors this step (see :meth:`PagedRunnerBase._layout`).
    """

    __slots__ = ("ids", "q_lens", "starts", "samples", "tables", "q_starts", "seq_of", "positions", "rows",
                 "prompt", "pick", "num_drafts", "long_rope")

    def __init__(self, ids: list[int], q_lens: np.ndarray, starts: np.ndarray, samples: np.ndarray,
                 tables: np.ndarray, q_starts: np.ndarray, seq_of: np.ndarray, positions: np.ndarray,
                 rows: np.ndarray, prompt: list[tuple[int, int, int]] | None = None) -> None:
        self.prompt = prompt
        self.num_drafts: np.ndarray | None = None
        self.long_rope: np.ndarray | None = None
        #: with ``prompt``: which of the (sorted) ``rows`` are the sampled ones, which the prompt ones
        self.pick: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self.ids = ids
        self.q_lens = q_lens
        self.starts = starts
        self.samples = samples
        self.tables = tables
        self.q_starts = q_starts
        self.seq_of = seq_of
        self.positions = positions
        self.rows = rows


class PagedRunnerBase(ModelRunner):
    """See the module docstring."""

    #: dtype of :attr:`StepLayout.tables` (what the subclass's kernels read)
    table_dtype: Any = np.int64
    #: the model attends within a config's ``sliding_window`` (else a window
    #: shorter than ``--max-model-len`` is refused)
    honours_sliding_window = False
    #: tensor-parallel ranks of this runner's group (1: none)
    tensor_parallel_size = 1
    #: the model takes per-row rope factors (:attr:`StepLayout.long_rope`), so a
    #: LongRoPE model serves sequences past ``original_max_position_embeddings``
    #: (else a longer ``--max-model-len`` is refused)
    honours_long_rope = False

    @property
    def kv_cache_dtype(self) -> str:  # type: ignore[override]
        """The KV pool's dtype: :attr:`dtype` (the subclass chose it from ``--kv-cache-dtype``)."""
        return str(self.dtype)

    config: EngineConfig
    device: Device
    dtype: str
    model: Any
    sampler: Any
    caches: list[Any] | None

    #: the geometry of this process's KV pool and model: the checkpoint's
    #: (set with :attr:`args`), or a tensor-parallel rank's shard of it
    kv_args: Any

    def expert_tokens(self) -> tuple[tuple[int, str, int], ...]:
        """A mixture of experts' load for ``/metrics``: ``(expert, rank, pairs)``
        per expert, the (token, slot) pairs routed to it summed over the
        layers; ``rank``: the rank that holds it under expert parallelism,
        ``all`` when every rank holds a slice of it (tensor parallel)."""
        blocks = [layer.moe for layer in self.model.layers if layer.moe is not None]
        if not blocks:
            return ()
        total = sum(b.routed for b in blocks)
        ep, N = self.config.enable_expert_parallel, self.tensor_parallel_size
        per = len(total) // N
        return tuple((e, str(e // per) if ep or N == 1 else "all", int(n)) for e, n in enumerate(total))

    # ------------------------------------------------------------------ start-up

    def _open_checkpoint(self, config: EngineConfig) -> Checkpoint:
        """Load ``--model``'s checkpoint and tokenizer facts; the caller
        loads the weights from the returned checkpoint into its model."""
        from fdx.model.loader import load_checkpoint, load_tokenizer

        ckpt = load_checkpoint(config.model)
        self.source = ckpt.source
        self.args = self.kv_args = ckpt.args
        tok = load_tokenizer(config.model)
        self.eos_token_ids = frozenset(tok.eos_token_ids)
        self.vocab_size = self.args.vocab_size
        self.block_size = config.block_size
        self.max_model_len = int(config.max_model_len or self.args.max_position)
        window = self.args.sliding_window
        if window is not None and self.max_model_len > window and not self.honours_sliding_window:
            raise ModelLoadError(
                f"{ckpt.source.path}: unsupported config field 'sliding_window' = {window}: sliding-window "
                f"attention is not implemented; serve with --max-model-len <= {window} (now {self.max_model_len})")
        #: LongRoPE: the length past which a sequence takes the long factors (None: never, within max_model_len)
        self.long_rope_after = orig = long_rope_after(self.args, self.max_model_len)
        if orig is not None:
            why = ("the long factors past it are not implemented by this runner" if not self.honours_long_rope else
                   # a cached block would serve sequences of either factor set (transformers recomputes instead)
                   "past it a sequence's KV takes the long factors, which the prefix cache cannot tell apart; "
                   "add --no-enable-prefix-caching or" if config.enable_prefix_caching else
                   "speculative drafts crossing it would be verified with one factor set; drop --speculative or"
                   if config.speculative else None)
            if why is not None:
                raise ModelLoadError(
                    f"{ckpt.source.path}: unsupported config field 'original_max_position_embeddings' = {orig}: "
                    f"rope type {self.args.rope_scaling.rope_type!r}: {why}"
                    f"{'' if why.endswith(' or') else ';'} serve with --max-model-len <= {orig} (now {self.max_model_len})")
        self.weights_version = ""
        self._weights_path = config.model
        return ckpt

    def _available_memory(self) -> int:
        return self.device.memory_info()[1]

    def _size_kv_pool(self) -> None:
        """``bytes_per_block``, ``num_kv_blocks`` (``--num-kv-blocks``, else
        what ``--kv-cache-memory`` holds within 80% of the device's free
        memory, capped at ``max_num_seqs`` full-length sequences) and the
        pool's :class:`KVCacheSpec`."""
        a, config = self.kv_args, self.config
        tp = int(config.tensor_parallel_size)
        self.bytes_per_block = a.num_layers * 2 * a.num_kv_heads * self.block_size * a.head_dim * _ITEMSIZE[self.dtype]
        if config.num_kv_blocks:
            n = int(config.num_kv_blocks)
        else:
            budget = int(config.kv_cache_memory) // tp  # the ranks of a tensor-parallel group share it
            avail = self._available_memory()
            if avail and budget > 0.8 * avail:
                log.warning("kv_cache_memory %d B exceeds 80%% of available memory (%d B); shrinking", budget, avail)
                budget = int(0.8 * avail)
            n = max(1, budget // self.bytes_per_block)
            # no point in more blocks than max_num_seqs full-length sequences
            n = min(n, config.max_num_seqs * math.ceil(self.max_model_len / self.block_size) + 1)
        self.num_kv_blocks = int(n)
        self._spec = KVCacheSpec(
            num_layers=a.num_layers, num_blocks=self.num_kv_blocks, block_size=self.block_size,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, dtype=self.dtype,
        )

    def _allocate(self) -> list[Any]:
        """A fresh zeroed KV pool, in the form :attr:`caches` keeps."""
        return self.device.allocate_kv_cache(self._spec)

    # ------------------------------------------------------------------ step

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        seqs = batch.seqs
        if not seqs:
            return ModelOutput(np.zeros(0, dtype=np.int64), None)
        if self.caches is None or not self.model.loaded:
            raise FdxError("model runner is sleeping (call wakeup first)")
        if batch.block_copies:
            self.copy_kv_blocks(batch.block_copies)
        layout = self._layout(seqs)
        logits = self._forward(layout)
        if layout.prompt:  # prompt logprobs: only requests asking for them pay
            pick_s, pick_p = layout.pick
            self._prompt_logprobs(take_rows(logits, pick_p), seqs, layout.prompt)
            logits = take_rows(logits, pick_s) if len(pick_s) else None
        if layout.num_drafts is not None:
            return self._verify(logits, seqs, layout)
        return self._sample(logits, seqs, layout.samples)

    def _verify(self, logits: Any, seqs: Sequence[ScheduledSeq], layout: StepLayout) -> ModelOutput:
        """Speculative decoding: a seq with K drafts has K + 1 logits rows;
        the target's greedy token at each (the same argmax the sampler's
        greedy path takes) is compared with the drafts, the longest equal
        prefix is accepted and the target's token at the first mismatch
        (or after the last draft) is added.  Other seqs sample normally."""
        from fdx.model.sampler import logits_to_numpy

        k = layout.num_drafts
        assert k is not None and logits is not None
        sampled = np.flatnonzero(layout.samples)
        n_rows = np.where(k[sampled] > 0, k[sampled] + 1, 1)  # logits rows of each sampling seq, in order
        first = np.zeros(len(sampled), dtype=np.int64)
        np.cumsum(n_rows[:-1], out=first[1:])
        spec = k[sampled] > 0

        plain = sampled[~spec]
        token_ids = np.full(len(seqs), -1, dtype=np.int64)
        logprobs_out: list[Any] | None = None
        if len(plain):
            toks, lps = self.sampler.sample(take_rows(logits, first[~spec]), [seqs[i].request for i in plain])
            token_ids[plain] = toks
            if lps is not None:
                logprobs_out = [None] * len(seqs)
                for j, i in enumerate(plain):
                    logprobs_out[i] = lps[j]
        ns = n_rows[spec]
        spec_rows = np.repeat(first[spec], ns) + np.arange(int(ns.sum())) - np.repeat(np.cumsum(ns) - ns, ns)
        arr = logits_to_numpy(take_rows(logits, spec_rows))
        target = arr[:, : self.vocab_size].argmax(axis=1).astype(np.int64)  # the sampler's greedy argmax
        out: dict[int, list[int]] = {}
        pos = 0
        for i in sampled[spec]:
            drafts = seqs[i].draft_token_ids
            t = target[pos : pos + len(drafts) + 1]
            miss = np.flatnonzero(t[:-1] != np.asarray(drafts, dtype=np.int64))
            a = int(miss[0]) if len(miss) else len(drafts)
            out[int(i)] = t[: a + 1].tolist()
            token_ids[i] = t[0]
            pos += len(drafts) + 1
        return ModelOutput(token_ids, logprobs_out, out)

    def _forward(self, layout: StepLayout) -> Any:
        """The step's forward: logits of ``layout.rows`` (``None`` when no row samples)."""
        raise NotImplementedError

    def _layout(self, seqs: Sequence[ScheduledSeq]) -> StepLayout:
        """Flatten and check the step (a chunk past the request's tokens,
        past ``max_model_len``, without enough blocks, or with a block id
        outside the pool is an :class:`FdxError`).

        LongRoPE past ``original_max_position_embeddings`` (``orig``), as
        transformers computes it: a sequence takes the long factors, at every
        position, once its length exceeds ``orig`` -- the length its next
        sampled token is computed at, ``max(chunk end, known tokens)``; until
        then the short ones.  Its cached KV has the long factors exactly when
        ``max(computed, prompt length) > orig`` (a prompt past ``orig`` is long
        from its first chunk; a sequence crossing ``orig`` while decoding is
        recomputed then; nothing else writes it: the prefix cache is off).  A
        sequence whose KV has the short factors but that now takes the long
        ones runs this step from position 0 (transformers' generate drops its
        cache at that point too): ``starts`` 0 and every known token a row."""
        S = len(seqs)
        bs = self.block_size
        ids: list[int] = []
        q_lens = np.empty(S, dtype=np.int64)
        starts = np.empty(S, dtype=np.int64)
        nblocks = np.empty(S, dtype=np.int64)
        samples = np.zeros(S, dtype=bool)
        prompt: list[tuple[int, int, int]] = []
        num_drafts: np.ndarray | None = None
        orig = self.long_rope_after
        longs = np.zeros(S, dtype=bool)
        for i, seq in enumerate(seqs):
            r = seq.request
            c, n = r.num_computed_tokens, seq.num_new_tokens
            np_, end = len(r.prompt_token_ids), c + n
            if seq.draft_token_ids:  # speculative: the one uncomputed token, then the drafts
                k = len(seq.draft_token_ids)
                if n != k + 1 or c + 1 != r.num_tokens or not 0 <= min(seq.draft_token_ids) <= max(
                        seq.draft_token_ids) < self.vocab_size:
                    raise FdxError(f"request {r.request_id}: bad speculative step ({c}+1+{k} of {r.num_tokens} "
                                   "tokens, draft ids in the vocabulary)")
                if end > self.max_model_len:
                    raise FdxError(f"request {r.request_id}: position {end} exceeds max_model_len {self.max_model_len}")
                nb = -(-end // bs)
                if len(r.block_ids) < nb:
                    raise FdxError(f"request {r.request_id}: {len(r.block_ids)} blocks cannot hold {end} tokens")
                ids.append(r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1])
                ids.extend(seq.draft_token_ids)
                q_lens[i], starts[i], nblocks[i], samples[i] = n, c, nb, True
                if num_drafts is None:
                    num_drafts = np.zeros(S, dtype=np.int64)
                num_drafts[i] = k
                continue
            if r.params.prompt_logprobs is not None:  # positions whose next prompt token has no logprob yet
                lo, hi = max(c, len(r.prompt_logprobs)), min(end, np_ - 1)
                if hi > lo:
                    prompt.append((i, lo, hi - lo))
            if n <= 0 or end > np_ + len(r.output_token_ids):
                raise FdxError(f"request {r.request_id}: bad chunk ({c}+{n} of {r.num_tokens} tokens)")
            if end > self.max_model_len:
                raise FdxError(f"request {r.request_id}: position {end} exceeds max_model_len {self.max_model_len}")
            nb = -(-end // bs)
            if len(r.block_ids) < nb:
                raise FdxError(f"request {r.request_id}: {len(r.block_ids)} blocks cannot hold {end} tokens")
            if orig is not None and max(end, r.num_tokens) > orig:  # LongRoPE's long factors (see the docstring)
                longs[i] = True
                if c and max(c, np_) <= orig:  # its KV has the short factors: recompute it from position 0
                    c, n = 0, end
            if c >= np_:
                ids.extend(r.output_token_ids[c - np_ : end - np_])
            elif end <= np_:
                ids.extend(r.prompt_token_ids[c:end])
            else:
                ids.extend(r.prompt_token_ids[c:])
                ids.extend(r.output_token_ids[: end - np_])
            q_lens[i], starts[i], nblocks[i] = n, c, nb
            samples[i] = end >= np_ + len(r.output_token_ids)
        tables = np.zeros((S, int(nblocks.max())), dtype=self.table_dtype)
        for i, seq in enumerate(seqs):
            tables[i, : nblocks[i]] = seq.request.block_ids[: nblocks[i]]
        if int(tables.max()) >= self.num_kv_blocks or int(tables.min()) < 0:
            raise FdxError(f"block id out of range (pool has {self.num_kv_blocks} blocks)")
        q_starts = np.zeros(S, dtype=np.int64)
        np.cumsum(q_lens[:-1], out=q_starts[1:])
        seq_of = np.repeat(np.arange(S, dtype=np.int64), q_lens)
        positions = np.arange(len(ids), dtype=np.int64) - np.repeat(q_starts - starts, q_lens)
        if num_drafts is None:
            rows = (q_starts + q_lens - 1)[samples]
        else:  # every row of a speculative seq: K + 1 positions to verify
            n_rows = np.where(num_drafts > 0, num_drafts + 1, 1)[samples]
            ends = (q_starts + q_lens)[samples]
            offs = np.arange(int(n_rows.sum())) - np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
            rows = np.repeat(ends - n_rows, n_rows) + offs
        long_rope = np.repeat(longs, q_lens) if orig is not None else None
        if not prompt:
            layout = StepLayout(ids, q_lens, starts, samples, tables, q_starts, seq_of, positions, rows)
            layout.num_drafts = num_drafts
            layout.long_rope = long_rope
            return layout
        # sampled rows, then prompt rows, sorted (a forward may read rows == all rows as "in order")
        both = np.concatenate([rows, *[q_starts[i] + (lo - starts[i]) + np.arange(k) for i, lo, k in prompt]])
        order = np.argsort(both, kind="stable")
        where = np.empty_like(order)
        where[order] = np.arange(len(order))
        layout = StepLayout(ids, q_lens, starts, samples, tables, q_starts, seq_of, positions, both[order], prompt)
        layout.pick = (where[: len(rows)], where[len(rows) :])
        layout.num_drafts = num_drafts
        layout.long_rope = long_rope
        return layout

    def _prompt_logprobs(self, logits: Any, seqs: Sequence[ScheduledSeq], prompt: list[tuple[int, int, int]]) -> None:
        """Append to each request's ``prompt_logprobs`` the logprob, rank and
        top alternatives of the prompt tokens its rows predict (``logits``:
        one row per prompt position of ``prompt``, in order; on the device,
        only the asked-for numbers reach the host).  A position already
        recorded (a re-run step, a recompute) is not recorded twice."""
        import paddle

        x = logits if not isinstance(logits, np.ndarray) else paddle.to_tensor(logits)
        if int(x.shape[1]) > self.vocab_size:
            x = x[:, : self.vocab_size]
        if x.dtype != paddle.float32:
            x = x.astype("float32")
        targets = np.concatenate([np.asarray(seqs[i].request.prompt_token_ids[lo + 1 : lo + 1 + k], dtype=np.int64)
                                  for i, lo, k in prompt])
        tgt = paddle.to_tensor(targets, place=x.place).unsqueeze(1)
        lse = paddle.logsumexp(x, axis=1, keepdim=True)
        chosen = paddle.take_along_axis(x, tgt, axis=1)
        ranks = ((x > chosen).astype("int64").sum(axis=1) + 1).numpy()
        chosen_lp = (chosen - lse)[:, 0].numpy().astype(np.float64)
        vocab = int(x.shape[1])
        wants = [_prompt_k(seqs[i].request.params.prompt_logprobs, vocab, self.config.max_logprobs)
                 for i, _, _ in prompt]
        kmax = max(wants)
        top_ids = top_lp = None
        if kmax > 0:
            vals, idx = paddle.topk(x, kmax, axis=1)
            top_lp, top_ids = (vals - lse).numpy().astype(np.float64).tolist(), idx.numpy().tolist()
        row = 0
        for (i, lo, k), want in zip(prompt, wants):
            r = seqs[i].request
            if len(r.prompt_logprobs) == lo:
                for j in range(row, row + k):
                    top = tuple(zip(top_ids[j][:want], top_lp[j][:want])) if want and top_ids is not None \
                        and top_lp is not None else ()
                    r.prompt_logprobs.append(TokenLogprob(int(targets[j]), float(chosen_lp[j]), top, int(ranks[j])))
            row += k

    def _sample(self, logits: Any, seqs: Sequence[ScheduledSeq], samples: np.ndarray) -> ModelOutput:
        """One token per sampling sequence (``-1`` for the others)."""
        S = len(seqs)
        token_ids = np.full(S, -1, dtype=np.int64)
        logprobs_out: list[Any] | None = None
        if logits is not None:
            sidx = np.flatnonzero(samples)
            toks, lps = self.sampler.sample(logits, [seqs[i].request for i in sidx])
            token_ids[sidx] = toks
            if lps is not None:
                logprobs_out = [None] * S
                for j, i in enumerate(sidx):
                    logprobs_out[i] = lps[j]
        return ModelOutput(token_ids, logprobs_out)

    # ------------------------------------------------------------------ KV blocks

    def kv_fingerprint(self) -> str:
        """The same parts for both runners: a float32 block written by
        either is read back identically by the other (payloads are
        key-major whatever the pool holds).  v2: the C++ attention's scores
        became one fma chain a key, so later layers' blocks hold other
        values than v1's."""
        a = self.args
        try:
            stamp = self.source.stamp()
        except OSError:
            stamp = (self.source.path, 0, 0)
        parts = [
            "fdx-kv-v2", str(stamp), self.weights_version, self.dtype, str(self.block_size),
            str(a.num_layers), str(a.num_kv_heads), str(a.head_dim), a.arch, "neox-rope",
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]

    def _kv_views(self) -> list[Any]:
        """Per layer, a 2-D view of the KV pool sharing its storage."""
        raise NotImplementedError

    def _block_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of :meth:`_kv_views` holding blocks ``ids``: ``[n, 2, r]`` (K then V)."""
        raise NotImplementedError

    def _check_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(list(block_ids), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_kv_blocks):
            raise FdxError("block id out of range")
        return ids

    def _views(self) -> list[Any]:
        if self.caches is None:
            raise FdxError("KV cache is released (sleeping)")
        return self._kv_views()

    def _host_pools(self) -> list[np.ndarray] | None:
        """Per layer, the KV pool as a host NumPy array ``[2, NB, X]`` (K
        then V; ``X`` = one block of one layer's K or V) sharing the pool's
        memory, so block I/O copies each byte once (bfloat16 as its uint16
        bit patterns); ``None`` where NumPy cannot address the pool (device
        memory): the Paddle gather/scatter path runs then."""
        return None

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block as bytes: layout ``[layer, K/V, kv_head, slot, head_dim]``
        in the runner dtype (bfloat16 as its bit pattern)."""
        import paddle

        ids = self._check_ids(block_ids)
        if ids.size == 0:
            return []
        pools = self._host_pools()  # None while sleeping: _views() below says so
        if pools is not None:  # per block: its [L, 2, X] gathered once, then its bytes
            if self.key_blocks == "key-major":
                return [np.concatenate([a[:, b] for a in pools]).tobytes() for b in ids.tolist()]
            out = []
            for b in ids.tolist():
                blk = np.empty((len(pools), 2, pools[0].shape[2]), dtype=pools[0].dtype)
                for layer, a in enumerate(pools):
                    blk[layer, 1] = a[1, b]
                    blk[layer, 0] = self._keys_moved(a[0, b], to_wire=True)
                out.append(blk.tobytes())
            return out
        views = self._views()
        idx = paddle.to_tensor(self._block_rows(ids).reshape(-1))
        per_layer = [paddle.index_select(v, idx).numpy() for v in views]  # bf16 -> uint16 bits
        arr = np.stack(per_layer).reshape(len(per_layer), ids.size, -1).transpose(1, 0, 2)  # [n, L, 2*X]
        if self.key_blocks != "key-major":
            arr = arr.reshape(ids.size, len(per_layer), 2, -1).copy()
            arr[:, :, 0] = self._keys_moved(arr[:, :, 0], to_wire=True)
        return [np.ascontiguousarray(arr[i]).tobytes() for i in range(ids.size)]

    #: how the pool holds a block's keys: "key-major" (``[kv_head, slot,
    #: head_dim]``, the layout of every payload) or "dim-major" (fdx's C++
    #: attention, paged_attention.cc KEY BLOCKS: ``[kv_head, head_dim, slot]``
    #: in float32, ``[kv_head, head_dim / 2, slot, 2]`` in bfloat16), turned
    #: into the payload's layout on the way out and back on the way in
    key_blocks = "key-major"

    def _keys_moved(self, k: np.ndarray, to_wire: bool) -> np.ndarray:
        """Keys ``[..., X]`` (one block of one layer each), a copy: from the
        pool's layout to key-major (``to_wire``) or back.  The two layouts
        differ by one swap of the slot axis and the (pair of) dims axis."""
        a = self.kv_args  # this rank's kv heads under tensor parallelism
        KV, BS, D = a.num_kv_heads, self.block_size, a.head_dim
        pairs = self.dtype != "float32"  # bfloat16: dims side by side in pairs
        dims = D // 2 if pairs else D
        inner = (dims, BS) if to_wire else (BS, dims)
        lead = k.shape[:-1]
        t = k.reshape(*lead, KV, *inner, *((2,) if pairs else ())).swapaxes(-1 - pairs, -2 - pairs)
        return np.ascontiguousarray(t).reshape(*lead, -1)

    def copy_kv_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each ``src`` block's KV (every layer, K and V) into ``dst``
        (a forked beam's partial last block: copy on write)."""
        import paddle

        src = self._check_ids([s for s, _ in pairs])
        dst = self._check_ids([d for _, d in pairs])
        if src.size == 0:
            return
        pools = self._host_pools()
        if pools is not None:  # in host memory: NumPy copies (Paddle's CPU scatter has no bfloat16)
            for a in pools:
                a[:, dst] = a[:, src]
            return
        isrc = paddle.to_tensor(self._block_rows(src).reshape(-1))
        idst = paddle.to_tensor(self._block_rows(dst).reshape(-1))
        for view in self._views():
            paddle.scatter_(view, idst, paddle.index_select(view, isrc), overwrite=True)

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        import paddle

        ids = self._check_ids(block_ids)
        if ids.size != len(payloads):
            raise FdxError("write_kv_blocks: block_ids and payloads differ in length")
        if ids.size == 0:
            return
        for p in payloads:
            if len(p) != self.bytes_per_block:
                raise FdxError(f"KV payload has {len(p)} bytes, expected {self.bytes_per_block}")
        pools = self._host_pools()  # None while sleeping: _views() below says so
        if pools is not None:  # straight from each payload into its slots: one copy, no joined buffer
            blocks = [np.frombuffer(p, dtype=pools[0].dtype).reshape(len(pools), 2, -1) for p in payloads]
            for layer, a in enumerate(pools):
                for b, blk in zip(ids.tolist(), blocks):
                    if self.key_blocks == "key-major":
                        a[:, b] = blk[layer]
                    else:
                        a[1, b] = blk[layer, 1]
                        a[0, b] = self._keys_moved(blk[layer, 0], to_wire=False)
            return
        views = self._views()
        raw = b"".join(payloads)
        if self.dtype == "bfloat16":  # numpy has no bfloat16: go through exact float32
            arr = bf16_bits_to_f32(np.frombuffer(raw, dtype=np.uint16))
        else:
            arr = np.frombuffer(raw, dtype=np.float16 if self.dtype == "float16" else np.float32)
        W = int(views[0].shape[1])
        if self.key_blocks != "key-major":
            arr = arr.reshape(ids.size, len(views), 2, -1).copy()
            arr[:, :, 0] = self._keys_moved(arr[:, :, 0], to_wire=False)
        arr = arr.reshape(ids.size, len(views), -1, W)
        idx = paddle.to_tensor(self._block_rows(ids).reshape(-1))
        for layer, view in enumerate(views):
            upd = paddle.to_tensor(np.ascontiguousarray(arr[:, layer].reshape(-1, W)))
            if upd.dtype != view.dtype:
                upd = upd.astype(self.dtype)
            paddle.scatter_(view, idx, upd, overwrite=True)

    # ------------------------------------------------------------------ sleep / weights

    def _my_part(self, ckpt: Checkpoint) -> Checkpoint:
        """The part of a (re)loaded checkpoint this process's model holds: all of it,
        or a tensor-parallel rank's shard."""
        return ckpt

    def release(self, tags: Sequence[str]) -> None:
        tags = set(tags)
        if "weight" in tags:
            self.model.release()
        if "kv_cache" in tags:
            self.caches = None
        release_scratch = getattr(self.model, "release_scratch", None)
        if release_scratch is not None:  # the kernels' kept buffers (a long prefill's, hundreds of MB)
            release_scratch()
        self.device.trim_memory()  # cpu: malloc_trim, RSS really drops; cuda: empty Paddle's allocator cache

    def restore(self, tags: Sequence[str]) -> None:
        import paddle

        from fdx.model.loader import load_checkpoint

        tags = set(tags)
        if "weight" in tags and not self.model.loaded:
            ckpt = load_checkpoint(self._weights_path)
            with paddle.no_grad():
                self.model.load(self._my_part(ckpt), progress=False)
        if "kv_cache" in tags and self.caches is None:
            self.caches = self._allocate()

    def load_weights(self, path: str, version: str) -> None:
        import paddle

        from fdx.model.loader import load_checkpoint

        ckpt = load_checkpoint(path)
        if ckpt.args != self.args:
            diff = _arg_diff(ckpt.args, self.args)
            raise ModelLoadError(f"{ckpt.source.path}: shapes differ from the running model: {', '.join(diff)}")
        with paddle.no_grad():
            self.model.load(self._my_part(ckpt), progress=False)
        self._weights_path = path
        self.source = ckpt.source
        self.weights_version = version


def _arg_diff(new: Any, old: Any) -> list[str]:
    import attrs

    return [f"{f.name}={getattr(new, f.name)!r} (running {getattr(old, f.name)!r})"
            for f in attrs.fields(type(old)) if getattr(new, f.name) != getattr(old, f.name)]
