"""The hook specifications of fdx: every way a plugin can extend the engine.

A plugin is any module or object with functions decorated by
``fdx.hookimpl``.  Installed packages expose plugins through the entry-point
group ``fdx.plugins``; tests register them with ``pm.register(obj)``.

Two families of hooks:

* **Registry hooks** (``fdx_register_*``) are called exactly once, at start-up,
  while :mod:`fdx.core.plugins` collects the named factories of each component
  kind.  After start-up the engine calls the chosen components' plain methods:
  pluggy is never dispatched per token.
* **Extension hooks** are called on rare events (a request's life-cycle, app
  or parser construction, config finalisation).  They are called in the
  front-end (API server / offline ``LLM``) process.

Hooks grow by new keyword arguments only; an implementation may accept any
subset of the documented arguments (pluggy passes by name).  No hook is
``firstresult``: every implementation is called, in registration order, and
where results matter (:func:`fdx_adjust_config`) the hook says how they
combine.  Factories are always called with keyword arguments, named as in
each registry hook's docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import pluggy

if TYPE_CHECKING:
    import argparse

    from fastapi import FastAPI

    from fdx.config import EngineConfig
    from fdx.core.messages import SamplingParams
    from fdx.deploy.frontend import EngineFrontend

PROJECT = "fdx"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

class Register(Protocol):
    """The callable passed to every registry hook.

    ``register(name, factory, *, description="")``: ``name`` is what the
    user selects (``--scheduler NAME``...), ``factory`` is called later with
    keyword arguments that depend on the kind (see each hook) and returns
    the component; heavy imports belong inside it.  ``description`` is the
    one line ``fdx plugins`` shows.
    """

    def __call__(self, name: str, factory: Callable[..., Any], *, description: str = "") -> None: ...


# --------------------------------------------------------------------------
# Registry hooks: one per component kind
# --------------------------------------------------------------------------


@hookspec
def fdx_register_schedulers(register: Register) -> None:
    """Contribute schedulers, selected with ``--scheduler NAME``.

    Called once at start-up, in the engine process (and in ``fdx plugins``).

    :param register: call ``register(name, factory)`` for each scheduler.
        ``factory(config=..., kv=...)`` must return a
        :class:`fdx.core.interfaces.Scheduler`; ``config`` is the frozen
        :class:`fdx.config.EngineConfig` and ``kv`` the
        :class:`fdx.core.kv_cache.KVCacheManager` that owns the block pool.
        With ``--kv-connector`` set the factory also gets ``connector=``,
        the :class:`fdx.core.interfaces.KVConnector` the engine built.

    Return nothing.  Registering a name twice (from any two plugins) is an
    error that names both plugins.
    """


@hookspec
def fdx_register_token_processors(register: Register) -> None:
    """Contribute token processors, selected with ``--token-processor NAME``.

    A token processor turns the token ids a request produces into text,
    incrementally, and detects stop strings.  It runs in the front-end
    process (next to the tokenizer), never in the engine loop.

    Called once at start-up, in the API-server process, in ``fdx.LLM`` and
    in ``fdx plugins``.

    :param register: call ``register(name, factory)``.
        ``factory(tokenizer=..., config=...)`` returns a
        :class:`fdx.core.interfaces.TokenProcessor`; ``tokenizer`` is the
        model's :class:`fdx.core.interfaces.Tokenizer` and ``config`` the
        :class:`fdx.config.EngineConfig`.

    Return nothing.
    """


@hookspec
def fdx_register_cache_backends(register: Register) -> None:
    """Contribute cache backends, selected with ``--cache-backend NAME``.

    A cache backend stores KV blocks beyond the device pool; the engine
    drives the chosen one through its KV storage tier
    (:mod:`fdx.kv_storage`).  Called once at start-up,
    in the engine process (and in ``fdx plugins``).

    :param register: call ``register(name, factory)``.  ``factory(options=...)``
        receives the parsed ``--cache-backend-config`` JSON object (a dict,
        possibly empty) and returns a :class:`fdx.core.interfaces.CacheBackend`.

    Return nothing.
    """


@hookspec
def fdx_register_devices(register: Register) -> None:
    """Contribute devices, selected with ``--device NAME[:INDEX]``.

    Called once at start-up, in every process that needs a device (and in
    ``fdx plugins``).  Must not import Paddle: a device sets its environment
    (threads, CPU type) before Paddle is first imported.

    :param register: call ``register(name, factory)``.  ``factory()`` (or
        ``factory(index=N)`` for ``--device NAME:N``) returns a
        :class:`fdx.core.interfaces.Device`.

    Return nothing.
    """


@hookspec
def fdx_register_model_runners(register: Register) -> None:
    """Contribute model runners, selected with ``--model-runner NAME``.

    A model runner loads the weights onto a device, owns the device's KV
    pool and runs one forward pass (plus sampling) per engine step.  When
    ``--model-runner`` is not given, the device plugin's
    :attr:`fdx.core.interfaces.Device.default_runner` is used, so
    ``--device cuda`` picks a GPU runner with no other flag.

    Called once at start-up, in the engine process (and in ``fdx plugins``).
    Must not import Paddle or load a model: that belongs in the factory.

    :param register: call ``register(name, factory)`` for each runner.
        ``factory(config=..., device=...)`` must return a
        :class:`fdx.core.interfaces.ModelRunner`; ``config`` is the frozen
        :class:`fdx.config.EngineConfig` and ``device`` the
        :class:`fdx.core.interfaces.Device` chosen by ``--device``, already
        created, checked available and configured (``configure_env``).

    Return nothing.  Registering a name twice (from any two plugins) is an
    error that names both plugins.
    """


@hookspec
def fdx_register_kv_connectors(register: Register) -> None:
    """Contribute KV connectors, selected with ``--kv-connector NAME``.

    A KV connector moves a request's prompt KV blocks (and the splitwise
    messages that go with them) from a prefill to a decode instance
    (``--scheduler splitwise``).  Called once at start-up, in the engine
    process (and in ``fdx plugins``).  Must not import heavy libraries:
    that belongs in the factory.

    :param register: call ``register(name, factory)`` for each connector.
        ``factory(config=..., runner=...)`` must return a started (listening)
        :class:`fdx.core.interfaces.KVConnector`; ``config`` is the frozen
        :class:`fdx.config.EngineConfig` (``kv_connector_port``,
        ``kv_connector_config``) and ``runner`` the
        :class:`fdx.core.interfaces.ModelRunner` whose KV blocks it reads
        (``read_kv_blocks``) and writes (``write_kv_blocks``).

    Return nothing.  Registering a name twice (from any two plugins) is an
    error that names both plugins.
    """


@hookspec
def fdx_register_grammar_backends(register: Register) -> None:
    """Contribute grammar backends (structured outputs), selected with
    ``--grammar-backend NAME``.

    A grammar backend compiles the structured-output spec of a request
    (JSON schema, regex, choice, grammar) and keeps one matcher per request,
    whose token mask the sampler applies each step.  Called once at
    start-up, in the engine process, the API-server process, ``fdx.LLM`` and
    ``fdx plugins``.  Must not import the grammar engine: that belongs in
    the factory (or in the backend's first compile).

    :param register: call ``register(name, factory)``.
        ``factory(config=..., vocab_size=...)`` returns a
        :class:`fdx.core.interfaces.GrammarBackend`; ``config`` is the
        :class:`fdx.config.EngineConfig` (``config.model`` names the
        tokenizer) and ``vocab_size`` the width of the model's logits.

    Return nothing.  Registering a name twice is an error naming both plugins.
    """


@hookspec
def fdx_register_speculators(register: Register) -> None:
    """Contribute speculative-decoding proposers, selected with
    ``--speculative NAME`` (``--num-speculative-tokens K``).

    A speculator proposes up to K draft tokens for a decoding request from
    the request's own tokens (``ngram``: prompt lookup); the model runner
    verifies them in the same forward pass, so a wrong draft costs time,
    never output.  Called once at start-up, in the engine process (and in
    ``fdx plugins``).  Must not import heavy libraries: that belongs in the
    factory.

    :param register: call ``register(name, factory)`` for each speculator.
        ``factory(config=...)`` must return a
        :class:`fdx.core.interfaces.Speculator`; ``config`` is the frozen
        :class:`fdx.config.EngineConfig` (``num_speculative_tokens``,
        ``prompt_lookup_min``, ``prompt_lookup_max``).

    Return nothing.  Registering a name twice is an error naming both plugins.
    """


@hookspec
def fdx_register_architectures(register: Register) -> None:
    """Contribute model architectures, picked by the checkpoint's
    architecture name (HF ``config.json`` ``architectures[0]``, GGUF
    ``general.architecture``); there is no flag.

    Called once, when the model runner opens a checkpoint (engine process),
    and in ``fdx plugins``.  Must not import Paddle.

    :param register: call ``register(name, factory)`` for each architecture.
        ``factory()`` takes no arguments and returns a
        frozen :class:`fdx.model.arch.Architecture` (a pure declaration of its HF and GGUF names,
        weight names, layer recipe and the config fields it understands).

    Return nothing.  Registering a name twice, or two architectures claiming
    the same HF or GGUF name, is an error naming both plugins.
    """


@hookspec
def fdx_register_deployments(register: Register) -> None:
    """Contribute deployments: how ``fdx serve`` lays out its processes
    (``--deployment NAME``; default ``single``, ``dp`` under ``--scheduler
    dp``, ``splitwise`` for ``--num-prefill``/``--num-decode``).

    Called once at start-up in the launcher and in the API process.

    :param register: call ``register(name, factory, description=...)``.
        ``factory(config=EngineConfig)`` returns a
        :class:`fdx.deploy.deployment.Deployment`: the engine processes to
        run, and the :class:`fdx.deploy.frontend.EngineFrontend` the API
        process reaches them through (or the whole foreground, ``run()``).

    Return nothing.  Registering a name twice is an error naming both plugins.
    """


@hookspec
def fdx_register_tool_parsers(register: Register) -> None:
    """Contribute tool-call parsers, selected with ``--tool-call-parser NAME``.

    A tool parser finds the tool calls in a chat completion's output text
    (``tool_choice`` ``auto``), streaming or not.  Called once at start-up,
    in the API-server process and in ``fdx plugins``.

    :param register: call ``register(name, factory)``.  ``factory(config=...)``
        returns a :class:`fdx.core.interfaces.ToolParser`; ``config`` is the
        :class:`fdx.config.EngineConfig`.

    Return nothing.  Registering a name twice is an error naming both plugins.
    """


# --------------------------------------------------------------------------
# Extension hooks
# --------------------------------------------------------------------------


@hookspec
def fdx_add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Add options to ``fdx serve`` (and ``fdx.LLM`` ignores them).

    Called once while the ``serve`` argument parser is built, before the
    command line is parsed.

    :param parser: the :class:`argparse.ArgumentParser` of ``fdx serve``.
        Add an option group; plugin options should start with the plugin's
        name to avoid clashes.

    Return nothing.  The parsed values are visible to
    :func:`fdx_adjust_config` as ``args``, and travel to every process in
    ``config.plugin_options`` (``dest`` -> value).
    """


@hookspec
def fdx_adjust_config(config: EngineConfig, args: argparse.Namespace | None) -> dict[str, Any] | None:
    """Adjust the engine config after the command line is parsed.

    Called once, in the front-end process, after the config is built and
    validated.

    :param config: the frozen :class:`fdx.config.EngineConfig`.
    :param args: the :class:`argparse.Namespace` (or ``None`` for ``fdx.LLM``).

    Return a dict of field overrides, or ``None`` for no change.  Not
    "first non-None wins": every non-``None`` result is applied, in
    registration order (the last one wins per field); the result is
    validated again.
    """


@hookspec
def fdx_add_routes(app: FastAPI, client: EngineFrontend) -> None:
    """Add HTTP routes to the OpenAI-compatible server.

    Called once, in the API-server process, after fdx's own routes exist.

    :param app: the :class:`fastapi.FastAPI` application.
    :param client: the deployment's :class:`fdx.deploy.frontend.EngineFrontend`, through which
        a route can submit requests or control calls to the engine.

    Return nothing.
    """


@hookspec
def fdx_request_added(request_id: str, num_prompt_tokens: int, params: SamplingParams, time: float) -> None:
    """A request was accepted and sent to the engine.

    Called in the front-end process once per request (per choice when
    ``n > 1``).

    :param request_id: the engine-level request id.
    :param num_prompt_tokens: prompt length in tokens.
    :param params: the :class:`fdx.core.messages.SamplingParams`.
    :param time: ``time.time()`` at arrival.

    Return nothing.
    """


@hookspec
def fdx_request_first_token(request_id: str, ttft: float) -> None:
    """A request received its first generated token.

    Called in the front-end process once per request.

    :param request_id: the engine-level request id.
    :param ttft: seconds from arrival to the first token.

    Return nothing.
    """


@hookspec
def fdx_request_finished(
    request_id: str, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int, e2e: float
) -> None:
    """A request finished normally (``stop`` or ``length``).

    Called in the front-end process once per request.

    :param request_id: the engine-level request id.
    :param finish_reason: ``"stop"`` or ``"length"``.
    :param num_prompt_tokens: prompt length in tokens.
    :param num_output_tokens: tokens generated.
    :param e2e: seconds from arrival to the last token.

    Return nothing.
    """


@hookspec
def fdx_request_aborted(request_id: str, reason: str, num_output_tokens: int) -> None:
    """A request ended without finishing: client disconnect, abort call,
    pause, engine error or engine death.

    Called in the front-end process once per request.

    :param request_id: the engine-level request id.
    :param reason: a short human-readable reason.
    :param num_output_tokens: tokens generated before it ended.

    Return nothing.
    """
