"""The HTTP front end's process: uvicorn and the FastAPI app over an AsyncEngine, whose engine
runs in the server's main process (engine_loop.py says why).

Started by :class:`tqattn.serve.server.Server` as ``python -m tqattn.serve.frontend SOCK CMD EV``:
the listening socket and the two pipe ends come as inherited file descriptors, and the first
message on the event pipe is the :class:`FrontendConfig` — a fresh interpreter, so that the
caller's main module is never imported again (as multiprocessing's spawn would).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


@dataclass
class FrontendConfig:
    model_name: str
    tokenizer: Any  # the engine's (pickled over to this process), or None
    max_model_len: int
    max_waiting_requests: int
    request_timeout: float | None
    log_level: str
    max_num_seqs: int | None = None  # the engine's running slots


def uvicorn_module():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        from ..extras import missing_extra

        raise missing_extra("the server", "serve", e) from e
    return uvicorn


def run_frontend(config: FrontendConfig, sock, commands, events) -> None:
    """The front end's main: serve on the listening socket until the engine's pipe ends or a
    signal (SIGINT / SIGTERM) stops uvicorn."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    uvicorn = uvicorn_module()
    from .async_engine import AsyncEngine
    from .routes import build_app

    engine = AsyncEngine(commands, events, config.tokenizer, config.max_model_len,
                         config.max_waiting_requests, max_num_seqs=config.max_num_seqs)
    app = build_app(engine, config.model_name, config.request_timeout)
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=5,
                                           lifespan="off"))
    engine.on_closed = lambda: setattr(server, "should_exit", True)
    engine.start()
    threading.Thread(target=_say_ready, args=(server, engine), daemon=True).start()
    server.run(sockets=[sock])


def _say_ready(server, engine) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    if server.started:
        try:
            engine._send(("ready",))
        except Exception:  # the server went away meanwhile: on_closed stops uvicorn
            pass


def main(argv: list[str]) -> None:
    sock_fd, commands_fd, events_fd = (int(a) for a in argv)
    sock = socket.socket(fileno=sock_fd)
    commands = Connection(commands_fd, readable=False)
    events = Connection(events_fd, writable=False)
    try:
        config = events.recv()
    except EOFError:  # the server went away before we started
        return
    run_frontend(config, sock, commands, events)


if __name__ == "__main__":
    main(sys.argv[1:])
