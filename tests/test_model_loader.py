"""Model loading: the embedded GGUF's tokenizer, loader errors, and tiny
random Hugging Face Llama / Qwen2 checkpoints checked against a numpy forward."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fdx.core.errors import ModelLoadError


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and msg
    return msg


# --------------------------------------------------------------------------
# tokenizer of the embedded model
# --------------------------------------------------------------------------


def test_embedded_tokenizer_roundtrip_and_template() -> None:
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    assert tok is load_tokenizer("smollm2")  # cached
    assert tok.vocab_size == 49152 and tok.eos_token_ids == frozenset({2})
    for text in ["héllo wörld", "日本語 🎉", "def f(x):\r\n\treturn x ** 2", "12345 apples", "  spaces  "]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("2024") == [34, 32, 34, 36]  # digits split individually
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert len(ids) == 37 and ids[0] == 1  # template's own <|im_start|>, no extra BOS
    assert tok.decode(ids, skip_special_tokens=True).startswith("system\n")
    assert tok.id_to_token(2) == "<|im_end|>"


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    from fdx.model.loader import load_checkpoint, load_tokenizer

    p = str(tmp_path / "nope.gguf")
    for fn in (load_checkpoint, load_tokenizer):
        with pytest.raises(ModelLoadError) as ei:
            fn(p)
        msg = _one_line(ei.value)
        assert "nope.gguf" in msg and "not found" in msg


def test_corrupt_files(tmp_path: Path) -> None:
    from fdx.model.loader import load_checkpoint
    from fdx.model.source import embedded_gguf_path

    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"\x00\x01junkjunkjunk" * 100)
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(bad))
    assert "garbage.gguf" in _one_line(ei.value) and "not a GGUF" in str(ei.value)

    hdr = tmp_path / "header.gguf"
    hdr.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(hdr))
    assert "header.gguf" in _one_line(ei.value) and ("corrupt" in str(ei.value) or "implausible" in str(ei.value))

    trunc = tmp_path / "truncated.gguf"
    with open(embedded_gguf_path(), "rb") as f:
        trunc.write_bytes(f.read(8 << 20))
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(trunc))
    assert "truncated.gguf" in _one_line(ei.value) and "truncated" in str(ei.value)


def test_unsupported_architecture(tmp_path: Path) -> None:
    import gguf

    from fdx.model.loader import load_checkpoint

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(path))
    msg = _one_line(ei.value)
    assert "gpt2.gguf" in msg and "unsupported architecture 'gpt2'" in msg

    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(folder))
    msg = _one_line(ei.value)
    assert "config.json" in msg and "BertModel" in msg


def test_hf_folder_errors(tmp_path: Path) -> None:
    from fdx.model.loader import load_checkpoint

    folder = make_hf_model(tmp_path / "m", "llama")
    os.remove(folder / "model.safetensors")
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(folder))
    assert "no *.safetensors" in _one_line(ei.value)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError) as ei:
        load_checkpoint(str(folder))
    assert "model.safetensors" in _one_line(ei.value) and "corrupt" in str(ei.value)


# --------------------------------------------------------------------------
# tiny Hugging Face checkpoints
# --------------------------------------------------------------------------

TINY = dict(hidden=64, heads=4, kv=2, layers=2, ffn=128, vocab=320)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_hf_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """A random Llama/Qwen2 checkpoint + byte-level BPE tokenizer."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, nh, kv, L, ff, V = TINY["hidden"], TINY["heads"], TINY["kv"], TINY["layers"], TINY["ffn"], TINY["vocab"]
    d = h // nh

    def lin(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, h)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
         "lm_head.weight": lin(V, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[p + "self_attn.q_proj.weight"] = lin(nh * d, h)
        w[p + "self_attn.k_proj.weight"] = lin(kv * d, h)
        w[p + "self_attn.v_proj.weight"] = lin(kv * d, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, nh * d)
        w[p + "mlp.gate_proj.weight"] = lin(ff, h)
        w[p + "mlp.up_proj.weight"] = lin(ff, h)
        w[p + "mlp.down_proj.weight"] = lin(h, ff)
        if arch == "qwen2":
            for n, o in (("q", nh * d), ("k", kv * d), ("v", kv * d)):
                w[p + f"self_attn.{n}_proj.bias"] = (0.5 * rng.standard_normal(o)).astype(np.float32)
    save_file(w, str(folder / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch, "hidden_size": h, "num_attention_heads": nh, "num_key_value_heads": kv,
        "num_hidden_layers": L, "intermediate_size": ff, "vocab_size": V, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False}))
    return folder


def hf_numpy_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    """Independent numpy forward (rotate_half RoPE) over the safetensors."""
    from safetensors.numpy import load_file

    w = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    h, nh, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh
    eps = cfg["rms_norm_eps"]
    n = len(tokens)
    pos = np.arange(n)
    inv = cfg["rope_theta"] ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def rot(x: np.ndarray) -> np.ndarray:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["model.embed_tokens.weight"][tokens].astype(np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t = rms(x, w[p + "input_layernorm.weight"])
        q = t @ w[p + "self_attn.q_proj.weight"].T + w.get(p + "self_attn.q_proj.bias", 0)
        k = t @ w[p + "self_attn.k_proj.weight"].T + w.get(p + "self_attn.k_proj.bias", 0)
        v = t @ w[p + "self_attn.v_proj.weight"].T + w.get(p + "self_attn.v_proj.bias", 0)
        q, k, v = rot(q.reshape(n, nh, d)), rot(k.reshape(n, kv, d)), v.reshape(n, kv, d)
        k, v = np.repeat(k, nh // kv, 1), np.repeat(v, nh // kv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", pr, v).reshape(n, h) @ w[p + "self_attn.o_proj.weight"].T
        t = rms(x, w[p + "post_attention_layernorm.weight"])
        g = t @ w[p + "mlp.gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (t @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_checkpoint_loads_and_matches_numpy(tmp_path: Path, arch: str) -> None:
    from fdx.config import make_config
    from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
    from fdx.core.messages import SamplingParams
    from fdx.core.request import Request
    from fdx.model.loader import load_checkpoint, load_tokenizer
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    folder = make_hf_model(tmp_path / arch, arch)
    ck = load_checkpoint(str(folder))
    assert ck.args.arch == arch and ck.args.attention_bias == (arch == "qwen2") and ck.args.num_kv_heads == 2
    tok = load_tokenizer(str(folder))
    assert tok.eos_token_ids == frozenset({2})
    text = "hello world, the quick fox"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode_chat([{"role": "user", "content": text}])
    assert ids[0] == 1 and 2 in ids

    runner = PaddleModelRunner(make_config(model=str(folder), num_kv_blocks=16, block_size=4, dtype="float32"),
                               CPUDevice())  # the exact path (int8 compute drifts ~1e-2)
    captured: list[np.ndarray] = []
    real = runner.sampler.sample

    def spy(logits: Any, reqs: Any) -> Any:
        captured.append(np.asarray(logits.numpy() if hasattr(logits, "numpy") else logits))
        return real(logits, reqs)

    runner.sampler.sample = spy  # type: ignore[method-assign]
    req = Request("x", ids, SamplingParams(max_tokens=4, temperature=0.0), eos_token_ids=runner.eos_token_ids)
    req.block_ids = [7, 3, 11, 0, 5, 9, 2, 14]  # deliberately scattered
    # prefill in two chunks, then two decode steps
    outs = []
    for n in (5, len(ids) - 5, 1, 1):
        seq = ScheduledSeq(req, n)
        smp = seq.samples
        o = runner.execute(ScheduledBatch([seq]))
        req.num_computed_tokens += n
        if smp:
            outs.append(int(o.token_ids[0]))
            req.append_token(outs[-1])
    assert len(captured) == 3
    for k, logits in enumerate(captured):
        ref = hf_numpy_logits(folder, (ids + outs)[: len(ids) + k])[-1]
        np.testing.assert_allclose(logits[0], ref, rtol=1e-4, atol=1e-4)
        assert outs[k] == int(np.argmax(ref))


def test_load_weights_same_shape_and_mismatch(tmp_path: Path) -> None:
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    a = make_hf_model(tmp_path / "a", "llama", seed=1)
    b = make_hf_model(tmp_path / "b", "llama", seed=2)
    q = make_hf_model(tmp_path / "q", "qwen2", seed=3)
    runner = PaddleModelRunner(make_config(model=str(a), num_kv_blocks=8, block_size=4), CPUDevice())
    fp = runner.kv_fingerprint()
    runner.load_weights(str(b), "v2")
    assert runner.weights_version == "v2" and runner.kv_fingerprint() != fp
    with pytest.raises(ModelLoadError) as ei:
        runner.load_weights(str(q), "v3")
    msg = _one_line(ei.value)
    assert "arch='qwen2'" in msg and "attention_bias" in msg
    assert runner.weights_version == "v2"
    shutil.rmtree(q)
