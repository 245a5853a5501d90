"""Write a GGUF from a small HF test folder (tests/data/arch/<name>/) with the
``gguf`` package's ``GGUFWriter``, doing what llama.cpp's
``convert_hf_to_gguf.py`` does for that architecture:

* ``general.architecture``: ``llama`` for Mistral and Mixtral (its
  ``LlamaModel`` converts both), ``qwen2``, ``qwen3``, ``qwen3moe``;
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
from pathlib import Path
from typing import Any

import numpy as np

#: HF model_type -> (GGUF architecture, q/k permuted)
GGUF_ARCH = {
    "qwen2": ("qwen2", False), "qwen3": ("qwen3", False), "qwen3_moe": ("qwen3moe", False),
    "mistral": ("llama", True), "mixtral": ("llama", True), "llama": ("llama", True),
}

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
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
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, gg in _LAYER.items():
            if p + hf in w:
                t = w[p + hf]
                if permuted and hf.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                    t = permute(t, n_head if "q_proj" in hf else n_kv)
                out[f"blk.{i}.{gg}"] = t
        for hf, gg in _EXPERTS.items():
            if p + hf.format(e=0) in w:
                out[f"blk.{i}.{gg}"] = np.stack([w[p + hf.format(e=e)] for e in range(n_exp)])
    return cfg, out, arch


def write_gguf(folder: Path, path: Path, ftype: str = "F32", arch: str | None = None, **extra_keys: Any) -> Path:
    """``folder`` (an HF test model) written as llama.cpp's converter would,
    matrices stored as ``ftype``.  ``arch``: another ``general.architecture``
    (a mislabelled file); ``extra_keys``: more ``<arch>.KEY`` values (a key
    fdx does not implement, for the refusal tests)."""
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
    if arch == "qwen3moe":
        wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
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
        if t.ndim == 1 or name.endswith("ffn_gate_inp.weight") or qt == Q.F32:
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
