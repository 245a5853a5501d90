"""fdx: a plugin-oriented LLM serving engine.

``fdx.LLM`` and ``fdx.SamplingParams`` are imported lazily so ``import fdx``
(and ``fdx --help``) never imports Paddle.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from fdx.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fdx.core.messages import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'fdx' has no attribute {name!r}")
