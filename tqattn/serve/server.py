"""Run the app with uvicorn: in the foreground (``tqattn serve``) or in a thread (tests, benchmarks)."""

from __future__ import annotations

import logging
import threading
import time

from ..engine.llm_engine import LLMEngine, format_plan, format_startup
from .async_engine import AsyncEngine
from .routes import build_app

logger = logging.getLogger("tqattn.serve")


def _uvicorn():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ImportError(f"the server needs FastAPI and uvicorn ({e.name} is missing); install them "
                          f"with: pip install -e \".[serve]\" (or pip install fastapi uvicorn)") from e
    return uvicorn


class Server:
    """An OpenAI-compatible server over one LLMEngine. ``port=0`` takes a free port (see ``url``)."""

    def __init__(self, engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000,
                 served_model_name: str | None = None, max_waiting_requests: int = 256,
                 request_timeout: float | None = None, log_level: str = "info"):
        uvicorn = _uvicorn()
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds or None, got {request_timeout!r}")
        self.model_name = served_model_name or engine.loaded.name
        self.async_engine = AsyncEngine(engine, max_waiting_requests)
        self.app = build_app(self.async_engine, self.model_name, request_timeout)
        config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=5, lifespan="off")
        self.uvicorn = uvicorn.Server(config)
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.uvicorn.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve in the foreground until interrupted (Ctrl-C / SIGTERM)."""
        self.async_engine.start()
        try:
            self.uvicorn.run()
        finally:
            self.async_engine.shutdown()

    def start(self, timeout: float = 30.0) -> Server:
        """Serve from a background thread; returns once the socket is listening."""
        self.async_engine.start()
        self._thread = threading.Thread(target=self.uvicorn.run, name="tqattn-http", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"the server did not start on {self.host}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.async_engine.shutdown()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def startup_message(server: Server) -> str:
    engine = server.async_engine.engine
    startup = format_startup(engine.startup_times, engine.runner.compile_model, bool(engine.runner.graphs))
    return (f"{format_plan(engine.plan)}\nstart-up {startup}\nserving {server.model_name!r} (max_model_len "
            f"{engine.scheduler.config.max_model_len}) at {server.url}/v1")
