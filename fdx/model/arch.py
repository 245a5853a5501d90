"""Architectures: what a checkpoint's architecture name means to fdx.

An :class:`Architecture` is the declaration the ``fdx.architectures`` plugin
kind contributes (hook ``fdx_register_architectures``; the built-ins live in
:mod:`fdx.plugins.architectures.builtin`).  It says, as typed fields, never
as a second copy of the model:

* which checkpoints it serves: its HF ``architectures[0]`` names and its
  GGUF ``general.architecture`` name;
* where each weight lives (:class:`WeightNames`, HF and GGUF);
* its layer recipe (:class:`LayerRecipe`: q/k/v biases, per-head q/k norm,
  norm, MLP, rope style), which the loader copies into :class:`ModelArgs`,
  the geometry every runner's model reads;
* every config field (HF ``config.json``) and GGUF metadata key it
  understands (:class:`FieldRule`).  A field it does not list, and that is
  not known to be harmless (:data:`HARMLESS_HF_FIELDS`), is refused at
  start-up with a one-line error naming it -- no silent misreads.

Invariant: two runners built from the same :class:`ModelArgs` compute the
same maths; every fact the maths depends on is a field of it.  RoPE tables
for both runners come from :func:`rope_inv_freq`, the one place a rope
scaling's frequencies are applied (LongRoPE's attention factor is folded
into the q/k weights by the loader: :class:`LongRopeScaling`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import attrs
import numpy as np


@attrs.frozen
class RopeScaling:
    """Llama 3.x rope scaling (``rope_type: llama3``): wavelengths longer than
    ``original_max_position / low_freq_factor`` are stretched by ``factor``,
    shorter than ``original_max_position / high_freq_factor`` kept, and the
    band between interpolated smoothly (transformers'
    ``_compute_llama3_parameters``)."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@attrs.frozen
class LongRopeScaling:
    """Phi-3's LongRoPE (``rope_type: longrope``, formerly ``su``): each
    rotary frequency divided by its own factor, and cos/sin multiplied by
    ``attention_factor`` (transformers' ``_compute_longrope_parameters``).

    transformers picks the factors per forward by the sequence's length:
    ``long_factor`` once it exceeds ``original_max_position``, for every
    position, and its generate recomputes the whole sequence when it first
    does.  The cpu runner does the same per sequence (the step layout's
    ``long_rope`` rows; a sequence crossing the boundary has its KV
    recomputed with the long factors in that step: :mod:`fdx.model.runner_base`);
    the other runners serve only contexts within ``original_max_position``.
    The attention factor (the same for both sets) scales q and k alike, so
    the loader folds it into the q/k projection rows (RoPE is linear);
    :func:`rope_inv_freq` applies the short factors, or with ``long`` the
    long ones."""

    rope_type: str
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    attention_factor: float
    original_max_position: int


@attrs.frozen
class FreqFactorRope:
    """A rope scaling given as one divisor per rotary frequency (``head_dim / 2``):
    llama.cpp's ``rope_freqs`` tensor, which its converter writes for a Llama
    3.x ``rope_scaling`` (``rope_type`` names the scaling it came from)."""

    rope_type: str
    factors: tuple[float, ...]


@attrs.frozen
class LinearRopeScaling:
    """Position interpolation (``rope_type: linear``): every rotary frequency
    divided by ``factor`` (Gemma 3's global layers)."""

    rope_type: str
    factor: float


@attrs.frozen
class ModelArgs:
    """Geometry and recipe of a decoder-only Llama-family transformer.

    Weights handed to the model use Hugging Face conventions: linear weights
    are ``[out, in]`` and q/k rows are in HF order (NEOX "rotate_half" RoPE).
    ``qk_norm``: a per-head RMSNorm (weights ``[head_dim]``) on q and k,
    before RoPE (Qwen3).  ``sliding_window``: the attention window the
    checkpoint declares for every layer (``None``: full attention; Mistral,
    Mixtral, Phi-3): keys at ``pos - window < j <= pos``, as ``layer_windows``,
    honoured in the attention where shorter than the context.

    Gemma's quirks (all off by default: the Llama maths, the fused C++ paths):

    * ``mlp_act``: the gate's activation, ``"silu"`` (SwiGLU) or ``"gelu_tanh"``
      (GeGLU: tanh-approximated GELU);
    * ``embed_scale``: the embedding rows are multiplied by it (``sqrt(hidden_size)``);
    * ``sandwich_norms``: an RMSNorm on the attention output and on the MLP
      output before each joins the residual (the layer's ``post_attn_norm``
      and ``post_ffn_norm``).  Gemma's ``(1 + w)`` norm weights are folded to
      ``1 + w`` by the loader, so every norm here is the plain ``x * w`` one;
    * ``attn_scale``: the score scale (``query_pre_attn_scalar ** -0.5``;
      ``None``: ``head_dim ** -0.5``);
    * ``attn_softcap`` / ``final_softcap``: ``c * tanh(x / c)`` of the scaled
      attention scores (before the mask) and of the logits;
    * ``layer_windows``: per layer, the sliding window (``0``: global
      attention) a query attends over -- keys at ``pos - window < j <= pos``
      (transformers' ``sliding_window_causal_mask_function``); empty: every
      layer global.  Honoured in the attention, so any context length serves;
    * ``rope_local_theta``: the rope base of the windowed layers (Gemma 3;
      ``None``: ``rope_theta``).
    """

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | LongRopeScaling | LinearRopeScaling | FreqFactorRope | None = None
    sliding_window: int | None = None
    mlp_act: str = "silu"
    embed_scale: float | None = None
    sandwich_norms: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None

    @property
    def gemma_fields(self) -> tuple[str, ...]:
        """The Gemma fields set away from their Llama defaults (the fused C++
        layer op and the GPU runner compute none of them)."""
        d = {f.name: f.default for f in attrs.fields(ModelArgs)}
        names = ("mlp_act", "embed_scale", "sandwich_norms", "attn_scale", "attn_softcap", "final_softcap",
                 "layer_windows", "rope_local_theta")
        return tuple(n for n in names if getattr(self, n) != d[n])
    #: mixture of experts (:mod:`fdx.model.moe`); ``num_experts == 0``: every
    #: layer has a dense MLP of ``intermediate_size``.  Otherwise every layer's
    #: MLP is ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``,
    #: each token routed to ``num_experts_per_tok`` of them by a softmax over
    #: the router's logits, their top-k weights renormalised to sum to 1 when
    #: ``norm_topk_prob`` (Mixtral always; Qwen3-MoE by its config)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    #: Qwen2-MoE's shared expert: a SwiGLU of this width every token runs
    #: beside the routed ones, its output scaled by ``sigmoid(h . w_gate)``
    #: (its ``[hidden]`` gate) and added to theirs; ``0``: none
    shared_expert_size: int = 0
    #: the layers of a mixture of experts whose MLP is dense instead, a SwiGLU
    #: of ``intermediate_size`` (Qwen2/3-MoE's ``mlp_only_layers`` and
    #: ``decoder_sparse_step``, transformers' rule); ``()``: every layer sparse
    dense_layers: tuple[int, ...] = ()
    #: expert parallelism (a rank's local geometry, :mod:`fdx.parallel.sharding`):
    #: this rank holds experts ``[first, first + count)`` of the ``num_experts``
    #: the router picks from; ``None``: all of them
    local_experts: tuple[int, int] | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def describe(self) -> str:
        extra = "".join((" qk-norm" if self.qk_norm else "", f" rope={self.rope_scaling.rope_type}" if self.rope_scaling else "",
                         f" mlp={self.mlp_act}" if self.mlp_act != "silu" else "",
                         f" softcap={self.attn_softcap}/{self.final_softcap}" if self.attn_softcap or self.final_softcap else "",
                         f" windows={'/'.join(map(str, self.layer_windows))}" if any(self.layer_windows) else "",
                         f" moe={self.num_experts}x{self.moe_intermediate_size}/top{self.num_experts_per_tok}"
                         if self.num_experts else "",
                         f"+shared{self.shared_expert_size}" if self.shared_expert_size else "",
                         f" dense={','.join(map(str, self.dense_layers))}" if self.dense_layers else "",
                         f" experts {self.local_experts[0]}..{sum(self.local_experts) - 1}" if self.local_experts else ""))
        return (
            f"{self.arch} L{self.num_layers} d{self.hidden_size} ff{self.intermediate_size} "
            f"h{self.num_heads}/kv{self.num_kv_heads}x{self.head_dim} V{self.vocab_size}{extra}"
        )


def rope_inv_freq(args: ModelArgs, local: bool = False, long: bool = False) -> np.ndarray:
    """The ``head_dim / 2`` rotary frequencies (float64), rope scaling applied.
    Both runners build their cos/sin tables from this.  ``local``: those of
    the windowed layers (``rope_local_theta``, unscaled: Gemma 3); ``long``:
    LongRoPE's long factors (a sequence past ``original_max_position``)."""
    half = args.head_dim // 2
    theta = args.rope_local_theta if local and args.rope_local_theta is not None else args.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / args.head_dim))
    if local:
        return inv
    rs = args.rope_scaling
    if rs is None:
        return inv
    if isinstance(rs, LinearRopeScaling):
        return inv / rs.factor
    if isinstance(rs, FreqFactorRope):  # llama.cpp's rope_freqs: theta / factor
        if len(rs.factors) != half:
            raise ValueError(f"rope frequency factors: {len(rs.factors)} entries, head_dim / 2 = {half}")
        return inv / np.asarray(rs.factors, dtype=np.float64)
    if isinstance(rs, LongRopeScaling):  # the short factors, or the long ones (see LongRopeScaling)
        factors = rs.long_factor if long else rs.short_factor
        if len(factors) != half:
            raise ValueError(f"longrope {'long' if long else 'short'}_factor has {len(factors)} entries, "
                             f"head_dim / 2 = {half}")
        return inv / np.asarray(factors, dtype=np.float64)
    if rs.rope_type != "llama3":  # the loader refuses others; this guards new callers
        raise ValueError(f"rope scaling {rs.rope_type!r} is not implemented")
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2.0 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    mid = (1.0 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, mid, scaled)


def rope_angles(args: ModelArgs, max_pos: int, local: bool = False, long: bool = False) -> np.ndarray:
    """``[max_pos, head_dim / 2]`` rotary angles (float64) of positions ``0..max_pos-1``."""
    return np.arange(max_pos, dtype=np.float64)[:, None] * rope_inv_freq(args, local, long)[None, :]


def long_rope_after(args: ModelArgs, max_model_len: int) -> int | None:
    """``original_max_position`` when a LongRoPE model can see a sequence past
    it within ``max_model_len`` (its long factors are then in play), else ``None``."""
    rs = args.rope_scaling
    if isinstance(rs, LongRopeScaling) and max_model_len > rs.original_max_position:
        return rs.original_max_position
    return None


# --------------------------------------------------------------------------
# the declaration an architecture plugin contributes
# --------------------------------------------------------------------------


@attrs.frozen
class WeightNames:
    """Tensor names of one checkpoint format; per-layer names hold ``{i}``,
    per-expert names ``{i}`` and ``{e}``.  An empty name: the architecture
    has no such tensor."""

    embed: str
    final_norm: str
    lm_head: str
    attn_norm: str
    wq: str
    wk: str
    wv: str
    wo: str
    ffn_norm: str
    w_gate: str
    w_up: str
    w_down: str
    bq: str = ""
    bk: str = ""
    bv: str = ""
    q_norm: str = ""
    k_norm: str = ""
    #: Gemma's sandwich norms: on the attention output and on the MLP output
    post_attn_norm: str = ""
    post_ffn_norm: str = ""
    #: fused projections (Phi-3): ``wqkv`` rows are q, k, v in that order,
    #: ``w_gate_up`` rows gate then up; the loader splits them, and
    #: ``wq``/``wk``/``wv`` (``w_gate``/``w_up``) are then empty
    wqkv: str = ""
    w_gate_up: str = ""
    #: mixture of experts: the router (``[num_experts, hidden]``) and each
    #: expert's SwiGLU (``{e}``: the expert's index; a name without ``{e}``:
    #: one stacked ``[num_experts, out, in]`` tensor, as llama.cpp writes them);
    #: a MoE layer has these instead of ``w_gate``/``w_up``/``w_down``
    router: str = ""
    expert_gate: str = ""
    expert_up: str = ""
    expert_down: str = ""
    #: Qwen2-MoE's shared expert: its SwiGLU (``[width, hidden]`` gate and up,
    #: ``[hidden, width]`` down) and its gate (``[1, hidden]``: one logit a token)
    shared_gate: str = ""
    shared_up: str = ""
    shared_down: str = ""
    shared_expert_gate: str = ""
    #: LongRoPE's factors as tensors (llama.cpp's Phi-3: ``rope_factors_long`` /
    #: ``rope_factors_short``, ``head_dim / 2`` each; model-wide, not per layer)
    rope_long: str = ""
    rope_short: str = ""
    #: llama.cpp's ``rope_freqs`` (a Llama 3.x rope scaling: one divisor per
    #: rotary frequency, ``head_dim / 2``; model-wide)
    rope_freqs: str = ""

    def layer(self, i: int) -> dict[str, str]:
        """Every field's name in layer ``i`` (per-expert names keep ``{e}``)."""
        return {f.name: getattr(self, f.name).format(i=i, e="{e}") for f in attrs.fields(WeightNames)}


HF_LLAMA_WEIGHTS = WeightNames(
    embed="model.embed_tokens.weight", final_norm="model.norm.weight", lm_head="lm_head.weight",
    attn_norm="model.layers.{i}.input_layernorm.weight",
    wq="model.layers.{i}.self_attn.q_proj.weight", wk="model.layers.{i}.self_attn.k_proj.weight",
    wv="model.layers.{i}.self_attn.v_proj.weight", wo="model.layers.{i}.self_attn.o_proj.weight",
    ffn_norm="model.layers.{i}.post_attention_layernorm.weight",
    w_gate="model.layers.{i}.mlp.gate_proj.weight", w_up="model.layers.{i}.mlp.up_proj.weight",
    w_down="model.layers.{i}.mlp.down_proj.weight",
    bq="model.layers.{i}.self_attn.q_proj.bias", bk="model.layers.{i}.self_attn.k_proj.bias",
    bv="model.layers.{i}.self_attn.v_proj.bias",
    q_norm="model.layers.{i}.self_attn.q_norm.weight", k_norm="model.layers.{i}.self_attn.k_norm.weight",
)

GGUF_LLAMA_WEIGHTS = WeightNames(
    embed="token_embd.weight", final_norm="output_norm.weight", lm_head="output.weight",
    attn_norm="blk.{i}.attn_norm.weight", wq="blk.{i}.attn_q.weight", wk="blk.{i}.attn_k.weight",
    wv="blk.{i}.attn_v.weight", wo="blk.{i}.attn_output.weight", ffn_norm="blk.{i}.ffn_norm.weight",
    w_gate="blk.{i}.ffn_gate.weight", w_up="blk.{i}.ffn_up.weight", w_down="blk.{i}.ffn_down.weight",
    bq="blk.{i}.attn_q.bias", bk="blk.{i}.attn_k.bias", bv="blk.{i}.attn_v.bias",
    q_norm="blk.{i}.attn_q_norm.weight", k_norm="blk.{i}.attn_k_norm.weight",
)


#: the values of each :class:`LayerRecipe` variant field the model code implements
IMPLEMENTED_RECIPE = {"norm": ("rms", "rms_1p"), "mlp": ("swiglu", "geglu", "moe"), "rope": ("neox",)}


@attrs.frozen
class LayerRecipe:
    """What a decoder layer computes, beyond the shared Llama skeleton
    (RMSNorm -> attention -> RMSNorm -> MLP, residuals around both).

    ``qkv_bias``: the q/k/v projections always carry biases (Qwen2; other
    architectures take them when the config's ``attention_bias`` says so).
    ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3).
    ``norm``/``mlp``/``rope`` name the variants fdx implements
    (:data:`IMPLEMENTED_RECIPE`: ``rms``, or Gemma's ``rms_1p`` whose weights
    are stored as ``w`` and applied as ``1 + w`` (folded at load);
    ``swiglu``, ``geglu`` (Gemma's tanh-GELU gate), or ``moe``: routed SwiGLU
    experts in every layer; ``neox``: rotate_half over the whole head); they
    are fields so a new variant is a new value, checked at load.
    ``moe_renormalize``: the top-k router weights always sum to 1 (Mixtral;
    other MoE architectures take it from the config's ``norm_topk_prob``).
    ``shared_expert``: every MoE layer also has a gated shared expert
    (Qwen2-MoE: ``ModelArgs.shared_expert_size``).
    ``sandwich_norms``: RMSNorms after attention and after the MLP too
    (Gemma 2/3).  ``embed_scale``: embeddings scaled by ``sqrt(hidden_size)``.
    ``window_pattern`` (non-zero: Gemma 2/3): the config's ``layer_types``
    (``sliding_attention`` / ``full_attention``) pick each layer's window;
    without them every ``window_pattern``-th layer is global (the config
    class's default, overridden by ``sliding_window_pattern``).  Zero:
    ``sliding_window``, where read, covers every layer (Mistral).
    ``local_rope``: the rope parameters are per layer type (Gemma 3:
    ``rope_parameters.sliding_attention`` / v4's ``rope_local_base_freq``
    for the windowed layers, ``full_attention`` for the global ones).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    norm: str = "rms"
    mlp: str = "swiglu"
    rope: str = "neox"
    moe_renormalize: bool = False
    shared_expert: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    window_pattern: int = 0
    local_rope: bool = False

    def unimplemented(self) -> str | None:
        """The first variant field whose value the model code lacks, as ``"field=value"``."""
        for f, ok in IMPLEMENTED_RECIPE.items():
            if getattr(self, f) not in ok:
                return f"{f}={getattr(self, f)!r}"
        return None


#: a field check: ``(value, whole config) -> None`` when fdx computes what
#: the field says, else the reason it cannot (the error names the field)
Check = Callable[[Any, Mapping[str, Any]], "str | None"]


@attrs.frozen
class FieldRule:
    """How an architecture treats one config field / GGUF key: ``read`` (the
    loader reads it into :class:`ModelArgs`), ``harmless`` (no effect on the
    maths: ids, dtype, dropout at inference...).  ``check``, when set, runs
    either way and refuses the values fdx does not implement."""

    kind: str  # "read" | "harmless"
    check: Check | None = None


def read(check: Check | None = None) -> FieldRule:
    return FieldRule("read", check)


def harmless(check: Check | None = None) -> FieldRule:
    return FieldRule("harmless", check)


def equals(*allowed: Any) -> Check:
    """A check accepting only ``allowed`` values."""

    def check(v: Any, cfg: Mapping[str, Any]) -> str | None:
        return None if v in allowed else f"fdx implements only {', '.join(map(repr, allowed))}"

    return check


#: HF config fields with no effect on a decoder's maths at inference, for
#: every architecture (token ids, dtype, bookkeeping of transformers' classes)
HARMLESS_HF_FIELDS: frozenset[str] = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "initializer_range", "attention_dropout", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "tokenizer_class", "torchscript", "pruned_heads", "tie_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "finetuning_task", "prefix", "task_specific_params", "bad_words_ids",
    "num_labels", "use_return_dict", "output_scores", "return_dict_in_generate",
    "pretraining_tp",  # v4 Llama's tensor-parallel slicing: the same maths
})

#: GGUF keys outside the architecture's namespace that never change the maths
HARMLESS_GGUF_PREFIXES = ("general.", "tokenizer.", "quantize.", "split.")


@attrs.frozen
class Architecture:
    """One architecture, as the ``fdx.architectures`` plugin kind declares it
    (see the module docstring).

    ``hf_fields``: every HF config field it understands beyond
    :data:`HARMLESS_HF_FIELDS`.  ``gguf_keys``: the keys of its GGUF
    namespace (``{gguf_name}.KEY``) it understands.  A mixture of experts
    claims ``gguf_name`` for files with experts (``expert_count`` > 0) only,
    so Mixtral and Llama can share llama.cpp's ``llama``.  ``gguf_weights`` is
    ``None`` when fdx reads only its HF folders.  ``gguf_qk_permuted``:
    llama.cpp's converter stores q/k rows in interleaved-pair order (the
    loader un-permutes them).  ``gguf_moe_renormalize``: llama.cpp
    renormalises the top-k router weights of this architecture's GGUF
    (Mixtral, Qwen3-MoE; not Qwen2-MoE), which carries no key saying so.

    Invariants: a pure declaration (immutable, no device state, safe to
    share across threads); every field the ``check_*`` methods accept is one
    the model computes exactly.  Used once, at load, never per token.
    """

    name: str
    hf_names: tuple[str, ...]
    recipe: LayerRecipe
    hf_weights: WeightNames
    hf_fields: Mapping[str, FieldRule]
    gguf_name: str | None = None
    gguf_weights: WeightNames | None = None
    gguf_keys: Mapping[str, FieldRule] = attrs.field(factory=dict)
    gguf_qk_permuted: bool = True
    gguf_moe_renormalize: bool = True
    description: str = ""

    def check_hf_config(self, cfg: Mapping[str, Any]) -> tuple[str, str] | None:
        """The first field of ``cfg`` fdx cannot serve: ``(field, reason)``, or ``None``."""
        for key in sorted(cfg):
            rule = self.hf_fields.get(key)
            if rule is None:
                if key in HARMLESS_HF_FIELDS:
                    continue
                return key, f"not implemented by fdx's {self.name} architecture"
            if rule.check is not None:
                why = rule.check(cfg[key], cfg)
                if why:
                    return key, why
        return None

    def check_gguf_keys(self, fields: Mapping[str, Any]) -> tuple[str, str] | None:
        """The first GGUF metadata key fdx cannot serve: ``(key, reason)``, or ``None``."""
        ns = f"{self.gguf_name}."
        for key in sorted(fields):
            if key.startswith(HARMLESS_GGUF_PREFIXES):
                continue
            rule = self.gguf_keys.get(key[len(ns):]) if key.startswith(ns) else None
            if rule is None:
                return key, f"not implemented by fdx's {self.name} architecture"
            if rule.check is not None:
                why = rule.check(fields[key], fields)
                if why:
                    return key, why
        return None
