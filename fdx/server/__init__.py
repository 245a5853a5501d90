"""``fdx serve``: the OpenAI-compatible HTTP server.

Three processes: the launcher (:mod:`fdx.deploy.launcher`, foreground), the
API server (:mod:`fdx.server.api_proc`, FastAPI under uvicorn; tokenizes and
detokenizes) and the engine (:mod:`fdx.core.engine_proc`).  The API process
talks to the engine over ZMQ through :class:`fdx.deploy.engine_client.EngineClient`.
"""
