"""Load a model's tokenizer (fast, no weights) and its weights (numpy fp32).

The checkpoint's architecture name (HF ``architectures[0]``, GGUF
``general.architecture``) picks an :class:`fdx.model.arch.Architecture`
from the ``architecture`` plugins (:func:`find_architecture`); it names the
tensors, the layer recipe and the config fields fdx understands.  Any other
config field, GGUF key or tensor is refused, naming it (no silent misreads).

Weights come out in one canonical layout (see :class:`LayerWeights`), the
same for GGUF and Hugging Face checkpoints, so the forward pass has a single
code path.  GGUF q/k rows are un-permuted back to Hugging Face order.
Errors: a one-line :class:`ModelLoadError` naming the file and the reason.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
from typing import Any, Iterator

import attrs
import numpy as np

from fdx.core.errors import ModelLoadError, PluginError
from fdx.model.arch import (Architecture, FreqFactorRope, LinearRopeScaling, LongRopeScaling, ModelArgs, RopeScaling,
                            WeightNames)
from fdx.model.source import ModelSource, resolve
from fdx.model.tokenizer import ModelTokenizer, tokenizer_from_gguf, tokenizer_from_hf


@attrs.define
class LayerWeights:
    """One decoder block, HF layout (linear weights ``[out, in]``).  A
    mixture-of-experts layer (``ModelArgs.num_experts``) has ``router``
    and the stacked experts instead of ``w_gate``/``w_up``/``w_down``."""

    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray | None
    w_up: np.ndarray | None
    w_down: np.ndarray | None
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    #: per-head q/k RMSNorm weights ``[head_dim]`` (``ModelArgs.qk_norm``)
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    #: Gemma's sandwich norms ``[hidden]`` (``ModelArgs.sandwich_norms``)
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None
    #: mixture of experts: router ``[E, hidden]``; experts' gate and up
    #: ``[E, moe_intermediate, hidden]``, down ``[E, hidden, moe_intermediate]``
    router: np.ndarray | None = None
    e_gate: np.ndarray | None = None
    e_up: np.ndarray | None = None
    e_down: np.ndarray | None = None
    #: Qwen2-MoE's shared expert (``ModelArgs.shared_expert_size``): gate and up
    #: ``[width, hidden]``, down ``[hidden, width]``, its gate ``[hidden]``
    s_gate: np.ndarray | None = None
    s_up: np.ndarray | None = None
    s_down: np.ndarray | None = None
    s_gate_inp: np.ndarray | None = None
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
    #: callable ``(experts: range | None = None) -> Iterator[LayerWeights]``;
    #: ``experts``: read only those experts of a MoE layer (expert parallelism)
    layers: Any
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


def find_architecture(where: str, hf_names: list[str] | None = None, gguf_name: str | None = None,
                      model_type: str | None = None, gguf_experts: bool = False) -> Architecture:
    """The registered architecture claiming ``hf_names[0]`` (HF) or
    ``gguf_name`` (GGUF; ``gguf_experts``: the file has experts, so the
    claim of a mixture-of-experts architecture, as llama.cpp writes Mixtral
    as ``llama``); an HF config without ``architectures`` falls back to the
    architecture named ``model_type``.  Unknown: a :class:`ModelLoadError`
    listing the choices.  Two plugins claiming one name: a
    :class:`PluginError` naming both."""
    from fdx.core.plugins import get_plugins

    reg = get_plugins().registry("architecture")
    claims: dict[str, tuple[Architecture, str]] = {}
    by_name: dict[str, Architecture] = {}
    for name in reg.names():
        entry = reg.get(name)
        arch = entry.factory()
        by_name[arch.name] = arch
        keys = list(arch.hf_names) if hf_names is not None else ([gguf_claim(arch.gguf_name, arch.recipe.mlp == "moe")]
                                                                 if arch.gguf_name else [])
        for k in keys:
            if k in claims and claims[k][1] != entry.source.describe():
                raise PluginError(f"architecture name {k!r} is claimed twice: by {claims[k][1]} "
                                  f"and by {entry.source.describe()}")
            claims[k] = (arch, entry.source.describe())
    want = (hf_names[0] if hf_names else None) if hf_names is not None else \
        (gguf_claim(gguf_name, gguf_experts) if gguf_name is not None else None)
    if want in claims:
        return claims[want][0]
    if hf_names is not None and not hf_names and model_type in by_name:
        return by_name[model_type]
    choices = ", ".join(sorted(claims)) or "(none installed)"
    got = want if want is not None else model_type
    raise ModelLoadError(f"{where}: unsupported architecture {got!r} (supported: {choices})")


def gguf_claim(gguf_name: str, experts: bool) -> str:
    """The name a GGUF architecture is claimed under: ``general.architecture``,
    with `` (experts)`` for a mixture of experts (llama.cpp names Mixtral ``llama``)."""
    return f"{gguf_name} (experts)" if experts else gguf_name


def _refuse(where: str, what: str, key: str, value: Any, reason: str) -> ModelLoadError:
    v = repr(value)
    return ModelLoadError(f"{where}: unsupported {what} {key!r} = {v if len(v) <= 80 else v[:77] + '...'}: {reason}")


def _tensor_names(names: WeightNames, n_layers: int, *, qkv_bias: bool, qk_norm: bool,
                  sandwich: bool = False, num_experts: int = 0, shared: bool = False,
                  dense_layers: tuple[int, ...] = ()) -> tuple[set[str], set[str]]:
    """(required, optional) tensor names of a checkpoint of ``n_layers``
    (``dense_layers``: a mixture's layers with a dense MLP)."""
    moe = ["router", *(["shared_gate", "shared_up", "shared_down", "shared_expert_gate"] if shared else [])]
    dense = [*(["w_gate_up"] if names.w_gate_up else ["w_gate", "w_up"]), "w_down"]
    per = ["attn_norm", *(["wqkv"] if names.wqkv else ["wq", "wk", "wv"]), "wo", "ffn_norm"]
    opt = ["bq", "bk", "bv"]
    if qkv_bias:
        per, opt = per + opt, []
    if qk_norm:
        per += ["q_norm", "k_norm"]
    if sandwich:
        per += ["post_attn_norm", "post_ffn_norm"]
    req = {names.embed, names.final_norm}
    optional = {names.lm_head} | {t for t in (names.rope_long, names.rope_short, names.rope_freqs) if t}
    for i in range(n_layers):
        n = names.layer(i)
        sparse = bool(num_experts) and i not in dense_layers
        req |= {n[f] for f in (*per, *(moe if sparse else dense))}
        optional |= {n[f] for f in opt if n[f]}
        req |= {n[f].format(e=e) for e in range(num_experts if sparse else 0)
                for f in ("expert_gate", "expert_up", "expert_down")}
    return req, optional


def _check_tensors(where: str, present: Any, names: WeightNames, args: ModelArgs, ignore: tuple[str, ...] = ()) -> None:
    req, optional = _tensor_names(names, args.num_layers, qkv_bias=args.attention_bias, qk_norm=args.qk_norm,
                                  sandwich=args.sandwich_norms, num_experts=args.num_experts,
                                  shared=bool(args.shared_expert_size), dense_layers=args.dense_layers)
    for t in sorted(present):
        if t not in req and t not in optional and not t.endswith(ignore):
            raise ModelLoadError(f"{where}: unsupported tensor {t!r}: not part of fdx's {args.arch} architecture")
    for t in sorted(req):
        if t not in present:
            raise ModelLoadError(f"{where}: missing tensor {t!r}")


def _gguf_checkpoint(src: ModelSource) -> Checkpoint:
    from fdx.model.gguf_file import SUPPORTED_QUANTS, GGUFFile, raw_rows

    g = GGUFFile(src.path)
    gname = g.get("general.architecture")
    n_experts = int(g.get(f"{gname}.expert_count", 0) or 0)
    arch = find_architecture(src.path, gguf_name=gname, gguf_experts=n_experts > 0)
    names = arch.gguf_weights
    if names is None or arch.gguf_name is None:
        raise ModelLoadError(f"{src.path}: fdx reads architecture {gname!r} from HF folders only")
    bad = arch.check_gguf_keys(g.fields)
    if bad:
        raise _refuse(src.path, "metadata key", bad[0], g.fields[bad[0]], bad[1])
    ns = arch.gguf_name

    def meta(key: str, default: Any = None) -> Any:
        v = g.get(f"{ns}.{key}", default)
        if v is None:
            raise ModelLoadError(f"{src.path}: missing metadata key '{ns}.{key}'")
        return v

    n_layers = int(meta("block_count"))
    hidden = int(meta("embedding_length"))
    n_head = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_head))
    head_dim = int(g.get(f"{ns}.attention.key_length", hidden // n_head))
    rope_dim = int(g.get(f"{ns}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{src.path}: partial rotary (rope dim {rope_dim} != head dim {head_dim}) is unsupported")
    if names.embed not in g.tensors:
        raise ModelLoadError(f"{src.path}: missing tensor {names.embed!r}")
    vocab = int(g.tensors[names.embed].shape[0])
    moe: dict[str, Any] = {}
    if n_experts:  # llama.cpp renormalises the top-k weights of Mixtral (llama) and Qwen3-MoE, not Qwen2-MoE's
        k = int(meta("expert_used_count"))
        if not 1 <= k <= n_experts:
            raise ModelLoadError(f"{src.path}: unsupported metadata key '{ns}.expert_used_count' = {k}: "
                                 f"must be between 1 and the number of experts ({n_experts})")
        moe = dict(num_experts=n_experts, num_experts_per_tok=k, norm_topk_prob=arch.gguf_moe_renormalize,
                   moe_intermediate_size=int(g.get(f"{ns}.expert_feed_forward_length") or meta("feed_forward_length")))
        if arch.recipe.shared_expert:
            moe["shared_expert_size"] = int(meta("expert_shared_feed_forward_length"))
    args = ModelArgs(
        arch=arch.name,
        **_gguf_extras(g, arch, n_layers, hidden, head_dim),
        num_layers=n_layers,
        hidden_size=hidden,
        intermediate_size=moe["moe_intermediate_size"] if moe else int(meta("feed_forward_length")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        rope_theta=float(g.get(f"{ns}.rope.freq_base", 10000.0)),
        rms_eps=float(g.get(f"{ns}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(g.get(f"{ns}.context_length", 2048)),
        tie_embeddings=names.lm_head not in g.tensors,
        attention_bias=arch.recipe.qkv_bias,
        qk_norm=arch.recipe.qk_norm,
        **moe,
    )
    _check_recipe(src.path, arch)
    _check_tensors(src.path, g.tensors, names, args)
    for name in g.tensors:
        tn = g.type_name(name)
        if tn not in SUPPORTED_QUANTS:
            raise ModelLoadError(f"{src.path}: tensor {name!r} has unsupported type {tn}")
    permuted = arch.gguf_qk_permuted

    def unperm(w: np.ndarray, heads: int) -> np.ndarray:
        return _unpermute(w, heads) if permuted else w

    def quant(name: str, n_head: int | None = None) -> tuple[np.ndarray, int] | None:
        if not name or name not in g.tensors or g.type_name(name) not in QUANT_KERNEL_TYPES:
            return None
        rows, qt = raw_rows(g, name)
        return (unperm(rows, n_head) if n_head else rows), qt

    def opt(name: str) -> np.ndarray | None:
        return g.load(name) if name and name in g.tensors else None

    def layers(experts: range | None = None) -> Iterator[LayerWeights]:
        for i in range(n_layers):
            n = names.layer(i)
            raw = {"wq": quant(n["wq"], n_head), "wk": quant(n["wk"], n_kv), "wv": quant(n["wv"]), "wo": quant(n["wo"]),
                   **({f: quant(n[f]) for f in ("w_gate", "w_up", "w_down")} if not args.num_experts else {})}
            p = _projections(src.path, n, names, args, g.load, experts)
            p["wq"], p["wk"] = unperm(p["wq"], n_head), unperm(p["wk"], n_kv)
            yield LayerWeights(
                raw={k: v for k, v in raw.items() if v is not None},
                attn_norm=g.load(n["attn_norm"]),
                wo=g.load(n["wo"]),
                ffn_norm=g.load(n["ffn_norm"]),
                **p,
                bq=(lambda b: None if b is None else unperm(b, n_head))(opt(n["bq"])),
                bk=(lambda b: None if b is None else unperm(b, n_kv))(opt(n["bk"])),
                bv=opt(n["bv"]),
                q_norm=opt(n["q_norm"]) if args.qk_norm else None,
                k_norm=opt(n["k_norm"]) if args.qk_norm else None,
                post_attn_norm=opt(n["post_attn_norm"]) if args.sandwich_norms else None,
                post_ffn_norm=opt(n["post_ffn_norm"]) if args.sandwich_norms else None,
            )

    return Checkpoint(
        source=src,
        args=args,
        embed=g.load(names.embed),
        final_norm=g.load(names.final_norm),
        lm_head=None if args.tie_embeddings else g.load(names.lm_head),
        layers=layers,
        lm_head_raw=quant(names.embed if args.tie_embeddings else names.lm_head),
    )


def _gguf_extras(g: Any, arch: Architecture, n_layers: int, hidden: int, head_dim: int) -> dict[str, Any]:
    """The :class:`ModelArgs` fields beyond Llama's a GGUF carries, as
    llama.cpp reads them: LongRoPE from the ``rope_factors_*`` tensors and
    ``rope.scaling.attn_factor`` / ``original_context_length`` (Phi-3); the
    Llama 3.x's rope scaling from ``rope_freqs`` (one divisor per rotary
    frequency, as llama.cpp applies it); the
    sliding window (``attention.sliding_window``: every layer's, or, for Gemma,
    that of all but every ``window_pattern``-th layer: llama.cpp fixes Gemma 2's
    at 2 and Gemma 3's at 6); a linear rope scaling (Gemma 3's global layers;
    its sliding layers' base llama.cpp fixes at 10000); Gemma's caps, GeGLU,
    sandwich norms and embedding scale.  llama.cpp's converter stores Gemma's
    norm weights as ``1 + w`` already and writes no ``query_pre_attn_scalar``:
    llama.cpp scales the scores by ``head_dim ** -0.5`` (by
    ``(hidden / heads) ** -0.5`` for the 27B models: :data:`GEMMA_27B_LAYERS`),
    and so does fdx."""
    ns, names, rc = arch.gguf_name, arch.gguf_weights, arch.recipe
    out: dict[str, Any] = {}
    if names is not None and names.rope_short and names.rope_short in g.tensors:
        orig = g.get(f"{ns}.rope.scaling.original_context_length")
        if orig is None:
            raise ModelLoadError(f"{g.path}: tensor {names.rope_short!r} needs metadata key "
                                 f"'{ns}.rope.scaling.original_context_length'")
        short, long = (tuple(float(x) for x in g.load(t).reshape(-1)) for t in (names.rope_short, names.rope_long))
        out["rope_scaling"] = LongRopeScaling("longrope", short, long,
                                              float(g.get(f"{ns}.rope.scaling.attn_factor", 1.0)), int(orig))
    if names is not None and names.rope_freqs and names.rope_freqs in g.tensors:  # Llama 3.x: per-frequency divisors
        f = g.load(names.rope_freqs).reshape(-1)
        if f.shape[0] != head_dim // 2 or not np.all(f > 0):
            raise ModelLoadError(f"{g.path}: tensor {names.rope_freqs!r} must be {head_dim // 2} positive numbers "
                                 f"(head_dim / 2), got shape {list(f.shape)}")
        out["rope_scaling"] = FreqFactorRope("llama3", tuple(float(x) for x in f))
    window = g.get(f"{ns}.attention.sliding_window") or None  # 0: none (llama.cpp's Phi-4)
    if rc.window_pattern and window is not None:  # llama.cpp's fixed pattern: every n-th layer global
        out["layer_windows"] = tuple(int(window) if (i + 1) % rc.window_pattern else 0 for i in range(n_layers))
    elif window is not None:
        out["sliding_window"] = int(window)
    if g.get(f"{ns}.rope.scaling.type") == "linear":
        out["rope_scaling"] = LinearRopeScaling("linear", float(g.get(f"{ns}.rope.scaling.factor") or 1.0))
    if rc.local_rope:  # llama.cpp's Gemma 3: the sliding layers' base is fixed at 10000, unscaled
        out["rope_local_theta"] = 10_000.0
    if rc.norm == "rms_1p":
        n_head = int(g.get(f"{ns}.attention.head_count"))
        out.update(mlp_act="gelu_tanh" if rc.mlp == "geglu" else "silu", sandwich_norms=rc.sandwich_norms,
                   embed_scale=math.sqrt(hidden) if rc.embed_scale else None,
                   attn_scale=(hidden / n_head) ** -0.5 if n_layers == GEMMA_27B_LAYERS.get(ns) else None,
                   attn_softcap=_opt_float(g.get(f"{ns}.attn_logit_softcapping")),
                   final_softcap=_opt_float(g.get(f"{ns}.final_logit_softcapping")))
    return out


#: llama.cpp scales a Gemma's scores by ``(hidden / heads) ** -0.5`` for its 27B
#: models (which it tells by their layer count), by ``head_dim ** -0.5`` otherwise
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _check_recipe(where: str, arch: Architecture) -> None:
    bad = arch.recipe.unimplemented()
    if bad:
        raise ModelLoadError(f"{where}: architecture {arch.name!r} asks for layer recipe {bad}, which fdx's model lacks")


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


def hf_model_args(cfg: dict[str, Any], arch: Architecture, cfg_path: str) -> ModelArgs:
    """``config.json`` -> :class:`ModelArgs`, after refusing any field ``arch``
    does not understand (one line naming the field)."""
    bad = arch.check_hf_config(cfg)
    if bad:
        raise _refuse(cfg_path, "config field", bad[0], cfg[bad[0]], bad[1])
    _check_recipe(cfg_path, arch)
    # transformers >= 5 writes rope_parameters (theta inside); older configs rope_theta + rope_scaling
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta_default, local_theta = 10000.0, None
    if arch.recipe.local_rope:  # Gemma 3: the global layers' parameters; the sliding layers' base
        rp, theta_default, local_theta = _gemma3_rope(cfg)
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", theta_default)))
    scaling: RopeScaling | LongRopeScaling | LinearRopeScaling | None = None
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type == "linear":
        scaling = LinearRopeScaling("linear", float(rp["factor"]))
    elif rope_type == "llama3":
        scaling = RopeScaling("llama3", float(rp["factor"]), float(rp["low_freq_factor"]),
                              float(rp["high_freq_factor"]), int(rp["original_max_position_embeddings"]))
    elif rope_type in ("longrope", "su"):
        scaling = _longrope(rp, cfg, cfg_path)
    window_rule = arch.hf_fields.get("sliding_window")
    window = cfg.get("sliding_window") if window_rule is not None and window_rule.kind == "read" else None
    rc = arch.recipe
    try:
        hidden = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        layer_windows: tuple[int, ...] = ()
        if rc.window_pattern:  # per-layer windows (Gemma): honoured in the attention, not refused
            layer_windows = _layer_windows(cfg, window, rc.window_pattern, cfg_path)
            window = None
        gemma = dict(
            mlp_act="gelu_tanh" if rc.mlp == "geglu" else "silu",
            embed_scale=math.sqrt(hidden) if rc.embed_scale else None,
            sandwich_norms=rc.sandwich_norms,
            attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if cfg.get("query_pre_attn_scalar") else None,
            attn_softcap=_opt_float(cfg.get("attn_logit_softcapping")),
            final_softcap=_opt_float(cfg.get("final_logit_softcapping")),
            layer_windows=layer_windows,
            rope_local_theta=local_theta,
        )
        moe = _moe_args(cfg, arch, cfg_path) if arch.recipe.mlp == "moe" else {}
        return ModelArgs(
            arch=arch.name,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            # a MoE model's width is the experts', or its dense layers' where it has some
            intermediate_size=(int(cfg["intermediate_size"]) if not moe or moe.get("dense_layers")
                               else moe["moe_intermediate_size"]),
            num_heads=n_head,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg.get("head_dim") or hidden // n_head),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=theta,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch.recipe.qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=arch.recipe.qk_norm,
            rope_scaling=scaling,
            sliding_window=int(window) if window is not None else None,
            **gemma,
            **moe,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{cfg_path}: missing key {exc.args[0]!r}") from None


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], float, float]:
    """(the global layers' rope dict, their default base, the sliding layers'
    base), from v5's per-layer-type ``rope_parameters`` or v4's
    ``rope_scaling`` + ``rope_theta`` + ``rope_local_base_freq``
    (``Gemma3TextConfig``'s defaults: 1e6 and 1e4)."""
    rp = cfg.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:
        local = rp.get("sliding_attention") or {}
        return rp.get("full_attention") or {}, 1_000_000.0, float(local.get("rope_theta", 10_000.0))
    return cfg.get("rope_scaling") or rp, 1_000_000.0, float(cfg.get("rope_local_base_freq", 10_000.0))


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _layer_windows(cfg: dict[str, Any], window: Any, pattern: int, cfg_path: str) -> tuple[int, ...]:
    """Each layer's window (0: global) from ``layer_types``, else the config
    class's default pattern: every ``sliding_window_pattern``-th layer global
    (``pattern`` without it: Gemma 2's 2, so the even layers slide; Gemma 3's 6)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("_sliding_window_pattern") or cfg.get("sliding_window_pattern") or pattern)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if "sliding_attention" in types and window is None:
        raise ModelLoadError(f"{cfg_path}: config field 'layer_types' has sliding layers but 'sliding_window' is not set")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def _moe_args(cfg: dict[str, Any], arch: Architecture, cfg_path: str) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelArgs`: the expert count
    (``num_experts``, or ``num_local_experts`` as Mixtral and transformers 5
    write it), top-k, the expert width (``moe_intermediate_size``, else the
    dense ``intermediate_size`` as Mixtral) and the top-k renormalisation."""
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    if n is None:
        raise ModelLoadError(f"{cfg_path}: missing key 'num_experts' (or 'num_local_experts')")
    n, k = int(n), int(cfg["num_experts_per_tok"])
    if not 1 <= k <= n:
        raise ModelLoadError(f"{cfg_path}: unsupported config field 'num_experts_per_tok' = {k}: "
                             f"must be between 1 and the number of experts ({n})")
    width = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    out = dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=width,
               norm_topk_prob=arch.recipe.moe_renormalize or bool(cfg.get("norm_topk_prob", False)))
    if arch.recipe.shared_expert:  # Qwen2-MoE
        out["shared_expert_size"] = int(cfg["shared_expert_intermediate_size"])
    # transformers' Qwen2/3-MoE rule: layer i is sparse unless in mlp_only_layers, and only
    # when (i + 1) % decoder_sparse_step == 0; the others are a dense MLP
    only, step = cfg.get("mlp_only_layers") or [], int(cfg.get("decoder_sparse_step") or 1)
    dense = tuple(i for i in range(int(cfg["num_hidden_layers"])) if i in only or (i + 1) % step)
    if dense:
        out["dense_layers"] = dense
    return out


def _longrope(rp: dict[str, Any], cfg: dict[str, Any], cfg_path: str) -> LongRopeScaling:
    """transformers' ``_compute_longrope_parameters``: the original context
    from the rope dict, else the config; the attention factor given, else
    ``sqrt(1 + ln(factor) / ln(original))`` with ``factor`` given, else
    ``max_position_embeddings / original`` (1.0 when ``factor <= 1``)."""
    orig = rp.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if orig is None:
        raise ModelLoadError(f"{cfg_path}: rope type longrope needs 'original_max_position_embeddings'")
    orig = int(orig)
    factor = rp.get("factor")
    factor = float(factor) if factor is not None else int(cfg.get("max_position_embeddings", orig)) / orig
    attn = rp.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(orig))
    return LongRopeScaling(str(rp.get("rope_type", rp.get("type"))), tuple(map(float, rp["short_factor"])),
                           tuple(map(float, rp["long_factor"])), float(attn), orig)


def _split_rows(where: str, name: str, w: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """A fused projection's rows cut into ``sizes`` (q/k/v, gate/up)."""
    if w.ndim != 2 or w.shape[0] != sum(sizes):
        raise ModelLoadError(f"{where}: tensor {name!r} has shape {list(w.shape)}, expected {sum(sizes)} rows "
                             f"({' + '.join(map(str, sizes))})")
    return np.split(w, np.cumsum(sizes)[:-1], axis=0)


def _stack(where: str, parts: list[np.ndarray], name: str) -> np.ndarray:
    """The experts' matrices ``name`` (``*``: the expert) stacked ``[E, out, in]``."""
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ModelLoadError(f"{where}: tensors {name!r} differ in shape or are not matrices ({sorted(shapes)})")
    return np.stack(parts)


def _qk_scale(where: str, args: ModelArgs) -> float:
    """LongRoPE's attention factor (1.0 without it), folded into the q/k rows."""
    qk_scale = args.rope_scaling.attention_factor if isinstance(args.rope_scaling, LongRopeScaling) else 1.0
    if qk_scale != 1.0 and (args.qk_norm or args.attention_bias):  # the fold would be wrong
        raise ModelLoadError(f"{where}: longrope's attention factor with q/k norm or biases is not implemented")
    return qk_scale


def _projections(where: str, n: dict[str, str], names: WeightNames, args: ModelArgs, get: Any,
                 experts: range | None, dense: bool = False) -> dict[str, np.ndarray | None]:
    """Layer ``n``'s q/k/v and MLP matrices as :class:`LayerWeights` fields
    (``dense``: a mixture's dense layer, ModelArgs.dense_layers),
    read with ``get(name)``: fused q|k|v and gate|up split (Phi-3), LongRoPE's
    attention factor folded into q and k, a mixture of experts' router and
    experts ``[E, out, in]`` (only ``experts``, when given) from one tensor
    per expert (HF) or one stacked tensor per matrix (llama.cpp: a name
    without ``{e}``)."""
    if names.wqkv:
        wq, wk, wv = _split_rows(where, n["wqkv"], get(n["wqkv"]), (args.q_size, args.kv_size, args.kv_size))
    else:
        wq, wk, wv = get(n["wq"]), get(n["wk"]), get(n["wv"])
    qk_scale = _qk_scale(where, args)
    if qk_scale != 1.0:  # cos/sin x attention factor == q and k x it (RoPE is linear)
        wq, wk = wq * np.float32(qk_scale), wk * np.float32(qk_scale)
    out: dict[str, np.ndarray | None] = dict(wq=wq, wk=wk, wv=wv, w_gate=None, w_up=None, w_down=None)
    if args.num_experts and not dense:
        out["router"] = get(n["router"])
        held = experts if experts is not None else range(args.num_experts)
        for f in ("expert_gate", "expert_up", "expert_down"):
            if "{e}" in n[f]:
                out["e_" + f[7:]] = _stack(where, [get(n[f].format(e=e)) for e in held], n[f].format(e="*"))
                continue
            w = get(n[f])
            if w.ndim != 3 or w.shape[0] != args.num_experts:
                raise ModelLoadError(f"{where}: tensor {n[f]!r} has shape {list(w.shape)}, "
                                     f"expected [{args.num_experts}, out, in] (one matrix per expert)")
            out["e_" + f[7:]] = np.ascontiguousarray(w[list(held)])
        if args.shared_expert_size:  # Qwen2-MoE's shared expert and its [1, hidden] gate
            out.update(s_gate=get(n["shared_gate"]), s_up=get(n["shared_up"]), s_down=get(n["shared_down"]),
                       s_gate_inp=get(n["shared_expert_gate"]).reshape(-1))
        return out
    if names.w_gate_up:
        ff = args.intermediate_size
        out["w_gate"], out["w_up"] = _split_rows(where, n["w_gate_up"], get(n["w_gate_up"]), (ff, ff))
    else:
        out["w_gate"], out["w_up"] = get(n["w_gate"]), get(n["w_up"])
    out["w_down"] = get(n["w_down"])
    return out


#: HF tensors that carry no weights fdx needs (recomputed buffers saved by old transformers)
HF_IGNORED_TENSORS = (".rotary_emb.inv_freq",)


def _hf_checkpoint(src: ModelSource) -> Checkpoint:
    cfg = _hf_config(src.path)
    cfg_path = os.path.join(src.path, "config.json")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise _refuse(cfg_path, "config field", "architectures", archs, "not a list")
    arch = find_architecture(cfg_path, hf_names=archs, model_type=cfg.get("model_type"))
    args = hf_model_args(cfg, arch, cfg_path)
    names = arch.hf_weights
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
    _check_tensors(src.path, index, names, args, ignore=HF_IGNORED_TENSORS)

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

    # Gemma's (1 + w) RMSNorm: fold the 1 in, so every runner's norm is x * w
    one = np.float32(1.0) if arch.recipe.norm == "rms_1p" else None

    def norm(name: str) -> np.ndarray:
        w = get(name)
        return w if one is None else w + one

    _qk_scale(cfg_path, args)

    def layers(experts: range | None = None) -> Iterator[LayerWeights]:
        for i in range(args.num_layers):
            n = names.layer(i)
            p = _projections(src.path, n, names, args, get, experts, dense=i in args.dense_layers)
            yield LayerWeights(
                attn_norm=norm(n["attn_norm"]),
                wo=get(n["wo"]),
                ffn_norm=norm(n["ffn_norm"]),
                **p,
                bq=get(n["bq"], optional=True) if n["bq"] else None,
                bk=get(n["bk"], optional=True) if n["bk"] else None,
                bv=get(n["bv"], optional=True) if n["bv"] else None,
                q_norm=norm(n["q_norm"]) if args.qk_norm else None,
                k_norm=norm(n["k_norm"]) if args.qk_norm else None,
                post_attn_norm=norm(n["post_attn_norm"]) if args.sandwich_norms else None,
                post_ffn_norm=norm(n["post_ffn_norm"]) if args.sandwich_norms else None,
            )

    lm_head = None if args.tie_embeddings else get(names.lm_head, optional=True)
    if lm_head is None and not args.tie_embeddings:
        args = attrs.evolve(args, tie_embeddings=True)
    return Checkpoint(
        source=src,
        args=args,
        embed=get(names.embed),
        final_norm=norm(names.final_norm),
        lm_head=lm_head,
        layers=layers,
    )


def _to_f32(t: np.ndarray) -> np.ndarray:
    if t.dtype == np.float32:
        return t
    if t.dtype.kind == "V" or str(t.dtype) == "bfloat16":  # pragma: no cover - numpy has no bf16
        return (t.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return t.astype(np.float32)
