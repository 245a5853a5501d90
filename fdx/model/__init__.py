"""Model loading (GGUF / Hugging Face), the Paddle Llama forward and the
model runner.  Importing this package does not import Paddle; only
:mod:`fdx.model.runner` and :mod:`fdx.model.llama` do."""
