"""Model-runner plugins (``fdx_register_model_runners``), chosen with ``--model-runner``."""
