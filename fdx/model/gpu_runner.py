"""The GPU model runner (registered as ``gpu``): half-precision weights and
KV on an accelerator, Paddle's fused kernels where the device has them, and
sampling on the device.

* dtype (``--dtype``): ``bfloat16`` / ``float16`` / ``float32``, or
  ``auto`` -- bfloat16 where the GPU supports it, else float16; float32 on
  the CPU place.  Weights and the KV pool are kept in that dtype.
* weights: GGUF quant blocks are dequantized on the host at load and cast on
  the device; raw quant blocks are never uploaded (no kernel here reads
  them).
* kernels: :func:`fdx.model.fused_kernels.probe_kernels` picks, per op,
  Paddle's fused kernel (``fused_rms_norm``, ``fused_rotary_position_embedding``,
  ``swiglu``, ``flash_attn_unpadded``) or the plain-Paddle fallback, and the
  start-up log line says which and why.  A device plugin gates ops off with
  ``unsupported_fused_ops`` (op -> reason); ``FDX_GPU_DISABLE_FUSED=rope,flash_attn``
  turns ops off by hand (names: ``rms_norm``, ``rope``, ``swiglu``, ``flash_attn``).
* sampling: :class:`fdx.model.device_sampler.DeviceSampler`; only the
  sampled ids (and requested logprobs) come to the host.

**GPU-only pieces:** the fused RoPE and the flash attention kernels (Paddle's
CPU build registers neither), bfloat16/float16 matmuls, and
``paddle.device.cuda`` memory queries.  Everything else -- the plain-Paddle
fallbacks, the paged KV layout and block I/O, the device sampler, sleep and
weight swaps -- also runs on the CPU place in float32, which is how the
tests check it against the ``cpu`` runner on a machine without a GPU.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import math
import os
from typing import Any, Sequence

import numpy as np

from fdx.core.config import EngineConfig
from fdx.core.errors import FdxError, ModelLoadError
from fdx.core.interfaces import Device, KVCacheSpec, ModelOutput, ModelRunner, ScheduledBatch

log = logging.getLogger("fdx.model")

_DTYPES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def resolve_dtype(requested: str, place: str) -> str:
    """The runner dtype for ``--dtype`` on ``place`` (a one-line
    :class:`ModelLoadError` for an unknown or unsupported one)."""
    import paddle

    req = (requested or "auto").strip().lower()
    on_cpu = place == "cpu"
    if req == "auto":
        if on_cpu:
            return "float32"
        if place.startswith("gpu"):
            try:
                if paddle.amp.is_bfloat16_supported(place):
                    return "bfloat16"
            except Exception:  # noqa: BLE001 - older Paddle / other devices
                pass
        return "float16"
    if req not in _DTYPES:
        raise ModelLoadError(f"--dtype {requested}: unknown (choose auto, bfloat16, float16 or float32)")
    dt = _DTYPES[req]
    if on_cpu and dt != "float32":
        raise ModelLoadError(f"--dtype {requested}: the gpu runner on the CPU place runs float32 only")
    return dt


def _check_dtype_works(dtype: str, place: str) -> None:
    import paddle

    try:  # the ops every step needs in this dtype: matmul, KV scatter and gather
        a = paddle.ones([4, 8], dtype="float32").astype(dtype)
        float(paddle.matmul(a, a, transpose_y=True).astype("float32").sum())
        idx = paddle.to_tensor(np.array([2, 0], dtype=np.int64))
        paddle.scatter_(a, idx, a[:2] * 2, overwrite=True)
        float(paddle.index_select(a, idx).astype("float32").sum())
    except Exception as exc:  # noqa: BLE001
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise ModelLoadError(f"--dtype {dtype} is not supported on {place} by this Paddle build ({first})") from None


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> the float32 values they encode (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class GPUModelRunner(ModelRunner):
    """See the module docstring.  ``device`` is any :class:`Device` whose
    place Paddle can run (``gpu:N``, ``xpu:N``, a custom device, or ``cpu``)."""

    def __init__(self, config: EngineConfig, device: Device) -> None:
        import paddle

        from fdx.model.device_sampler import DeviceSampler
        from fdx.model.fused_kernels import FUSED_OPS, probe_kernels
        from fdx.model.gpu_llama import GPULlama
        from fdx.model.loader import load_checkpoint, load_tokenizer

        self.config = config
        self.device = device
        self.place = device.paddle_place()
        paddle.set_device(self.place)
        paddle.disable_static()
        self.dtype = resolve_dtype(config.dtype, self.place)
        _check_dtype_works(self.dtype, self.place)
        ckpt = load_checkpoint(config.model)
        self.source = ckpt.source
        self.args = a = ckpt.args
        tok = load_tokenizer(config.model)
        self.eos_token_ids = frozenset(tok.eos_token_ids)
        self.vocab_size = a.vocab_size
        self.block_size = config.block_size
        self.max_model_len = int(config.max_model_len or a.max_position)
        self.weights_version = ""
        self._weights_path = config.model

        disabled = [s.strip() for s in os.environ.get("FDX_GPU_DISABLE_FUSED", "").split(",") if s.strip()]
        bad = sorted(set(disabled) - set(FUSED_OPS))
        if bad:
            raise ModelLoadError(f"FDX_GPU_DISABLE_FUSED: unknown op(s) {', '.join(bad)} (choices: {', '.join(FUSED_OPS)})")
        gated = dict(getattr(device, "unsupported_fused_ops", {}) or {})
        if self.place == "cpu":  # the fallback path; Paddle's CPU fused_rms_norm may SIGILL on some CPUs
            gated = {op: "plain ops on the CPU place" for op in FUSED_OPS}
        self.kernels = probe_kernels(self.dtype, a.num_heads, a.num_kv_heads, a.head_dim, disabled, gated)
        self.model = GPULlama(a, self.max_model_len, self.dtype, self.kernels)
        with paddle.no_grad():
            self.model.load(ckpt)
        del ckpt

        self.bytes_per_block = a.num_layers * 2 * a.num_kv_heads * self.block_size * a.head_dim * _ITEMSIZE[self.dtype]
        if config.num_kv_blocks:
            n = int(config.num_kv_blocks)
        else:
            budget = int(config.kv_cache_memory)
            try:
                _, avail = device.memory_info()
            except Exception:  # noqa: BLE001 - not every device reports memory
                avail = 0
            if avail and budget > 0.8 * avail:
                log.warning("kv_cache_memory %d B exceeds 80%% of available memory (%d B); shrinking", budget, avail)
                budget = int(0.8 * avail)
            n = max(1, budget // self.bytes_per_block)
            n = min(n, config.max_num_seqs * math.ceil(self.max_model_len / self.block_size) + 1)
        self.num_kv_blocks = int(n)
        self._spec = KVCacheSpec(
            num_layers=a.num_layers, num_blocks=self.num_kv_blocks, block_size=self.block_size,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, dtype=self.dtype,
        )
        self._rows_per_half = self.num_kv_blocks * a.num_kv_heads * self.block_size
        self.caches: list[Any] | None = self._allocate()
        self.sampler = DeviceSampler(self.vocab_size, config.max_logprobs, seed=config.seed)
        log.info(
            "gpu runner: model %s (%s) on %s in %s: %d KV blocks x %d tokens; %d GGUF quant tensors "
            "dequantized at load (raw blocks not uploaded); kernels: %s",
            self.source.name, a.describe(), self.place, self.dtype, self.num_kv_blocks, self.block_size,
            self.model.dequantized, self.kernels.describe(),
        )
        for op, why in self.kernels.off.items():
            log.info("%s on %s: fused %s unavailable (%s); using plain Paddle", device.name or "device", self.place, op, why)

    def _allocate(self) -> list[Any]:
        """The device's zeroed ``[2, NB, KV, BS, D]`` tensors, flattened once
        to ``[2 * NB * KV * BS, D]`` (the only handle kept)."""
        D = self.args.head_dim
        return [c.reshape([2 * self._rows_per_half, D]) for c in self.device.allocate_kv_cache(self._spec)]

    # ------------------------------------------------------------------ step

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        import paddle

        from fdx.model.gpu_llama import AttnGroup, GPUStep, plan_groups

        seqs = batch.seqs
        S = len(seqs)
        if S == 0:
            return ModelOutput(np.zeros(0, dtype=np.int64), None)
        if self.caches is None or not self.model.loaded:
            raise FdxError("model runner is sleeping (call wakeup first)")
        a, bs = self.args, self.block_size
        KV = a.num_kv_heads
        ids: list[int] = []
        q_lens = np.empty(S, dtype=np.int64)
        starts = np.empty(S, dtype=np.int64)
        nblocks = np.empty(S, dtype=np.int64)
        samples = np.zeros(S, dtype=bool)
        for i, seq in enumerate(seqs):
            r = seq.request
            c, n = r.num_computed_tokens, seq.num_new_tokens
            np_, end = len(r.prompt_token_ids), r.num_computed_tokens + seq.num_new_tokens
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
            q_lens[i], starts[i], nblocks[i] = n, c, nb
            samples[i] = end >= np_ + len(r.output_token_ids)
        T = len(ids)
        tables = np.zeros((S, int(nblocks.max())), dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, : nblocks[i]] = seq.request.block_ids[: nblocks[i]]
        if int(tables.max()) >= self.num_kv_blocks or int(tables.min()) < 0:
            raise FdxError(f"block id out of range (pool has {self.num_kv_blocks} blocks)")
        q_starts = np.zeros(S, dtype=np.int64)
        np.cumsum(q_lens[:-1], out=q_starts[1:])
        seq_of = np.repeat(np.arange(S), q_lens)
        pos = np.arange(T, dtype=np.int64) - np.repeat(q_starts - starts, q_lens)
        blk = tables[seq_of, pos // bs]
        write_rows = ((blk[:, None] * KV + np.arange(KV)[None, :]) * bs + (pos % bs)[:, None]).reshape(-1)
        rows = (q_starts + q_lens - 1)[samples]

        t = paddle.to_tensor
        groups = []
        for g in plan_groups(self.kernels, q_lens, starts, tables, KV, bs, a.num_heads // KV):
            up = {k: (t(v) if isinstance(v, np.ndarray) else v) for k, v in g.items()}
            groups.append(AttnGroup(**up))
        pos_t = t(pos)
        step = GPUStep(
            ids=t(np.asarray(ids, dtype=np.int64)),
            cos=paddle.index_select(self.model.cos, pos_t).unsqueeze(1),
            sin=paddle.index_select(self.model.sin, pos_t).unsqueeze(1),
            write_rows=t(write_rows),
            groups=groups,
            sample_rows=t(rows) if len(rows) else None,
            num_tokens=T,
        )
        with paddle.no_grad():
            logits = self.model.forward(step, self.caches)
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
        """Same parts as the ``cpu`` runner's: a float32 block written by
        either runner is read back identically by the other."""
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

    def _block_rows(self, ids: np.ndarray) -> np.ndarray:
        """Flat cache rows of blocks ``ids``: ``[n, 2, KV*BS]`` (K then V)."""
        per = self.args.num_kv_heads * self.block_size
        k = ids[:, None] * per + np.arange(per)[None, :]
        return np.stack([k, k + self._rows_per_half], axis=1)

    def _check_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        if self.caches is None:
            raise FdxError("KV cache is released (sleeping)")
        ids = np.asarray(list(block_ids), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_kv_blocks):
            raise FdxError("block id out of range")
        return ids

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block as bytes: layout ``[layer, K/V, kv_head, slot, head_dim]``
        in the runner dtype (bfloat16 as its bit pattern)."""
        import paddle

        ids = self._check_ids(block_ids)
        if ids.size == 0:
            return []
        assert self.caches is not None
        idx = paddle.to_tensor(self._block_rows(ids).reshape(-1))
        per_layer = [paddle.index_select(c, idx).numpy() for c in self.caches]  # bf16 -> uint16 bits
        arr = np.stack(per_layer).reshape(len(per_layer), ids.size, -1).transpose(1, 0, 2)  # [n, L, 2*X]
        return [np.ascontiguousarray(arr[i]).tobytes() for i in range(ids.size)]

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
        assert self.caches is not None
        L, D = len(self.caches), self.args.head_dim
        raw = b"".join(payloads)
        if self.dtype == "bfloat16":  # numpy has no bfloat16: go through exact float32
            arr = bf16_bits_to_f32(np.frombuffer(raw, dtype=np.uint16))
        else:
            arr = np.frombuffer(raw, dtype=np.float16 if self.dtype == "float16" else np.float32)
        arr = arr.reshape(ids.size, L, -1, D)
        idx = paddle.to_tensor(self._block_rows(ids).reshape(-1))
        for layer, cache in enumerate(self.caches):
            upd = paddle.to_tensor(np.ascontiguousarray(arr[:, layer].reshape(-1, D)))
            if upd.dtype != cache.dtype:
                upd = upd.astype(self.dtype)
            paddle.scatter_(cache, idx, upd, overwrite=True)

    # ------------------------------------------------------------------ sleep / weights

    def release(self, tags: Sequence[str]) -> None:
        tags = set(tags)
        if "weight" in tags:
            self.model.release()
        if "kv_cache" in tags:
            self.caches = None
        trim = getattr(self.device, "trim_memory", None)  # cuda: empty Paddle's allocator cache
        trim() if trim is not None else gc.collect()

    def restore(self, tags: Sequence[str]) -> None:
        import paddle

        from fdx.model.loader import load_checkpoint

        tags = set(tags)
        if "weight" in tags and not self.model.loaded:
            ckpt = load_checkpoint(self._weights_path)
            with paddle.no_grad():
                self.model.load(ckpt, progress=False)
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
            self.model.load(ckpt, progress=False)
        self._weights_path = path
        self.source = ckpt.source
        self.weights_version = version


def _arg_diff(new: Any, old: Any) -> list[str]:
    import attrs

    return [f"{f.name}={getattr(new, f.name)!r} (running {getattr(old, f.name)!r})"
            for f in attrs.fields(type(old)) if getattr(new, f.name) != getattr(old, f.name)]
