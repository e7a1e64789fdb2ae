"""OpenAI-compatible HTTP server (``tqattn serve``): the engine loop, the HTTP front
end's process, protocol, routes, metrics.

Needs the ``serve`` extra (FastAPI + uvicorn); nothing here is imported by ``import tqattn``.
"""
