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
