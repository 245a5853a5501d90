"""An architecture plugin for tests, as a third-party package would ship one:
``my-llama`` serves the HF architecture name ``MyLlamaForCausalLM`` with
fdx's llama declaration (a fine-tune that renamed its model class).

A real ``fdx serve`` finds it through :func:`write_entry_point` (a
``.dist-info`` with an ``fdx.plugins`` entry point on ``PYTHONPATH``).
"""

from __future__ import annotations

import os

from fdx.core.hookspecs import Register, hookimpl


@hookimpl
def fdx_register_architectures(register: Register) -> None:
    def factory():  # heavy imports inside the factory, as the hook asks
        from fdx.plugins.architectures.builtin import LLAMA, renamed

        return renamed(LLAMA, "my-llama", "MyLlamaForCausalLM", "test: llama under another class name")

    register("my-llama", factory, description="test: MyLlamaForCausalLM (a renamed llama)")


def write_entry_point(directory: str) -> str:
    """Write a ``.dist-info`` declaring this module as the ``fdx.plugins``
    entry point ``my_llama``; returns the ``PYTHONPATH`` that finds both."""
    info = os.path.join(directory, "fdx_my_llama-0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: fdx-my-llama\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[fdx.plugins]\nmy_llama = arch_plugin\n")
    here = os.path.dirname(os.path.abspath(__file__))
    return os.pathsep.join(p for p in (directory, here, os.environ.get("PYTHONPATH", "")) if p)
