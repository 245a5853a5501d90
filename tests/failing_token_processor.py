"""A token-processor plugin for tests: ``failing`` wraps the ``default``
token processor and fails on purpose for prompts that contain a marker.

* prompt containing :data:`FAIL_FEED` -- the stream raises on its
  :data:`FAIL_AFTER`-th ``feed`` call (a detokenization error mid-request);
* prompt containing :data:`FAIL_OPEN` -- ``open_stream`` raises;
* any other prompt -- exactly the default processor.

Used in process (``plugin_manager.register(failing_token_processor)``) and
by a real ``fdx serve``, which finds it through :func:`write_entry_point`
(a ``.dist-info`` with an ``fdx.plugins`` entry point on ``PYTHONPATH``,
as an installed third-party package would have).
"""

from __future__ import annotations

from typing import Any, Sequence

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import TextDelta, TokenProcessor, TokenStream
from fdx.core.messages import SamplingParams

FAIL_FEED = "ZQXFAILFEED"
FAIL_OPEN = "ZQXFAILOPEN"
FAIL_AFTER = 3
#: what the plugin raises; it must never reach a client
SECRET = "/secret/path/plugin_internal.py"


class _FailingStream(TokenStream):
    def __init__(self, inner: TokenStream) -> None:
        self.inner = inner
        self.calls = 0

    def feed(self, token_ids: Sequence[int], finished: bool) -> TextDelta:
        self.calls += 1
        if self.calls >= FAIL_AFTER:
            raise KeyError(f"detokenizer table corrupted at {SECRET}")
        return self.inner.feed(token_ids, finished)


class FailingTokenProcessor(TokenProcessor):
    def __init__(self, tokenizer: Any, config: Any = None) -> None:
        from fdx.plugins.token_processors.default import fdx_register_token_processors

        super().__init__(tokenizer, config)
        made: list[Any] = []
        fdx_register_token_processors(register=lambda name, factory, **kw: made.append(factory))
        self.inner: TokenProcessor = made[0](tokenizer=tokenizer, config=config)

    def open_stream(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> TokenStream:
        prompt = self.tokenizer.decode(list(prompt_token_ids), skip_special_tokens=False)
        if FAIL_OPEN in prompt:
            raise RuntimeError(f"cannot open a stream: {SECRET}")
        stream = self.inner.open_stream(prompt_token_ids, params)
        return _FailingStream(stream) if FAIL_FEED in prompt else stream

    def token_text(self, token_id: int) -> str:
        return self.inner.token_text(token_id)


@hookimpl
def fdx_register_token_processors(register: Any) -> None:
    register("failing", lambda tokenizer, config=None: FailingTokenProcessor(tokenizer, config),
             description="test plugin: fails for prompts containing a marker")


def write_entry_point(directory: str) -> str:
    """A ``.dist-info`` in ``directory`` declaring this module as the
    ``fdx.plugins`` entry point ``failing``; returns the ``PYTHONPATH`` that finds both."""
    from serverutil import write_plugin_entry_point

    return write_plugin_entry_point(directory, "fdx-failing-plugin", "failing", "failing_token_processor")
