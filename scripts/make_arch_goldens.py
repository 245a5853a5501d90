"""Build the small random-weight models of tests/data/arch/ and their goldens.

Run with the golden venv (torch CPU + transformers + safetensors):

    /work/golden-venv/bin/python scripts/make_arch_goldens.py

For each architecture, a model is built with transformers' own config class
(2 layers -- Gemma 4 --, hidden 128, vocab 512, every quirk of the architecture switched
on), its weights randomised with a fixed seed and saved with
``save_pretrained`` as an fp32 safetensors folder.  ``config.json`` is the
config class's *full* dict (``use_diff=False``), so the field-walking test
sees every field the class has.  Beside it:

* ``tokenizer.json``: a word-level tokenizer ``t0 .. t{V-1}`` (a random model
  has no tokenizer of its own; fdx needs one to serve the folder);
* ``goldens.json``: 3 token-id prompts, transformers' fp32 greedy tokens
  (32 each, no EOS stop) and the log-probability of each greedy token.

The tests need no torch: they read these files only.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "arch")
VOCAB = 512
N_TOKENS = 32
PROMPT_LENS = (6, 19, 37)
#: Gemma's soft-caps (both bend the scores/logits of the model below) and,
#: per Gemma model, (embedding std, final norm w of 1 + w)
GEMMA_ATTN_CAP, GEMMA_FINAL_CAP = 5.0, 30.0
GEMMA_TUNING = {"gemma2": (0.1, 4.0), "gemma3": (0.1, 4.0)}
COMMON = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)


PHI3 = dict(
    rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(16)],
                  "long_factor": [2.0 + 0.5 * i for i in range(16)]},
    max_position_embeddings=2048, original_max_position_embeddings=512, sliding_window=512,
    pad_token_id=None, rope_theta=10000.0, tie_word_embeddings=False)
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, sliding_window=512,
               rope_theta=1000000.0, tie_word_embeddings=False)


def models() -> dict[str, tuple[type, type, dict]]:
    t = transformers
    return {
        # Llama 3.x: llama3 rope scaling; original context 32 so the low
        # frequencies (wavelength > 32) are scaled at the test's positions
        "llama3": (t.LlamaConfig, t.LlamaForCausalLM, dict(
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
            rope_theta=10000.0, tie_word_embeddings=False)),
        # Qwen2: q/k/v biases, tied embeddings
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, dict(rope_theta=10000.0, tie_word_embeddings=True)),
        # Qwen3: per-head q/k RMSNorm, no bias, head_dim 64 != hidden / heads
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(head_dim=64, rope_theta=1000000.0,
                                                          tie_word_embeddings=False)),
        # Mistral: a sliding window no shorter than the context (the case fdx serves)
        "mistral": (t.MistralConfig, t.MistralForCausalLM, dict(sliding_window=512, rope_theta=10000.0,
                                                                tie_word_embeddings=False)),
        # Mistral with a sliding window (8) shorter than two of the prompts (19, 37)
        # and than every greedy continuation: honoured in the attention
        "mistral_swa": (t.MistralConfig, t.MistralForCausalLM, dict(sliding_window=8, rope_theta=10000.0,
                                                                    tie_word_embeddings=False)),
        # Phi-3: fused qkv_proj and gate_up_proj; longrope scaling with the
        # context (512) within original_max_position_embeddings, so the short
        # factors apply, and max_position_embeddings 4x that, so the attention
        # factor sqrt(1 + ln 4 / ln 512) scales cos/sin; a sliding window as
        # long as the context
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, PHI3),
        # Gemma 2: 4 layers alternating sliding (window 8, shorter than two of
        # the prompts) and global; both soft-caps small enough to bend the
        # scores and logits; query_pre_attn_scalar != head_dim; GeGLU, the
        # (1 + w) sandwich norms and the embedding scale are the class's own
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM, dict(
            num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=48, sliding_window=8,
            attn_logit_softcapping=GEMMA_ATTN_CAP, final_logit_softcapping=GEMMA_FINAL_CAP,
            rope_theta=10000.0, tie_word_embeddings=True)),
        # Gemma 3 text: Gemma 2's recipe plus per-head (1 + w) q/k norm; the
        # sliding layers' rope base (1e4) apart from the global layers' (1e6,
        # linear scaling x8); three sliding layers (window 8) then a global one;
        # no soft-capping (the class's default)
        "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM, dict(
            num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=48, sliding_window=8,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            tie_word_embeddings=True)),
        # Qwen3-MoE: 8 experts, top-2 with norm_topk_prob (the renormalised
        # top-k weights of Qwen3-30B-A3B), every layer sparse; q/k norm and
        # head_dim 64 as Qwen3; the dense intermediate_size is unused
        "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM, dict(
            head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0, tie_word_embeddings=False)),
        # Qwen2-MoE: 8 experts top-2 without norm_topk_prob (the class's default:
        # the top-k softmax weights kept as they are), a shared expert of width
        # 96 behind its sigmoid gate, q/k/v biases, every layer sparse
        "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM, dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
            tie_word_embeddings=False)),
        # Qwen2-MoE with dense layers (transformers' rule: layer i is sparse unless
        # in mlp_only_layers, and only when (i + 1) % decoder_sparse_step == 0):
        # 4 layers, layer 0 listed, step 2 -> layers 0 and 2 a dense MLP of
        # intermediate_size (256), layers 1 and 3 the experts and shared expert
        "qwen2_moe_dense": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM, dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
            norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[0], rope_theta=1000000.0,
            tie_word_embeddings=False, num_hidden_layers=4)),
        # Phi-3 past original_max_position_embeddings (32): the prompt of 37 is
        # long from the start (the long factors at every position), those of 6
        # and 19 cross it while generating (transformers then recomputes the
        # whole sequence with the long factors); max_position_embeddings 4x the
        # original, so the attention factor is sqrt(1 + ln 4 / ln 32); no window
        "phi3_long": (t.Phi3Config, t.Phi3ForCausalLM, {
            **PHI3, "max_position_embeddings": 128, "original_max_position_embeddings": 32, "sliding_window": None}),
        # Mixtral: 4 experts of intermediate_size, top-2 (softmax over the
        # two selected logits), a sliding window as long as the context
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, MIXTRAL),
        # Phi-3 and Mixtral as above with a sliding window of 8 (transformers'
        # mask is Mistral's): a check of the window on their paths
        "phi3_swa": (t.Phi3Config, t.Phi3ForCausalLM, {**PHI3, "sliding_window": 8}),
        "mixtral_swa": (t.MixtralConfig, t.MixtralForCausalLM, {**MIXTRAL, "sliding_window": 8}),
    }


def tokenizer_json(vocab: int) -> dict:
    from tokenizers import Tokenizer, models as tm, pre_tokenizers

    tok = Tokenizer(tm.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return json.loads(tok.to_str())


def build(name: str, cfg_cls: type, model_cls: type, extra: dict) -> None:
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    cfg = cfg_cls(**{**COMMON, **extra})
    cfg.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # larger-than-init weights so the logits are not flat
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in pname else p.normal_(0, 0.5)
            else:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)  # [out, in] or experts' [E, out, in]
        if name in GEMMA_TUNING:
            # the tied embedding scaled by sqrt(hidden) would outweigh the layers (every greedy
            # token the last prompt token): small embeddings, and the final (1 + w) norm
            # sized so the raw logits reach the soft-cap's bend
            std, w = GEMMA_TUNING[name]
            model.model.embed_tokens.weight.normal_(0, std)
            model.model.norm.weight.copy_(w + 0.1 * torch.randn_like(model.model.norm.weight))
        else:
            model.model.embed_tokens.weight.normal_(0, 1.0)
            model.model.norm.weight.mul_(3.0)  # sharper logits: few near-ties for the int8/bf16 checks
    model.save_pretrained(folder, safe_serialization=True)
    cfg.to_json_file(os.path.join(folder, "config.json"), use_diff=False)
    for extra_file in ("generation_config.json",):
        p = os.path.join(folder, extra_file)
        if os.path.exists(p):
            os.remove(p)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(VOCAB), f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": None, "add_bos_token": False}, f)

    write_goldens(model, model_cls, os.path.join(folder, "goldens.json"))
    size = sum(os.path.getsize(os.path.join(folder, x)) for x in os.listdir(folder))
    print(f"{name}: {folder} ({size / 1e6:.2f} MB)")


def greedy(model: object, prompt: list[int]) -> dict:
    """transformers' fp32 greedy tokens (``N_TOKENS``, no EOS stop) and their log-probabilities."""
    ids = list(prompt)
    toks, lps = [], []
    with torch.no_grad():
        for _ in range(N_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            t = int(torch.argmax(lp))
            toks.append(t)
            lps.append(float(lp[t]))
            ids.append(t)
    return {"prompt": prompt, "tokens": toks, "logprobs": lps}


def write_goldens(model: object, model_cls: type, path: str) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    out = [greedy(model, p) for p in prompts]
    with open(path, "w") as f:
        json.dump({"architecture": model_cls.__name__, "transformers": transformers.__version__,
                   "torch": torch.__version__, "dtype": "float32", "samples": out}, f, indent=1)


#: the Gemma config fields llama.cpp fixes (its GGUF does not carry them):
#: the score scale head_dim ** -0.5, and the layer pattern (Gemma 2: every 2nd
#: layer global; Gemma 3: every 6th, so all 4 layers here are local)
LLAMACPP_FIXED = {"gemma2": lambda c: dict(query_pre_attn_scalar=c.head_dim,
                                           layer_types=[("sliding_attention", "full_attention")[i % 2]
                                                        for i in range(c.num_hidden_layers)]),
                  "gemma3": lambda c: dict(query_pre_attn_scalar=c.head_dim,
                                           layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                        for i in range(c.num_hidden_layers)])}


def llamacpp_goldens(name: str) -> None:
    """``goldens_llamacpp.json`` beside an existing Gemma folder: transformers'
    goldens for the same weights under the values llama.cpp fixes
    (:data:`LLAMACPP_FIXED`), which is what a GGUF of the folder means; the
    folder's own weights and ``goldens.json`` are left as they are."""
    cfg_cls, model_cls, _ = models()[name]
    folder = os.path.join(OUT, name)
    cfg = cfg_cls.from_pretrained(folder)
    for k, v in LLAMACPP_FIXED[name](cfg).items():
        setattr(cfg, k, v)
    model = model_cls.from_pretrained(folder, config=cfg, dtype=torch.float32).eval()
    write_goldens(model, model_cls, os.path.join(folder, "goldens_llamacpp.json"))
    print(f"{name}: {folder}/goldens_llamacpp.json")


def main() -> int:
    """``make_arch_goldens.py [NAME ...]``: build those models (all without
    names); ``gemma2-llamacpp`` / ``gemma3-llamacpp``: only the goldens of
    :func:`llamacpp_goldens`, from the folder already there."""
    torch.set_num_threads(1)
    only = set(sys.argv[1:])
    for name, (c, m, extra) in models().items():
        if not only or name in only:
            build(name, c, m, extra)
        if name in LLAMACPP_FIXED and (not only or name in only or f"{name}-llamacpp" in only):
            llamacpp_goldens(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
