"""Benchmarks of a running server (``fdx bench serve``, ``fdx bench plot``).

Nothing here imports Paddle: the tools measure any OpenAI-compatible server
over HTTP.  Entry points: :func:`fdx.bench.serve.main` and
:func:`fdx.bench.plot.main` (``argv`` without the program name -> exit code).
"""
