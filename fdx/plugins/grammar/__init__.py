"""Grammar backends (structured outputs): the ``fdx_register_grammar_backends``
plugin kind, selected with ``--grammar-backend``; ``llguidance`` is built in."""
