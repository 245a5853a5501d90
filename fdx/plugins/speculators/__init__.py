"""Speculative-decoding proposers (``fdx_register_speculators``)."""
