"""OpenAI-compatible HTTP server (``tqattn serve``): async engine loop, protocol, routes, metrics.

Needs the ``serve`` extra (FastAPI + uvicorn); nothing here is imported by ``import tqattn``.
"""
