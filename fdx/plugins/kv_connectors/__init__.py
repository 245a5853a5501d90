"""The KV connector plugins (``fdx_register_kv_connectors``, ``--kv-connector``)
of the splitwise scheduler: ``zmq`` (direct, instance to instance) and
``mooncake`` (through a Mooncake store)."""
