"""Architectures (the ``architecture`` plugin kind) against transformers.

The models and goldens in tests/data/arch/ come from
scripts/make_arch_goldens.py: small random-weight models built with
transformers' own config classes (Llama 3 with llama3 rope scaling, Qwen2
with q/k/v biases and tied embeddings, Qwen3 with per-head q/k norm and an
explicit head_dim, Mistral with a sliding window as long as its context
and again with one of 8 (shorter than two of the prompts: mistral_swa),
Phi-3 with fused qkv/gate_up weights and longrope scaling, Gemma 2 with
soft-capping on and a sliding window shorter than two of the prompts,
Gemma 3 with per-head q/k norm, a local rope base and linear global scaling,
Qwen3-MoE with 8 experts top-2 and norm_topk_prob, Qwen2-MoE with 8 experts
top-2 and a sigmoid-gated shared expert, Mixtral with 4 experts top-2, and
Phi-3 past its original context of 32: phi3_long, the long factors),
and transformers' fp32 greedy tokens and logprobs for 3 token-id prompts x
32 tokens.  No torch here.

* every config field of every architecture is understood (read or
  harmless), and a flipped math field is refused at load, naming it;
* float32, teacher-forced on the golden tokens through the runner (paged KV
  cache): the same top-1 token at every position, logprobs within 1e-3;
* int8 and bfloat16: top-1 agreement with the goldens >= 97%;
* a real ``fdx serve --dtype float32`` per architecture gives the greedy
  tokens over HTTP (token-id prompts, ``return_token_ids``); Gemma at TP=2 too;
* the ``gpu`` runner's forward, on the CPU place in float32, matches the
  goldens as the cpu runner does;
* MoE: the experts read from their tensor names; at TP=2 with
  ``--enable-expert-parallel`` the tokens of one rank and each expert's load
  in ``/metrics``; in int8/bfloat16 a prompt's tokens and logprobs are bit-identical alone
  and among 16 others;
* GGUF (written from each folder as llama.cpp's converter does: tests/ggufutil.py):
  the folder's weights and transformers' goldens at F32 (qwen3, qwen2, mistral,
  qwen3_moe, qwen2_moe, mixtral, phi3, llama3 with llama.cpp's rope_freqs; Gemma
  against transformers under llama.cpp's fixed
  values), F16/BF16/Q8_0/Q4_K read as ``gguf`` dequantizes them, one real
  ``fdx serve``, and every key or tensor fdx lacks refused, naming it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from fdx.core.errors import ModelLoadError
from fdx.core.hookspecs import hookimpl
from serverutil import start_server

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data" / "arch"
#: qwen2_moe_dense: Qwen2-MoE with dense layers (mlp_only_layers [0], decoder_sparse_step 2: layers 0 and 2 dense)
ARCHS = ("llama3", "qwen2", "qwen3", "mistral", "mistral_swa", "phi3", "gemma2", "gemma3", "qwen3_moe", "qwen2_moe",
         "qwen2_moe_dense", "mixtral")


def goldens(name: str, which: str = "goldens") -> list[dict[str, Any]]:
    """Model ``name``'s transformers goldens (``goldens_llamacpp``: Gemma's, under llama.cpp's fixed values)."""
    return json.loads((DATA / name / f"{which}.json").read_text())["samples"]


def copy_with_config(tmp: Path, name: str, **changes: Any) -> Path:
    """A copy of model ``name`` (weights symlinked) with ``config.json`` fields changed
    (a value of ``None`` removes the field)."""
    dst = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
    for f in (DATA / name).iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((DATA / name / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def copy_without_tensor(tmp: Path, name: str, tensor: str) -> Path:
    """A copy of model ``name`` whose safetensors lack ``tensor``."""
    from safetensors.numpy import load_file, save_file

    w = load_file(str(DATA / name / "model.safetensors"))
    del w[tensor]
    dst = copy_with_config(tmp, name)
    (dst / "model.safetensors").unlink()
    save_file(w, str(dst / "model.safetensors"))
    return dst


# --------------------------------------------------------------------------
# no silent misreads
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARCHS + ("phi3_long",))
def test_every_config_field_is_read_or_harmless(name: str) -> None:
    from fdx.model.arch import HARMLESS_HF_FIELDS
    from fdx.model.loader import find_architecture

    cfg = json.loads((DATA / name / "config.json").read_text())
    arch = find_architecture("config.json", hf_names=cfg["architectures"])
    assert cfg["architectures"][0] in arch.hf_names
    for key in cfg:  # the config class's full field list (saved with use_diff=False)
        rule = arch.hf_fields.get(key)
        assert rule is not None or key in HARMLESS_HF_FIELDS, f"{name}: {key} is neither read nor harmless"
        assert rule is None or rule.kind in ("read", "harmless")
    assert arch.check_hf_config(cfg) is None


PHI3_ROPE = json.loads((DATA / "phi3" / "config.json").read_text())["rope_parameters"]
FLIPS = [
    ("llama3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope_parameters", "yarn"),
    ("llama3", {"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling", "dynamic"),
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32, "rope_theta": 1e4,
                                    "partial_rotary_factor": 0.5}}, "rope_parameters", "partial_rotary_factor"),
    ("llama3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "not implemented"),
    ("llama3", {"hidden_act": "gelu"}, "hidden_act", "silu"),
    ("llama3", {"mlp_bias": True}, "mlp_bias", "False"),
    ("qwen2", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32, "rope_theta": 1e4}}, "rope_parameters", "llama3"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window", "False"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types", "sliding_attention"),
    ("qwen3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config", "not implemented"),
    ("mistral", {"sliding_window": 0}, "sliding_window", "positive"),
    ("phi3", {"rope_parameters": {**PHI3_ROPE, "partial_rotary_factor": 0.75}}, "rope_parameters", "partial_rotary_factor"),
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor", "1.0"),
    ("phi3", {"rope_parameters": {**PHI3_ROPE, "rope_type": "yarn"}}, "rope_parameters", "yarn"),
    ("phi3", {"rope_parameters": {**PHI3_ROPE, "short_factor": [1.0] * 8}}, "rope_parameters", "short_factor"),
    ("phi3", {"rope_parameters": {**PHI3_ROPE, "mscale": 1.0}}, "rope_parameters", "mscale"),
    ("phi3", {"attention_bias": True}, "attention_bias", "False"),
    ("phi3", {"sliding_window": 0}, "sliding_window", "positive"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation", "gelu_pytorch_tanh"),
    ("gemma2", {"attention_bias": True}, "attention_bias", "False"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping", "positive"),
    ("gemma2", {"final_logit_softcapping": "30"}, "final_logit_softcapping", "positive"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]},
     "layer_types", "chunked_attention"),
    ("gemma2", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types", "one layer type per layer"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention", "False"),
    ("gemma2", {"sliding_window_size": 4096}, "sliding_window_size", "differs from sliding_window"),
    ("gemma2", {"rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}}, "rope_parameters", "linear"),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters", "sliding_attention: rope type 'linear'"),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}}},
     "rope_parameters", "full_attention: rope type 'yarn'"),
    ("gemma3", {"hidden_activation": "silu"}, "hidden_activation", "gelu_pytorch_tanh"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention", "False"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step", "positive"),
    ("qwen3_moe", {"mlp_only_layers": [2]}, "mlp_only_layers", "layer indices"),
    ("qwen2_moe", {"mlp_only_layers": "0"}, "mlp_only_layers", "layer indices"),
    ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok", "positive"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok", "between 1 and the number of experts (8)"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window", "False"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts", "positive"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act", "silu"),
    ("mixtral", {"sliding_window": 0}, "sliding_window", "positive"),
]


@pytest.mark.parametrize("name,changes,field,why", FLIPS, ids=[f"{f[0]}-{f[2]}-{f[3]}" for f in FLIPS])
def test_unimplemented_math_field_is_refused_naming_it(tmp_path: Path, name: str, changes: dict[str, Any],
                                                       field: str, why: str) -> None:
    from fdx.model.loader import load_checkpoint

    folder = copy_with_config(tmp_path, name, **changes)
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(folder))
    msg = str(ei.value)
    assert "\n" not in msg and "config.json" in msg and f"config field {field!r}" in msg and why in msg, msg


def test_unknown_architecture_lists_choices_and_stray_tensor_is_refused(tmp_path: Path) -> None:
    from fdx.model.loader import load_checkpoint

    folder = copy_with_config(tmp_path, "qwen3", architectures=["FalconForCausalLM"])
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(folder))
    msg = str(ei.value)
    assert "'FalconForCausalLM'" in msg and all(n in msg for n in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                                                                   "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"))

    # a Qwen3 checkpoint labelled Llama: its q/k norm weights are not silently dropped
    folder = copy_with_config(tmp_path, "qwen3",
                              architectures=["LlamaForCausalLM"], model_type="llama", layer_types=None,
                              use_sliding_window=None, sliding_window=None, max_window_layers=None)
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(folder))
    assert "unsupported tensor 'model.layers.0.self_attn.k_norm.weight'" in str(ei.value)
    # and a missing one is named
    dst = copy_without_tensor(tmp_path, "qwen3", "model.layers.1.self_attn.q_norm.weight")
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.self_attn.q_norm.weight'"):
        load_checkpoint(str(dst))


def test_sliding_window_shorter_than_the_context(tmp_path: Path) -> None:
    """Both runners attend within the window (the cpu runner's C++ op and the
    gpu runner's plain attention take each layer's window), so any
    --max-model-len serves; a window no shorter than the context is dropped.
    A runner that does not honour windows refuses one shorter than the context."""
    from fdx.config import make_config
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    folder = str(DATA / "mistral")
    runner = PaddleModelRunner(make_config(model=folder, num_kv_blocks=8, max_model_len=1024), CPUDevice())
    assert runner.attention_impl == "native" and [l.window for l in runner.model.layers] == [512, 512]
    runner = PaddleModelRunner(make_config(model=folder, num_kv_blocks=8, max_model_len=512), CPUDevice())
    assert [l.window for l in runner.model.layers] == [0, 0]  # as long as the context: no window at all
    gpu = GPUModelRunner(make_config(model=folder, num_kv_blocks=8, max_model_len=1024), CPUDevice())
    assert gpu.model.layer_windows == (512, 512) and gpu.model.plain_attention
    gpu = GPUModelRunner(make_config(model=folder, num_kv_blocks=8, max_model_len=512), CPUDevice())
    assert gpu.model.layer_windows == () and not gpu.model.plain_attention

    class NoWindows(PaddleModelRunner):
        honours_sliding_window = False

    with pytest.raises(ModelLoadError) as ei:
        NoWindows(make_config(model=folder, num_kv_blocks=8, max_model_len=1024), CPUDevice())
    msg = str(ei.value)
    assert "'sliding_window' = 512" in msg and "--max-model-len <= 512" in msg, msg


def test_phi3_longrope_beyond_the_original_context_is_refused_where_fdx_would_serve_it_wrong(tmp_path: Path) -> None:
    """Past original_max_position_embeddings (512 here) a sequence takes the
    long factors; both runners serve that (phi3_long's tests), but not
    with the prefix cache on (a cached block cannot tell which factors its KV
    has), nor with speculative drafts (a draft crossing it would be verified
    with one factor set), nor on a runner without per-row rope factors: each
    refused at start, naming the field (the sliding window taken out)."""
    from fdx.config import make_config
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    class NoLongRope(PaddleModelRunner):
        honours_long_rope = False

    folder = str(copy_with_config(tmp_path, "phi3", sliding_window=None))
    cases = [(PaddleModelRunner, 513, {}, "--no-enable-prefix-caching"),
             (PaddleModelRunner, None, {}, "--no-enable-prefix-caching"),  # None: max_position_embeddings (2048)
             (PaddleModelRunner, 513, dict(enable_prefix_caching=False, speculative="ngram", scheduler="v1"),
              "--speculative"),
             (NoLongRope, 513, dict(enable_prefix_caching=False), "not implemented by this runner"),
             (GPUModelRunner, 513, {}, "--no-enable-prefix-caching")]
    for cls, max_len, extra, why in cases:
        with pytest.raises(ModelLoadError) as ei:
            cls(make_config(model=folder, num_kv_blocks=8, max_model_len=max_len, **extra), CPUDevice())
        msg = str(ei.value)
        assert "\n" not in msg and "'original_max_position_embeddings' = 512" in msg and "longrope" in msg, msg
        assert why in msg and f"--max-model-len <= 512 (now {max_len or 2048})" in msg, msg
    runner = PaddleModelRunner(make_config(model=folder, num_kv_blocks=8, max_model_len=513, enable_prefix_caching=False),
                               CPUDevice())
    assert runner.long_rope_after == 512 and runner.model.long_rope and not runner.model.fused_layers


def long_runner(dtype: str, model: Path | None = None) -> Any:
    """The cpu runner of phi3_long (original context 32) with a context of 128, the prefix cache off."""
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    return PaddleModelRunner(make_config(model=str(model or DATA / "phi3_long"), num_kv_blocks=64, block_size=4,
                                         max_model_len=128, dtype=dtype, enable_prefix_caching=False), CPUDevice())


def test_phi3_longrope_past_the_original_context_matches_transformers(tmp_path: Path) -> None:
    """phi3_long's goldens cross original_max_position_embeddings (32): the
    37-token prompt is past it from the start (the long factors everywhere),
    the 6- and 19-token ones cross it while decoding (transformers then
    recomputes the sequence with the long factors, and so does the runner:
    the crossing step runs from position 0).  Teacher-forced in float32: the
    same top-1 everywhere, logprobs within 1e-3; from the GGUF (llama.cpp's
    rope_factors_long) too.  With the long factors made the short ones, the
    tokens past 32 drift: they are in play."""
    from fdx.model.arch import LongRopeScaling
    from fdx.model.loader import load_checkpoint

    rs = load_checkpoint(str(DATA / "phi3_long")).args.rope_scaling
    assert isinstance(rs, LongRopeScaling) and rs.original_max_position == 32 and rs.long_factor != rs.short_factor
    agree, worst = golden_gap(long_runner("float32"), "phi3_long")
    assert agree == 1.0 and worst < 1e-3, f"top-1 {agree:.3f}, logprobs differ by {worst:.2e}"
    agree, worst = golden_gap(long_runner("float32", arch_gguf(tmp_path, "phi3_long")), "phi3_long")
    assert agree == 1.0 and worst < 1e-3, f"GGUF: top-1 {agree:.3f}, logprobs differ by {worst:.2e}"

    cfg = json.loads((DATA / "phi3_long" / "config.json").read_text())
    short = copy_with_config(tmp_path, "phi3_long", rope_parameters={
        **cfg["rope_parameters"], "long_factor": cfg["rope_parameters"]["short_factor"]})
    agree, worst = golden_gap(long_runner("float32", short), "phi3_long")
    assert worst > 0.05, f"the long factors changed nothing ({worst:.2e})"


def test_gpu_runner_on_the_cpu_place_longrope_past_the_original_context_matches_transformers() -> None:
    """The gpu runner takes each row's factor set too (its rope tables hold the
    short then the long rows): phi3_long's goldens, teacher-forced in float32
    on the CPU place, the same top-1 everywhere and logprobs within 1e-3."""
    from fdx.config import make_config
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    runner = GPUModelRunner(make_config(model=str(DATA / "phi3_long"), num_kv_blocks=64, block_size=4,
                                        max_model_len=128, dtype="float32", enable_prefix_caching=False), CPUDevice())
    assert runner.long_rope_after == 32 and runner.model.long_rope
    agree, worst = golden_gap(runner, "phi3_long")
    assert agree == 1.0 and worst < 1e-3, f"top-1 {agree:.3f}, logprobs differ by {worst:.2e}"


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_phi3_longrope_past_the_original_context_packed_modes(dtype: str, request: Any) -> None:
    """int8 / bfloat16 top-1 against the goldens past the original context.
    int8: 92/96, fp32 near-ties, not LongRoPE: int8's max logit error is the
    dense models' (median 0.162, p90 0.192; mistral 0.147 / 0.179, qwen3
    0.147 / 0.178), and 17 of the 96 positions have an fp32 top-2 gap under
    0.1; the four misses are at gaps 0.021, 0.044, 0.051 and 0.129."""
    if dtype == "int8":
        request.applymarker(pytest.mark.xfail(strict=True, reason="92/96 top-1: fp32 top-2 gaps 0.02-0.13 at the "
                                                                  "misses under int8's logit error ~0.16"))
    agree, _ = golden_gap(long_runner(dtype), "phi3_long")
    assert agree >= 0.97, f"phi3_long {dtype}: top-1 agreement {agree:.3f}"


def test_phi3_longrope_served_past_the_original_context_gives_the_greedy_tokens() -> None:
    """A real ``fdx serve`` (prefix cache off): transformers' greedy tokens and
    logprobs for the three prompts, all in one continuous batch (each
    sequence switches to the long factors at its own step)."""
    import concurrent.futures

    samples = goldens("phi3_long")
    with start_server("--model", str(DATA / "phi3_long"), "--dtype", "float32", "--max-model-len", "128",
                      "--no-enable-prefix-caching", "--served-model-name", "m",
                      default_args=("--num-kv-blocks", "64")) as (base, _):
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda s: served_greedy(base, [s])[0], samples))
        for s, (toks, lps) in zip(samples, got):
            assert toks == s["tokens"]
            np.testing.assert_allclose(lps, s["logprobs"], atol=1e-3)


def test_phi3_longrope_short_factors_and_attention_factor(tmp_path: Path) -> None:
    """The short factors divide the frequencies; the attention factor
    (sqrt(1 + ln 4 / ln 512): max_position_embeddings is 4x the original)
    scales the q and k rows split from the fused qkv_proj; a transformers v4
    config (``rope_scaling`` of type ``su``, ``rope_theta`` beside it) reads
    the same, as does one naming Microsoft's remote-code classes."""
    import math

    import attrs
    from safetensors.numpy import load_file

    from fdx.model.arch import LongRopeScaling, rope_inv_freq
    from fdx.model.loader import load_checkpoint

    ck = load_checkpoint(str(DATA / "phi3"))
    rs = ck.args.rope_scaling
    assert isinstance(rs, LongRopeScaling) and rs.original_max_position == 512
    assert rs.short_factor == tuple(PHI3_ROPE["short_factor"])
    assert math.isclose(rs.attention_factor, math.sqrt(1 + math.log(4) / math.log(512)))
    plain = rope_inv_freq(attrs.evolve(ck.args, rope_scaling=None))
    np.testing.assert_allclose(rope_inv_freq(ck.args), plain / np.asarray(PHI3_ROPE["short_factor"]))

    w = load_file(str(DATA / "phi3" / "model.safetensors"))
    qkv, gate_up = w["model.layers.1.self_attn.qkv_proj.weight"], w["model.layers.1.mlp.gate_up_proj.weight"]
    layer = list(ck.layers())[1]
    a = ck.args
    np.testing.assert_allclose(layer.wq, qkv[:a.q_size] * np.float32(rs.attention_factor), rtol=1e-6)
    np.testing.assert_allclose(layer.wk, qkv[a.q_size:a.q_size + a.kv_size] * np.float32(rs.attention_factor), rtol=1e-6)
    np.testing.assert_array_equal(layer.wv, qkv[a.q_size + a.kv_size:])
    np.testing.assert_array_equal(layer.w_gate, gate_up[:a.intermediate_size])
    np.testing.assert_array_equal(layer.w_up, gate_up[a.intermediate_size:])

    v4_rope = {"type": "su", "short_factor": PHI3_ROPE["short_factor"], "long_factor": PHI3_ROPE["long_factor"]}
    folder = copy_with_config(tmp_path, "phi3", rope_parameters=None, rope_scaling=v4_rope, rope_theta=10000.0,
                              auto_map={"AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"})
    assert load_checkpoint(str(folder)).args == attrs.evolve(ck.args, rope_scaling=attrs.evolve(rs, rope_type="su"))


def test_phi3_fused_weight_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    from fdx.model.loader import load_checkpoint

    folder = copy_with_config(tmp_path, "phi3", intermediate_size=200)
    with pytest.raises(ModelLoadError) as ei:
        list(load_checkpoint(str(folder)).layers())
    assert "tensor 'model.layers.0.mlp.gate_up_proj.weight' has shape [512, 128], expected 400 rows (200 + 200)" in str(ei.value)


def test_gemma2_config_and_weights_as_read(tmp_path: Path) -> None:
    """Gemma 2's fields land in ModelArgs (per-layer windows from
    ``layer_types``, the attention scale from ``query_pre_attn_scalar``, both
    caps, the embedding scale); its ``(1 + w)`` norm weights come out as
    ``1 + w``; a transformers v4 config (no ``layer_types``: the class's
    even-layers-slide pattern; ``rope_theta``, ``hidden_act`` beside
    ``hidden_activation``, ``sliding_window_size``, ``cache_implementation``)
    reads the same; sliding layers without a window are refused."""
    import math

    from safetensors.numpy import load_file

    from fdx.model.loader import load_checkpoint

    ck = load_checkpoint(str(DATA / "gemma2"))
    a = ck.args
    assert (a.arch, a.mlp_act, a.sandwich_norms, a.layer_windows, a.sliding_window) == ("gemma2", "gelu_tanh", True, (8, 0, 8, 0), None)
    assert (a.attn_softcap, a.final_softcap, a.tie_embeddings) == (5.0, 30.0, True)
    assert math.isclose(a.attn_scale, 48 ** -0.5) and math.isclose(a.embed_scale, math.sqrt(128))
    w = load_file(str(DATA / "gemma2" / "model.safetensors"))
    layer = list(ck.layers())[2]
    for ours, theirs in (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
                         ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffn_norm", "post_feedforward_layernorm")):
        np.testing.assert_array_equal(getattr(layer, ours), w[f"model.layers.2.{theirs}.weight"] + np.float32(1))
    np.testing.assert_array_equal(ck.final_norm, w["model.norm.weight"] + np.float32(1))

    v4 = copy_with_config(tmp_path, "gemma2", layer_types=None, rope_parameters=None, rope_scaling=None, rope_theta=10000.0,
                          hidden_act="gelu_pytorch_tanh", sliding_window_size=8, cache_implementation="hybrid")
    assert load_checkpoint(str(v4)).args == a
    folder = copy_with_config(tmp_path, "gemma2", sliding_window=None)
    with pytest.raises(ModelLoadError, match="'layer_types' has sliding layers but 'sliding_window' is not set"):
        load_checkpoint(str(folder))


def test_gemma3_config_and_weights_as_read(tmp_path: Path) -> None:
    """Gemma 3: the sliding layers' rope base (1e4, unscaled) apart from the
    global layers' (1e6, linear x8), per-head q/k norm weights as ``1 + w``,
    no caps; a transformers v4 config (``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling``, ``sliding_window_pattern``
    in place of ``layer_types``) reads the same."""
    import attrs
    from safetensors.numpy import load_file

    from fdx.model.arch import LinearRopeScaling, rope_inv_freq
    from fdx.model.loader import load_checkpoint

    ck = load_checkpoint(str(DATA / "gemma3"))
    a = ck.args
    assert (a.arch, a.qk_norm, a.layer_windows, a.attn_softcap, a.final_softcap) == ("gemma3", True, (8, 8, 8, 0), None, None)
    assert (a.rope_theta, a.rope_local_theta, a.rope_scaling) == (1e6, 1e4, LinearRopeScaling("linear", 8.0))
    plain = 1.0 / 1e4 ** (np.arange(16) / 16)
    np.testing.assert_allclose(rope_inv_freq(a, local=True), plain)
    np.testing.assert_allclose(rope_inv_freq(a), 1.0 / 1e6 ** (np.arange(16) / 16) / 8)
    w = load_file(str(DATA / "gemma3" / "model.safetensors"))
    layer = list(ck.layers())[3]
    np.testing.assert_array_equal(layer.q_norm, w["model.layers.3.self_attn.q_norm.weight"] + np.float32(1))
    np.testing.assert_array_equal(layer.k_norm, w["model.layers.3.self_attn.k_norm.weight"] + np.float32(1))

    v4 = copy_with_config(tmp_path, "gemma3", layer_types=None, _sliding_window_pattern=None, sliding_window_pattern=4,
                          rope_parameters=None, rope_theta=1e6, rope_local_base_freq=1e4,
                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert load_checkpoint(str(v4)).args == a
    # without a pattern, the class's: every 6th layer global (here: none of the 4)
    v4 = copy_with_config(tmp_path, "gemma3", layer_types=None, _sliding_window_pattern=None)
    assert load_checkpoint(str(v4)).args == attrs.evolve(a, layer_windows=(8, 8, 8, 8))


def test_llama3_rope_scaling_changes_only_the_low_frequencies() -> None:
    from fdx.model.arch import RopeScaling, rope_inv_freq
    from fdx.model.loader import load_checkpoint

    args = load_checkpoint(str(DATA / "llama3")).args
    rs = args.rope_scaling
    assert rs == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    import attrs

    plain = rope_inv_freq(attrs.evolve(args, rope_scaling=None))
    scaled = rope_inv_freq(args)
    wavelen = 2 * np.pi / plain
    np.testing.assert_array_equal(scaled[wavelen < 32 / 4], plain[wavelen < 32 / 4])
    np.testing.assert_allclose(scaled[wavelen > 32], plain[wavelen > 32] / 8)
    mid = (wavelen >= 8) & (wavelen <= 32)
    assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)


# --------------------------------------------------------------------------
# parity with transformers (in-process runner, teacher-forced on the goldens)
# --------------------------------------------------------------------------


def teacher_forced(runner: Any, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logits ``[len(tokens), V]`` predicting each golden token, the goldens fed back in."""
    from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
    from fdx.core.messages import SamplingParams
    from fdx.core.request import Request

    captured: list[np.ndarray] = []
    real = runner.sampler.sample

    def spy(logits: Any, reqs: Any) -> Any:
        captured.append(np.asarray(logits.numpy() if hasattr(logits, "numpy") else logits, dtype=np.float64))
        return real(logits, reqs)

    runner.sampler.sample = spy
    try:
        req = Request("tf", list(prompt), SamplingParams(max_tokens=len(tokens) + 1, temperature=0.0, ignore_eos=True),
                      eos_token_ids=runner.eos_token_ids, max_model_len=runner.max_model_len)
        req.block_ids = list(range(-(-(len(prompt) + len(tokens)) // runner.block_size)))
        n = len(prompt)
        for t in tokens:
            runner.execute(ScheduledBatch([ScheduledSeq(req, n)]))
            req.num_computed_tokens += n
            req.append_token(int(t))  # the golden token, whatever was sampled
            n = 1
    finally:
        runner.sampler.sample = real
    return np.concatenate([c[:1] for c in captured], axis=0)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=ARCHS)
def arch_name(request: Any) -> str:
    return request.param


def make_runner(name: str, dtype: str, model: Path | None = None) -> Any:
    """The runner of test model ``name`` (or of ``model``: its GGUF)."""
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    return PaddleModelRunner(make_config(model=str(model or DATA / name), num_kv_blocks=32, block_size=4,
                                         max_model_len=512, dtype=dtype), CPUDevice())


def golden_gap(runner: Any, name: str, which: str = "goldens") -> tuple[float, float]:
    """Teacher-forced on ``name``'s goldens: (top-1 agreement, max |logprob - golden|)."""
    same = total = 0
    worst = 0.0
    for s in goldens(name, which):
        lp = log_softmax(teacher_forced(runner, s["prompt"], s["tokens"]))
        same += sum(int(i) == t for i, t in zip(lp.argmax(-1), s["tokens"]))
        total += len(s["tokens"])
        got = lp[np.arange(len(s["tokens"])), s["tokens"]]
        worst = max(worst, float(np.abs(got - np.asarray(s["logprobs"])).max()))
    return same / total, worst


def test_float32_matches_transformers(arch_name: str) -> None:
    agree, worst = golden_gap(make_runner(arch_name, "float32"), arch_name)
    assert agree == 1.0, arch_name
    assert worst < 1e-3, f"{arch_name}: logprobs differ by {worst:.2e}"


@pytest.mark.parametrize("name", ["phi3_swa", "mixtral_swa"])
def test_phi3_and_mixtral_sliding_window_match_transformers(tmp_path: Path, name: str) -> None:
    """Phi-3 and Mixtral with a window of 8 (shorter than two prompts): the
    greedy tokens and logprobs of transformers; with every key, they drift."""
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    agree, worst = golden_gap(make_runner(name, "float32"), name)
    assert agree == 1.0, name
    assert worst < 1e-3, f"{name}: logprobs differ by {worst:.2e}"
    folder = copy_with_config(tmp_path, name, sliding_window=512)
    runner = PaddleModelRunner(make_config(model=str(folder), num_kv_blocks=32, block_size=4, max_model_len=512,
                                           dtype="float32"), CPUDevice())
    _, drift = golden_gap(runner, name)
    assert drift > 0.05, f"{name}: the goldens do not tell the window apart ({drift:.2e})"


def test_gemma2_goldens_depend_on_the_window_and_the_caps(tmp_path: Path) -> None:
    """The parity test can fail on each Gemma quirk: served without its
    sliding window (every layer global) or without either soft-cap, the
    random Gemma 2 drifts far from transformers' logprobs."""
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    s = goldens("gemma2")[2]  # the 37-token prompt: longer than the window
    for changes in ({"layer_types": ["full_attention"] * 4}, {"attn_logit_softcapping": None},
                    {"final_logit_softcapping": None}):
        folder = copy_with_config(tmp_path, "gemma2", **changes)
        runner = PaddleModelRunner(make_config(model=str(folder), num_kv_blocks=32, block_size=4, max_model_len=512,
                                               dtype="float32"), CPUDevice())
        # the scores' soft-cap: the pure-Paddle attention (the C++ op computes windows, not caps)
        assert runner.attention_impl == ("native" if "attn_logit_softcapping" in changes else "paddle")
        lp = log_softmax(teacher_forced(runner, s["prompt"], s["tokens"]))
        drift = np.abs(lp[np.arange(len(s["tokens"])), s["tokens"]] - np.asarray(s["logprobs"])).max()
        assert drift > 0.05, f"{changes}: the goldens do not tell this change apart ({drift:.2e})"


def test_mistral_swa_goldens_depend_on_the_window(tmp_path: Path) -> None:
    """The short-window Mistral's goldens tell the window apart: served with
    every key (a window as long as the context) or a window one key longer,
    the model drifts from transformers' logprobs."""
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    s = goldens("mistral_swa")[2]  # the 37-token prompt: longer than the window (8)
    for window in (512, 9):
        folder = copy_with_config(tmp_path, "mistral_swa", sliding_window=window)
        runner = PaddleModelRunner(make_config(model=str(folder), num_kv_blocks=32, block_size=4, max_model_len=512,
                                               dtype="float32"), CPUDevice())
        lp = log_softmax(teacher_forced(runner, s["prompt"], s["tokens"]))
        drift = np.abs(lp[np.arange(len(s["tokens"])), s["tokens"]] - np.asarray(s["logprobs"])).max()
        assert drift > 0.05, f"window {window}: the goldens do not tell the window apart ({drift:.2e})"


def test_mistral_swa_prompt_served_twice_from_the_prefix_cache() -> None:
    """Every KV block stays cached (the window is applied in the attention,
    not by freeing blocks), so a prompt longer than the window served again
    from the prefix cache gives the same greedy tokens and logprobs."""
    s = goldens("mistral_swa")[2]
    with start_server("--model", str(DATA / "mistral_swa"), "--dtype", "float32", "--max-model-len", "512",
                      "--served-model-name", "m", "--block-size", "4", default_args=("--num-kv-blocks", "64")) as (base, _):
        runs = []
        for _ in range(2):
            r = httpx.post(base + "/v1/completions", json={
                "model": "m", "prompt": s["prompt"], "max_tokens": len(s["tokens"]), "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_token_ids": True}, timeout=120)
            assert r.status_code == 200, r.text
            js = r.json()
            runs.append((js["choices"][0]["token_ids"], js["choices"][0]["logprobs"]["token_logprobs"],
                         int(js["usage"]["prompt_tokens_details"]["cached_tokens"])))
    assert runs[0][2] == 0 and runs[1][2] >= 32, runs  # the second: the prompt's full blocks from the cache
    assert runs[0][0] == runs[1][0] == s["tokens"]
    np.testing.assert_allclose(runs[1][1], s["logprobs"], atol=1e-3)


def test_gemma3_goldens_depend_on_the_local_rope_base(tmp_path: Path) -> None:
    """Gemma 3's sliding layers rotate with their own base: served with the
    global layers' base (and scaling) there too, the model drifts."""
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    s = goldens("gemma3")[1]
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    for local in ({"rope_type": "default", "rope_theta": 1e6}, {"rope_type": "default", "rope_theta": 1e5}):
        folder = copy_with_config(tmp_path, "gemma3", rope_parameters={"sliding_attention": local, "full_attention": full})
        runner = PaddleModelRunner(make_config(model=str(folder), num_kv_blocks=32, block_size=4, max_model_len=512,
                                               dtype="float32"), CPUDevice())
        lp = log_softmax(teacher_forced(runner, s["prompt"], s["tokens"]))
        drift = np.abs(lp[np.arange(len(s["tokens"])), s["tokens"]] - np.asarray(s["logprobs"])).max()
        assert drift > 0.05, f"{local}: the goldens do not tell the local base apart ({drift:.2e})"


@pytest.mark.parametrize("name", (*ARCHS, "mixtral_swa"))
def test_gpu_runner_on_the_cpu_place_matches_transformers(name: str) -> None:
    """The ``gpu`` runner's forward (here on the CPU place, float32, its plain
    attention) computes every architecture's recipe too: Gemma's caps,
    windows, sandwich norms and local rope included, and the mixtures of
    experts (the CPU model's :class:`~fdx.model.moe.MoeBlock`, plain Paddle)."""
    from fdx.config import make_config
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    runner = GPUModelRunner(make_config(model=str(DATA / name), num_kv_blocks=32, block_size=4, max_model_len=512,
                                        dtype="float32"), CPUDevice())
    worst = 0.0
    for s in goldens(name):
        lp = log_softmax(teacher_forced(runner, s["prompt"], s["tokens"]))
        assert [int(i) for i in lp.argmax(-1)] == s["tokens"], name
        worst = max(worst, float(np.abs(lp[np.arange(len(s["tokens"])), s["tokens"]] - np.asarray(s["logprobs"])).max()))
    assert worst < 1e-3, f"{name}: logprobs differ by {worst:.2e}"


#: int8 misses the 97% bar on these random models: every miss is an fp32
#: near-tie against int8's logit error (its one-digit Q8_0 activations, ~0.1-0.2
#: at most on these flat random logits; docs/PERFORMANCE.md "int8 accuracy").
#: The dense ones by one token (top-2 gap 0.004-0.012, phi3 0.04-0.09); the
#: short-window Mistral 92/96, not the window: its int8 max logit error is the
#: unwindowed Mistral's (median 0.157 / p90 0.180 against 0.147 / 0.179), and
#: 12 of its 96 positions have an fp32 top-2 gap under 0.1 (the misses: gaps
#: 0.023, 0.025, 0.059, 0.068).  Only a finer activation quantization moves
#: these (the two-level activations of branch int8acc: 100%, at 0.65-0.79x). The MoE models, with the
#: router in float32 (fdx/model/moe.py; measured with a Q8_0 router -> float32):
#: qwen3_moe 91 -> 93/96 (gaps 0.003 and 0.009 and 0.021; at two of them an
#: expert choice still flips, as the router's input carries the int8 error of
#: the layers before, and a logit moves by 1.4-1.9), mixtral 93 -> 93/96 (gaps
#: 0.03-0.10), qwen2_moe 92 -> 90/96 (gaps 0.001-0.19, its routed and shared
#: experts' Q8_0 error, max 0.10-0.15).  With int8's default bfloat16 KV cache
#: (--kv-cache-dtype auto) the near-ties fall otherwise: llama3 93, mistral 93,
#: mistral_swa 90, phi3 93, mixtral 92 of 96; qwen3_moe 96 and qwen2_moe 94 now
#: pass (with a float32 pool: 93 and 90).
INT8_SHORT = {"llama3", "mistral", "mistral_swa", "phi3", "mixtral"}
#: bfloat16 passes everywhere since the router is float32 (qwen3_moe was 92/96
#: with a bf16 router, is 94/96: its two misses at fp32 top-2 gaps 0.003, 0.009)
BF16_SHORT: set[str] = set()


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_packed_modes_agree_with_float32(arch_name: str, dtype: str, request: Any) -> None:
    if dtype == "int8" and arch_name in INT8_SHORT:
        request.applymarker(pytest.mark.xfail(strict=True, reason="90-95/96 top-1: fp32 near-ties (top-2 gaps "
                                                                  "0.001-0.19) under int8's activation error"))
    if dtype == "bfloat16" and arch_name in BF16_SHORT:
        request.applymarker(pytest.mark.xfail(strict=True, reason="92/96 top-1: near-ties of the random model"))
    runner = make_runner(arch_name, dtype)
    hits = total = 0
    for s in goldens(arch_name):
        top = teacher_forced(runner, s["prompt"], s["tokens"]).argmax(-1)
        hits += int((top == np.asarray(s["tokens"])).sum())
        total += len(s["tokens"])
    assert hits / total >= 0.97, f"{arch_name} {dtype}: top-1 agreement {hits}/{total}"


# --------------------------------------------------------------------------
# a real server per architecture
# --------------------------------------------------------------------------


def served_greedy(base: str, samples: list[dict[str, Any]]) -> list[tuple[list[int], list[float]]]:
    out = []
    for s in samples:
        r = httpx.post(base + "/v1/completions", json={
            "model": "m", "prompt": s["prompt"], "max_tokens": len(s["tokens"]), "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        out.append((ch["token_ids"], ch["logprobs"]["token_logprobs"]))
    return out


def test_served_float32_gives_the_greedy_tokens(arch_name: str) -> None:
    samples = goldens(arch_name)
    with start_server("--model", str(DATA / arch_name), "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "m",
                      default_args=("--num-kv-blocks", "64")) as (base, _):
        for s, (toks, lps) in zip(samples, served_greedy(base, samples)):
            assert toks == s["tokens"]
            np.testing.assert_allclose(lps, s["logprobs"], atol=1e-3)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral_swa"])
def test_gemma_at_tp2_gives_the_greedy_tokens(name: str) -> None:
    """Gemma's additions are row-wise or element-wise (the embedding scale
    after the vocab-parallel sum, the sandwich norms after each all-reduce,
    the final soft-cap per vocab shard) and a sliding window is per head
    (Gemma's, the short-window Mistral's), so two ranks give transformers'
    tokens too; a prompt served again from the prefix cache as well."""
    samples = goldens(name)[1:]
    with start_server("--model", str(DATA / name), "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "m",
                      "-tp", "2", default_args=("--num-kv-blocks", "64")) as (base, _):
        for s, (toks, lps) in zip(samples, served_greedy(base, samples)):
            assert toks == s["tokens"]
            np.testing.assert_allclose(lps, s["logprobs"], atol=1e-3)
        # again, its prompt's blocks from the prefix cache: the window applies to cached keys alike
        s = samples[-1]
        (toks, lps), = served_greedy(base, [s])
        assert toks == s["tokens"]
        np.testing.assert_allclose(lps, s["logprobs"], atol=1e-3)
        hits = [ln for ln in httpx.get(base + "/metrics").text.splitlines() if ln.startswith("fdx:prefix_cache_hits")]
        assert hits and float(hits[0].split()[-1]) >= 16, hits  # at least a block of the 37-token prompt, > the window


def test_renamed_llama_from_a_plugin_is_served(tmp_path: Path) -> None:
    """A third-party package adds ``MyLlamaForCausalLM`` through the public hook
    (tests/arch_plugin.py, found by its entry point); fdx serves it."""
    import arch_plugin

    folder = copy_with_config(tmp_path, "llama3", architectures=["MyLlamaForCausalLM"])
    env = {"PYTHONPATH": arch_plugin.write_entry_point(str(tmp_path / "ep"))}
    samples = goldens("llama3")[:1]
    with start_server("--model", str(folder), "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "m", env=env,
                      default_args=("--num-kv-blocks", "64")) as (base, _):
        (toks, _lps), = served_greedy(base, samples)
        assert toks == samples[0]["tokens"]
    shutil.rmtree(folder)


def test_architecture_plugin_on_a_fresh_plugin_manager(tmp_path: Path, plugin_manager: Any) -> None:
    """The public hook on a fresh plugin manager: a renamed llama is picked by
    its HF name and loads; two plugins claiming one HF name are named; the
    plugin set is restored in ``finally``."""
    import arch_plugin

    from fdx.core.errors import PluginError
    from fdx.core.plugins import collect, set_plugins
    from fdx.model.loader import find_architecture, load_checkpoint
    from fdx.plugins.architectures import builtin

    folder = copy_with_config(tmp_path, "llama3", architectures=["MyLlamaForCausalLM"])
    plugin_manager.register(builtin, name="architectures_builtin")
    plugin_manager.register(arch_plugin, name="my_llama")
    try:
        plugins = collect(plugin_manager)
        assert {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "my-llama"} <= set(plugins.registry("architecture").names())
        set_plugins(plugins)
        ck = load_checkpoint(str(folder))
        assert ck.args.arch == "my-llama" and ck.args.rope_scaling is not None
        with pytest.raises(ModelLoadError, match="'NopeForCausalLM'.*MyLlamaForCausalLM"):
            find_architecture("config.json", hf_names=["NopeForCausalLM"])

        class Twin:
            @staticmethod
            @hookimpl
            def fdx_register_architectures(register: Any) -> None:
                from fdx.plugins.architectures.builtin import LLAMA, renamed

                register("twin", lambda: renamed(LLAMA, "twin", "MyLlamaForCausalLM"))

        plugin_manager.register(Twin, name="twin-plugin")
        set_plugins(collect(plugin_manager))
        with pytest.raises(PluginError, match="'MyLlamaForCausalLM' is claimed twice: by plugin 'my_llama'.*'twin-plugin'"):
            load_checkpoint(str(folder))
    finally:
        set_plugins(None)


def test_fdx_plugins_lists_the_architectures() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fdx", "plugins"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {tuple(ln.split()[:2]) for ln in out.stdout.splitlines()}
    assert {("architecture", n) for n in ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe",
                                          "qwen2_moe", "mixtral")} <= rows, out.stdout


# --------------------------------------------------------------------------
# mixture of experts
# --------------------------------------------------------------------------


def test_moe_experts_are_read_and_expert_parallel_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    """Qwen3-MoE's and Mixtral's experts come out stacked from their own
    tensor names, the routing fields as the configs say (Qwen3-MoE's
    ``num_experts``, as the hub's configs name it, reads as transformers 5's
    ``num_local_experts``); a missing expert is named; MoE under tensor
    parallelism is a one-line ConfigError at start-up."""
    from safetensors.numpy import load_file

    from fdx.config import make_config
    from fdx.core.errors import ConfigError
    from fdx.model.loader import load_checkpoint
    from fdx.model.runner import PaddleModelRunner
    from fdx.parallel.sharding import make_shard, shard_checkpoint
    from fdx.plugins.hardware.cpu import CPUDevice

    q = load_checkpoint(str(DATA / "qwen3_moe"))
    a = q.args
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.norm_topk_prob) == (8, 2, 64, True)
    w = load_file(str(DATA / "qwen3_moe" / "model.safetensors"))
    lw = list(q.layers())[1]
    np.testing.assert_array_equal(lw.router, w["model.layers.1.mlp.gate.weight"])
    np.testing.assert_array_equal(lw.e_up[5], w["model.layers.1.mlp.experts.5.up_proj.weight"])
    np.testing.assert_array_equal(lw.e_down[7], w["model.layers.1.mlp.experts.7.down_proj.weight"])
    assert lw.w_gate is None and lw.w_down is None
    cfg = json.loads((DATA / "qwen3_moe" / "config.json").read_text())
    hub = copy_with_config(tmp_path, "qwen3_moe", num_local_experts=None, num_experts=cfg["num_local_experts"])
    assert load_checkpoint(str(hub)).args == a
    m = load_checkpoint(str(DATA / "mixtral")).args
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) == (4, 2, 96, True)
    mw = load_file(str(DATA / "mixtral" / "model.safetensors"))
    ml = list(load_checkpoint(str(DATA / "mixtral")).layers())[0]
    np.testing.assert_array_equal(ml.e_gate[3], mw["model.layers.0.block_sparse_moe.experts.3.w1.weight"])
    np.testing.assert_array_equal(ml.e_up[3], mw["model.layers.0.block_sparse_moe.experts.3.w3.weight"])

    dst = copy_without_tensor(tmp_path, "qwen3_moe", "model.layers.0.mlp.experts.3.gate_proj.weight")
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.0.mlp.experts.3.gate_proj.weight'"):
        load_checkpoint(str(dst))

    mine = list(q.layers(range(6, 8)))[1]  # rank 3 of 4's experts: the others' tensors are not read
    assert mine.e_up.shape == (2, 64, 128)
    np.testing.assert_array_equal(mine.e_up[1], w["model.layers.1.mlp.experts.7.up_proj.weight"])
    asked: list[Any] = []
    read = q.layers
    q.layers = lambda experts=None: (asked.append(experts), read(experts))[1]
    shard = list(shard_checkpoint(q, make_shard(a, 1, 2, expert_parallel=True)).layers())
    assert asked == [range(4, 8)] and shard[1].e_down.shape == (4, 128, 64)  # rank 1 asks the loader for its own
    np.testing.assert_array_equal(shard[1].e_down[3], w["model.layers.1.mlp.experts.7.down_proj.weight"])

    with pytest.raises(ConfigError) as ei:
        PaddleModelRunner(make_config(model=str(DATA / "llama3"), num_kv_blocks=8, max_model_len=512,
                                      enable_expert_parallel=True), CPUDevice())
    msg = str(ei.value)
    assert "\n" not in msg and "--enable-expert-parallel" in msg and "mixture-of-experts models only" in msg, msg


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "qwen2_moe_dense", "mixtral"])
def test_expert_parallel_gives_the_one_rank_tokens_and_counts_the_experts_load(name: str) -> None:
    """``fdx serve -tp 2 --enable-expert-parallel`` (each rank half the experts,
    whole), and ``-tp 2`` alone (each expert's width halved), give the greedy
    tokens of one rank, logprobs within 1e-4; ``/metrics`` counts each
    expert's (token, slot) pairs with the rank that holds it (``all``: every
    rank a slice): under expert parallelism every rank some, and all of them
    summing to the tokens run x top-k x layers."""
    samples = goldens(name)
    cfg = json.loads((DATA / name / "config.json").read_text())
    top_k, E = cfg["num_experts_per_tok"], cfg.get("num_local_experts") or cfg["num_experts"]
    only, step = cfg.get("mlp_only_layers") or [], cfg.get("decoder_sparse_step") or 1  # the sparse layers route
    layers = sum(i not in only and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"]))
    runs = {}
    for tp, ep in (("1", True), ("2", True), ("2", False)):
        with start_server("--model", str(DATA / name), "--dtype", "float32", "--max-model-len", "512",
                          "--served-model-name", "m", "-tp", tp, *(["--enable-expert-parallel"] if ep else []),
                          default_args=("--num-kv-blocks", "64", "--no-enable-prefix-caching")) as (base, _):
            runs[tp, ep] = served_greedy(base, samples)
            text = httpx.get(base + "/metrics").text
        load = {}
        for ln in text.splitlines():
            if ln.startswith("fdx:moe_expert_tokens_total{"):
                labels = dict(kv.split("=") for kv in ln[ln.index("{") + 1 : ln.index("}")].replace('"', "").split(","))
                load[int(labels["expert"])] = (labels["rank"], float(ln.split()[-1]))
        run = [ln for ln in text.splitlines() if ln.startswith("fdx:engine_batched_tokens_total")]
        owner = {e: str(e * int(tp) // E) if ep else "all" for e in range(E)}
        assert {e: r for e, (r, _n) in load.items()} == owner, text
        for rank in set(owner.values()):
            assert sum(n for r, n in load.values() if r == rank) > 0, load
        assert sum(n for _r, n in load.values()) == float(run[0].split()[-1]) * top_k * layers, (load, run)
    for key in (("2", True), ("2", False)):
        for (toks1, lps1), (toks2, lps2) in zip(runs["1", True], runs[key]):
            assert toks2 == toks1, key
            np.testing.assert_allclose(lps2, lps1, atol=1e-4, err_msg=str(key))


@pytest.mark.parametrize(("dtype", "tp"), [("int8", 1), ("bfloat16", 1), ("int8", 2), ("float32", 1)])
def test_moe_batch_invariance(dtype: str, tp: int) -> None:
    """Every mode: each golden prompt alone and among 16 others (random
    lengths, some sampled, other max_tokens: the experts' row groups change
    size every step) through ``fdx.LLM`` gives bit-identical tokens and
    logprobs (the chosen token's and the top-2); at TP=2 with expert
    parallelism too (a rank's experts and the all-reduce are row-wise).
    float32 too: ``fdx_moe``'s experts and, in a MoE model, every other
    matmul (``fdx_fgemm``) are row-invariant, unlike MKL's."""
    assert_batch_invariant("qwen3_moe", dtype, tp)


@pytest.mark.parametrize(("dtype", "tp"), [("int8", 1), ("bfloat16", 1), ("int8", 2)])
def test_qwen2_moe_shared_expert_batch_invariance(dtype: str, tp: int) -> None:
    """Qwen2-MoE's shared expert and its sigmoid gate are ``fdx_qgemm`` matmuls
    and element-wise ops: a prompt's bits are its own alone and among 16
    others; at TP=2 with expert parallelism (the shared expert whole on rank
    0, an exact zero from rank 1) too."""
    assert_batch_invariant("qwen2_moe", dtype, tp)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
@pytest.mark.parametrize("name", ["mistral_swa", "gemma3"])
def test_sliding_window_batch_invariance(name: str, dtype: str) -> None:
    """The C++ op's sliding window keeps a row's bits its own: the short-window
    Mistral and Gemma 3 (its windowed layers with their own rope table) in
    the packed modes, each prompt alone and among 16 others, bit-identical."""
    assert_batch_invariant(name, dtype, 1)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_phi3_longrope_batch_invariance(dtype: str) -> None:
    """Past the original context (32) each row takes its own sequence's
    factor set: a prompt's bits are its own alone and among 16 others, some
    of them short, some past 32, some crossing it (and recomputed) in the
    same steps as it."""
    assert_batch_invariant("phi3_long", dtype, 1, max_model_len=128, enable_prefix_caching=False)


def assert_batch_invariant(name: str, dtype: str, tp: int, **engine: Any) -> None:
    """Each golden prompt of model ``name`` alone and among 16 others gives the
    very tokens and logprobs (see test_moe_batch_invariance); ``engine``: more
    engine options."""
    import random

    import fdx
    from fdx import SamplingParams

    llm = fdx.LLM(model=str(DATA / name), dtype=dtype, num_kv_blocks=128, **{"max_model_len": 512, **engine},
                  max_num_seqs=32, max_num_batched_tokens=256, tensor_parallel_size=tp, enable_expert_parallel=tp > 1)
    assert llm.engine.runner.compute == dtype

    def params(**kw: Any) -> Any:
        return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "logprobs": 2, "ignore_eos": True, **kw})

    def key(res: Any) -> Any:
        return list(res.token_ids), [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in res.outputs[0].logprobs]

    prompts = [s["prompt"] for s in goldens(name)]
    alone = [key(llm.generate([p], params())[0]) for p in prompts]
    rng = random.Random(25)
    others = [([rng.randrange(3, 512) for _ in range(rng.randrange(2, 50))],
               params(max_tokens=rng.randrange(1, 17), logprobs=None,
                      **({"temperature": 0.8, "seed": rng.randrange(1 << 30)} if rng.random() < 0.3 else {})))
              for _ in range(16)]
    for i, p in enumerate(prompts):
        batch = others[:i * 5] + [(p, params())] + others[i * 5:]
        res = llm.generate([b[0] for b in batch], [b[1] for b in batch])
        assert key(res[i * 5]) == alone[i], f"{dtype}: prompt {i} changed among {len(batch) - 1} others"


# --------------------------------------------------------------------------
# GGUF: llama.cpp's architecture names, keys, tensor names and layout
# --------------------------------------------------------------------------

#: the architectures fdx reads from GGUF (Mistral and Mixtral as llama.cpp writes them: ``llama``)
GGUF_ARCHS = ("qwen3", "qwen2", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "phi3", "llama3")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: Any) -> Path:
    return Path(tmp_path_factory.mktemp("gguf"))


def arch_gguf(where: Path, name: str, ftype: str = "F32", arch: str | None = None, **keys: Any) -> Path:
    """Test model ``name`` as a GGUF written the way llama.cpp's converter does (tests/ggufutil.py)."""
    from ggufutil import write_gguf

    tag = "-".join([name, ftype, *([arch] if arch else []), *keys])
    path = where / f"{tag}.gguf"
    return path if path.exists() else write_gguf(DATA / name, path, ftype, arch, **keys)


@pytest.mark.parametrize("name", GGUF_ARCHS)
def test_gguf_float32_matches_transformers(gguf_dir: Path, name: str) -> None:
    """From an F32 GGUF: the HF folder's weights (q/k un-permuted for
    ``llama``, experts unstacked, Phi-3's fused tensors split), and
    transformers' goldens teacher-forced."""
    import attrs

    from fdx.model.arch import FreqFactorRope, LongRopeScaling, rope_inv_freq
    from fdx.model.loader import load_checkpoint

    path = arch_gguf(gguf_dir, name)
    g, h = load_checkpoint(str(path)), load_checkpoint(str(DATA / name))
    # GGUF stores the epsilon (and Phi-3's rope factors) as float32; llama.cpp's
    # converter writes no sliding window for ``llama``
    expect = attrs.evolve(h.args, rms_eps=g.args.rms_eps, arch="llama" if name == "mistral" else h.args.arch,
                          sliding_window=h.args.sliding_window if name == "phi3" else None)
    if isinstance(h.args.rope_scaling, LongRopeScaling):
        got, want = g.args.rope_scaling, h.args.rope_scaling
        for f in ("short_factor", "long_factor", "attention_factor"):
            np.testing.assert_allclose(getattr(got, f), getattr(want, f), rtol=1e-7)
        expect = attrs.evolve(expect, rope_scaling=got)
    if name == "llama3":  # llama.cpp's rope_freqs: the llama3 scaling's frequencies, as float32 divisors
        assert isinstance(g.args.rope_scaling, FreqFactorRope)
        np.testing.assert_allclose(rope_inv_freq(g.args), rope_inv_freq(h.args), rtol=1e-6)
        assert not np.allclose(rope_inv_freq(g.args), rope_inv_freq(attrs.evolve(h.args, rope_scaling=None)))
        expect = attrs.evolve(expect, rope_scaling=g.args.rope_scaling, arch="llama")
    assert g.args == expect
    for lg, lh in zip(g.layers(), h.layers()):
        for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "bq", "bk", "bv", "q_norm", "k_norm",
                  "router", "e_gate", "e_up", "e_down", "s_gate", "s_up", "s_down", "s_gate_inp", "attn_norm", "ffn_norm"):
            a, b = getattr(lg, f), getattr(lh, f)
            assert (a is None) == (b is None), f
            if a is not None:  # Phi-3's q/k: times the attention factor, float32 in the GGUF
                np.testing.assert_allclose(a, b, rtol=1e-6 if name == "phi3" else 0, err_msg=f)
    if g.args.num_experts:  # a rank's experts (expert parallelism) sliced from the stacked tensors
        held = range(2, 4)
        for lg, lh in zip(g.layers(held), h.layers(held)):
            for f in ("e_gate", "e_up", "e_down"):
                np.testing.assert_array_equal(getattr(lg, f), getattr(lh, f), err_msg=f)
    agree, worst = golden_gap(make_runner(name, "float32", path), name)
    assert agree == 1.0 and worst < 1e-3, f"{name}: top-1 {agree:.3f}, logprobs differ by {worst:.2e}"


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3", "qwen2", "mixtral", "qwen3_moe", "qwen2_moe", "mistral", "llama3", "phi3"])
def test_gguf_float32_file_in_packed_modes_is_the_hf_folder(gguf_dir: Path, name: str, dtype: str) -> None:
    """An F32 GGUF in int8 / bfloat16 gives the HF folder's logits bit for bit
    (the same weights, packed alike; Mistral's q/k un-permuted exactly), so
    the folder's packed-mode results hold for it.  Llama 3 and Phi-3 carry
    their rope factors as float32 in the GGUF (``rope_freqs``,
    ``rope_factors_long/short``), which fdx otherwise computes from the
    config: their rotations differ by float32 rounding, which int8's per-block
    activation scales carry into every product (measured: up to 2.6e-6), so
    those two are held to the same top-1 and 1e-4."""
    s = goldens(name)[0]
    a = teacher_forced(make_runner(name, dtype, arch_gguf(gguf_dir, name)), s["prompt"], s["tokens"][:8])
    b = teacher_forced(make_runner(name, dtype), s["prompt"], s["tokens"][:8])
    if name in ("llama3", "phi3"):
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    else:
        np.testing.assert_array_equal(a, b)


def test_gguf_phi3_window_zero_is_no_window(gguf_dir: Path) -> None:
    """llama.cpp's converter writes ``sliding_window`` 0 for a Phi-3 config without one."""
    from ggufutil import write_gguf
    from fdx.model.loader import load_checkpoint

    folder = copy_with_config(gguf_dir, "phi3", sliding_window=None)
    ck = load_checkpoint(str(write_gguf(folder, gguf_dir / "phi3-nowindow.gguf")))
    assert ck.args.sliding_window is None and ck.args.rope_scaling is not None


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gguf_gemma_reads_as_llama_cpp_does(gguf_dir: Path, name: str) -> None:
    """Gemma 2 / 3 from llama.cpp's converter: norm weights (q/k norms too)
    stored as ``1 + w`` (read as they are: the HF folder's folded weights),
    the caps, window and Gemma 3's linear global scaling from its keys.
    llama.cpp fixes what the GGUF does not carry: every 2nd (Gemma 2) / 6th
    (Gemma 3) layer global, Gemma 3's local rope base 10000, and the score
    scale ``head_dim ** -0.5`` (its converter writes no
    ``query_pre_attn_scalar``); so does fdx.  The test models differ there
    (scalar 48, not head_dim 32; Gemma 3's layer 3 global), so the GGUF means
    the folder under those fixed values: its weights are the folder's, and it
    gives transformers' goldens for that config (``goldens_llamacpp.json``,
    scripts/make_arch_goldens.py ``gemma2-llamacpp``)."""
    import attrs

    from fdx.model.loader import load_checkpoint

    path = arch_gguf(gguf_dir, name)
    same = copy_with_config(gguf_dir, name, query_pre_attn_scalar=32, layer_types=None)
    g, h = load_checkpoint(str(path)), load_checkpoint(str(same))
    assert g.args == attrs.evolve(h.args, rms_eps=g.args.rms_eps, attn_scale=None)
    assert g.args.layer_windows == ((8, 0, 8, 0) if name == "gemma2" else (8, 8, 8, 8))
    for lg, lh in zip(g.layers(), h.layers()):
        for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm", "ffn_norm", "post_attn_norm",
                  "post_ffn_norm", "q_norm", "k_norm"):
            a, b = getattr(lg, f), getattr(lh, f)
            assert (a is None) == (b is None), f
            if a is not None:
                np.testing.assert_array_equal(a, b, err_msg=f)
    np.testing.assert_array_equal(g.final_norm, h.final_norm)
    agree, worst = golden_gap(make_runner(name, "float32", path), name, "goldens_llamacpp")
    assert agree == 1.0 and worst < 1e-3, f"{name} GGUF: top-1 {agree:.3f}, logprobs differ by {worst:.2e}"


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "mistral", "phi3", "qwen3_moe", "qwen2_moe", "mixtral", "llama3"])
def test_gguf_on_the_gpu_runner_matches_transformers(gguf_dir: Path, name: str) -> None:
    """The ``gpu`` runner (on the CPU place, float32) from the F32 GGUF."""
    from fdx.config import make_config
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    runner = GPUModelRunner(make_config(model=str(arch_gguf(gguf_dir, name)), num_kv_blocks=32, block_size=4,
                                        max_model_len=512, dtype="float32"), CPUDevice())
    agree, worst = golden_gap(runner, name)
    assert agree == 1.0 and worst < 1e-3, f"{name}: top-1 {agree:.3f}, logprobs differ by {worst:.2e}"


@pytest.mark.parametrize("ftype", ["F16", "BF16", "Q8_0"])
def test_gguf_formats_read_as_gguf_dequantizes_them(gguf_dir: Path, ftype: str) -> None:
    """Qwen3 (and Qwen3-MoE's stacked experts) at F16, BF16 and Q8_0: every
    matrix reads as ``gguf.quants.dequantize`` of what llama.cpp stores; the
    goldens' top-1 agreement stays >= 97%.  (Q4_K: the ``gguf`` package has no
    quantizer to write one; fdx reads it through ``dequantize``.)"""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q
    from safetensors.numpy import load_file

    from fdx.model.loader import load_checkpoint

    def rounded(w: np.ndarray) -> np.ndarray:
        return gguf.quants.dequantize(gguf.quants.quantize(w, Q[ftype]), Q[ftype]).reshape(w.shape)

    for name, hf, field in (("qwen3", "model.layers.1.self_attn.q_proj.weight", "wq"),
                            ("qwen3_moe", "model.layers.1.mlp.experts.{e}.down_proj.weight", "e_down")):
        ck = load_checkpoint(str(arch_gguf(gguf_dir, name, ftype)))
        w = load_file(str(DATA / name / "model.safetensors"))
        want = (np.stack([w[hf.format(e=e)] for e in range(8)]) if "{e}" in hf else w[hf])
        np.testing.assert_array_equal(getattr(list(ck.layers())[1], field), rounded(want))
        np.testing.assert_array_equal(ck.embed, rounded(w["model.embed_tokens.weight"]))
    agree, worst = golden_gap(make_runner("qwen3", "float32", arch_gguf(gguf_dir, "qwen3", ftype)), "qwen3")
    assert agree >= 0.97, f"{ftype}: top-1 {agree:.3f} (logprobs up to {worst:.2e} apart)"


def test_gguf_q4_k_reads_as_gguf_dequantizes_it(tmp_path: Path) -> None:
    """Q4_K: the ``gguf`` package dequantizes it but has no quantizer, so the
    test writes Q4_K blocks directly (256 weights in 144 bytes: f16 scale and
    min, 12 bytes of 6-bit sub-block scales/mins, 128 bytes of nibbles) and
    checks fdx reads them as ``gguf.quants.dequantize`` does."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    from ggufutil import write_gguf
    from fdx.model.loader import load_checkpoint

    rng = np.random.default_rng(0)
    rows, blocks = 128, 1  # blk.1.ffn_down: [hidden 128, ffn 256]
    b = rng.integers(0, 256, size=(rows, blocks, 144), dtype=np.uint8)
    b[:, :, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)  # d
    b[:, :, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)  # dmin
    raw = b.reshape(rows, -1)
    path = write_gguf(DATA / "qwen3", tmp_path / "q4k.gguf", raw={"blk.1.ffn_down.weight": (raw, Q.Q4_K)})
    ck = load_checkpoint(str(path))
    want = gguf.quants.dequantize(raw, Q.Q4_K).reshape(rows, 256)
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(list(ck.layers())[1].w_down, want)


GGUF_REFUSALS = [
    ("qwen3", None, {"attention.sliding_window": 8}, "metadata key 'qwen3.attention.sliding_window'", "not implemented"),
    ("qwen2", None, {"rope.scaling.type": "yarn"}, "metadata key 'qwen2.rope.scaling.type'", "'none'"),
    ("qwen3_moe", None, {"expert_shared_count": 1}, "metadata key 'qwen3moe.expert_shared_count'", "not implemented"),
    ("mixtral", None, {"expert_gating_func": 2}, "metadata key 'llama.expert_gating_func'", "not implemented"),
    # llama.cpp's top-k renormalisation switch (written for other MoE architectures): qwen2moe's graph has none
    ("qwen2_moe", None, {"expert_weights_norm": 1}, "metadata key 'qwen2moe.expert_weights_norm'", "not implemented"),
    # a Qwen3 file labelled qwen2: its q/k norm tensors are not silently dropped
    ("qwen3", "qwen2", {}, "tensor 'blk.0.attn_k_norm.weight'", "not part of fdx's qwen2"),
    # a Qwen3-MoE file labelled qwen3 (dense): refused by its expert count
    ("qwen3_moe", "qwen3", {}, "architecture 'qwen3 (experts)'", "supported:"),
    ("phi3", None, {"rope.scaling.type": "yarn"}, "metadata key 'phi3.rope.scaling.type'", "'none'"),
    ("gemma2", None, {"attention.sliding_window_pattern": 3}, "metadata key 'gemma2.attention.sliding_window_pattern'",
     "not implemented"),
    ("gemma3", None, {"attn_logit_softcapping": 50.0}, "metadata key 'gemma3.attn_logit_softcapping'", "not implemented"),
]


@pytest.mark.parametrize("name,arch,keys,what,why", GGUF_REFUSALS, ids=[f"{r[0]}-{r[1]}-{r[3]}" for r in GGUF_REFUSALS])
def test_gguf_key_or_tensor_fdx_lacks_is_refused_naming_it(gguf_dir: Path, name: str, arch: str | None,
                                                          keys: dict[str, Any], what: str, why: str) -> None:
    from fdx.model.loader import load_checkpoint

    path = arch_gguf(gguf_dir, name, "F32", arch, **keys)
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(path))
    msg = str(ei.value)
    assert "\n" not in msg and path.name in msg and what in msg and why in msg, msg


@pytest.mark.parametrize("tp", [[], ["-tp", "2", "--enable-expert-parallel"]], ids=["tp1", "tp2-ep"])
def test_served_float32_from_gguf_gives_the_greedy_tokens(gguf_dir: Path, tp: list[str]) -> None:
    """A real ``fdx serve`` over the Qwen3-MoE GGUF (stacked experts), and at
    TP=2 with expert parallelism (each rank slicing its half of the stack)."""
    samples = goldens("qwen3_moe")
    with start_server("--model", str(arch_gguf(gguf_dir, "qwen3_moe")), "--dtype", "float32", "--max-model-len", "512",
                      "--served-model-name", "m", *tp, default_args=("--num-kv-blocks", "64")) as (base, _):
        for s, (toks, lps) in zip(samples, served_greedy(base, samples)):
            assert toks == s["tokens"]
            np.testing.assert_allclose(lps, s["logprobs"], atol=1e-3)


def test_gguf_of_a_mixture_with_dense_layers_is_refused_naming_a_dense_tensor(tmp_path: Path) -> None:
    """A GGUF carries no ``mlp_only_layers`` / ``decoder_sparse_step`` (llama.cpp's
    Qwen2-MoE has every layer sparse): a file written from ``qwen2_moe_dense`` is
    refused at its first dense tensor, not read as experts."""
    from fdx.model.loader import load_checkpoint

    with pytest.raises(ModelLoadError, match=r"unsupported tensor 'blk\.0\.ffn_down\.weight'"):
        load_checkpoint(str(arch_gguf(tmp_path, "qwen2_moe_dense")))
