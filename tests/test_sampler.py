"""Sampler behaviour on synthetic logits (fdx.model.sampler)."""

from __future__ import annotations

import numpy as np
import pytest

from fdx.core.messages import SamplingParams
from fdx.core.request import Request
from fdx.model.sampler import Sampler

V = 64


def req(rid: str = "r", prompt: list[int] | None = None, eos: frozenset[int] = frozenset(), **kw: object) -> Request:
    return Request(rid, list(prompt or [0]), SamplingParams(**kw), eos_token_ids=eos)  # type: ignore[arg-type]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(params=["numpy", "native"], autouse=True)
def sampler_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs twice: the random rows sampled by NumPy, then by the
    C++ kernel (fdx/csrc/sampling.cc) -- every ``Sampler`` built without a
    ``native`` argument gets it."""
    if request.param == "native":
        from fdx.model import native

        native.load_ops()
        kernel = native.sampling_kernel()
        if kernel is None:
            pytest.skip("fdx's native CPU ops are not loaded here (no AVX2/AVX-512 or no compiler)")
        defaults = Sampler.__init__.__defaults__
        assert defaults is not None and defaults[-1] is None
        monkeypatch.setattr(Sampler.__init__, "__defaults__", (*defaults[:-1], kernel))
    return str(request.param)


@pytest.fixture()
def sampler() -> Sampler:
    return Sampler(V, seed=1234)


@pytest.fixture()
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(6, V)).astype(np.float32) * 2


def test_greedy_is_argmax(sampler: Sampler, logits: np.ndarray) -> None:
    toks, lps = sampler.sample(logits, [req(str(i), temperature=0.0) for i in range(6)])
    assert toks.dtype == np.int64
    assert toks.tolist() == logits.argmax(1).tolist()
    assert lps is None


def test_greedy_rows_mixed_with_random_rows(sampler: Sampler, logits: np.ndarray) -> None:
    reqs = [req(str(i), temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    toks, _ = sampler.sample(logits, reqs)
    assert toks[::2].tolist() == logits[::2].argmax(1).tolist()


def test_paddle_tensor_input_matches_numpy(sampler: Sampler, logits: np.ndarray) -> None:
    paddle = pytest.importorskip("paddle")
    t = paddle.to_tensor(logits)
    greedy = [req(str(i), temperature=0.0) for i in range(6)]
    assert sampler.sample(t, greedy)[0].tolist() == logits.argmax(1).tolist()
    seeded_a = [req(str(i), temperature=0.8, top_p=0.9, seed=i) for i in range(6)]
    seeded_b = [req(str(i), temperature=0.8, top_p=0.9, seed=i) for i in range(6)]
    assert sampler.sample(t, seeded_a)[0].tolist() == sampler.sample(logits, seeded_b)[0].tolist()


def test_top_k_1_equals_greedy(sampler: Sampler, logits: np.ndarray) -> None:
    for _ in range(5):
        toks, _ = sampler.sample(logits, [req(str(i), temperature=1.5, top_k=1) for i in range(6)])
        assert toks.tolist() == logits.argmax(1).tolist()


def test_top_k_restricts_to_k_best(sampler: Sampler) -> None:
    row = np.random.default_rng(1).normal(size=V).astype(np.float32)
    x = np.tile(row, (500, 1))
    toks, _ = sampler.sample(x, [req(str(i), temperature=2.0, top_k=3) for i in range(500)])
    best3 = set(np.argsort(-row)[:3].tolist())
    assert set(toks.tolist()) == best3


def test_top_p_cuts_mass() -> None:
    s = Sampler(4, seed=0)
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    x = np.tile(row, (400, 1))
    toks, _ = s.sample(x, [req(str(i), top_p=0.7) for i in range(400)])
    assert set(toks.tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    toks, _ = s.sample(x, [req(str(i), top_p=0.5) for i in range(400)])
    assert set(toks.tolist()) == {0}  # the first token alone reaches 0.5
    toks, _ = s.sample(x, [req(str(i), top_p=0.81) for i in range(400)])
    assert set(toks.tolist()) == {0, 1, 2}
    freq1 = np.mean(toks == 1)
    assert abs(freq1 - 0.3 / 0.95) < 0.08  # renormalised over the survivors


def test_top_p_large_nucleus_fallback() -> None:
    """A nucleus wider than the candidate window takes the full-sort path."""
    width = 2000
    s = Sampler(width, seed=0)
    row = -np.linspace(0, 1, width, dtype=np.float32)  # nearly flat, decreasing
    p = softmax(row.astype(np.float64))
    nucleus = int(np.searchsorted(np.cumsum(p), 0.6) + 1)
    assert nucleus > 300
    x = np.tile(row, (300, 1))
    toks, _ = s.sample(x, [req(str(i), top_p=0.6) for i in range(300)])
    assert toks.max() < nucleus
    assert toks.max() > nucleus * 0.8  # the tail of the nucleus is reachable


def test_min_p() -> None:
    s = Sampler(4, seed=0)
    row = np.log(np.array([0.4, 0.3, 0.19, 0.11], dtype=np.float32))
    x = np.tile(row, (400, 1))
    toks, _ = s.sample(x, [req(str(i), min_p=0.5) for i in range(400)])
    assert set(toks.tolist()) == {0, 1}  # 0.19 < 0.5 * 0.4
    toks, _ = s.sample(x, [req(str(i), min_p=0.99) for i in range(400)])
    assert set(toks.tolist()) == {0}


def test_temperature_follows_softmax() -> None:
    s = Sampler(5, seed=7)
    row = np.array([1.0, 0.5, 0.0, -0.5, -1.0], dtype=np.float32)
    n = 6000
    x = np.tile(row, (n, 1))
    for t in (0.5, 1.0, 2.0):
        toks, _ = s.sample(x, [req(str(i), temperature=t) for i in range(n)])
        emp = np.bincount(toks, minlength=5) / n
        assert np.abs(emp - softmax(row / t)).max() < 0.025


def test_repetition_penalty_changes_argmax(sampler: Sampler) -> None:
    x = np.full((1, V), -5.0, dtype=np.float32)
    x[0, 3], x[0, 5] = 2.0, 1.8
    assert sampler.sample(x, [req(prompt=[3], temperature=0.0)])[0][0] == 3
    # 2.0 / 1.2 = 1.67 < 1.8
    assert sampler.sample(x, [req(prompt=[3], temperature=0.0, repetition_penalty=1.2)])[0][0] == 5
    # output tokens are penalised too
    r = req(prompt=[9], temperature=0.0, repetition_penalty=1.2)
    r.output_token_ids = [3]
    assert sampler.sample(x, [r])[0][0] == 5
    # negative logits are multiplied: -0.5 * 2 = -1.0 < -0.9
    y = np.full((1, V), -5.0, dtype=np.float32)
    y[0, 3], y[0, 5] = -0.5, -0.9
    assert sampler.sample(y, [req(prompt=[3], temperature=0.0, repetition_penalty=2.0)])[0][0] == 5


def test_frequency_and_presence_penalties(sampler: Sampler) -> None:
    x = np.full((1, V), -5.0, dtype=np.float32)
    x[0, 3], x[0, 5] = 2.0, 1.8

    def run(out: list[int], **kw: float) -> int:
        r = req(prompt=[3, 3, 3], temperature=0.0, **kw)  # prompt tokens never count here
        r.output_token_ids = list(out)
        return int(sampler.sample(x, [r])[0][0])

    assert run([], frequency_penalty=2.0) == 3
    assert run([3], frequency_penalty=0.1) == 3  # 1.9
    assert run([3, 3, 3], frequency_penalty=0.1) == 5  # 1.7
    assert run([3, 3, 3], presence_penalty=0.1) == 3  # 1.9
    assert run([3], presence_penalty=0.25) == 5  # 1.75
    assert run([3], frequency_penalty=-1.0) == 3  # negative rewards


def test_penalty_counts_follow_appended_tokens(sampler: Sampler) -> None:
    """Counts kept in sampler_state are updated incrementally as tokens arrive."""
    x = np.full((1, V), -5.0, dtype=np.float32)
    x[0, 3], x[0, 5] = 2.0, 1.85
    r = req(prompt=[0], temperature=0.0, frequency_penalty=0.1)
    seen = []
    for _ in range(4):
        t = int(sampler.sample(x, [r])[0][0])
        seen.append(t)
        r.append_token(t)
    # 3 wins while 2.0 - 0.1 c > 1.85 (c = 0, 1); then 5 (1.85 > 1.8); then 3 (1.8 > 1.75)
    assert seen == [3, 3, 5, 3]


def test_min_tokens_blocks_eos_and_stop_ids(sampler: Sampler) -> None:
    x = np.zeros((1, V), dtype=np.float32)
    x[0, 2], x[0, 7], x[0, 9] = 5.0, 4.0, 3.0
    r = req(eos=frozenset({2}), temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert sampler.sample(x, [r])[0][0] == 9
    r.output_token_ids = [1]
    assert sampler.sample(x, [r])[0][0] == 9
    r.output_token_ids = [1, 1]
    assert sampler.sample(x, [r])[0][0] == 2
    # random rows too
    r2 = req(eos=frozenset({2}), temperature=1.0, top_k=2, min_tokens=1)
    toks = [int(sampler.sample(x, [r2])[0][0]) for _ in range(30)]
    assert 2 not in toks and set(toks) <= {7, 9}


def _run(sampler: Sampler, rows: list[Request], target: int, steps: int, seed_logits: int) -> list[int]:
    """Sample ``steps`` tokens; returns the tokens of ``rows[target]``."""
    rng = np.random.default_rng(seed_logits)
    out = []
    for _ in range(steps):
        x = np.tile(rng.normal(size=V).astype(np.float32), (len(rows), 1))
        toks, _ = sampler.sample(x, rows)
        out.append(int(toks[target]))
    return out


def test_seed_reproducible_across_batch_compositions() -> None:
    kw = dict(temperature=1.0, top_p=0.95, seed=42)
    alone = _run(Sampler(V), [req("a", **kw)], 0, 30, 5)
    mixed = [req("x", temperature=0.7), req("y", temperature=0.0), req("a", **kw), req("z", seed=3, top_k=5)]
    in_batch = _run(Sampler(V), mixed, 2, 30, 5)
    first = [req("a", **kw), req("q", temperature=1.3, seed=9, min_p=0.05)]
    assert alone == in_batch == _run(Sampler(V), first, 0, 30, 5)


def test_different_seeds_differ() -> None:
    a = _run(Sampler(V), [req("a", seed=1)], 0, 30, 5)
    b = _run(Sampler(V), [req("a", seed=2)], 0, 30, 5)
    assert a != b


def test_logprobs(sampler: Sampler, logits: np.ndarray) -> None:
    reqs = [
        req("a", temperature=0.0, logprobs=5),
        req("b"),
        req("c", temperature=0.6, logprobs=0, repetition_penalty=1.5, prompt=[1, 2, 3]),
        req("d", logprobs=100),  # clamped to max_logprobs
    ]
    toks, lps = sampler.sample(logits[:4], reqs)
    assert lps is not None and lps[1] is None
    ref = [np.log(softmax(logits[i].astype(np.float64))) for i in range(4)]
    a = lps[0]
    assert a is not None and a.token_id == toks[0]
    assert len(a.top) == 5
    assert [t for t, _ in a.top] == np.argsort(-ref[0])[:5].tolist()
    vals = [v for _, v in a.top]
    assert vals == sorted(vals, reverse=True)
    assert np.allclose(vals, np.sort(ref[0])[::-1][:5], atol=1e-5)
    assert a.logprob == pytest.approx(a.top[0][1])  # greedy picks the top token
    c = lps[2]
    assert c is not None and c.top == ()
    # raw logprobs: untouched by penalties and temperature
    assert c.logprob == pytest.approx(ref[2][toks[2]], abs=1e-5)
    d = lps[3]
    assert d is not None and len(d.top) == 20
    assert np.exp(ref[3]).sum() == pytest.approx(1.0)


def test_vocab_padding_never_sampled() -> None:
    s = Sampler(10, seed=0)
    x = np.zeros((200, 16), dtype=np.float32)
    x[:, 10:] = 50.0  # padding columns would win
    toks, _ = s.sample(x, [req(str(i), temperature=1.0) for i in range(200)])
    assert toks.max() < 10
    toks, _ = s.sample(x[:2], [req("g", temperature=0.0), req("h", temperature=0.0)])
    assert toks.max() < 10


def test_shape_mismatch_is_an_error(sampler: Sampler, logits: np.ndarray) -> None:
    with pytest.raises(ValueError, match="does not match"):
        sampler.sample(logits, [req()])
    toks, lps = sampler.sample(np.zeros((0, V), np.float32), [])
    assert toks.shape == (0,) and lps is None


# --------------------------------------------------------------------------
# Wide vocabularies: the windowed fast path and the dense fallback must both
# sample exactly the filtered distribution.
# --------------------------------------------------------------------------

W = 3000


def reference_dist(row: np.ndarray, t: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Straightforward per-row reference: temperature, min_p, top_k, top_p."""
    p = softmax(row.astype(np.float64) / t)
    p = np.where(p >= min_p * p.max(), p, 0.0)
    order = np.argsort(-p, kind="stable")
    if top_k > 0:
        p[order[top_k:]] = 0.0
    p /= p.sum()
    cum = np.cumsum(p[order])
    keep = max(int(np.count_nonzero(cum - p[order] < top_p)), 1)
    p[order[keep:]] = 0.0
    return p / p.sum()


def wide_row(decay: float, seed: int = 0) -> np.ndarray:
    """Geometrically decaying probabilities over a shuffled vocabulary."""
    perm = np.random.default_rng(seed).permutation(W)
    row = np.empty(W, dtype=np.float32)
    row[perm] = -decay * np.arange(W, dtype=np.float32)
    return row


@pytest.mark.parametrize(
    "decay,kw",
    [
        (0.05, dict(top_p=0.9)),  # nucleus ~46 tokens: first window
        (0.002, dict(top_p=0.9)),  # nucleus ~1150 tokens: second window (or dense)
        (0.05, dict(min_p=0.01)),  # cut at ~92: first window
        (0.002, dict(min_p=0.05)),  # cut at ~1500: second window (or dense)
        (0.002, dict(top_k=100, top_p=0.5)),  # window bounded by top_k
        (0.001, dict(top_k=2000, temperature=0.7)),  # top_k beyond the window: dense
        (0.01, dict(top_k=300, min_p=0.1, top_p=0.8, temperature=1.3)),
        (0.003, dict(temperature=0.9)),  # no filter: plain inverse CDF
    ],
)
@pytest.mark.parametrize("windows", [(256, 4096), (256,), ()], ids=["tiers", "one-window", "dense"])
def test_wide_vocab_matches_reference(
    decay: float, kw: dict, windows: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    import fdx.model.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "_TOPP_WINDOWS", windows)
    n = 3000
    row = wide_row(decay)
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    params.update(kw)
    ref = reference_dist(row, params["temperature"], params["top_k"], params["top_p"], params["min_p"])
    s = Sampler(W, seed=11)
    toks, _ = s.sample(np.tile(row, (n, 1)), [req(str(i), **params) for i in range(n)])
    assert ref[toks].min() > 0, "sampled outside the filtered support"
    assert_follows(ref, toks)


def assert_follows(ref: np.ndarray, toks: np.ndarray) -> None:
    """The sampled ``toks`` follow the reference distribution ``ref``: over 10
    buckets of ~equal reference mass (in descending probability order), the
    empirical frequencies are within 0.03 of the reference masses."""
    order = np.argsort(-ref, kind="stable")
    rank = np.empty(len(ref), dtype=np.int64)
    rank[order] = np.arange(len(ref))
    edges = np.searchsorted(np.cumsum(ref[order]), np.linspace(0.1, 0.9, 9))
    bucket_ref = np.diff(np.concatenate([[0.0], np.cumsum(ref[order])[edges], [1.0]]))
    bucket_emp = np.bincount(np.searchsorted(edges, rank[toks], side="left"), minlength=10) / len(toks)
    assert np.abs(bucket_emp - bucket_ref).max() < 0.03


def test_seed_reproducible_whatever_the_window() -> None:
    """A wide top_k row in the batch widens the shared window; a seeded
    top_p row must not notice."""
    rng = np.random.default_rng(3)
    base = wide_row(0.02)
    kw = dict(top_p=0.95, temperature=1.0, seed=77)
    rows_alone = [req("a", **kw)]
    rows_mixed = [req("k", top_k=1000), req("a", **kw), req("m", min_p=0.001)]
    a, b = Sampler(W), Sampler(W)
    for _ in range(20):
        row = base + rng.normal(scale=0.5, size=W).astype(np.float32)
        ta, _ = a.sample(row[None, :], rows_alone)
        tb, _ = b.sample(np.tile(row, (3, 1)), rows_mixed)
        assert ta[0] == tb[1]


def test_input_logits_never_modified(sampler: Sampler, logits: np.ndarray) -> None:
    before = logits.copy()
    reqs = [
        req("a", prompt=[1, 2], temperature=0.0, repetition_penalty=1.3, logprobs=3),
        req("b", prompt=[3], eos=frozenset({5}), min_tokens=4, frequency_penalty=0.5),
        req("c", top_p=0.5, presence_penalty=1.0),
        req("d", top_k=3, min_p=0.1, temperature=0.5),
        req("e", temperature=0.0, min_tokens=2, eos=frozenset({7})),
        req("f", temperature=2.0),
    ]
    for r in reqs:
        r.output_token_ids = [4, 4, 9]
    sampler.sample(logits, reqs)
    assert np.array_equal(logits, before)


# --------------------------------------------------------------------------
# The C++ kernel on a model-sized vocabulary: masked tokens, degenerate rows,
# the nucleus search on rows whose nucleus is a few tokens or thousands.
# --------------------------------------------------------------------------


@pytest.fixture()
def kernel() -> object:
    from fdx.model import native

    native.load_ops()
    k = native.sampling_kernel()
    if k is None:
        pytest.skip("fdx's native CPU ops are not loaded here")
    return k


def test_native_never_samples_a_masked_token(kernel: object, sampler_kernel: str) -> None:
    if sampler_kernel != "native":
        pytest.skip("the kernel itself: once")
    width = 49152
    rng = np.random.default_rng(5)
    x = np.full((6, width), -np.inf, dtype=np.float32)
    allowed = rng.choice(width, 40, replace=False)
    x[:, allowed] = rng.normal(size=(6, 40)).astype(np.float32) * 3
    x[5, :] = -np.inf  # nothing allowed: no mass, token 0 (as the NumPy path)
    for kw in (dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=5, min_p=0.01)):
        s = Sampler(width, seed=3)
        for _ in range(30):
            toks, _ = s.sample(x, [req(str(i), **kw) for i in range(6)])
            assert set(toks[:5].tolist()) <= set(allowed.tolist()), kw
            assert toks[5] == 0


@pytest.mark.parametrize("boost", [12.0, 3.0], ids=["small-nucleus", "wide-nucleus"])
def test_native_top_p_on_a_model_sized_vocab(kernel: object, sampler_kernel: str, boost: float) -> None:
    """A 49,152-token row: a few boosted tokens over a N(0, 1.5) bulk (top_p 0.9
    at T = 0.8 keeps 2-3 tokens with a boost of 12, thousands with 3): the
    kernel's candidate bound and selection by mass give the reference's
    distribution."""
    if sampler_kernel != "native":
        pytest.skip("the kernel itself: once")
    width = 49152
    rng = np.random.default_rng(8)
    row = (rng.normal(size=width) * 1.5).astype(np.float32)
    top = rng.choice(width, 5, replace=False)
    row[top] += np.float32(boost) - np.arange(5, dtype=np.float32)
    ref = reference_dist(row, 0.8, 0, 0.9, 0.0)
    n = 4000
    toks, _ = Sampler(width, seed=2).sample(np.tile(row, (n, 1)), [req(str(i), temperature=0.8, top_p=0.9)
                                                                   for i in range(n)])
    assert ref[toks].min() > 0, "sampled outside the nucleus"
    assert_follows(ref, toks)


def test_native_sampler_is_what_the_tests_run(sampler_kernel: str) -> None:
    assert (Sampler(V)._native is not None) == (sampler_kernel == "native")


def test_native_logprobs_equal_numpy_s(kernel: object, sampler_kernel: str) -> None:
    """The C++ logprobs (one pass a row) against the NumPy path's on a
    model-sized vocabulary: the same top ids (ties: the lower id first), the
    same values to float32 rounding; masked -inf tokens have -inf logprobs."""
    if sampler_kernel != "native":
        pytest.skip("the kernel itself: once")
    width = 49152
    rng = np.random.default_rng(12)
    x = (rng.normal(size=(5, width)) * 2).astype(np.float32)
    x[1, 100:110] = x[1].max() + 1  # ten tied best logits
    x[2, : width - 7] = -np.inf  # seven finite tokens, asked for 20
    x[3] *= 40  # a very peaked row
    reqs = [req(str(i), temperature=0.0, logprobs=k) for i, k in enumerate((5, 20, 20, 1, 0))]
    (ta, la), (tb, lb) = Sampler(width, native=None).sample(x, reqs), Sampler(width, native=kernel).sample(x, reqs)  # type: ignore[arg-type]
    assert ta.tolist() == tb.tolist()
    assert la is not None and lb is not None
    for a, b in zip(la, lb):
        assert a is not None and b is not None
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=2e-5)
        fin = [j for j, (_, v) in enumerate(a.top) if np.isfinite(v)]  # which -inf ids fill up a row: any
        assert [a.top[j][0] for j in fin] == [b.top[j][0] for j in fin]
        assert np.allclose([a.top[j][1] for j in fin], [b.top[j][1] for j in fin], atol=2e-5)
    assert lb[1] is not None and [t for t, _ in lb[1].top[:10]] == list(range(100, 110))
    assert lb[2] is not None and np.isinf([v for _, v in lb[2].top[7:]]).all()


@pytest.mark.parametrize("width", [49152, 37, 16, 1])
def test_native_argmax_is_numpys(kernel: object, sampler_kernel: str, width: int) -> None:
    """The C++ greedy rows (fdx_argmax_rows, the Sampler's from 16 rows) give NumPy's argmax: the first
    of tied maxima, the first NaN of a row that has one, index 0 of an
    all -inf row, +0.0 and -0.0 as equals, a padded row stride (a view)."""
    if sampler_kernel != "native":
        pytest.skip("the kernel itself: once")
    rng = np.random.default_rng(width)
    x = (rng.normal(size=(20, width + 5)) * 3).astype(np.float32)  # 20 rows: the Sampler's native argmax
    x[1, :] = x[1].max()  # every value tied: index 0
    x[2, width // 2:] = np.float32(x[2].max() + 1)  # a tie from the middle on
    x[3, :] = -np.inf
    x[4, width - 1] = np.nan  # NaN wins wherever it is
    x[5, width // 3] = np.nan
    x[5, (2 * width) // 3] = np.nan
    x[6, :] = -1.0
    x[6, width - 1] = 0.0
    x[6, max(0, width - 2)] = -0.0  # -0.0 == 0.0: the first of the two
    x[7, :] = np.float32(3.0e38)
    x[7, width - 1] = np.inf
    view = x[:, :width]  # the padded vocabulary's view: rows width + 5 apart
    got = kernel.argmax(view)  # type: ignore[attr-defined]
    assert got.dtype == np.int64
    assert got.tolist() == view.argmax(axis=1).tolist()
    assert Sampler(width, native=kernel).sample(x, [req(str(i), temperature=0.0) for i in range(20)])[0].tolist() \
        == view.argmax(axis=1).tolist()  # type: ignore[arg-type]
