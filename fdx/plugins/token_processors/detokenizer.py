"""The default token processor: incremental detokenization + stop strings.

Two detokenizers, chosen once per processor:

* :class:`ByteLevelStream` -- for byte-level BPE tokenizers (GPT-2 style,
  e.g. SmolLM2).  Each token id maps to a fixed byte string (special tokens
  to nothing), and a UTF-8 incremental decoder turns the byte stream into
  text.  O(new tokens) per call; a partial UTF-8 character is held inside the
  decoder until its last byte arrives; invalid bytes become U+FFFD exactly as
  ``tokenizers``' lossy decode does.
* :class:`OffsetStream` -- for any tokenizer: vLLM's prefix/read offsets over
  ``tokenizer.decode`` (text ending in U+FFFD is held back).  Each call
  decodes only the window since the last emitted text.

Both feed a :class:`StopMatcher`, which finds stop strings across token
boundaries and holds back a suffix that could still start one.

Invariant for every stream: the concatenation of all ``feed(...).text`` up to
and including ``finished=True`` equals ``tokenizer.decode(output_ids,
skip_special_tokens=True)`` (without the terminating stop token id), cut
before the first stop string when one matched.
"""

from __future__ import annotations

import codecs
import logging
from typing import TYPE_CHECKING, Any, Sequence

from fdx.core.interfaces import TextDelta, TokenProcessor, TokenStream
from fdx.core.messages import SamplingParams

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.interfaces import Tokenizer

log = logging.getLogger(__name__)

#: prompt tokens decoded as left context by :class:`OffsetStream` (vLLM's
#: ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``).
PROMPT_CONTEXT = 5


# --------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------


class StopMatcher:
    """Finds the first stop string in a growing text.

    ``push(text)`` returns ``(final_text, stopped)``: text that can no longer
    be part of a stop string, cut before the stop string if one completed.
    Held back is at most ``max(len(stop)) - 1`` characters: the longest
    suffix that is a proper prefix of some stop string.  Cost per call is
    O(len(text) + held) searching plus O(sum len(stop)^2) for the hold-back.
    """

    __slots__ = ("stops", "max_len", "held", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.held = ""
        self.stopped = False

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self.held + text
        # a match completed now must end inside the new text
        start = max(0, len(self.held) - self.max_len + 1)
        best = -1
        for s in self.stops:
            i = buf.find(s, start)
            if i >= 0 and (best < 0 or i < best):
                best = i
        if best >= 0:
            self.held = ""
            self.stopped = True
            return buf[:best], True
        if final:
            self.held = ""
            return buf, False
        hold = 0
        for s in self.stops:
            tail = buf[-(len(s) - 1) :] if len(s) > 1 else ""
            p = tail.find(s[0])
            while p >= 0:  # the first hit that starts ``s`` is the longest suffix
                if s.startswith(tail[p:]):
                    hold = max(hold, len(tail) - p)
                    break
                p = tail.find(s[0], p + 1)
        self.held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False


# --------------------------------------------------------------------------
# Detokenizers
# --------------------------------------------------------------------------


class _Stream(TokenStream):
    """Common part: stop-token-id handling and the stop matcher."""

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int]) -> None:
        self.params = params
        self._terminators = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self._stop = StopMatcher(params.stop)
        self._num_output = 0
        self._done = False

    def feed(self, token_ids: Sequence[int], finished: bool) -> TextDelta:
        if self._done:
            return TextDelta("", self._stop.stopped)
        ids = list(token_ids)
        self._num_output += len(ids)
        if (
            finished
            and ids
            and ids[-1] in self._terminators
            and self._num_output >= self.params.min_tokens
        ):
            ids.pop()  # the terminating stop token's text is not output (vLLM)
        if len(ids) > 1 and self._stop.stops:  # several tokens: find the one that completes a stop string
            parts = []
            for k, t in enumerate(ids):
                last = finished and k == len(ids) - 1
                out, stopped = self._stop.push(self._decode([t], last), final=last)
                parts.append(out)
                if stopped:
                    self._done = True
                    return TextDelta("".join(parts), True, k + 1)
            self._done = finished
            return TextDelta("".join(parts), False)
        text = self._decode(ids, finished)
        out, stopped = self._stop.push(text, final=finished)
        if stopped or finished:
            self._done = True
        return TextDelta(out, stopped)

    def _decode(self, token_ids: list[int], final: bool) -> str:
        raise NotImplementedError


class ByteLevelStream(_Stream):
    """Byte table + UTF-8 incremental decoder (see module docstring)."""

    def __init__(self, table: Sequence[bytes], params: SamplingParams, eos_token_ids: frozenset[int]) -> None:
        super().__init__(params, eos_token_ids)
        self._table = table
        self._n = len(table)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _decode(self, token_ids: list[int], final: bool) -> str:
        table, n = self._table, self._n
        data = b"".join([table[t] if 0 <= t < n else b"" for t in token_ids])
        return self._utf8.decode(data, final)


class OffsetStream(_Stream):
    """vLLM-style prefix/read offsets over ``tokenizer.decode``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
    ) -> None:
        super().__init__(params, eos_token_ids)
        self._tok = tokenizer
        ctx = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._ids: list[int] = ctx
        self._prefix = 0
        self._read = len(ctx)
        self._prefix_text = tokenizer.decode(ctx, skip_special_tokens=True) if ctx else ""

    def _decode(self, token_ids: list[int], final: bool) -> str:
        self._ids.extend(token_ids)
        if self._read >= len(self._ids):
            return ""
        new_text = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or a character is still incomplete
        delta = new_text[len(self._prefix_text) :]
        # slide the window: the next prefix is what was just read
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        # keep memory bounded: drop ids before the window
        if self._prefix > 1024:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta


# --------------------------------------------------------------------------
# Byte table for byte-level BPE
# --------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (char -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def byte_level_table(tokenizer: Tokenizer) -> list[bytes] | None:
    """Per-id output bytes (specials: empty) when ``tokenizer`` wraps a
    Hugging Face ``tokenizers`` object with a ByteLevel decoder; ``None``
    otherwise.  Mirrors ``tokenizers``' ByteLevel ``decode_chain``: a token
    whose characters all map to bytes gives those bytes, any other token its
    UTF-8 text.  Self-checked against ``tokenizer.decode`` before use."""
    hf: Any = getattr(tokenizer, "hf_tokenizer", None) or getattr(tokenizer, "_tok", None)
    if hf is None or type(getattr(hf, "decoder", None)).__name__ != "ByteLevel":
        return None
    try:
        specials = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        size = int(hf.get_vocab_size(with_added_tokens=True))
    except Exception:  # noqa: BLE001 - an unexpected tokenizers build: use the generic path
        return None
    char_byte = _bytes_to_unicode()
    table: list[bytes] = []
    for i in range(size):
        s = hf.id_to_token(i)
        if s is None or i in specials:
            table.append(b"")
            continue
        try:
            table.append(bytes([char_byte[c] for c in s]))
        except KeyError:
            table.append(s.encode("utf-8"))
    if not _table_agrees(tokenizer, table):
        log.warning("byte-level table disagrees with tokenizer.decode; using the generic detokenizer")
        return None
    return table


def _table_agrees(tokenizer: Tokenizer, table: list[bytes]) -> bool:
    import random

    rnd = random.Random(0)
    n = len(table)
    for _ in range(8):
        ids = [rnd.randrange(n) for _ in range(64)]
        want = tokenizer.decode(ids, skip_special_tokens=True)
        got = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
        if want != got:
            return False
    return True


# --------------------------------------------------------------------------
# Processor
# --------------------------------------------------------------------------


class DefaultTokenProcessor(TokenProcessor):
    """Opens a :class:`ByteLevelStream` when the tokenizer is byte-level BPE
    (``byte_level=None``: detect), else an :class:`OffsetStream`."""

    def __init__(
        self, tokenizer: Tokenizer, config: EngineConfig | None = None, byte_level: bool | None = None
    ) -> None:
        super().__init__(tokenizer, config)
        self._eos = frozenset(getattr(tokenizer, "eos_token_ids", frozenset()))
        self._table = byte_level_table(tokenizer) if byte_level in (None, True) else None
        if byte_level and self._table is None:
            raise ValueError("byte_level=True but the tokenizer is not a byte-level BPE")
        self._token_text: dict[int, str] = {}

    @property
    def byte_level(self) -> bool:
        return self._table is not None

    def open_stream(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> TokenStream:
        if self._table is not None:
            return ByteLevelStream(self._table, params, self._eos)
        return OffsetStream(self.tokenizer, prompt_token_ids, params, self._eos)

    def token_text(self, token_id: int) -> str:
        """Text of one token (special tokens included), cached."""
        t = self._token_text.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1 << 17:
                self._token_text[token_id] = t
        return t
