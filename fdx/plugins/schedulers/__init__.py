"""The scheduler plugins (``fdx_register_schedulers``, ``--scheduler``): v0 and v1."""
