"""Beam search at the request edge (vLLM's ``use_beam_search``, ``n``,
``length_penalty``, ``early_stopping``; docs/OPENAI_API.md, "Beam search"):
the request's fields -> the engine's beam params, and one engine request's
beams -> its ``n`` choices' events.

:func:`beam_params` checks a request's fields and turns them into the
engine's :class:`~fdx.core.messages.SamplingParams` (``beam_width = n``).
A field beam search cannot honour is a 400 naming it, never ignored:
sampling (``temperature`` > 0, ``top_p`` < 1, ``top_k``, ``min_p``),
penalties, ``min_tokens``, ``logprobs`` / ``top_logprobs`` /
``prompt_logprobs``, stop strings, ``logit_bias``, structured outputs and
tools.  The search itself runs in the scheduler
(:mod:`fdx.plugins.schedulers.beam`): one engine request per prompt, whose
final output carries its beams, best first.  :class:`BeamChoices` is that
engine request's tag in a :class:`~fdx.server.serving.generation.Generation`:
:func:`beam_events` turns the output into one event per choice, so
streaming and non-streaming replies are built as for any request (a stream
gets every beam's text at the end, as vLLM streams beam search).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import attrs

from fdx.core.errors import RequestError
from fdx.core.messages import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from fdx.output_processor import ChoiceState, OutputEvent

#: request fields that beam search cannot honour: (field, is it asking for something)
CONFLICTS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("temperature", lambda v: v is not None and v > 0),
    ("top_p", lambda v: v is not None and v < 1),
    ("top_k", lambda v: v is not None and v > 0),
    ("min_p", lambda v: v is not None and v > 0),
    ("presence_penalty", lambda v: v is not None and v != 0),
    ("frequency_penalty", lambda v: v is not None and v != 0),
    ("repetition_penalty", lambda v: v is not None and v != 1),
    ("min_tokens", lambda v: bool(v)),
    ("logprobs", lambda v: v is not None and v is not False),
    ("top_logprobs", lambda v: v is not None),
    ("prompt_logprobs", lambda v: v is not None),
    ("stop", lambda v: bool(v)),
    ("logit_bias", lambda v: bool(v)),
    ("response_format", lambda v: v is not None and v.type != "text"),
    ("guided_json", lambda v: v is not None),
    ("guided_regex", lambda v: v is not None),
    ("guided_choice", lambda v: v is not None),
    ("guided_grammar", lambda v: v is not None),
    ("structured_outputs", lambda v: v is not None),
    ("tools", lambda v: bool(v)),
)

EARLY_STOPPING = {True: "true", False: "false", "never": "never"}


def beam_params(req: Any, params: SamplingParams, max_logprobs: int, eos_token_ids: frozenset[int]) -> SamplingParams:
    """The engine params of a request: unchanged without
    ``use_beam_search`` (then ``length_penalty`` / ``early_stopping`` must be
    left at their defaults), else beam search with ``n`` beams, greedy
    scoring (sampling defaults, such as a model's, do not apply).  ``n`` is
    at most what ``--max-logprobs`` lets each step read (HF's ``max(2, 1 +
    #stop ids) * n`` candidates per beam)."""
    if not req.use_beam_search:
        for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
            v = getattr(req, name)
            if v is not None and (v is not default if isinstance(default, bool) else v != default):
                raise RequestError(f"'{name}' applies only to beam search (set use_beam_search: true)", 400,
                                   param=name)
        return params
    for name, asks in CONFLICTS:
        if name in type(req).model_fields and asks(getattr(req, name)):
            raise RequestError(f"'{name}' is not supported with use_beam_search (beam search is deterministic "
                               f"and scores the raw log-probabilities)", 400, param=name)
    stops = (frozenset() if params.ignore_eos else eos_token_ids) | frozenset(params.stop_token_ids)
    mult = params.beam_candidates(1, len(stops))
    if params.n * mult > max_logprobs:
        raise RequestError(f"'n' (the beam width) must be at most {max_logprobs // mult} with use_beam_search: each "
                           f"step reads {mult} x n top logprobs per beam (--max-logprobs {max_logprobs})", 400,
                           param="n")
    es = False if req.early_stopping is None else req.early_stopping
    lp = 1.0 if req.length_penalty is None else float(req.length_penalty)
    return attrs.evolve(params, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, beam_width=params.n, length_penalty=lp,
                        early_stopping=EARLY_STOPPING[es])


@attrs.define(eq=False)
class BeamChoices:
    """The choices of one beam-search engine request: beam ``j`` (best
    first) is ``states[j]``."""

    states: list[ChoiceState]


def beam_events(process: Callable[[ChoiceState, RequestOutput], OutputEvent | None], tag: BeamChoices,
                out: RequestOutput) -> Iterator[OutputEvent | None]:
    """One event per choice from the engine request's final output: its
    beams, or its error / abort for every choice.  Outputs before the
    final one carry nothing (the engine sends none)."""
    if out.beams is not None:
        for j, state in enumerate(tag.states):
            if j < len(out.beams):
                b = out.beams[j]
                yield process(state, RequestOutput(out.request_id, b.token_ids, b.finish_reason,
                                                   out.num_prompt_tokens, out.num_cached_tokens, len(b.token_ids)))
            else:  # fewer beams than asked for (a search cut short): an empty choice
                yield process(state, RequestOutput(out.request_id, (), "length", out.num_prompt_tokens,
                                                   out.num_cached_tokens, 0))
    elif out.finish_reason is not None:
        for state in tag.states:
            yield process(state, out)
