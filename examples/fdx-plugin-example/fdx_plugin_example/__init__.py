"""An example third-party fdx plugin.

Registers, through the same hooks fdx's built-ins use:

* scheduler ``serial``: one request at a time, first come first served;
* token processor ``upper``: the default token processor, upper-cased.
"""

from __future__ import annotations

from fdx.core.hookspecs import hookimpl


@hookimpl
def fdx_register_schedulers(register):  # type: ignore[no-untyped-def]
    def factory(config, kv):  # type: ignore[no-untyped-def]
        from fdx_plugin_example.serial import SerialScheduler

        return SerialScheduler(config, kv)

    register("serial", factory, description="one request at a time, FIFO (example plugin)")


@hookimpl
def fdx_register_token_processors(register):  # type: ignore[no-untyped-def]
    def factory(tokenizer, config=None):  # type: ignore[no-untyped-def]
        from fdx_plugin_example.upper import UpperTokenProcessor

        return UpperTokenProcessor(tokenizer, config)

    register("upper", factory, description="upper-cases generated text (example plugin)")


# ---------------------------------------------------------------------------
# Extension hooks: a CLI option, a route, and request life-cycle counters.
# They run in the API-server process.
# ---------------------------------------------------------------------------

EVENTS: dict[str, int] = {"added": 0, "first_token": 0, "finished": 0, "aborted": 0}


@hookimpl
def fdx_add_cli_options(parser):  # type: ignore[no-untyped-def]
    group = parser.add_argument_group("fdx-plugin-example")
    group.add_argument("--example-greeting", default=None, help="text returned by GET /example/events")


@hookimpl
def fdx_adjust_config(config, args):  # type: ignore[no-untyped-def]
    """Ask for a larger logprobs limit whenever the example greeting is set."""
    if config.plugin_options.get("example_greeting"):
        return {"max_logprobs": max(config.max_logprobs, 5)}
    return None


@hookimpl
def fdx_add_routes(app, client):  # type: ignore[no-untyped-def]
    @app.get("/example/events")
    def events() -> dict:  # type: ignore[type-arg]
        return {"greeting": client.config.plugin_options.get("example_greeting", "hello"), **EVENTS}


@hookimpl
def fdx_request_added(request_id, num_prompt_tokens, params, time):  # type: ignore[no-untyped-def]
    EVENTS["added"] += 1


@hookimpl
def fdx_request_first_token(request_id, ttft):  # type: ignore[no-untyped-def]
    EVENTS["first_token"] += 1


@hookimpl
def fdx_request_finished(request_id, finish_reason, num_prompt_tokens, num_output_tokens, e2e):  # type: ignore[no-untyped-def]
    EVENTS["finished"] += 1


@hookimpl
def fdx_request_aborted(request_id, reason, num_output_tokens):  # type: ignore[no-untyped-def]
    EVENTS["aborted"] += 1
