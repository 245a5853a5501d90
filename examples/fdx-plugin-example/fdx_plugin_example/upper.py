"""A token processor that upper-cases the default processor's text."""

from __future__ import annotations

from typing import Sequence

from fdx.core.interfaces import TextDelta, TokenProcessor, TokenStream
from fdx.core.messages import SamplingParams


class _UpperStream(TokenStream):
    def __init__(self, inner: TokenStream) -> None:
        self.inner = inner

    def feed(self, token_ids: Sequence[int], finished: bool) -> TextDelta:
        d = self.inner.feed(token_ids, finished)
        return TextDelta(d.text.upper(), d.stopped)


class UpperTokenProcessor(TokenProcessor):
    def __init__(self, tokenizer, config=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(tokenizer, config)
        from fdx.plugins.token_processors.detokenizer import DefaultTokenProcessor

        self.inner = DefaultTokenProcessor(tokenizer, config)

    def open_stream(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> TokenStream:
        return _UpperStream(self.inner.open_stream(prompt_token_ids, params))
