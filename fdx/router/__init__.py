"""``fdx router``: the OpenAI-compatible front end of a splitwise (prefill/decode) topology.

* :mod:`fdx.router.instances`: the P and D instances behind the router (their
  ``/v1/splitwise/info``, up/down by health probe, in-flight load) and how
  one is picked for a request.
* :mod:`fdx.router.proxy`: the byte passthrough of one request to an
  instance (SSE relayed unchanged, client disconnect closes the upstream
  connection, a dead instance becomes an error envelope or error event).
* :mod:`fdx.router.app`: the FastAPI app (``/v1/completions``,
  ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``).
* :mod:`fdx.router.metrics`: the router's own counters and each instance's
  series re-labelled with ``instance`` and ``role``.
* :mod:`fdx.router.main`: the ``fdx router`` command line and its config.
* :mod:`fdx.router.topology`: ``fdx serve --scheduler splitwise --num-prefill
  N --num-decode M``: P, D and the router as managed children.
"""
