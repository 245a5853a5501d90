"""The token-processor plugins (``fdx_register_token_processors``, ``--token-processor``)."""
