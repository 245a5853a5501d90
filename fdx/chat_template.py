"""The chat template of a request: rendered over its messages with vLLM's
options (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``) and its ``echo``; shared by the server's chat
endpoints, ``/tokenize`` and ``fdx run-batch``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fdx.core.errors import RequestError

if TYPE_CHECKING:
    from fdx.core.interfaces import Tokenizer
    from fdx.server.protocol import ChatCompletionRequest


def echo_text(req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    """vLLM's chat ``echo``: the last message's content when that message is
    the assistant's (a continued final message), else nothing."""
    if not req.echo or not messages or messages[-1].get("role") != "assistant":
        return ""
    return str(messages[-1].get("content") or "")


def chat_options(req: ChatCompletionRequest) -> tuple[bool, bool, dict[str, Any]]:
    """``(add_generation_prompt, continue_final_message, template variables)``
    of a request (vLLM's semantics: setting both flags true is a 400; a
    continued final message gets no generation prompt)."""
    cont = bool(req.continue_final_message)
    explicit_add = "add_generation_prompt" in req.model_fields_set and bool(req.add_generation_prompt)
    if cont and explicit_add:
        raise RequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true", 400,
                           param="continue_final_message")
    add_gen = req.add_generation_prompt if req.add_generation_prompt is not None else True
    return add_gen and not cont, cont, dict(req.chat_template_kwargs or {})


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool = False, template_vars: dict[str, Any] | None = None) -> str:
    """The chat template rendered over ``messages`` (vLLM's semantics).

    ``continue_final_message``: the prompt ends inside the last message
    (rendered without a generation prompt, cut right after that message's
    content), so the model continues it, e.g. a prefilled assistant answer.
    Raises :class:`ValueError` when the template does not show the last
    message's content.  ``template_vars`` (``chat_template_kwargs``) are
    extra template variables; the fixed ones (``messages``, ...) win.
    """
    extra = {k: v for k, v in (template_vars or {}).items() if k not in ("messages", "add_generation_prompt")}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt and
                                         not continue_final_message, **extra)
    if not continue_final_message:
        return text
    final = messages[-1].get("content") or ""
    core = final.strip()
    if not core or core not in text:
        raise ValueError("continue_final_message is set, but the last message's content does not appear in the "
                         "rendered chat (an empty last message cannot be continued)")
    at = text.rindex(core)
    keep = final.lstrip()  # the template kept the message's trailing spaces: keep them too
    end = at + len(keep) if text[at:at + len(keep)] == keep else at + len(core)
    return text[:end]
