"""``python -m fdx`` == the ``fdx`` command."""

from fdx.cli import entry

entry()
