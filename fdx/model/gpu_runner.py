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
* tensor parallelism (``--tensor-parallel-size N``,
  :class:`fdx.model.tp_runner.TensorParallelRunner`): rank 0 is this runner,
  ranks 1..N-1 the same runner in worker processes, each on its own device
  (``gpu:base+r`` for the node's ``r``-th rank; fewer visible devices than
  ranks is a one-line error), each loading only its shard; the collectives
  are Paddle's: ``nccl`` on GPUs (untested without GPUs), ``gloo`` on the
  CPU place (``--tp-backend shm`` is the cpu runner's and refused here).

**GPU-only pieces:** the fused RoPE and the flash attention kernels (Paddle's
CPU build registers neither), bfloat16/float16 matmuls, and
``paddle.device.cuda`` memory queries.  Everything else -- the plain-Paddle
fallbacks, the paged KV layout and block I/O, the device sampler, sleep and
weight swaps -- also runs on the CPU place in float32, which is how the
tests check it against the ``cpu`` runner on a machine without a GPU.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from fdx.config import EngineConfig, split_device
from fdx.core.errors import ModelLoadError
from fdx.core.interfaces import Device
from fdx.model.packed_weights import bf16_bits_to_f32
from fdx.model.runner_base import StepLayout
from fdx.model.tp_runner import TensorParallelRunner

if TYPE_CHECKING:
    from fdx.parallel.group import RankLink

__all__ = ["GPUModelRunner", "bf16_bits_to_f32", "resolve_dtype"]

log = logging.getLogger("fdx.model")

_DTYPES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


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


def check_rank_devices(config: EngineConfig, device: Device, place: str) -> None:
    """The gpu runner's tensor-parallel ranks can run on ``place``: the CPU
    place over gloo, or one CUDA GPU per rank of this node over nccl (one-line errors)."""
    N, per = int(config.tensor_parallel_size), int(config.ranks_per_node)
    if place == "cpu":
        if config.tp_backend != "gloo":
            raise ModelLoadError(f"--tp-backend {config.tp_backend}: the gpu runner on the CPU place joins its ranks "
                                 "over gloo; use --tp-backend gloo (or auto)")
        return
    if not place.startswith("gpu") or config.tp_backend != "nccl":
        raise ModelLoadError(f"--tensor-parallel-size {N}: the gpu runner joins its ranks over nccl on CUDA GPUs "
                             f"(or gloo on the CPU place); {place} with --tp-backend {config.tp_backend} is neither")
    base = split_device(config.device)[1] or 0  # rank 0's device (a worker's own is base + its rank on the node)
    count = device._count() if hasattr(device, "_count") else 0
    if count < base + per:
        raise ModelLoadError(f"--tensor-parallel-size {N}: the gpu runner puts each rank on its own device "
                             f"(gpu:{base}..gpu:{base + per - 1} on this node), but {count} GPU(s) are visible")


class GPUModelRunner(TensorParallelRunner):
    """See the module docstring.  ``device`` is any :class:`Device` whose
    place Paddle can run (``gpu:N``, ``xpu:N``, a custom device, or ``cpu``).
    What it shares with the ``cpu`` runner is in
    :class:`~fdx.model.runner_base.PagedRunnerBase` and
    :class:`~fdx.model.tp_runner.TensorParallelRunner` (``link``,
    ``on_layer``: as :class:`fdx.model.runner.PaddleModelRunner`'s)."""

    #: a sliding window shorter than the context: plain attention groups with a window mask
    honours_sliding_window = True
    #: GPULlama picks each row's LongRoPE table rows (StepLayout.long_rope)
    honours_long_rope = True

    def __init__(self, config: EngineConfig, device: Device, link: RankLink | None = None,
                 on_layer: Callable[[], None] | None = None) -> None:
        import paddle

        from fdx.model.device_sampler import DeviceSampler
        from fdx.model.fused_kernels import FUSED_OPS, probe_kernels
        from fdx.model.gpu_llama import GPULlama

        self.config = config
        self.device = device
        self.place = device.paddle_place()
        paddle.set_device(self.place)
        paddle.disable_static()
        self.dtype = resolve_dtype(config.dtype, self.place)
        _check_dtype_works(self.dtype, self.place)
        if config.kv_cache_dtype not in ("auto", self.dtype):
            raise ModelLoadError(f"--kv-cache-dtype {config.kv_cache_dtype}: the gpu runner keeps its KV cache in "
                                 f"the compute dtype ({self.dtype}); leave it auto or set --dtype")
        ckpt = self._open_checkpoint(config)
        self._take_shard(config, link)  # tensor parallelism: this rank's geometry (fdx.model.tp_runner)
        if self.shard is not None:
            check_rank_devices(config, device, self.place)
        a = self.kv_args

        disabled = [s.strip() for s in os.environ.get("FDX_GPU_DISABLE_FUSED", "").split(",") if s.strip()]
        bad = sorted(set(disabled) - set(FUSED_OPS))
        if bad:
            raise ModelLoadError(f"FDX_GPU_DISABLE_FUSED: unknown op(s) {', '.join(bad)} (choices: {', '.join(FUSED_OPS)})")
        gated = dict(getattr(device, "unsupported_fused_ops", {}) or {})
        if self.place == "cpu":  # the fallback path; Paddle's CPU fused_rms_norm may SIGILL on some CPUs
            gated = {op: "plain ops on the CPU place" for op in FUSED_OPS}
        self.kernels = probe_kernels(self.dtype, a.num_heads, a.num_kv_heads, a.head_dim, disabled, gated)
        if self.shard is not None:  # every rank's pool is rank 0's size: sized before the group starts
            self._size_kv_pool()
            dev_id = None if self.place == "cpu" else int(self.place.split(":")[1])
            ckpt = self._join_group(ckpt, link, on_layer, dev_id)
        model = GPULlama(a, self.max_model_len, self.dtype, self.kernels, comm=self.comm,
                         vocab_start=self.shard.vocab_start if self.shard else 0, vocab_size=self.vocab_size)
        with paddle.no_grad():
            model.load(ckpt, progress=self.shard is None)
        self.model = model
        del ckpt
        if self.shard is None:  # TP=1: sized in what the weights left free
            self._size_kv_pool()

        self._rows_per_half = self.num_kv_blocks * a.num_kv_heads * self.block_size
        self.caches: list[Any] | None = self._allocate()
        self._group_ready()
        self.sampler = DeviceSampler(self.vocab_size, config.max_logprobs, seed=config.seed)
        log.info(
            "gpu runner: model %s (%s) on %s in %s: %d KV blocks x %d tokens; %d GGUF quant tensors "
            "dequantized at load (raw blocks not uploaded); kernels: %s%s",
            self.source.name, a.describe(), self.place, self.dtype, self.num_kv_blocks, self.block_size,
            self.model.dequantized, self.kernels.describe(),
            f"; tensor-parallel rank {self.shard.rank} of {self.shard.world} over {self.comm.backend}"
            if self.shard is not None else "",
        )
        for op, why in self.kernels.off.items():
            log.info("%s on %s: fused %s unavailable (%s); using plain Paddle", device.name or "device", self.place, op, why)

    def _allocate(self) -> list[Any]:
        """The device's zeroed ``[2, NB, KV, BS, D]`` tensors, flattened once
        to ``[2 * NB * KV * BS, D]`` (the only handle kept)."""
        D = self.kv_args.head_dim
        return [c.reshape([2 * self._rows_per_half, D]) for c in self.device.allocate_kv_cache(self._spec)]

    def _available_memory(self) -> int:
        try:
            avail = super()._available_memory()
        except Exception:  # noqa: BLE001 - not every device reports memory
            return 0
        if avail and self.shard is not None and getattr(self, "model", None) is None:
            # a tensor-parallel rank sizes its pool before its shard loads (rank 0 tells every rank the size):
            # what the shard will take is not free
            avail = max(1, avail - self._shard_weight_bytes())
        return avail

    def _shard_weight_bytes(self) -> int:
        """About the bytes this rank's shard of the weights takes on the device."""
        a = self.kv_args
        layer = a.hidden_size * (2 * a.q_size + 2 * a.kv_size) + 3 * a.hidden_size * a.intermediate_size
        vocab = a.vocab_size * a.hidden_size * (1 if a.tie_embeddings else 2)
        return int((a.num_layers * layer + vocab) * (2 if self.dtype in ("bfloat16", "float16") else 4))

    # ------------------------------------------------------------------ step

    def forward_shard(self, layout: StepLayout) -> Any:
        """This rank's forward of the step (every rank runs it; only rank 0's returns logits)."""
        import paddle

        from fdx.model.gpu_llama import AttnGroup, GPUStep, plan_groups

        a, bs = self.kv_args, self.block_size
        KV = a.num_kv_heads
        tables, pos = layout.tables, layout.positions
        blk = tables[layout.seq_of, pos // bs]
        write_rows = ((blk[:, None] * KV + np.arange(KV)[None, :]) * bs + (pos % bs)[:, None]).reshape(-1)
        rows = layout.rows

        t = paddle.to_tensor
        groups = []
        m = self.model
        for g in plan_groups(self.kernels, layout.q_lens, layout.starts, tables, KV, bs, a.num_heads // KV,
                             plain_only=m.plain_attention, windows=m.layer_windows):
            up = {k: (t(v) if isinstance(v, np.ndarray) else v) for k, v in g.items()}
            if up.get("window_masks"):
                up["window_masks"] = {w: t(v) for w, v in up["window_masks"].items()}
            groups.append(AttnGroup(**up))
        pos_t = t(pos)
        rope_t = pos_t if layout.long_rope is None or not m.long_rope else t(pos + m.max_pos * layout.long_rope)
        step = GPUStep(
            ids=t(np.asarray(layout.ids, dtype=np.int64)),
            cos=paddle.index_select(m.cos, rope_t).unsqueeze(1),
            sin=paddle.index_select(m.sin, rope_t).unsqueeze(1),
            write_rows=t(write_rows),
            groups=groups,
            sample_rows=t(rows) if len(rows) else None,
            num_tokens=len(layout.ids),
            cos_local=None if m.cos_local is None else paddle.index_select(m.cos_local, pos_t).unsqueeze(1),
            sin_local=None if m.sin_local is None else paddle.index_select(m.sin_local, pos_t).unsqueeze(1),
        )
        with paddle.no_grad():
            return self.model.forward(step, self.caches)

    # ------------------------------------------------------------------ KV blocks

    def _kv_views(self) -> list[Any]:
        """The flat ``[2 * NB * KV * BS, D]`` tensors themselves."""
        assert self.caches is not None
        return self.caches

    def _block_rows(self, ids: np.ndarray) -> np.ndarray:
        """Flat cache rows of blocks ``ids``: ``[n, 2, KV*BS]`` (K then V)."""
        per = self.kv_args.num_kv_heads * self.block_size
        k = ids[:, None] * per + np.arange(per)[None, :]
        return np.stack([k, k + self._rows_per_half], axis=1)
