"""Architecture plugins (``fdx_register_architectures``), picked by the
checkpoint's architecture name (HF ``architectures[0]``, GGUF
``general.architecture``).  Each contributes a :class:`fdx.model.arch.Architecture`."""
