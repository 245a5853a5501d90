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

import ctypes
import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from fdx.config import EngineConfig
from fdx.core.errors import ModelLoadError
from fdx.core.interfaces import Device
from fdx.model.runner_base import StepLayout
from fdx.model.tp_runner import TensorParallelRunner

if TYPE_CHECKING:
    from fdx.parallel.group import RankLink

log = logging.getLogger("fdx.model")


#: ``--dtype`` names the cpu runner accepts -> the compute mode they ask for
#: (``auto``: int8 where it can run, else float32)
CPU_DTYPES = {"auto": "int8", "int8": "int8", "bfloat16": "bfloat16", "bf16": "bfloat16",
              "float32": "float32", "fp32": "float32"}


def requested_compute(requested: str | None) -> str:
    """The compute mode ``--dtype`` asks for; a one-line error listing the
    choices for a name the cpu runner does not know."""
    mode = CPU_DTYPES.get((requested or "auto").lower())
    if mode is None:
        raise ModelLoadError(f"--dtype {requested}: the Paddle CPU runner supports auto, int8, bfloat16, float32")
    return mode


def resolve_compute(requested: str, ops: Any, args: Any) -> str:
    """The compute mode (``"int8"``/``"bfloat16"``/``"float32"``, see
    :mod:`fdx.model.llama`) for ``--dtype``: ``float32``/``fp32``; ``int8``
    or ``bfloat16``/``bf16`` (need the native ops and layer widths that are
    multiples of 32: otherwise a one-line error); ``auto`` = int8 where it
    can run, else float32."""
    mode = requested_compute(requested)
    if mode == "float32":
        return mode
    why = None
    if ops is None:
        why = "fdx's native CPU ops are not loaded (FDX_NATIVE_OPS=0, no AVX2/AVX-512, or no compiler)"
    elif any(d % 32 for d in (args.hidden_size, args.q_size, args.intermediate_size)):
        why = "the layer widths are not multiples of 32"
    if why is None:
        return mode
    if (requested or "auto").lower() != "auto":
        raise ModelLoadError(f"--dtype {requested}: {why}; use --dtype float32")
    return "float32"


def kv_pool_dtype(requested: str, compute: str, native_attention: bool) -> str:
    """The CPU runner's KV pool dtype for ``--kv-cache-dtype``.  bfloat16
    needs int8 or bfloat16 compute (float32 is the exact path: HF's logits
    to 1e-3) and the C++ attention, which reads and writes it
    (paged_attention.cc's BFLOAT16 CACHE).  ``auto`` is bfloat16 with int8
    compute, the speed default (vLLM keeps the cache in the model's 16-bit
    dtype, llama.cpp in f16): half the bytes, which decode attention is
    bound by reading (1.2x decode at 32 sequences of ~300 tokens); float32
    with the accuracy modes, bfloat16 (whose top-1 against float32 the
    bfloat16 cache moves at near-ties: docs/PERFORMANCE.md) and float32."""
    if requested == "auto":
        return "bfloat16" if compute == "int8" and native_attention else "float32"
    if requested == "float32":
        return "float32"
    if compute == "float32":
        raise ModelLoadError(f"--kv-cache-dtype {requested}: float32 compute keeps a float32 KV cache (the exact "
                             "path); use --dtype int8 or bfloat16")
    if not native_attention:
        raise ModelLoadError(f"--kv-cache-dtype {requested}: needs fdx's C++ attention op, which this model does "
                             "not run (Gemma 2's soft-capped attention, or the ops did not load); leave it auto")
    return requested


class PaddleModelRunner(TensorParallelRunner):
    """The ``cpu`` runner: a bfloat16 KV pool with int8 compute (float32
    with bfloat16 and float32 compute; ``--kv-cache-dtype``), :class:`LlamaModel` in int8, bfloat16 or
    float32 compute (``--dtype``; C++ ops where the device has them), the NumPy
    sampler.  What it shares with the ``gpu`` runner is in
    :class:`~fdx.model.runner_base.PagedRunnerBase` and, for tensor
    parallelism, :class:`~fdx.model.tp_runner.TensorParallelRunner`."""

    #: the C++ ops read int32 block tables
    table_dtype = np.int32
    #: LlamaModel's attention (the C++ op or the pure-Paddle one) takes each layer's window
    honours_sliding_window = True
    #: LlamaModel rotates each row by its own LongRoPE factor set (StepLayout.long_rope)
    honours_long_rope = True

    def __init__(self, config: EngineConfig, device: Device, link: RankLink | None = None,
                 on_layer: Callable[[], None] | None = None) -> None:
        """``link``: this process is worker rank ``link.rank`` of a
        tensor-parallel group (:mod:`fdx.parallel.worker`; ``on_layer``
        reports each loaded layer).  Without it and with
        ``--tensor-parallel-size N > 1``, this is rank 0: it starts the
        group's other ranks (:class:`fdx.parallel.group.RankGroup`)."""
        from fdx.logs import import_paddle_quietly

        import_paddle_quietly()  # after the device set the threads; its start-up notices go to the log at debug
        import paddle

        from fdx.model.llama import LlamaModel
        from fdx.model.sampler import Sampler

        self.config = config
        self.device = device
        paddle.set_device(device.paddle_place())
        paddle.disable_static()
        requested_compute(config.dtype)  # an unknown name fails before the checkpoint opens
        ckpt = self._open_checkpoint(config)
        self._take_shard(config, link)  # tensor parallelism: this rank's geometry (fdx.model.tp_runner)

        ops = None
        if device.attention_backend() == "native":
            from fdx.model.native import load_ops

            ops = load_ops()
        from fdx.model.native import sampling_kernel

        self.attention_impl = "native" if ops is not None else "paddle"
        #: "int8", "bfloat16" or "float32" (see fdx.model.llama)
        self.compute = resolve_compute(config.dtype, ops, self.kv_args)
        # Gemma 2's soft-capped attention runs in Paddle (LlamaModel.paddle_attention), on a float32 cache
        native_attention = ops is not None and not self.kv_args.attn_softcap
        self.dtype = kv_pool_dtype(config.kv_cache_dtype, self.compute, native_attention)  # the KV pool's
        if native_attention:  # the C++ op's keys, turned key-major in block I/O
            self.key_blocks = "dim-major"
        self._size_kv_pool()
        if self.shard is not None:
            ckpt = self._join_group(ckpt, link, on_layer)
        self.model = LlamaModel(self.kv_args, self.max_model_len, ops, self.compute, comm=self.comm,
                                vocab_start=self.shard.vocab_start if self.shard else 0, vocab_size=self.vocab_size)
        if self.model.paddle_attention:  # Gemma 2's soft-caps: the pure-Paddle attention
            self.attention_impl = "paddle"
            assert self.dtype == "float32", "the Paddle attention reads a float32 cache"
        with paddle.no_grad():
            self.model.load(ckpt, progress=self.shard is None)
        del ckpt
        self.caches: list[Any] | None = self._allocate()
        self._group_ready()
        self.sampler = Sampler(self.vocab_size, config.max_logprobs, seed=config.seed, native=sampling_kernel())
        log.info(
            "model %s (%s) on %s: %d KV blocks x %d tokens, kv_cache=%s, attention=%s, compute=%s",
            self.source.name, self.args.describe(), device.paddle_place(), self.num_kv_blocks, self.block_size,
            self.dtype, self.attention_impl, self.compute,
        )

    def _kv_extra(self) -> str:
        """int8 compute writes other K/V values than float32 compute: its
        blocks get their own fingerprint (float32 keeps the shared one)."""
        return "" if self.compute == "float32" else f"|compute={self.compute}"

    # ------------------------------------------------------------------ step

    def forward_shard(self, layout: StepLayout) -> Any:
        """This rank's forward of the step (every rank runs it; only rank 0's returns logits)."""
        import paddle

        from fdx.model.llama import StepInputs

        tables, positions, seq_of = layout.tables, layout.positions, layout.seq_of
        meta = np.stack([seq_of.astype(np.int32), positions.astype(np.int32)], axis=1)
        rows = layout.rows
        step = StepInputs(
            ids=paddle.to_tensor(np.asarray(layout.ids, dtype=np.int64)),
            meta=paddle.to_tensor(meta),
            tables=paddle.to_tensor(tables),
            sample_rows=paddle.to_tensor(rows) if len(rows) else None,
            positions=positions,
            seq_of=seq_of,
            q_starts=layout.q_starts,
            q_lens=layout.q_lens,
            ctx_lens=layout.starts + layout.q_lens,
            tables_np=tables,
            long_rope=layout.long_rope,
        )
        with paddle.no_grad():
            return self.model.forward(step, self.caches)

    # ------------------------------------------------------------------ KV blocks

    def _kv_views(self) -> list[Any]:
        """``[2, NB, KV, BS, D]`` per layer viewed as ``[2 * NB, KV*BS*D]``."""
        assert self.caches is not None
        return [c.reshape([2 * self.num_kv_blocks, -1]) for c in self.caches]

    def _block_rows(self, ids: np.ndarray) -> np.ndarray:
        return np.stack([ids, ids + self.num_kv_blocks], axis=1)[:, :, None]

    def _host_pools(self) -> list[np.ndarray] | None:
        """The pool in host memory, no copy: float32 through DLPack; bfloat16
        (which NumPy and DLPack's consumers lack) as its uint16 bit patterns
        over the tensor's memory (the arrays live no longer than
        :attr:`caches`: they are made per call)."""
        if self.caches is None:
            return None
        if self.dtype == "float32":
            return [np.from_dlpack(c).reshape(2, self.num_kv_blocks, -1) for c in self.caches]
        return [np.ctypeslib.as_array(ctypes.cast(c.data_ptr(), ctypes.POINTER(ctypes.c_uint16)),
                                      shape=(int(np.prod(c.shape)),)).reshape(2, self.num_kv_blocks, -1)
                for c in self.caches]
