"""An architecture plugin for tests, as a third-party package would ship one:
``my-llama`` serves the HF architecture name ``MyLlamaForCausalLM`` with
fdx's llama declaration (a fine-tune that renamed its model class).

A real ``fdx serve`` finds it through :func:`write_entry_point` (a
``.dist-info`` with an ``fdx.plugins`` entry point on ``PYTHONPATH``).
"""

from __future__ import annotations


from fdx.core.hookspecs import Register, hookimpl


@hookimpl
def fdx_register_architectures(register: Register) -> None:
    def factory():  # heavy imports inside the factory, as the hook asks
        from fdx.plugins.architectures.builtin import LLAMA, renamed

        return renamed(LLAMA, "my-llama", "MyLlamaForCausalLM", "test: llama under another class name")

    register("my-llama", factory, description="test: MyLlamaForCausalLM (a renamed llama)")


def write_entry_point(directory: str) -> str:
    """A ``.dist-info`` in ``directory`` declaring this module as the
    ``fdx.plugins`` entry point ``my_llama``; returns the ``PYTHONPATH`` that finds both."""
    from serverutil import write_plugin_entry_point

    return write_plugin_entry_point(directory, "fdx-my-llama", "my_llama", "arch_plugin")
