"""Tool-call parsers: the ``fdx_register_tool_parsers`` plugin kind, selected
with ``--tool-call-parser``; ``hermes`` is built in."""
