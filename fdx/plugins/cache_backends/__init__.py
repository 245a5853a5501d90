"""The cache-backend plugins (``fdx_register_cache_backends``,
``--cache-backend``) and the KV storage tier that drives the chosen one
(:mod:`fdx.plugins.cache_backends.kv_storage`)."""
