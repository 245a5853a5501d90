"""Write a GGUF from a small HF test folder (tests/data/arch/<name>/) with the
``gguf`` package's ``GGUFWriter``, doing what llama.cpp's
``convert_hf_to_gguf.py`` does for that architecture:

* ``general.architecture``: ``llama`` for Llama, Mistral and Mixtral (its
  ``LlamaModel`` converts them; a Llama 3.x rope scaling as the
  ``rope_freqs`` tensor), ``qwen2``, ``qwen3``, ``qwen3moe``, ``qwen2moe``
  (the shared expert's ``*_shexp`` tensors), ``phi3``
  (fused ``attn_qkv`` / ``ffn_up``, LongRoPE's factors as ``rope_factors_*``
  tensors), ``gemma2`` (every norm weight stored as ``1 + w``; no rope base
  and no ``query_pre_attn_scalar`` written), ``gemma3`` (as Gemma 2, with the
  q/k norms, the global layers' rope base and linear scaling);
* llama.cpp's tensor names (``blk.N.attn_q.weight``, ``attn_q_norm``,
  ``ffn_gate_inp``, the experts stacked ``[E, out, in]`` in
  ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``), no ``output``
  tensor when the embeddings are tied;
* q/k rows permuted to interleaved pairs for the ``llama`` ones only (its
  ``LlamaModel.permute``; the Qwen converters keep HF's order);
* the ``<arch>.*`` keys its ``set_gguf_parameters`` writes (``key_length`` /
  ``value_length`` when the config has ``head_dim``, ``vocab_size`` and
  ``rope.dimension_count`` for ``llama``, ``expert_feed_forward_length``
  for ``qwen3moe``);
* ``ftype``: F32, F16, BF16 or Q8_0 for the matrices; 1-D tensors and the
  router (``ffn_gate_inp``) stay F32, as the converter keeps them.  Q4_K has
  no quantizer in the ``gguf`` package (dequantize only), so it is not
  written here;
* a ``gpt2`` (byte-level BPE) tokenizer block from the folder's vocabulary
  (the test models' prompts are token ids: one merge, as the format needs one).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

#: HF model_type -> (GGUF architecture, q/k permuted)
GGUF_ARCH = {
    "qwen2": ("qwen2", False), "qwen3": ("qwen3", False), "qwen3_moe": ("qwen3moe", False),
    "qwen2_moe": ("qwen2moe", False),
    "mistral": ("llama", True), "mixtral": ("llama", True), "llama": ("llama", True),
    "phi3": ("phi3", False), "gemma2": ("gemma2", False), "gemma3_text": ("gemma3", False),
}
#: names that differ by architecture
_PHI3 = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
_GEMMA = {"post_attention_layernorm.weight": "post_attention_norm.weight",
          "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    # Qwen2-MoE's shared expert and its gate ([1, hidden], kept as is)
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
#: per-expert HF names -> the stacked GGUF tensor
_EXPERTS = {
    "mlp.experts.{e}.gate_proj.weight": "ffn_gate_exps.weight", "mlp.experts.{e}.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.{e}.down_proj.weight": "ffn_down_exps.weight",
    "block_sparse_moe.experts.{e}.w1.weight": "ffn_gate_exps.weight",
    "block_sparse_moe.experts.{e}.w3.weight": "ffn_up_exps.weight",
    "block_sparse_moe.experts.{e}.w2.weight": "ffn_down_exps.weight",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], str]:
    """(the HF config, the tensors under llama.cpp's names and layout, the GGUF architecture)."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch, permuted = GGUF_ARCH[cfg["model_type"]]
    w = load_file(str(folder / "model.safetensors"))
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    out = {"token_embd.weight": w["model.embed_tokens.weight"], "output_norm.weight": w["model.norm.weight"]}
    if not cfg.get("tie_word_embeddings") and "lm_head.weight" in w:
        out["output.weight"] = w["lm_head.weight"]
    layer = {**_LAYER, **(_PHI3 if arch == "phi3" else {}), **(_GEMMA if arch in ("gemma2", "gemma3") else {})}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, gg in layer.items():
            if p + hf in w:
                t = w[p + hf]
                if permuted and hf.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                    t = permute(t, n_head if "q_proj" in hf else n_kv)
                out[f"blk.{i}.{gg}"] = t
        for hf, gg in _EXPERTS.items():
            if p + hf.format(e=0) in w:
                out[f"blk.{i}.{gg}"] = np.stack([w[p + hf.format(e=e)] for e in range(n_exp)])
    if arch in ("gemma2", "gemma3"):  # Gemma2Model / Gemma3Model.modify_tensors: every norm weight stored as 1 + w
        out = {k: t + np.float32(1) if k.endswith("norm.weight") else t for k, t in out.items()}
    rope = cfg.get("rope_parameters") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        out["rope_freqs.weight"] = llama3_rope_freqs(cfg, rope)
    if arch == "phi3" and rope.get("rope_type") in ("longrope", "su"):  # generate_extra_tensors
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    return cfg, out, arch


def llama3_rope_freqs(cfg: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of a Llama 3.x rope scaling: per rotary pair
    the divisor of its frequency (1 for the short wavelengths, ``factor`` for
    the long ones, ``1 / ((1 - s) / factor + s)`` between), from float32
    frequencies as the converter computes them.  The converter reads the
    original context from the config's top level (default 8192, Llama 3.x's
    value); the test model keeps it in its rope dict, where transformers reads
    it, so it is taken from there."""
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = float(rope.get("rope_theta", 10000.0))
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    factor, lo, hi = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(folder: Path, path: Path, ftype: str = "F32", arch: str | None = None,
               raw: dict[str, tuple[np.ndarray, Any]] | None = None, **extra_keys: Any) -> Path:
    """``folder`` (an HF test model) written as llama.cpp's converter would,
    matrices stored as ``ftype``.  ``arch``: another ``general.architecture``
    (a mislabelled file); ``raw``: tensors stored as given block bytes
    (``name -> (uint8 [rows, row bytes], ggml type)``: a type the ``gguf``
    package cannot quantize to, Q4_K); ``extra_keys``: more ``<arch>.KEY``
    values (a key fdx does not implement, for the refusal tests)."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    cfg, tensors, own = gguf_tensors(folder)
    arch = arch or own
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(folder.name)
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(cfg["num_attention_heads"])
    wr.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}
    if arch != "gemma2":  # Gemma2Model writes no rope base (llama.cpp's default, 10000); Gemma 3: the global layers'
        rope = rope.get("full_attention", rope)
        wr.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    wr.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_exp:
        wr.add_expert_count(n_exp)
        wr.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim"):
        wr.add_key_length(cfg["head_dim"])
        wr.add_value_length(cfg["head_dim"])
    if arch == "llama":
        wr.add_vocab_size(cfg["vocab_size"])
        wr.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch in ("qwen3moe", "qwen2moe"):
        wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":  # Qwen2MoeModel.set_gguf_parameters
        wr.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        orig = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        wr.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
        wr.add_rope_scaling_orig_ctx_len(orig)
        wr.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        wr.add_sliding_window(cfg.get("sliding_window") or 0)  # 0: no window (its Phi-4 marker)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        wr.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        wr.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        wr.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":  # Gemma3Model.set_gguf_parameters: the global layers' linear scaling
        if cfg.get("final_logit_softcapping"):
            wr.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        wr.add_sliding_window(cfg["sliding_window"])
        if rope.get("rope_type") == "linear":
            wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            wr.add_rope_scaling_factor(float(rope["factor"]))
    for k, v in extra_keys.items():
        key = f"{arch}.{k}"
        if isinstance(v, str):
            wr.add_string(key, v)
        elif isinstance(v, float):
            wr.add_float32(key, v)
        else:
            wr.add_uint32(key, v)
    qt = Q[ftype]
    wr.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}[ftype])
    _tokenizer(wr, folder, cfg)
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if raw and name in raw:
            wr.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        elif t.ndim == 1 or name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")) or qt == Q.F32:
            wr.add_tensor(name, t)
        elif qt == Q.F16:
            wr.add_tensor(name, t.astype(np.float16))
        else:
            wr.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def _tokenizer(wr: Any, folder: Path, cfg: dict[str, Any]) -> None:
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    # GGUF refuses an empty array and llama.cpp (like fdx) needs a gpt2 tokenizer's
    # merges: the last token is renamed to the merge of the first two (ids unchanged)
    tokens[-1] = tokens[0] + tokens[1]
    wr.add_tokenizer_model("gpt2")
    wr.add_token_list(tokens)
    wr.add_token_types([1] * len(tokens))
    wr.add_token_merges([f"{tokens[0]} {tokens[1]}"])
    wr.add_bos_token_id(cfg.get("bos_token_id") or 1)
    wr.add_eos_token_id(cfg.get("eos_token_id") or 2)
