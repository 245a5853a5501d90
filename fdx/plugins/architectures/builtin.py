"""fdx's built-in architectures: Llama (1, 2, 3.x), Qwen2, Qwen3, Mistral, Phi-3,
Gemma 2, Gemma 3 (text), and the mixtures of experts Qwen3-MoE, Qwen2-MoE
(with its shared expert) and Mixtral.

All share the Llama skeleton and fdx's one model code; what differs is
declared here (recipe, weight names, the config fields each understands).
Registered through ``fdx_register_architectures``, exactly as a third-party
package registers one.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from fdx.core.hookspecs import Register, hookimpl
from fdx.model.arch import (
    GGUF_LLAMA_WEIGHTS,
    HF_LLAMA_WEIGHTS,
    Architecture,
    FieldRule,
    LayerRecipe,
    equals,
    harmless,
    read,
)

#: keys of a rope-parameters dict (``rope_scaling`` / v5 ``rope_parameters``) by rope type
ROPE_KEYS = {
    "default": frozenset({"rope_type", "type", "rope_theta"}),
    "llama3": frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
    "longrope": frozenset({"rope_type", "type", "rope_theta", "short_factor", "long_factor", "factor",
                           "attention_factor", "original_max_position_embeddings"}),
}
ROPE_KEYS["linear"] = frozenset({"rope_type", "type", "rope_theta", "factor"})
ROPE_KEYS["su"] = ROPE_KEYS["longrope"]  # longrope's first name (early Phi-3 configs)
#: keys a rope type may omit (its default applies)
ROPE_OPTIONAL = {"longrope": frozenset({"factor", "attention_factor", "original_max_position_embeddings"})}
ROPE_OPTIONAL["su"] = ROPE_OPTIONAL["longrope"]


def rope_check(*types: str, partial_rotary: bool = False) -> Any:
    """A check of ``rope_scaling`` / ``rope_parameters``: ``None`` or a dict of a
    rope type in ``types`` with exactly the keys fdx reads for it.
    ``partial_rotary``: the dict may carry ``partial_rotary_factor`` (Phi-3's
    config class always writes it), refused unless 1.0."""

    def check(v: Any, cfg: Mapping[str, Any]) -> str | None:
        if v is None:
            return None
        if not isinstance(v, dict):
            return f"{v!r} is not an object"
        rt = v.get("rope_type", v.get("type", "default"))
        if rt not in types:
            return f"rope type {rt!r} is not implemented (fdx implements {', '.join(types)})"
        keys = set(v)
        if partial_rotary and "partial_rotary_factor" in keys:
            if v["partial_rotary_factor"] != 1.0:
                return f"partial_rotary_factor {v['partial_rotary_factor']!r} is not implemented (fdx implements 1.0)"
            keys.discard("partial_rotary_factor")
        extra = sorted(keys - ROPE_KEYS[rt])
        if extra:
            return f"key {extra[0]!r} (rope type {rt!r}) is not implemented"
        missing = sorted(ROPE_KEYS[rt] - {"rope_type", "type", "rope_theta"} - ROPE_OPTIONAL.get(rt, frozenset()) - keys)
        if missing:
            return f"rope type {rt!r} needs {missing[0]!r}"
        return None

    return check


def _longrope_factors(v: Any, cfg: Mapping[str, Any]) -> str | None:
    """LongRoPE's factor lists: ``head_dim / 2`` positive numbers each."""
    if not isinstance(v, dict) or v.get("rope_type", v.get("type")) not in ("longrope", "su"):
        return None
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    half = (cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0)) // 2
    for key in ("short_factor", "long_factor"):
        f = v[key]
        if not (isinstance(f, list) and len(f) == half and all(isinstance(x, (int, float)) and x > 0 for x in f)):
            return f"{key} must be {half} positive numbers (head_dim / 2)"
    return None


def _all(*checks: Any) -> Any:
    def check(v: Any, cfg: Mapping[str, Any]) -> str | None:
        return next((why for why in (c(v, cfg) for c in checks) if why), None)

    return check


def _full_attention(v: Any, cfg: Mapping[str, Any]) -> str | None:
    bad = [t for t in (v or []) if t != "full_attention"]
    return f"layer type {bad[0]!r} is not implemented (fdx implements 'full_attention')" if bad else None


def _positive_window(v: Any, cfg: Mapping[str, Any]) -> str | None:
    if v is None or (isinstance(v, int) and v > 0):
        return None  # served only while every sequence fits in it (checked at runner start)
    return f"{v!r} is not a positive integer"


_r = read()
LLAMA_FIELDS: dict[str, FieldRule] = {
    "vocab_size": _r, "hidden_size": _r, "intermediate_size": _r, "num_hidden_layers": _r,
    "num_attention_heads": _r, "num_key_value_heads": _r, "head_dim": _r, "rms_norm_eps": _r,
    "max_position_embeddings": _r, "tie_word_embeddings": _r, "rope_theta": _r, "attention_bias": _r,
    "hidden_act": read(equals("silu")), "mlp_bias": read(equals(False)),
    "rope_scaling": read(rope_check("default", "llama3")), "rope_parameters": read(rope_check("default", "llama3")),
}
PLAIN_ROPE = {"rope_scaling": read(rope_check("default")), "rope_parameters": read(rope_check("default"))}
QWEN_FIELDS: dict[str, FieldRule] = {
    **{k: v for k, v in LLAMA_FIELDS.items() if k != "mlp_bias"}, **PLAIN_ROPE,
    "use_sliding_window": read(equals(False)), "sliding_window": harmless(),  # used only with use_sliding_window, refused when true
    "max_window_layers": harmless(), "layer_types": read(_full_attention),
}
MISTRAL_FIELDS: dict[str, FieldRule] = {
    **{k: v for k, v in LLAMA_FIELDS.items() if k not in ("mlp_bias", "attention_bias")}, **PLAIN_ROPE,
    "sliding_window": read(_positive_window),
}
_phi3_rope = read(_all(rope_check("default", "longrope", "su", partial_rotary=True), _longrope_factors))
PHI3_FIELDS: dict[str, FieldRule] = {
    **{k: v for k, v in LLAMA_FIELDS.items() if k not in ("mlp_bias", "attention_bias")},
    "rope_scaling": _phi3_rope, "rope_parameters": _phi3_rope,
    "original_max_position_embeddings": read(),  # longrope's short/long boundary and attention factor
    "partial_rotary_factor": read(equals(1.0)),  # v4 configs keep it at the top level
    "attention_bias": read(equals(False)),  # Phi-3's projections have no biases
    "sliding_window": read(_positive_window),
    "resid_pdrop": harmless(), "embd_pdrop": harmless(),  # dropout: training only
    # Microsoft's checkpoints name their remote-code classes; those compute
    # what transformers' own Phi3ForCausalLM (which fdx matches) computes
    "auto_map": harmless(),
}

def _layer_types(v: Any, cfg: Mapping[str, Any]) -> str | None:
    """Gemma's per-layer attention kinds: one per layer, each sliding or full."""
    if v is None:
        return None  # the config class's default pattern (the loader derives it)
    if not isinstance(v, list) or len(v) != cfg.get("num_hidden_layers"):
        return f"must list one layer type per layer ({cfg.get('num_hidden_layers')})"
    bad = [t for t in v if t not in ("sliding_attention", "full_attention")]
    return f"layer type {bad[0]!r} is not implemented (fdx implements 'sliding_attention', 'full_attention')" if bad else None


def _positive_or_none(v: Any, cfg: Mapping[str, Any]) -> str | None:
    return None if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0) else \
        f"{v!r} is not a positive number"


def _same_as_window(v: Any, cfg: Mapping[str, Any]) -> str | None:
    return None if v == cfg.get("sliding_window") else f"{v!r} differs from sliding_window {cfg.get('sliding_window')!r}"


_gelu_tanh = read(equals("gelu_pytorch_tanh"))
GEMMA2_FIELDS: dict[str, FieldRule] = {
    **{k: v for k, v in LLAMA_FIELDS.items() if k not in ("mlp_bias", "hidden_act")}, **PLAIN_ROPE,
    "hidden_activation": _gelu_tanh, "hidden_act": _gelu_tanh,  # v4 configs carry both
    "attention_bias": read(equals(False)),  # Gemma's o_proj would take a bias too
    "query_pre_attn_scalar": read(_positive_or_none),
    "attn_logit_softcapping": read(_positive_or_none), "final_logit_softcapping": read(_positive_or_none),
    "sliding_window": read(_positive_window), "layer_types": read(_layer_types),
    "sliding_window_size": harmless(_same_as_window),  # an alias some Gemma 2 checkpoints carry
    "cache_implementation": harmless(),  # transformers' KV cache class ("hybrid")
    "use_bidirectional_attention": read(equals(None, False)),
}

_global_rope, _local_rope = rope_check("default", "linear"), rope_check("default")


def _gemma3_rope(v: Any, cfg: Mapping[str, Any]) -> str | None:
    """Gemma 3's ``rope_parameters``: per layer type (transformers >= 5), the
    global layers' default or linear, the sliding layers' default."""
    if isinstance(v, dict) and set(v) <= {"sliding_attention", "full_attention"} and v:
        return next((f"{kind}: {why}" for kind, check in (("full_attention", _global_rope), ("sliding_attention", _local_rope))
                     if (why := check(v.get(kind), cfg))), None)
    return _global_rope(v, cfg)  # a flat dict: the global layers' (v4's rope_scaling)


GEMMA3_FIELDS: dict[str, FieldRule] = {
    **{k: v for k, v in GEMMA2_FIELDS.items() if k != "sliding_window_size"},
    "rope_parameters": read(_gemma3_rope), "rope_scaling": read(_gemma3_rope),
    "rope_local_base_freq": read(),  # v4: the sliding layers' rope base
    "sliding_window_pattern": read(), "_sliding_window_pattern": read(),  # layer_types' default: every n-th global
}


def _layer_list(v: Any, cfg: Mapping[str, Any]) -> str | None:
    n = cfg.get("num_hidden_layers")
    ok = v is None or (isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < (n or 0)
                                                   for i in v))
    return None if ok else f"{v!r} is not a list of layer indices (0 .. num_hidden_layers - 1)"


def _positive_int(v: Any, cfg: Mapping[str, Any]) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v > 0 else f"{v!r} is not a positive integer"


#: the config fields of a mixture of experts (both Qwen3-MoE's and Mixtral's names)
MOE_FIELDS: dict[str, FieldRule] = {
    "num_experts": read(_positive_int), "num_local_experts": read(_positive_int),
    "num_experts_per_tok": read(_positive_int),
    "output_router_logits": harmless(), "router_aux_loss_coef": harmless(),  # the training loss
}
QWEN3_MOE_FIELDS: dict[str, FieldRule] = {
    **QWEN_FIELDS, **MOE_FIELDS,
    "moe_intermediate_size": read(_positive_int), "norm_topk_prob": read(),
    # transformers' rule: layer i is sparse unless listed and only when (i + 1) % step == 0;
    # the other layers are a dense SwiGLU of intermediate_size (ModelArgs.dense_layers)
    "decoder_sparse_step": read(_positive_int), "mlp_only_layers": read(_layer_list),
    "intermediate_size": read(),
}
#: Qwen2-MoE: Qwen3-MoE's fields (every layer sparse) plus the shared expert's
#: width and the q/k/v biases' switch (the recipe's biases: true only)
QWEN2_MOE_FIELDS: dict[str, FieldRule] = {
    **QWEN3_MOE_FIELDS, "shared_expert_intermediate_size": read(_positive_int), "qkv_bias": read(equals(True)),
}
MIXTRAL_FIELDS: dict[str, FieldRule] = {
    **MISTRAL_FIELDS, **MOE_FIELDS,
    # multiplies the hidden states by noise in training mode only (transformers'
    # MixtralSparseMoeBlock checks self.training): no effect at inference
    "router_jitter_noise": harmless(),
}

_g = read()
LLAMA_GGUF_KEYS: dict[str, FieldRule] = {
    "block_count": _g, "context_length": _g, "embedding_length": _g, "feed_forward_length": _g,
    "attention.head_count": _g, "attention.head_count_kv": _g, "attention.layer_norm_rms_epsilon": _g,
    "attention.key_length": _g, "rope.freq_base": _g, "rope.dimension_count": _g, "vocab_size": harmless(),
    "attention.value_length": read(lambda v, f: None if v == next(
        (x for k, x in f.items() if k.endswith(".attention.key_length")), v) else
        "a value length other than the key length is not implemented"),
    "rope.scaling.type": read(equals("none")), "expert_count": read(equals(0)), "expert_used_count": read(equals(0)),
}

#: Qwen2 / Qwen3 (llama.cpp's ``qwen2`` / ``qwen3``): Llama's keys; no ``rope.dimension_count``
#: or ``vocab_size`` is written by llama.cpp's converter, but either is accepted
QWEN_GGUF_KEYS = LLAMA_GGUF_KEYS
#: a mixture of experts (llama.cpp's ``llama`` with experts: Mixtral; ``qwen3moe``):
#: the expert count, top-k, and the experts' width (Qwen3-MoE's ``moe_intermediate_size``)
MOE_GGUF_KEYS: dict[str, FieldRule] = {
    **LLAMA_GGUF_KEYS, "expert_count": read(_positive_int), "expert_used_count": read(_positive_int),
    "expert_feed_forward_length": read(_positive_int),
}
#: llama.cpp's stacked experts (one ``[E, out, in]`` tensor per matrix) and its router
GGUF_MOE_WEIGHTS = attrs.evolve(
    GGUF_LLAMA_WEIGHTS, w_gate="", w_up="", w_down="", router="blk.{i}.ffn_gate_inp.weight",
    expert_gate="blk.{i}.ffn_gate_exps.weight", expert_up="blk.{i}.ffn_up_exps.weight",
    expert_down="blk.{i}.ffn_down_exps.weight",
)

LLAMA = Architecture(
    name="llama", hf_names=("LlamaForCausalLM",), recipe=LayerRecipe(), hf_weights=HF_LLAMA_WEIGHTS,
    hf_fields=LLAMA_FIELDS, gguf_name="llama", gguf_keys=LLAMA_GGUF_KEYS,
    # llama.cpp's converter writes a Llama 3.x rope scaling as the rope_freqs tensor
    gguf_weights=attrs.evolve(GGUF_LLAMA_WEIGHTS, rope_freqs="rope_freqs.weight"),
    description="Llama 1/2/3.x (rope_type default or llama3; GGUF rope_freqs)",
)
QWEN2 = Architecture(
    name="qwen2", hf_names=("Qwen2ForCausalLM",), recipe=LayerRecipe(qkv_bias=True),
    hf_weights=HF_LLAMA_WEIGHTS, hf_fields=QWEN_FIELDS, description="Qwen2 / Qwen2.5 (q/k/v biases)",
    gguf_name="qwen2", gguf_weights=GGUF_LLAMA_WEIGHTS, gguf_keys=QWEN_GGUF_KEYS, gguf_qk_permuted=False,
)
QWEN3 = Architecture(
    name="qwen3", hf_names=("Qwen3ForCausalLM",), recipe=LayerRecipe(qk_norm=True),
    hf_weights=HF_LLAMA_WEIGHTS, hf_fields=QWEN_FIELDS, description="Qwen3 dense (per-head q/k RMSNorm)",
    gguf_name="qwen3", gguf_weights=GGUF_LLAMA_WEIGHTS, gguf_keys=QWEN_GGUF_KEYS, gguf_qk_permuted=False,
)
MISTRAL = Architecture(
    name="mistral", hf_names=("MistralForCausalLM",), recipe=LayerRecipe(),
    hf_weights=HF_LLAMA_WEIGHTS, hf_fields=MISTRAL_FIELDS,
    description="Mistral (a sliding window no shorter than the context)",
)
HF_PHI3_WEIGHTS = attrs.evolve(
    HF_LLAMA_WEIGHTS, wq="", wk="", wv="", w_gate="", w_up="", bq="", bk="", bv="", q_norm="", k_norm="",
    wqkv="model.layers.{i}.self_attn.qkv_proj.weight", w_gate_up="model.layers.{i}.mlp.gate_up_proj.weight",
)
#: llama.cpp's Phi-3: fused ``attn_qkv`` and ``ffn_up`` (gate rows then up), LongRoPE's
#: factors as tensors and its attention factor / original context as keys
GGUF_PHI3_WEIGHTS = attrs.evolve(
    GGUF_LLAMA_WEIGHTS, wq="", wk="", wv="", w_gate="", w_up="", bq="", bk="", bv="", q_norm="", k_norm="",
    wqkv="blk.{i}.attn_qkv.weight", w_gate_up="blk.{i}.ffn_up.weight",
    rope_long="rope_factors_long.weight", rope_short="rope_factors_short.weight",
)
PHI3_GGUF_KEYS: dict[str, FieldRule] = {
    **LLAMA_GGUF_KEYS, "rope.scaling.attn_factor": _g, "rope.scaling.original_context_length": _g,
    # llama.cpp's converter writes 0 for "no window" (Phi-4)
    "attention.sliding_window": read(lambda v, f: None if v == 0 else _positive_window(v, f)),
}
PHI3 = Architecture(
    name="phi3", hf_names=("Phi3ForCausalLM",), recipe=LayerRecipe(), hf_weights=HF_PHI3_WEIGHTS,
    hf_fields=PHI3_FIELDS, gguf_name="phi3", gguf_weights=GGUF_PHI3_WEIGHTS, gguf_keys=PHI3_GGUF_KEYS,
    gguf_qk_permuted=False,
    description="Phi-3 / Phi-3.5 (fused qkv and gate_up; longrope within original_max_position_embeddings)",
)
HF_GEMMA_WEIGHTS = attrs.evolve(
    HF_LLAMA_WEIGHTS, lm_head="lm_head.weight", bq="", bk="", bv="", q_norm="", k_norm="",
    post_attn_norm="model.layers.{i}.post_attention_layernorm.weight",
    ffn_norm="model.layers.{i}.pre_feedforward_layernorm.weight",
    post_ffn_norm="model.layers.{i}.post_feedforward_layernorm.weight",
)
GEMMA_RECIPE = LayerRecipe(norm="rms_1p", mlp="geglu", sandwich_norms=True, embed_scale=True, window_pattern=2)
#: llama.cpp's Gemma 2 (norm weights stored as ``1 + w`` by its converter; no ``output``: tied)
GGUF_GEMMA2_WEIGHTS = attrs.evolve(
    GGUF_LLAMA_WEIGHTS, bq="", bk="", bv="", q_norm="", k_norm="",
    post_attn_norm="blk.{i}.post_attention_norm.weight", post_ffn_norm="blk.{i}.post_ffw_norm.weight",
)
GEMMA2_GGUF_KEYS: dict[str, FieldRule] = {
    **LLAMA_GGUF_KEYS, "attn_logit_softcapping": read(_positive_or_none),
    "final_logit_softcapping": read(_positive_or_none), "attention.sliding_window": read(_positive_window),
}
GEMMA2 = Architecture(
    name="gemma2", hf_names=("Gemma2ForCausalLM",), recipe=GEMMA_RECIPE, hf_weights=HF_GEMMA_WEIGHTS,
    hf_fields=GEMMA2_FIELDS, gguf_name="gemma2", gguf_weights=GGUF_GEMMA2_WEIGHTS, gguf_keys=GEMMA2_GGUF_KEYS,
    gguf_qk_permuted=False,
    description="Gemma 2 (GeGLU, (1 + w) sandwich norms, soft-capping, alternating sliding-window layers)",
)
#: llama.cpp's Gemma 3 text: Gemma 2's names with the q/k norms (all stored as ``1 + w``); a
#: linear rope scaling (its global layers'), no attention cap
GEMMA3_GGUF_KEYS: dict[str, FieldRule] = {
    **{k: v for k, v in GEMMA2_GGUF_KEYS.items() if k != "attn_logit_softcapping"},
    "rope.scaling.type": read(equals("none", "linear")), "rope.scaling.factor": read(_positive_or_none),
}
GEMMA3 = Architecture(
    name="gemma3", hf_names=("Gemma3ForCausalLM",),
    recipe=attrs.evolve(GEMMA_RECIPE, qk_norm=True, local_rope=True, window_pattern=6),
    hf_weights=attrs.evolve(HF_GEMMA_WEIGHTS, q_norm=HF_LLAMA_WEIGHTS.q_norm, k_norm=HF_LLAMA_WEIGHTS.k_norm),
    hf_fields=GEMMA3_FIELDS, gguf_name="gemma3",
    gguf_weights=attrs.evolve(GGUF_GEMMA2_WEIGHTS, q_norm=GGUF_LLAMA_WEIGHTS.q_norm, k_norm=GGUF_LLAMA_WEIGHTS.k_norm),
    gguf_keys=GEMMA3_GGUF_KEYS, gguf_qk_permuted=False,
    description="Gemma 3 text (Gemma 2's recipe with per-head (1 + w) q/k norm and a local rope base)",
)
#: (``w_gate``/``w_up``/``w_down``: a dense layer's MLP, ModelArgs.dense_layers)
HF_QWEN3_MOE_WEIGHTS = attrs.evolve(
    HF_LLAMA_WEIGHTS, router="model.layers.{i}.mlp.gate.weight",
    expert_gate="model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    expert_up="model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    expert_down="model.layers.{i}.mlp.experts.{e}.down_proj.weight",
)
QWEN3_MOE = Architecture(
    name="qwen3_moe", hf_names=("Qwen3MoeForCausalLM",), recipe=LayerRecipe(qk_norm=True, mlp="moe"),
    hf_weights=HF_QWEN3_MOE_WEIGHTS, hf_fields=QWEN3_MOE_FIELDS,
    gguf_name="qwen3moe", gguf_weights=GGUF_MOE_WEIGHTS, gguf_keys=MOE_GGUF_KEYS, gguf_qk_permuted=False,
    description="Qwen3-MoE (q/k norm; softmax top-k routing, norm_topk_prob)",
)
HF_QWEN2_MOE_WEIGHTS = attrs.evolve(
    HF_QWEN3_MOE_WEIGHTS, q_norm="", k_norm="",
    shared_gate="model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    shared_up="model.layers.{i}.mlp.shared_expert.up_proj.weight",
    shared_down="model.layers.{i}.mlp.shared_expert.down_proj.weight",
    shared_expert_gate="model.layers.{i}.mlp.shared_expert_gate.weight",
)
#: llama.cpp's Qwen2-MoE: the stacked experts, the shared expert's ``*_shexp``
#: tensors and its gate ``ffn_gate_inp_shexp``; its width is a key of its own
GGUF_QWEN2_MOE_WEIGHTS = attrs.evolve(
    GGUF_MOE_WEIGHTS, q_norm="", k_norm="", shared_gate="blk.{i}.ffn_gate_shexp.weight",
    shared_up="blk.{i}.ffn_up_shexp.weight", shared_down="blk.{i}.ffn_down_shexp.weight",
    shared_expert_gate="blk.{i}.ffn_gate_inp_shexp.weight",
)
QWEN2_MOE = Architecture(
    name="qwen2_moe", hf_names=("Qwen2MoeForCausalLM",),
    recipe=LayerRecipe(qkv_bias=True, mlp="moe", shared_expert=True),
    hf_weights=HF_QWEN2_MOE_WEIGHTS, hf_fields=QWEN2_MOE_FIELDS,
    gguf_name="qwen2moe", gguf_weights=GGUF_QWEN2_MOE_WEIGHTS, gguf_qk_permuted=False,
    gguf_keys={**MOE_GGUF_KEYS, "expert_shared_feed_forward_length": read(_positive_int)},
    # llama.cpp's qwen2moe graph never renormalises the top-k weights (HF's default, norm_topk_prob false)
    gguf_moe_renormalize=False,
    description="Qwen2-MoE (q/k/v biases; softmax top-k routing, norm_topk_prob; a sigmoid-gated shared expert)",
)
HF_MIXTRAL_WEIGHTS = attrs.evolve(
    HF_LLAMA_WEIGHTS, w_gate="", w_up="", w_down="", bq="", bk="", bv="", q_norm="", k_norm="",
    router="model.layers.{i}.block_sparse_moe.gate.weight",
    expert_gate="model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    expert_up="model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    expert_down="model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
)
MIXTRAL = Architecture(
    name="mixtral", hf_names=("MixtralForCausalLM",), recipe=LayerRecipe(mlp="moe", moe_renormalize=True),
    hf_weights=HF_MIXTRAL_WEIGHTS, hf_fields=MIXTRAL_FIELDS,
    # llama.cpp's converter writes Mixtral as ``llama`` with experts (q/k rows permuted, as Llama's)
    gguf_name="llama", gguf_weights=GGUF_MOE_WEIGHTS, gguf_keys=MOE_GGUF_KEYS,
    description="Mixtral (softmax over the top-k experts' logits; a sliding window no shorter than the context)",
)
BUILTIN = (LLAMA, QWEN2, QWEN3, MISTRAL, PHI3, GEMMA2, GEMMA3, QWEN3_MOE, QWEN2_MOE, MIXTRAL)


@hookimpl
def fdx_register_architectures(register: Register) -> None:
    for a in BUILTIN:
        register(a.name, lambda a=a: a, description=a.description)


def renamed(base: Architecture, name: str, hf_name: str, description: str = "") -> Architecture:
    """``base`` served under another HF architecture name (a fine-tune's own class name)."""
    return attrs.evolve(base, name=name, hf_names=(hf_name,), gguf_name=None, gguf_weights=None,
                        gguf_keys={}, description=description or f"{base.name} as {hf_name}")
