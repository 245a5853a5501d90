"""The default token processor: incremental detokenization and stop strings."""

from __future__ import annotations

import random
from typing import Any, Sequence

import pytest

from fdx.core.interfaces import TextDelta, TokenStream
from fdx.core.messages import SamplingParams
from fdx.plugins.token_processors.detokenizer import DefaultTokenProcessor, StopMatcher

TEXTS = [
    "Héllo wörld, crème brûlée à la française; ñandú, Ærø, Ελληνικά, Привет!",
    "你好，世界。日本語のテキストと한국어 문장도 있습니다。",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 and ✨ sparkles",
    'def f(x: int) -> int:\n    """Doc."""\n    return {"a": [1, 2, 3]}[x] ** 2  # 42\n\tpass\n',
    "line one\r\nline two\r\n\r\nend\r\n",
    "Mixed: naïve café — “quotes” … 1234567890 √2≈1.41 ∑∞ 🙂 中文 🚀\r\n```python\nprint('ok')\n```",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    from fdx.model.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def proc(tok: Any) -> DefaultTokenProcessor:
    return DefaultTokenProcessor(tok)


@pytest.fixture(scope="module")
def proc_generic(tok: Any) -> DefaultTokenProcessor:
    return DefaultTokenProcessor(tok, byte_level=False)


def stream_all(stream: TokenStream, ids: Sequence[int], chunk: int = 1) -> tuple[list[TextDelta], str]:
    deltas = [stream.feed(ids[i : i + chunk], False) for i in range(0, len(ids), chunk)]
    deltas.append(stream.feed([], True))
    return deltas, "".join(d.text for d in deltas)


# --------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------


def test_registered_as_default(plugin_manager: Any, tok: Any) -> None:
    from fdx.core.plugins import collect
    from fdx.plugins.token_processors import default

    plugin_manager.register(default)
    plugins = collect(plugin_manager, {})
    p = plugins.create("token_processor", "default", tokenizer=tok, config=None)
    assert isinstance(p, DefaultTokenProcessor) and p.byte_level


# --------------------------------------------------------------------------
# detokenization with the real SmolLM2 tokenizer
# --------------------------------------------------------------------------


def test_byte_table_matches_decode_for_every_token(tok: Any, proc: DefaultTokenProcessor) -> None:
    table = proc._table
    assert table is not None and len(table) == tok.vocab_size
    for i in range(tok.vocab_size):
        assert table[i].decode("utf-8", errors="replace") == tok.decode([i]), i


@pytest.mark.parametrize("generic", [False, True], ids=["byte_level", "offsets"])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_decode(tok: Any, proc: Any, proc_generic: Any, text: str, generic: bool) -> None:
    p = proc_generic if generic else proc
    ids = tok.encode(text)
    prompt = tok.encode_chat([{"role": "user", "content": "hi"}])
    for chunk in (1, 3):
        deltas, out = stream_all(p.open_stream(prompt, SamplingParams()), ids, chunk)
        assert out == tok.decode(ids) == text
        # never a partial character: no replacement char in any delta
        assert all("\ufffd" not in d.text and not d.stopped for d in deltas)


def test_multibyte_characters_are_held_until_complete(tok: Any, proc: Any) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
    s = proc.open_stream([], SamplingParams())
    texts = [s.feed([i], False).text for i in ids]
    assert texts[:-1] == [""] * (len(ids) - 1) and texts[-1] == "😀"


def test_special_tokens_are_skipped(tok: Any, proc: Any, proc_generic: Any) -> None:
    ids = tok.encode("The answer<|im_start|> is 42.") + [2]  # 2 = <|im_end|> (eos)
    for p in (proc, proc_generic):
        _, out = stream_all(p.open_stream([], SamplingParams()), ids)
        assert out == "The answer is 42." == tok.decode(ids)
        assert "<|im_end|>" not in out


def test_random_tokens_match_lossy_decode(tok: Any, proc: Any) -> None:
    """Arbitrary id sequences (invalid UTF-8, specials) decode like
    tokenizers' lossy decode, whatever the chunking."""
    rnd = random.Random(1)
    for _ in range(60):
        ids = [rnd.randrange(tok.vocab_size) for _ in range(rnd.randrange(1, 40))]
        _, out = stream_all(proc.open_stream([], SamplingParams()), ids, rnd.choice([1, 2, 5]))
        assert out == tok.decode(ids)


def test_incomplete_tail_is_flushed_on_finish(tok: Any, proc: Any, proc_generic: Any) -> None:
    ids = tok.encode("ok 😀")[:-1]  # cut inside the emoji
    for p in (proc, proc_generic):
        s = p.open_stream([], SamplingParams())
        emitted = "".join(s.feed([i], False).text for i in ids)
        assert emitted.startswith("ok") and "\ufffd" not in emitted
        tail = s.feed([], True).text
        assert tail.endswith("\ufffd")  # replacement char(s), as decode gives
        assert emitted + tail == tok.decode(ids)


def test_terminating_stop_token_id_is_not_output(tok: Any, proc: Any) -> None:
    ids = tok.encode("Hello world.")
    stop_id = ids[-1]  # "."
    params = SamplingParams(stop_token_ids=(stop_id,))
    s = proc.open_stream([], params)
    for i in ids[:-1]:
        s.feed([i], False)
    assert s.feed([stop_id], True).text == ""
    # with min_tokens not reached the same id is ordinary text
    s = proc.open_stream([], SamplingParams(stop_token_ids=(stop_id,), min_tokens=50))
    _, out = stream_all(s, ids)
    assert out == "Hello world."


def test_token_text(tok: Any, proc: Any) -> None:
    assert proc.token_text(2) == "<|im_end|>"
    i = tok.encode(" hello")[0]
    assert proc.token_text(i) == tok.decode([i], skip_special_tokens=False)


# --------------------------------------------------------------------------
# stop strings
# --------------------------------------------------------------------------


@pytest.mark.parametrize("generic", [False, True], ids=["byte_level", "offsets"])
def test_stop_string_across_tokens(tok: Any, proc: Any, proc_generic: Any, generic: bool) -> None:
    p = proc_generic if generic else proc
    text = "Sure! Here is the answer: 42.\n###END### trailing text"
    ids = tok.encode(text)
    s = p.open_stream([], SamplingParams(stop=("###END###", "never")))
    deltas = []
    for i in ids:
        d = s.feed([i], False)
        deltas.append(d)
        if d.stopped:
            break
    out = "".join(d.text for d in deltas)
    assert out == "Sure! Here is the answer: 42.\n"
    assert deltas[-1].stopped and not any(d.stopped for d in deltas[:-1])
    assert "#" not in out  # the partial stop string was held back, never emitted
    assert s.feed([ids[-1]], False) == TextDelta("", True)  # after a stop: nothing more


def test_earliest_stop_string_wins(tok: Any, proc: Any) -> None:
    ids = tok.encode("alpha beta gamma delta")
    _, out = stream_all(proc.open_stream([], SamplingParams(stop=("delta", "beta", "gamma"))), ids)
    assert out == "alpha "


def test_held_suffix_released_when_not_a_stop(tok: Any, proc: Any) -> None:
    ids = tok.encode("the world? the world!")
    s = proc.open_stream([], SamplingParams(stop=("world!",)))
    deltas, out = stream_all(s, ids)
    assert out == "the world? the "
    assert deltas[-1].stopped or any(d.stopped for d in deltas)


def test_finish_flushes_held_text(tok: Any, proc: Any) -> None:
    ids = tok.encode("see you wor")
    s = proc.open_stream([], SamplingParams(stop=("world",)))
    emitted = "".join(s.feed([i], False).text for i in ids)
    assert emitted == "see you "  # "wor" could start "world"
    d = s.feed([], True)
    assert d == TextDelta("wor", False)


def test_stop_matcher_overlapping_prefixes() -> None:
    m = StopMatcher(["aab"])
    assert m.push("xa") == ("x", False)
    assert m.push("a") == ("", False)
    assert m.push("a") == ("a", False)  # "aaa": only "aa" can still start "aab"
    assert m.push("b") == ("", True)
    m = StopMatcher(["ab", "bc"])
    assert m.push("zab") == ("z", True)
    m = StopMatcher([])
    assert m.push("anything") == ("anything", False)
    m = StopMatcher(["\n\n"])
    assert m.push("a\n") == ("a", False)
    assert m.push("b") == ("\nb", False)
    assert m.push("\n", final=True) == ("\n", False)


def test_stop_string_at_start_and_in_one_token(tok: Any, proc: Any) -> None:
    ids = tok.encode("STOP now")
    deltas, out = stream_all(proc.open_stream([], SamplingParams(stop=("STOP",))), ids)
    assert out == "" and any(d.stopped for d in deltas)


# --------------------------------------------------------------------------
# generic path with a non-byte-level tokenizer (pure logic)
# --------------------------------------------------------------------------


class PieceTokenizer:
    """A toy tokenizer: each id is a fixed text piece; id 0 is special."""

    eos_token_ids = frozenset({0})

    def __init__(self) -> None:
        self.pieces = ["<eos>", "Hel", "lo", " wor", "ld", "!", " 🙂", "\n"]
        self.vocab_size = len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in token_ids if not (skip_special_tokens and i == 0))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str:
        return self.pieces[token_id]


def test_generic_tokenizer_uses_offsets() -> None:
    t = PieceTokenizer()
    p = DefaultTokenProcessor(t)
    assert not p.byte_level
    ids = [1, 2, 3, 4, 5, 6, 7, 0]
    _, out = stream_all(p.open_stream([7, 1], SamplingParams()), ids)
    assert out == "Hello world! 🙂\n"
    _, out = stream_all(p.open_stream([], SamplingParams(stop=("world",))), ids)
    assert out == "Hello "
    with pytest.raises(ValueError, match="byte-level"):
        DefaultTokenProcessor(t, byte_level=True)


class CountingTokenizer:
    """Proxy recording the length of every ``decode`` call."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(token_ids))
        return self._inner.decode(token_ids, skip_special_tokens)


def test_cost_per_call_is_independent_of_length(tok: Any, proc: Any) -> None:
    """O(new tokens) per feed: the byte-level stream never calls decode; the
    offset stream decodes only a short window, however long the output."""
    ids = tok.encode("".join(TEXTS) * 6)
    assert len(ids) > 800
    counting = CountingTokenizer(tok)
    byte_proc = DefaultTokenProcessor(counting)
    assert byte_proc.byte_level
    s = byte_proc.open_stream([], SamplingParams(stop=("never-there",)))
    counting.calls.clear()
    _, out = stream_all(s, ids)
    assert counting.calls == []
    s_generic = DefaultTokenProcessor(counting, byte_level=False).open_stream([1, 2], SamplingParams())
    counting.calls.clear()
    _, out_generic = stream_all(s_generic, ids)
    assert out == out_generic == tok.decode(ids)
    assert len(counting.calls) <= 2 * len(ids) + 2
    assert max(counting.calls) <= 8  # the longest multi-token character window
