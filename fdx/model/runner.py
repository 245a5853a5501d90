"""The Paddle model runner: one mixed prefill/decode forward per step over
the paged KV cache, then sampling.

Invariants (from :class:`fdx.core.interfaces.ModelRunner`):

* every token of the step runs in ONE forward pass (flattened rows);
* new K/V go to slot ``block_ids[pos // bs] * bs + pos % bs`` of their
  request, and attention reads K/V only through the block tables;
* a request's sampled token depends only on its own logits, params and
  generator (the sampler is row-independent).
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Any, Sequence

import numpy as np

from fdx.core.config import EngineConfig
from fdx.core.errors import FdxError, ModelLoadError
from fdx.core.interfaces import Device, KVCacheSpec, ModelOutput, ModelRunner, ScheduledBatch

log = logging.getLogger("fdx.model")


class PaddleModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, device: Device) -> None:
        import paddle

        from fdx.model.llama import LlamaModel
        from fdx.model.loader import load_checkpoint, load_tokenizer
        from fdx.model.sampler import Sampler

        self.config = config
        self.device = device
        paddle.set_device(device.paddle_place())
        paddle.disable_static()
        if config.dtype not in ("float32", "fp32", "auto"):
            raise ModelLoadError(f"--dtype {config.dtype}: only float32 is supported by the Paddle CPU runner")
        self.dtype = "float32"
        ckpt = load_checkpoint(config.model)
        self.source = ckpt.source
        self.args = ckpt.args
        tok = load_tokenizer(config.model)
        self.eos_token_ids = frozenset(tok.eos_token_ids)
        self.vocab_size = self.args.vocab_size
        self.block_size = config.block_size
        self.max_model_len = int(config.max_model_len or self.args.max_position)
        self.weights_version = ""
        self._weights_path = config.model

        ops = None
        if device.attention_backend() == "native":
            from fdx.model.native import load_ops

            ops = load_ops()
        self.attention_impl = "native" if ops is not None else "paddle"
        self.model = LlamaModel(self.args, self.max_model_len, ops)
        with paddle.no_grad():
            self.model.load(ckpt)
        del ckpt

        a = self.args
        self.bytes_per_block = a.num_layers * 2 * a.num_kv_heads * self.block_size * a.head_dim * 4
        if config.num_kv_blocks:
            n = int(config.num_kv_blocks)
        else:
            budget = int(config.kv_cache_memory)
            _, avail = device.memory_info()
            if avail and budget > 0.8 * avail:
                log.warning(
                    "kv_cache_memory %d B exceeds 80%% of available memory (%d B); shrinking", budget, avail
                )
                budget = int(0.8 * avail)
            n = max(1, budget // self.bytes_per_block)
        # no point in more blocks than max_num_seqs full-length sequences
        cap = config.max_num_seqs * math.ceil(self.max_model_len / self.block_size) + 1
        self.num_kv_blocks = int(min(n, cap)) if not config.num_kv_blocks else n
        self._spec = KVCacheSpec(
            num_layers=a.num_layers,
            num_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            dtype=self.dtype,
        )
        self.caches: list[Any] | None = device.allocate_kv_cache(self._spec)
        self.sampler = Sampler(self.vocab_size, config.max_logprobs, seed=config.seed)
        log.info(
            "model %s (%s) on %s: %d KV blocks x %d tokens, attention=%s",
            self.source.name, a.describe(), device.paddle_place(), self.num_kv_blocks, self.block_size,
            self.attention_impl,
        )

    # ------------------------------------------------------------------ step

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        import paddle

        from fdx.model.llama import StepInputs

        seqs = batch.seqs
        S = len(seqs)
        if S == 0:
            return ModelOutput(np.zeros(0, dtype=np.int64), None)
        if self.caches is None or not self.model.loaded:
            raise FdxError("model runner is sleeping (call wakeup first)")
        bs = self.block_size
        ids: list[int] = []
        q_lens = np.empty(S, dtype=np.int64)
        starts = np.empty(S, dtype=np.int64)
        samples = np.zeros(S, dtype=bool)
        nblocks = np.empty(S, dtype=np.int64)
        for i, seq in enumerate(seqs):
            r = seq.request
            c = r.num_computed_tokens
            n = seq.num_new_tokens
            np_ = len(r.prompt_token_ids)
            end = c + n
            if n <= 0 or end > np_ + len(r.output_token_ids):
                raise FdxError(f"request {r.request_id}: bad chunk ({c}+{n} of {r.num_tokens} tokens)")
            if end > self.max_model_len:
                raise FdxError(f"request {r.request_id}: position {end} exceeds max_model_len {self.max_model_len}")
            nb = -(-end // bs)
            if len(r.block_ids) < nb:
                raise FdxError(f"request {r.request_id}: {len(r.block_ids)} blocks cannot hold {end} tokens")
            if c >= np_:
                ids.extend(r.output_token_ids[c - np_ : end - np_])
            elif end <= np_:
                ids.extend(r.prompt_token_ids[c:end])
            else:
                ids.extend(r.prompt_token_ids[c:])
                ids.extend(r.output_token_ids[: end - np_])
            q_lens[i] = n
            starts[i] = c
            nblocks[i] = nb
            samples[i] = end >= np_ + len(r.output_token_ids)
        T = len(ids)
        q_starts = np.zeros(S, dtype=np.int64)
        np.cumsum(q_lens[:-1], out=q_starts[1:])
        seq_of = np.repeat(np.arange(S, dtype=np.int64), q_lens)
        positions = np.arange(T, dtype=np.int64) - np.repeat(q_starts - starts, q_lens)
        maxb = int(nblocks.max())
        tables = np.zeros((S, maxb), dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, : nblocks[i]] = seq.request.block_ids[: nblocks[i]]
        if int(tables.max()) >= self.num_kv_blocks or int(tables.min()) < 0:
            raise FdxError(f"block id out of range (pool has {self.num_kv_blocks} blocks)")
        rows = (q_starts + q_lens - 1)[samples]
        meta = np.stack([seq_of.astype(np.int32), positions.astype(np.int32)], axis=1)
        step = StepInputs(
            ids=paddle.to_tensor(np.asarray(ids, dtype=np.int64)),
            meta=paddle.to_tensor(meta),
            tables=paddle.to_tensor(tables),
            sample_rows=paddle.to_tensor(rows) if len(rows) else None,
            positions=positions,
            seq_of=seq_of,
            q_starts=q_starts,
            q_lens=q_lens,
            ctx_lens=starts + q_lens,
            tables_np=tables,
        )
        with paddle.no_grad():
            logits = self.model.forward(step, self.caches)
        token_ids = np.full(S, -1, dtype=np.int64)
        logprobs_out: list[Any] | None = None
        if logits is not None:
            sidx = np.flatnonzero(samples)
            reqs = [seqs[i].request for i in sidx]
            toks, lps = self.sampler.sample(logits, reqs)
            token_ids[sidx] = toks
            if lps is not None:
                logprobs_out = [None] * S
                for j, i in enumerate(sidx):
                    logprobs_out[i] = lps[j]
        return ModelOutput(token_ids, logprobs_out)

    # ------------------------------------------------------------------ KV blocks

    def kv_fingerprint(self) -> str:
        a = self.args
        try:
            stamp = self.source.stamp()
        except OSError:
            stamp = (self.source.path, 0, 0)
        parts = [
            "fdx-kv-v1", str(stamp), self.weights_version, self.dtype, str(self.block_size),
            str(a.num_layers), str(a.num_kv_heads), str(a.head_dim), a.arch, "neox-rope",
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]

    def _flat_caches(self) -> list[Any]:
        if self.caches is None:
            raise FdxError("KV cache is released (sleeping)")
        return [c.reshape([2 * self.num_kv_blocks, -1]) for c in self.caches]

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block as bytes: layout ``[layer, K/V, kv_head, slot, head_dim]`` float32."""
        import paddle

        ids = np.asarray(list(block_ids), dtype=np.int64)
        if ids.size == 0:
            return []
        if ids.min() < 0 or ids.max() >= self.num_kv_blocks:
            raise FdxError("block id out of range")
        idx = paddle.to_tensor(np.concatenate([ids, ids + self.num_kv_blocks]))
        per_layer = [paddle.index_select(f, idx).numpy() for f in self._flat_caches()]
        arr = np.stack(per_layer)  # [L, 2n, X]
        n = ids.size
        arr = arr.reshape(len(per_layer), 2, n, -1).transpose(2, 0, 1, 3)  # [n, L, 2, X]
        return [np.ascontiguousarray(arr[i]).tobytes() for i in range(n)]

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        import paddle

        ids = np.asarray(list(block_ids), dtype=np.int64)
        if ids.size != len(payloads):
            raise FdxError("write_kv_blocks: block_ids and payloads differ in length")
        if ids.size == 0:
            return
        if ids.min() < 0 or ids.max() >= self.num_kv_blocks:
            raise FdxError("block id out of range")
        for p in payloads:
            if len(p) != self.bytes_per_block:
                raise FdxError(f"KV payload has {len(p)} bytes, expected {self.bytes_per_block}")
        flats = self._flat_caches()
        L = len(flats)
        arr = np.frombuffer(b"".join(payloads), dtype=np.float32).reshape(ids.size, L, 2, -1)
        idx = paddle.to_tensor(np.concatenate([ids, ids + self.num_kv_blocks]))
        for layer, flat in enumerate(flats):
            upd = np.ascontiguousarray(arr[:, layer].transpose(1, 0, 2).reshape(2 * ids.size, -1))
            paddle.scatter_(flat, idx, paddle.to_tensor(upd), overwrite=True)

    # ------------------------------------------------------------------ sleep / weights

    def release(self, tags: Sequence[str]) -> None:
        tags = set(tags)
        if "weight" in tags:
            self.model.release()
        if "kv_cache" in tags:
            self.caches = None
        self.device.trim_memory()  # RSS really drops (malloc_trim on the CPU device)

    def restore(self, tags: Sequence[str]) -> None:
        import paddle

        from fdx.model.loader import load_checkpoint

        tags = set(tags)
        if "weight" in tags and not self.model.loaded:
            ckpt = load_checkpoint(self._weights_path)
            with paddle.no_grad():
                self.model.load(ckpt, progress=False)
        if "kv_cache" in tags and self.caches is None:
            self.caches = self.device.allocate_kv_cache(self._spec)

    def load_weights(self, path: str, version: str) -> None:
        import paddle

        from fdx.model.loader import load_checkpoint

        ckpt = load_checkpoint(path)
        if ckpt.args != self.args:
            diff = _arg_diff(ckpt.args, self.args)
            raise ModelLoadError(f"{ckpt.source.path}: shapes differ from the running model: {', '.join(diff)}")
        with paddle.no_grad():
            self.model.load(ckpt, progress=False)
        self._weights_path = path
        self.source = ckpt.source
        self.weights_version = version


def _arg_diff(new: Any, old: Any) -> list[str]:
    import attrs

    out = []
    for f in attrs.fields(type(old)):
        a, b = getattr(new, f.name), getattr(old, f.name)
        if a != b:
            out.append(f"{f.name}={a!r} (running {b!r})")
    return out
