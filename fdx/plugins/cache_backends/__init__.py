"""The cache-backend plugins (``fdx_register_cache_backends``,
``--cache-backend``); the KV storage tier that drives the chosen one is
engine machinery, :mod:`fdx.kv_storage`."""
