"""The fused decoder op (fdx/csrc/paddle_ops.cc) against the per-layer path,
in both packed compute modes (int8 and bfloat16).

``fdx_decoder_layers`` runs every layer of a step in one call through the
same C++ kernels the per-layer path dispatches one by one, so the two must
give bit-identical logits.  Checked through the real engine with the real
model: greedy tokens and logprobs of prompts run alone and batched (prefill
chunks and decode steps mixed), with a q/k/v bias (Qwen2's) switched in,
and a malformed call gives a clear error instead of touching memory.  The
fused path passes the weights as addresses (``fdx_decoder_stack``, made
once from the tensors the model keeps): the same bits as passing them as
tensors (``fdx_decoder_layers``), and the addresses follow a reload.  The
loop's own clocks (``fdx_stack_profile``) time every kernel only while on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "Count: 1, 2, 3,",
           "Once upon a time, in a small village,"]


@pytest.fixture(scope="module", params=["int8", "bfloat16"])
def llm(request: pytest.FixtureRequest) -> Any:
    import fdx

    engine = fdx.LLM(dtype=request.param, enable_prefix_caching=False, max_num_batched_tokens=64)
    model = engine.engine.runner.model
    if not model.fused_layers:
        pytest.skip("fdx's native CPU ops are not loaded here")
    return engine


def _run(llm: Any, fused: bool, prompts: list[str], max_tokens: int = 12) -> list[Any]:
    from fdx import SamplingParams

    model = llm.engine.runner.model
    model.fused_layers = fused
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True))
    finally:
        model.fused_layers = True
    return [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in o.outputs[0].logprobs])
            for o in out]


def test_weights_by_address_give_the_bits_of_weights_as_tensors(llm: Any) -> None:
    model = llm.engine.runner.model
    assert model.stack_by_address  # the default fused path takes addresses
    by_address = _run(llm, True, PROMPTS[:3], max_tokens=8)
    model.stack_by_address = False
    try:
        assert _run(llm, True, PROMPTS[:3], max_tokens=8) == by_address
    finally:
        model.stack_by_address = True


def test_fused_layers_equal_the_per_layer_path_bit_for_bit(llm: Any) -> None:
    # batched: 5 prompts share steps; the 64-token budget splits prefill into chunks beside decodes
    fused = _run(llm, True, PROMPTS)
    assert fused == _run(llm, False, PROMPTS)
    # alone: the same request in a step of its own gives the same bits as in the batch
    assert _run(llm, True, PROMPTS[:1]) == fused[:1]
    assert len({tuple(f[0]) for f in fused}) == len(PROMPTS)  # the prompts really differ


def test_fused_layers_add_the_qkv_bias(llm: Any) -> None:
    import paddle

    model = llm.engine.runner.model
    width = int(model.layers[0].p_qkv.n_out)
    rng = np.random.default_rng(0)
    saved = [layer.b_qkv for layer in model.layers]
    base = _run(llm, True, PROMPTS[:2], max_tokens=6)
    try:
        for layer in model.layers:
            layer.b_qkv = paddle.to_tensor(rng.normal(0.0, 0.5, width).astype(np.float32))
        model._stack = None
        biased = _run(llm, True, PROMPTS[:2], max_tokens=6)
        assert biased == _run(llm, False, PROMPTS[:2], max_tokens=6)
        assert biased != base  # the bias reached the maths
    finally:
        for layer, b in zip(model.layers, saved):
            layer.b_qkv = b
        model._stack = None


def test_malformed_call_is_a_clear_error(llm: Any) -> None:
    import paddle

    model = llm.engine.runner.model
    an, wq, bq, wo, fn, wgu, wd, kinds, _windows = model._layer_stack()
    x = paddle.zeros([1, model.args.hidden_size], dtype="float32")
    meta = paddle.to_tensor(np.array([[0, 0]], dtype=np.int32))
    tables = paddle.to_tensor(np.array([[0]], dtype=np.int32))
    caches = list(llm.engine.runner.caches)
    op = model.ops.fdx_decoder_layers
    nw = [0] * len(an)  # no sliding window
    with pytest.raises(Exception, match="one entry per layer"):
        op(x, model.rope, meta, tables, an[:-1], wq, bq, wo, fn, wgu, wd, caches, kinds, model.args.num_heads, 1e-5, 0.1, 0, nw)
    bad_tables = paddle.to_tensor(np.array([[10**6]], dtype=np.int32))
    with pytest.raises(Exception, match="block id out of range"):
        op(x, model.rope, meta, bad_tables, an, wq, bq, wo, fn, wgu, wd, caches, kinds, model.args.num_heads, 1e-5, 0.1, 0, nw)
    with pytest.raises(Exception, match="w_o"):
        op(x, model.rope, meta, tables, an, wq, bq, wq, fn, wgu, wd, caches, kinds, model.args.num_heads, 1e-5, 0.1, 0, nw)
    with pytest.raises(Exception, match="one entry per layer"):
        op(x, model.rope, meta, tables, an, wq, bq, wo, fn, wgu, wd, caches, kinds, model.args.num_heads, 1e-5, 0.1, 0, nw[:-1])


def test_malformed_stack_call_is_a_clear_error(llm: Any) -> None:
    import paddle

    model = llm.engine.runner.model
    caches = list(llm.engine.runner.caches)
    ptrs, dims, kinds, windows = model._stack_args(caches)
    x = paddle.zeros([1, model.args.hidden_size], dtype="float32")
    meta = paddle.to_tensor(np.array([[0, 0]], dtype=np.int32))
    tables = paddle.to_tensor(np.array([[0]], dtype=np.int32))
    op = model.ops.fdx_decoder_stack
    a = model.args

    def call(p: list[int], d: list[int], c: list[Any] = caches) -> Any:
        return op(x, model.rope, meta, tables, c, p, d, kinds, a.num_heads, a.rms_eps, model.scale, 0, windows)

    with pytest.raises(Exception, match="7, 4 and 1 entries a layer"):
        call(ptrs[:-1], dims)
    with pytest.raises(Exception, match="7, 4 and 1 entries a layer"):
        call(ptrs[:-7], dims, caches[:-1])  # one layer fewer, but kinds and windows for all
    with pytest.raises(Exception, match="address is 0"):
        call([0] + ptrs[1:], dims)
    with pytest.raises(Exception, match="dims do not match"):
        call(ptrs, [dims[0], dims[1] + 32, dims[2], dims[3]])
    with pytest.raises(Exception, match="dims do not match"):
        call(ptrs, [dims[0] + 32, *dims[1:]])  # x's width is not the weights'
    with pytest.raises(Exception, match="windows must be >= 0"):
        op(x, model.rope, meta, tables, caches, ptrs, dims, kinds, a.num_heads, a.rms_eps, model.scale, 0,
           [-1] * len(windows))
    out, _res = call(ptrs, dims)  # and the well-formed call runs
    assert np.isfinite(out.numpy()).all()


def test_reloaded_weights_reach_the_fused_op(llm: Any) -> None:
    """``update_weights`` loads into the running model without a release:
    the fused op's per-layer lists must follow the new tensors."""
    import paddle

    from fdx.model.loader import load_checkpoint

    runner = llm.engine.runner
    model = runner.model
    model._layer_stack()
    with paddle.no_grad():
        model.load(load_checkpoint(runner._weights_path), progress=False)
    stack = model._layer_stack()
    assert all(w is layer.p_qkv.data for w, layer in zip(stack[1], model.layers))
    assert all(w is layer.p_down.data for w, layer in zip(stack[6], model.layers))
    ptrs, *_ = model._stack_args(list(runner.caches))  # the addresses follow the new tensors too
    assert ptrs[1::7] == [layer.p_qkv.data.data_ptr() for layer in model.layers]
    assert ptrs[6::7] == [layer.p_down.data.data_ptr() for layer in model.layers]


def test_stack_profile_clocks_every_kernel_of_the_loop_only_while_on(llm: Any) -> None:
    import paddle

    model = llm.engine.runner.model
    prof = lambda start: model.ops.fdx_stack_profile(paddle.zeros([1], "float32"), start).numpy()  # noqa: E731
    prof(1)  # zeroed, on
    try:
        _run(llm, True, PROMPTS[:2], max_tokens=4)
        clocks = prof(0)  # the figures so far; off
    finally:
        prof(0)
    parts, whole, calls, rows = clocks[:8], clocks[8], clocks[9], clocks[10]
    # 2 prompts (a prefill step or more, then decode steps of 2 rows): one loop call a step
    assert calls >= 4 and rows >= calls * 2
    assert (parts > 0).all()  # every kernel of every layer was clocked
    assert parts.sum() <= whole and parts.sum() > 0.9 * whole  # the laps cover the loop, nothing twice
    _run(llm, True, PROMPTS[:1], max_tokens=3)
    assert (prof(0) == clocks).all()  # off: the clocks stand still
    zeroed = prof(1)
    assert (zeroed == clocks).all()  # start returns the figures before zeroing them
    assert (prof(0) == 0).all()


def test_release_scratch_frees_the_kernels_buffers_and_steps_grow_them_again(llm: Any) -> None:
    model = llm.engine.runner.model
    runner = llm.engine.runner
    a = model.args
    prompts = PROMPTS[:2] + [" ".join(["water"] * 100)]  # > 64 tokens: a step of the whole 64-token budget
    before = _run(llm, True, prompts, max_tokens=4)
    freed = model.release_scratch()
    # at least the layer loop's intermediates (h, qkv, attention out, gate_up, act) of a 64-row step
    width = a.hidden_size + (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim + 3 * a.intermediate_size
    assert freed >= 64 * width * 4
    assert model.release_scratch() == 0  # nothing is held any more
    assert _run(llm, True, prompts, max_tokens=4) == before  # grown again; the same bits
    runner.release(["kv_cache"])  # sleep frees them too
    try:
        assert model.release_scratch() == 0
    finally:
        runner.restore(["kv_cache"])
    assert _run(llm, True, prompts[:1], max_tokens=4) == before[:1]


def test_release_scratch_frees_the_samplers_rows(llm: Any) -> None:
    """The native sampler's per-thread vocabulary row (fdx_sample_rows,
    fdx_logprobs_rows) is freed with the kernels' scratch, and grows again."""
    import numpy as np

    from fdx.model import native

    model = llm.engine.runner.model
    kernel = native.sampling_kernel()
    if kernel is None:
        pytest.skip("fdx's native CPU ops are not loaded here")
    V = model.args.vocab_size
    logits = np.random.default_rng(0).normal(size=(2, V)).astype(np.float32)
    rows, tokens = np.arange(2), np.array([3, 5])
    model.release_scratch()
    first = kernel.logprobs(logits, rows, tokens, 4)
    assert model.release_scratch() >= V * 4  # at least one thread's row of V floats
    assert model.release_scratch() == 0
    again = kernel.logprobs(logits, rows, tokens, 4)  # grown again: the same answers
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
