"""Load a model's tokenizer (fast, no weights) and its weights (numpy fp32).

Weights come out in one canonical layout (see :class:`LayerWeights`), the
same for GGUF and Hugging Face checkpoints, so the forward pass has a single
code path.  GGUF q/k rows are un-permuted back to Hugging Face order.
Errors: a one-line :class:`ModelLoadError` naming the file and the reason.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from typing import Any, Iterator

import attrs
import numpy as np

from fdx.core.errors import ModelLoadError
from fdx.model.arch import SUPPORTED_ARCHS, ModelArgs
from fdx.model.source import ModelSource, resolve
from fdx.model.tokenizer import ModelTokenizer, tokenizer_from_gguf, tokenizer_from_hf


@attrs.define
class LayerWeights:
    """One decoder block, HF layout (linear weights ``[out, in]``)."""

    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    #: GGUF block-quantized rows of the linear weights (same row order as the
    #: fp32 arrays): name -> (uint8 [out, row_bytes], ggml type id)
    raw: dict[str, tuple[np.ndarray, int]] = attrs.field(factory=dict)


@attrs.define
class Checkpoint:
    """Everything needed to build the model; layers are produced lazily so
    the caller can convert and drop them one at a time."""

    source: ModelSource
    args: ModelArgs
    embed: np.ndarray
    final_norm: np.ndarray
    lm_head: np.ndarray | None  # None when tied to ``embed``
    layers: Any  # callable () -> Iterator[LayerWeights]
    #: raw quantized rows of the LM head (``output`` or the tied embedding)
    lm_head_raw: tuple[np.ndarray, int] | None = None


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------


def load_tokenizer(model: str | None) -> ModelTokenizer:
    """The tokenizer + chat template of ``model`` (no weights are read).
    Cached per file (path, mtime, size) in this process."""
    src = resolve(model)
    return _load_tokenizer_cached(src, src.stamp())


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(src: ModelSource, stamp: tuple[str, int, int]) -> ModelTokenizer:
    if src.kind == "gguf":
        from fdx.model.gguf_file import GGUFFile

        g = GGUFFile(src.path)
        return tokenizer_from_gguf(g.fields, src.path)
    cfg = _hf_config(src.path)
    return tokenizer_from_hf(src.path, vocab_size=int(cfg.get("vocab_size", 0)) or None)


# --------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------


def load_checkpoint(model: str | None) -> Checkpoint:
    src = resolve(model)
    if src.kind == "gguf":
        return _gguf_checkpoint(src)
    return _hf_checkpoint(src)


#: ggml types the C++ ``fdx_qgemv`` kernel reads directly (Q4_0, Q4_1, Q8_0)
QUANT_KERNEL_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> halves)."""
    out, *rest = w.shape
    hd = out // n_head
    return w.reshape(n_head, hd // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _gguf_checkpoint(src: ModelSource) -> Checkpoint:
    from fdx.model.gguf_file import GGUFFile

    g = GGUFFile(src.path)
    arch = g.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{src.path}: unsupported architecture {arch!r} (GGUF supports: llama)")

    def meta(key: str, default: Any = None) -> Any:
        v = g.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"{src.path}: missing metadata key '{arch}.{key}'")
        return v

    n_layers = int(meta("block_count"))
    hidden = int(meta("embedding_length"))
    n_head = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_head))
    head_dim = int(g.get(f"{arch}.attention.key_length", hidden // n_head))
    rope_dim = int(g.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{src.path}: partial rotary (rope dim {rope_dim} != head dim {head_dim}) is unsupported")
    if "token_embd.weight" not in g.tensors:
        raise ModelLoadError(f"{src.path}: missing tensor 'token_embd.weight'")
    vocab = int(g.tensors["token_embd.weight"].shape[0])
    args = ModelArgs(
        arch="llama",
        num_layers=n_layers,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        rope_theta=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(g.get(f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in g.tensors,
        attention_bias=False,
    )
    for name, info in g.tensors.items():
        tn = g.type_name(name)
        from fdx.model.gguf_file import SUPPORTED_QUANTS

        if tn not in SUPPORTED_QUANTS:
            raise ModelLoadError(f"{src.path}: tensor {name!r} has unsupported type {tn}")

    from fdx.model.gguf_file import raw_rows

    def quant(name: str, n_head: int | None = None) -> tuple[np.ndarray, int] | None:
        if g.type_name(name) not in QUANT_KERNEL_TYPES:
            return None
        rows, qt = raw_rows(g, name)
        return (_unpermute(rows, n_head) if n_head else rows), qt

    def layers() -> Iterator[LayerWeights]:
        for i in range(n_layers):
            p = f"blk.{i}."
            raw = {
                "wq": quant(p + "attn_q.weight", n_head),
                "wk": quant(p + "attn_k.weight", n_kv),
                "wv": quant(p + "attn_v.weight"),
                "wo": quant(p + "attn_output.weight"),
                "w_gate": quant(p + "ffn_gate.weight"),
                "w_up": quant(p + "ffn_up.weight"),
                "w_down": quant(p + "ffn_down.weight"),
            }
            yield LayerWeights(
                raw={k: v for k, v in raw.items() if v is not None},
                attn_norm=g.load(p + "attn_norm.weight"),
                wq=_unpermute(g.load(p + "attn_q.weight"), n_head),
                wk=_unpermute(g.load(p + "attn_k.weight"), n_kv),
                wv=g.load(p + "attn_v.weight"),
                wo=g.load(p + "attn_output.weight"),
                ffn_norm=g.load(p + "ffn_norm.weight"),
                w_gate=g.load(p + "ffn_gate.weight"),
                w_up=g.load(p + "ffn_up.weight"),
                w_down=g.load(p + "ffn_down.weight"),
            )

    return Checkpoint(
        source=src,
        args=args,
        embed=g.load("token_embd.weight"),
        final_norm=g.load("output_norm.weight"),
        lm_head=None if args.tie_embeddings else g.load("output.weight"),
        layers=layers,
        lm_head_raw=quant("token_embd.weight" if args.tie_embeddings else "output.weight"),
    )


def _hf_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: invalid config (not a JSON object)")
    return cfg


_HF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}


def _hf_checkpoint(src: ModelSource) -> Checkpoint:
    cfg = _hf_config(src.path)
    cfg_path = os.path.join(src.path, "config.json")
    archs = cfg.get("architectures") or []
    mt = cfg.get("model_type")
    arch = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None)
    if arch is None and mt in SUPPORTED_ARCHS:
        arch = mt
    if arch is None:
        raise ModelLoadError(
            f"{cfg_path}: unsupported architecture {(archs or [mt])[0]!r} (supported: LlamaForCausalLM, Qwen2ForCausalLM)"
        )
    rs = cfg.get("rope_scaling")
    if rs and (rs.get("rope_type") or rs.get("type")) not in (None, "default"):
        raise ModelLoadError(f"{cfg_path}: unsupported rope_scaling {rs!r}")
    try:
        hidden = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        args = ModelArgs(
            arch=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=n_head,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg.get("head_dim") or hidden // n_head),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{cfg_path}: missing key {exc.args[0]!r}") from None
    files = sorted(glob.glob(os.path.join(src.path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{src.path}: no *.safetensors files")
    from safetensors import safe_open

    handles: dict[str, Any] = {}
    index: dict[str, str] = {}
    for fpath in files:
        try:
            h = safe_open(fpath, framework="numpy")
            for k in h.keys():
                index[k] = fpath
            handles[fpath] = h
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
            raise ModelLoadError(f"{fpath}: corrupt safetensors file ({exc})") from None

    def get(name: str, optional: bool = False) -> np.ndarray | None:
        f = index.get(name)
        if f is None:
            if optional:
                return None
            raise ModelLoadError(f"{src.path}: missing tensor {name!r}")
        try:
            t = handles[f].get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"{f}: cannot read tensor {name!r} ({exc})") from None
        return _to_f32(t)

    def layers() -> Iterator[LayerWeights]:
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            yield LayerWeights(
                attn_norm=get(p + "input_layernorm.weight"),
                wq=get(p + "self_attn.q_proj.weight"),
                wk=get(p + "self_attn.k_proj.weight"),
                wv=get(p + "self_attn.v_proj.weight"),
                wo=get(p + "self_attn.o_proj.weight"),
                ffn_norm=get(p + "post_attention_layernorm.weight"),
                w_gate=get(p + "mlp.gate_proj.weight"),
                w_up=get(p + "mlp.up_proj.weight"),
                w_down=get(p + "mlp.down_proj.weight"),
                bq=get(p + "self_attn.q_proj.bias", optional=not args.attention_bias),
                bk=get(p + "self_attn.k_proj.bias", optional=not args.attention_bias),
                bv=get(p + "self_attn.v_proj.bias", optional=not args.attention_bias),
            )

    lm_head = None if args.tie_embeddings else get("lm_head.weight", optional=True)
    if lm_head is None and not args.tie_embeddings:
        args = attrs.evolve(args, tie_embeddings=True)
    return Checkpoint(
        source=src,
        args=args,
        embed=get("model.embed_tokens.weight"),
        final_norm=get("model.norm.weight"),
        lm_head=lm_head,
        layers=layers,
    )


def _to_f32(t: np.ndarray) -> np.ndarray:
    if t.dtype == np.float32:
        return t
    if t.dtype.kind == "V" or str(t.dtype) == "bfloat16":  # pragma: no cover - numpy has no bf16
        return (t.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return t.astype(np.float32)
