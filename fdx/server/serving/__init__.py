"""The OpenAI endpoints of the API process, one module each
(``completions.py``, ``chat.py``), over what they share (``endpoints.py``,
``generation.py``; the prompt side is ``fdx/prompt_tokenizer.py``)."""

from fdx.server.serving.endpoints import OpenAIServing

__all__ = ["OpenAIServing"]
