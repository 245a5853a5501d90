"""The ``gpu`` model runner, checked here on the CPU place in float32 (its
plain-Paddle fallback path) against the ``cpu`` runner, and its pieces that
run anywhere: device sampling, KV block I/O, sleep, dtype rules, the kernel
probe and the attention grouping used with the GPU's flash kernel (driven
here by a reference implementation standing in for that kernel).

The GPU-only pieces (fused RoPE, flash attention, bf16/fp16 matmuls) are
checked on a GPU machine by ``bench/device_check``.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import numpy as np
import pytest

from fdx.core.errors import FdxError, ModelLoadError
from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
from fdx.core.messages import SamplingParams
from fdx.core.request import Request
from runnerutil import run_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "def fibonacci(n):", "Write a haiku about the sea, please, in English."]
N_TOKENS = 16


@pytest.fixture(scope="module")
def runners() -> tuple[Any, Any]:
    """(gpu runner on the CPU place, cpu runner), same config."""
    from fdx.config import make_config
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    cfg = make_config(num_kv_blocks=96, max_model_len=512, dtype="float32")  # the cpu runner's exact path
    return GPUModelRunner(cfg, CPUDevice()), PaddleModelRunner(cfg, CPUDevice())


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def _request(runner: Any, i: int, ids: list[int], params: SamplingParams) -> Request:
    return Request(f"r{i}", list(ids), params, eos_token_ids=runner.eos_token_ids, max_model_len=runner.max_model_len)


# --------------------------------------------------------------------------
# parity with the cpu runner
# --------------------------------------------------------------------------


def test_greedy_parity_with_cpu_runner(runners: tuple[Any, Any], prompt_ids: list[list[int]]) -> None:
    gpu, cpu = runners
    assert gpu.dtype == "float32" and gpu.place == "cpu"
    # one prompt alone (whole prefill, then decode)
    assert run_greedy(gpu, prompt_ids[:1], N_TOKENS) == run_greedy(cpu, prompt_ids[:1], N_TOKENS)
    # a batch of mixed lengths, chunked prefill mixed with decode rows
    got = run_greedy(gpu, prompt_ids, N_TOKENS, chunk=7)
    assert got == run_greedy(cpu, prompt_ids, N_TOKENS, chunk=7)
    assert len({tuple(x) for x in got}) == len(got)  # the prompts really differ


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_flash_attention_grouping(runners: tuple[Any, Any], prompt_ids: list[list[int]], alignment: str) -> None:
    """The GPU's varlen-flash path (one group, or decode/fresh/plain groups
    for a top-left-causal kernel), with a reference standing in for
    ``flash_attn_unpadded``, gives the plain path's tokens."""
    from fdx.model.fused_kernels import varlen_attention_reference

    gpu, _ = runners
    want = run_greedy(gpu, prompt_ids, 6, chunk=9)
    plain = gpu.kernels
    fake = attrs.evolve(plain, varlen_attention=functools.partial(varlen_attention_reference, alignment=alignment),
                        causal_alignment=alignment)
    gpu.kernels = gpu.model.kernels = fake
    try:
        assert run_greedy(gpu, prompt_ids, 6, chunk=9) == want
    finally:
        gpu.kernels = gpu.model.kernels = plain


def test_plan_groups_split_for_top_left_kernel() -> None:
    from fdx.model.fused_kernels import Kernels, varlen_attention_reference
    from fdx.model.gpu_llama import plan_groups

    q_lens = np.array([1, 5, 3, 1])
    starts = np.array([9, 0, 4, 2])
    tables = np.arange(8).reshape(4, 2)
    k = Kernels(varlen_attention=varlen_attention_reference, causal_alignment="top_left")
    groups = plan_groups(k, q_lens, starts, tables, num_kv_heads=2, block_size=8, group_size=3)
    kinds = [(g["kind"], g.get("causal")) for g in groups]
    assert kinds == [("varlen", False), ("varlen", True), ("plain", None)]
    assert [g["rows"].tolist() for g in groups] == [[0, 9], [1, 2, 3, 4, 5], [6, 7, 8]]
    assert groups[0]["cu_k"].tolist() == [0, 10, 13]
    one = plan_groups(attrs.evolve(k, causal_alignment="bottom_right"), q_lens, starts, tables, 2, 8, 3)
    assert len(one) == 1 and one[0]["rows"] is None and one[0]["cu_q"].tolist() == [0, 1, 6, 9, 10]
    # decode row's context: block 0 slots 0..9 (block table [0, 1]), 2 kv heads
    rows = groups[0]["read_rows"][:20].reshape(10, 2)
    assert rows[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 16, 17] and (rows[:, 1] - rows[:, 0] == 8).all()


# --------------------------------------------------------------------------
# weights, KV blocks, sleep
# --------------------------------------------------------------------------


def test_weights_are_dequantized_and_quant_blocks_not_uploaded(runners: tuple[Any, Any]) -> None:
    gpu, _ = runners
    m = gpu.model
    assert m.dequantized > 0  # the embedded model is Q4_1
    tensors = [m.embed, m.final_norm] + [getattr(layer, f.name) for layer in m.layers
                                         for f in attrs.fields(type(layer)) if getattr(layer, f.name) is not None]
    assert tensors and all("float32" in str(t.dtype) for t in tensors)


def test_kv_blocks_roundtrip_and_cross_runner(runners: tuple[Any, Any], prompt_ids: list[list[int]]) -> None:
    gpu, cpu = runners
    assert gpu.kv_fingerprint() == cpu.kv_fingerprint()  # same layout, dtype and weights
    assert gpu.bytes_per_block == cpu.bytes_per_block
    prompt = prompt_ids[2][:32]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a = _request(cpu, 0, prompt, greedy)
    a.block_ids = [5, 7, 9]
    cpu.execute(ScheduledBatch([ScheduledSeq(a, 32)]))  # two full blocks on the cpu runner
    payloads = cpu.read_kv_blocks([5, 7])
    gpu.write_kv_blocks([30, 31], payloads)
    assert gpu.read_kv_blocks([30, 31]) == payloads
    # continuing from the imported blocks equals computing them on the gpu runner
    b = _request(gpu, 1, prompt, greedy)
    b.block_ids, b.num_computed_tokens = [30, 31, 32], 31
    c = _request(gpu, 2, prompt, greedy)
    c.block_ids = [40, 41, 42]
    ob = gpu.execute(ScheduledBatch([ScheduledSeq(b, 1)]))
    oc = gpu.execute(ScheduledBatch([ScheduledSeq(c, 32)]))
    assert int(ob.token_ids[0]) == int(oc.token_ids[0])
    with pytest.raises(FdxError):
        gpu.write_kv_blocks([1], [b"short"])
    with pytest.raises(FdxError):
        gpu.read_kv_blocks([gpu.num_kv_blocks])


def test_sleep_and_wakeup(runners: tuple[Any, Any], prompt_ids: list[list[int]]) -> None:
    gpu, _ = runners
    before = run_greedy(gpu, prompt_ids[:1], 4)
    gpu.release(["weight", "kv_cache"])
    assert gpu.caches is None and not gpu.model.loaded
    r = _request(gpu, 0, prompt_ids[0], SamplingParams(max_tokens=2, temperature=0.0))
    r.block_ids = [0, 1, 2, 3]
    with pytest.raises(FdxError, match="sleeping"):
        gpu.execute(ScheduledBatch([ScheduledSeq(r, 4)]))
    with pytest.raises(FdxError, match="released"):
        gpu.read_kv_blocks([0])
    gpu.restore(["weight", "kv_cache"])
    assert run_greedy(gpu, prompt_ids[:1], 4) == before


def test_load_weights_rejects_other_shapes(runners: tuple[Any, Any], tmp_path: Any) -> None:
    gpu, _ = runners
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, '
                                          '"num_attention_heads": 4, "num_hidden_layers": 2, '
                                          '"intermediate_size": 128, "vocab_size": 100}')
    with pytest.raises(ModelLoadError):
        gpu.load_weights(str(tmp_path), "v2")
    assert gpu.weights_version == ""


# --------------------------------------------------------------------------
# dtype rules and the kernel probe
# --------------------------------------------------------------------------


def test_dtype_rules() -> None:
    import paddle

    from fdx.model.gpu_runner import bf16_bits_to_f32, resolve_dtype

    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("fp32", "cpu") == "float32"
    assert resolve_dtype("bf16", "gpu:0") == "bfloat16" and resolve_dtype("half", "gpu:0") == "float16"
    for bad, place in (("bfloat16", "cpu"), ("int4", "gpu:0")):
        with pytest.raises(ModelLoadError) as e:
            resolve_dtype(bad, place)
        assert "\n" not in str(e.value) and "--dtype" in str(e.value)
    vals = np.array([1.0, -2.5, 3.140625, 0.0, 1e-3], dtype=np.float32)
    bits = paddle.to_tensor(vals).astype("bfloat16").numpy()
    assert bits.dtype == np.uint16
    back = bf16_bits_to_f32(bits)
    assert np.allclose(back, vals, rtol=1e-2) and back[0] == 1.0 and back[1] == -2.5


def test_probe_reports_why_a_fused_op_is_off() -> None:
    from fdx.model.fused_kernels import FUSED_OPS, probe_kernels, rms_norm_plain, rope_plain

    k = probe_kernels("float32", 4, 2, 16, disabled=["rms_norm", "swiglu"], device_reasons={"rope": "not on this device"})
    assert set(k.off) | set(k.fused) == set(FUSED_OPS)
    assert k.off["rms_norm"] == "disabled by FDX_GPU_DISABLE_FUSED"
    assert k.off["rope"] == "not on this device"
    assert k.off["flash_attn"] == "needs float16/bfloat16" and k.varlen_attention is None
    assert k.rms_norm is rms_norm_plain and k.rope is rope_plain
    assert "flash_attn=plain (needs float16/bfloat16)" in k.describe()


# --------------------------------------------------------------------------
# device sampler
# --------------------------------------------------------------------------


def _reqs(params: list[SamplingParams], prompt: list[int] | None = None) -> list[Request]:
    return [Request(f"s{i}", list(prompt or [1, 2, 3]), p, eos_token_ids=frozenset({0}), max_model_len=64)
            for i, p in enumerate(params)]


def test_device_sampler_matches_numpy_sampler_on_deterministic_rows() -> None:
    import paddle

    from fdx.model.device_sampler import DeviceSampler
    from fdx.model.sampler import Sampler

    rng = np.random.default_rng(1)
    V = 300
    logits = rng.standard_normal((5, V + 4)).astype(np.float32)  # 4 padding columns
    logits[:, V:] = 100.0  # padding is never sampled
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=(7,)),
        SamplingParams(temperature=0.8, top_k=1, logprobs=0),
    ]
    prompt = [int(np.argmax(logits[2, :V])), 5, 9]
    logits[3, 0] = logits[3, 7] = 50.0  # eos and a stop id, masked under min_tokens
    want_t, want_lp = Sampler(V, 20).sample(logits, _reqs(params, prompt))
    got_t, got_lp = DeviceSampler(V, 20).sample(paddle.to_tensor(logits), _reqs(params, prompt))
    assert got_t.tolist() == want_t.tolist()
    assert got_t[2] != prompt[0] and got_t[3] not in (0, 7)
    assert got_lp is not None and want_lp is not None
    for g, w in zip(got_lp, want_lp):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-4
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-4)


def test_device_sampler_distribution_and_seeds() -> None:
    import paddle

    from fdx.model.device_sampler import DeviceSampler

    V = 6
    base = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    n = 3000
    cases = {
        "plain": (SamplingParams(temperature=1.0), np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])),
        "top_k": (SamplingParams(temperature=1.0, top_k=2), np.array([0.4, 0.25, 0, 0, 0, 0]) / 0.65),
        "top_p": (SamplingParams(temperature=1.0, top_p=0.7), np.array([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),
        "min_p": (SamplingParams(temperature=1.0, min_p=0.3), np.array([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),
    }
    s = DeviceSampler(V, seed=3)
    for name, (p, want) in cases.items():
        toks, _ = s.sample(paddle.to_tensor(np.tile(base, (n, 1)).astype(np.float32)), _reqs([p] * n))
        freq = np.bincount(toks, minlength=V) / n
        assert np.abs(freq - want).max() < 0.035, (name, freq, want)
    # a seeded request draws the same tokens alone or inside a batch
    seeded = SamplingParams(temperature=1.0, seed=42)
    rows = np.tile(base, (4, 1)).astype(np.float32)
    r_alone = _reqs([seeded])
    r_batch = _reqs([SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.5), seeded])
    a = [int(DeviceSampler(V).sample(paddle.to_tensor(rows[:1]), r_alone)[0][0]) for _ in range(20)]
    b = [int(DeviceSampler(V).sample(paddle.to_tensor(rows), r_batch)[0][1]) for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_repeated_kv_heads_give_the_same_attention() -> None:
    """The wrapper used when a flash build lacks grouped-query heads."""
    import paddle

    from fdx.model.fused_kernels import repeat_kv_heads, varlen_attention_reference

    rng = np.random.default_rng(2)
    q = paddle.to_tensor(rng.standard_normal((6, 6, 8)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((9, 2, 8)).astype(np.float32))
    v = paddle.to_tensor(rng.standard_normal((9, 2, 8)).astype(np.float32))
    cu_q, cu_k = np.array([0, 1, 6], dtype=np.int32), np.array([0, 4, 9], dtype=np.int32)
    a = varlen_attention_reference(q, k, v, cu_q, cu_k, 5, 5, 0.3, True)
    b = repeat_kv_heads(varlen_attention_reference, 3)(q, k, v, cu_q, cu_k, 5, 5, 0.3, True)
    assert np.allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_llm_with_the_gpu_runner_plugin(runners: tuple[Any, Any], prompt_ids: list[list[int]]) -> None:
    """``model_runner="gpu"`` goes through the registry and the engine's
    own path (scheduler, output processor); greedy tokens equal the cpu
    runner's, logprobs come back, and a seed repeats."""
    import fdx

    _, cpu = runners
    llm = fdx.LLM(model_runner="gpu", num_kv_blocks=64, max_model_len=512)
    assert type(llm.engine.runner).__name__ == "GPUModelRunner"
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    out = llm.generate([prompt_ids[0], prompt_ids[1]], greedy)
    assert [o.token_ids for o in out] == run_greedy(cpu, prompt_ids[:2], 10)
    for o in out:
        assert o.logprobs is not None and len(o.logprobs) == 10
        for tid, lp in zip(o.token_ids, o.logprobs):
            assert lp.token_id == tid and lp.logprob <= 0.0 and lp.top[0][0] == tid
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    a, b = llm.generate([prompt_ids[2]], seeded), llm.generate([prompt_ids[2]], seeded)
    assert a[0].token_ids == b[0].token_ids
