"""Prompt tokenization off the event loop, and memory given back after it.

Encoding a prompt of a few MiB takes seconds of CPU.  Run on the event
loop, it would stall ``/health`` and every open stream for that long; so a
request's long texts (more than :data:`INLINE_CHARS` characters in all)
are rendered and encoded in a worker thread (the ``tokenizers`` batch encoder releases the
GIL meanwhile, see ``fdx/model/tokenizer.py``).  A prompt longer than the
caller's token limit never reaches the event loop as a list: only its length
comes back.  After a text of :data:`RELEASE_CHARS` characters or more the
worker runs the garbage collector and glibc's ``malloc_trim``, so the
tokenizer's transient buffers go back to the OS instead of staying in the
API process.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import attrs

from fdx.chat_template import render_chat

if TYPE_CHECKING:
    from fdx.core.interfaces import Tokenizer

#: texts up to this many characters are tokenized inline (a thread hop costs more)
INLINE_CHARS = 8192
#: after tokenizing a text at least this long, give freed memory back to the OS
RELEASE_CHARS = 1 << 20
#: tokenizer worker threads (the encoder itself is multi-threaded for long texts)
WORKERS = 2


@attrs.frozen
class Tokenized:
    """A tokenized prompt: ``ids``, or ``None`` when it had more than the
    caller's limit of tokens; ``num_tokens`` either way."""

    ids: list[int] | None
    num_tokens: int


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


def release_memory() -> None:
    """Collect garbage and return free heap pages to the OS (glibc)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class PromptTokenizer:
    """Encodes prompts for the API process without blocking its event loop."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool: ThreadPoolExecutor | None = None

    async def encode(self, texts: list[str], add_special_tokens: bool, limit: int) -> list[Tokenized]:
        """Each text -> token ids (at most ``limit`` of them are returned);
        off the loop when the texts together are long."""
        return await self._run(sum(len(t) for t in texts), self._encode, texts, add_special_tokens, limit)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, limit: int,
                          continue_final_message: bool = False,
                          template_vars: dict[str, Any] | None = None) -> Tokenized:
        """Render the chat template (see :func:`fdx.chat_template.render_chat`),
        then encode it (no BOS added)."""
        size = sum(len(m.get("content") or "") for m in messages)
        return await self._run(size, self._encode_chat, messages, add_generation_prompt, limit,
                               continue_final_message, template_vars or {})

    async def _run(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        if size <= INLINE_CHARS:
            return fn(*args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="fdx-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._big, size, fn, args)

    @staticmethod
    def _big(size: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        try:
            return fn(*args)
        finally:
            if size >= RELEASE_CHARS:
                release_memory()

    def _encode(self, texts: list[str], add_special_tokens: bool, limit: int) -> list[Tokenized]:
        out = []
        for text in texts:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            n = len(ids)
            out.append(Tokenized(ids if n <= limit else None, n))
            del ids
        return out

    def _encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, limit: int,
                     continue_final_message: bool, template_vars: dict[str, Any]) -> Tokenized:
        text = render_chat(self.tokenizer, messages, add_generation_prompt, continue_final_message, template_vars)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        n = len(ids)
        return Tokenized(ids if n <= limit else None, n)
