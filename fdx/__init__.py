"""fdx: a plugin-oriented LLM serving engine.

``fdx.LLM``, ``fdx.SamplingParams`` and ``fdx.StructuredOutput`` (a grammar
for ``SamplingParams(structured=...)``) are imported lazily so ``import fdx``
(and ``fdx --help``) never imports Paddle.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from fdx.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fdx.core.messages import SamplingParams

        return SamplingParams
    if name == "StructuredOutput":
        from fdx.core.messages import StructuredOutput

        return StructuredOutput
    raise AttributeError(f"module 'fdx' has no attribute {name!r}")
