"""The ``default`` token processor plugin: incremental detokenization that is
exact for byte-level BPE, plus stop strings (see ``detokenizer``)."""

from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl


@hookimpl
def fdx_register_token_processors(register: Register) -> None:
    def factory(tokenizer: Any, config: Any = None) -> Any:
        from fdx.plugins.token_processors.detokenizer import DefaultTokenProcessor

        return DefaultTokenProcessor(tokenizer, config)

    register(
        "default",
        factory,
        description="incremental detokenizer (byte-level fast path, UTF-8 safe) with stop strings",
    )
