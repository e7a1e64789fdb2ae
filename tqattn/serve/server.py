"""The server: the engine in this process, the HTTP front end in a child process (frontend.py),
started in the background (tests, benchmarks, ``tqattn serve``) or run in the foreground."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from ..engine.llm_engine import LLMEngine, format_plan, format_startup
from .async_engine import check_max_waiting_requests
from .engine_loop import EngineLoop
from .frontend import FrontendConfig, uvicorn_module

logger = logging.getLogger("tqattn.serve")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); OSError if that fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


class Server:
    """An OpenAI-compatible server over one LLMEngine. ``port=0`` takes a free port (see ``url``).
    The socket is bound here (a taken port raises OSError at once), or passed in already bound
    (``sock``, from :func:`bind`: ``tqattn serve`` binds before the model loads); the front end
    process accepts on it."""

    def __init__(self, engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000,
                 served_model_name: str | None = None, max_waiting_requests: int = 256,
                 request_timeout: float | None = None, log_level: str = "info",
                 sock: socket.socket | None = None):
        uvicorn_module()
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds or None, got {request_timeout!r}")
        check_max_waiting_requests(max_waiting_requests)  # here: the front end's failure is later
        self.engine = engine
        self.model_name = served_model_name or engine.loaded.name
        self.host = host
        self._sock = sock if sock is not None else bind(host, port)
        self.port = self._sock.getsockname()[1]
        commands_r, commands_w = os.pipe()
        events_r, events_w = os.pipe()
        self.engine_loop = EngineLoop(engine, Connection(events_w, readable=False),
                                      Connection(commands_r, writable=False))
        self._config = FrontendConfig(self.model_name, engine.tokenizer,
                                      engine.scheduler.config.max_model_len, max_waiting_requests,
                                      request_timeout, log_level, engine.scheduler.config.max_num_seqs)
        self._child_fds = (self._sock.fileno(), commands_w, events_r)
        self._frontend: subprocess.Popen | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 120.0) -> Server:
        """Start the engine loop and the front end process; returns once it listens."""
        env = dict(os.environ)  # the child imports this tqattn, wherever it was imported from
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["CUDA_VISIBLE_DEVICES"] = ""  # the front end never touches a GPU
        try:
            # -P: nothing from the working directory shadows a module; a session of its own:
            # Ctrl-C reaches only this process, which stops the front end in order
            self._frontend = subprocess.Popen(
                [sys.executable, "-P", "-m", "tqattn.serve.frontend", *map(str, self._child_fds)],
                pass_fds=self._child_fds, env=env, start_new_session=True)
        finally:
            for fd in self._child_fds[1:]:  # the child has its own: end-of-file reaches us if it dies
                os.close(fd)
        # its first message (a pipe holds 64 KiB: the tokenizer waits there until the child reads)
        threading.Thread(target=self.engine_loop.send, args=(self._config,), daemon=True).start()
        self.engine_loop.start()
        deadline = time.monotonic() + timeout
        while not self.engine_loop.ready.wait(0.05):
            if self._frontend.poll() is not None or time.monotonic() > deadline:
                code = self._frontend.poll()
                self.stop()
                raise RuntimeError(f"the HTTP front end did not start on {self.host}:{self.port}"
                                   + (f" (it exited with code {code})" if code is not None else
                                      f" within {timeout} s"))
        self._sock.close()  # the front end holds its own copy
        return self

    def wait(self) -> int | None:
        """Block while the front end runs (until the server is stopped, or the front end exits
        on its own); its exit code."""
        return None if self._frontend is None else self._frontend.wait()

    def run(self) -> None:
        """Serve in the foreground until interrupted (Ctrl-C / SIGTERM)."""
        self.start()
        try:
            self.wait()
        finally:
            self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what still runs, stop the engine loop (the front end then exits) and wait for
        both, each up to ``timeout`` seconds; a front end that does not exit in time is killed."""
        if self._stopped:
            return
        self._stopped = True
        if not self.engine_loop.shutdown(timeout):  # blocked writing to a front end that does not read
            self._kill_frontend()
            self.engine_loop.shutdown(timeout)
        if self._frontend is None:
            for fd in self._child_fds[1:]:
                os.close(fd)
        else:
            try:
                self._frontend.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_frontend()
        self.engine_loop.close()
        self._sock.close()

    def _kill_frontend(self) -> None:
        if self._frontend is not None and self._frontend.poll() is None:
            logger.warning("the HTTP front end did not stop; killing it")
            self._frontend.kill()
            self._frontend.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def startup_message(server: Server) -> str:
    engine = server.engine
    startup = format_startup(engine.startup_times, engine.runner.compile_model, bool(engine.runner.graphs))
    return (f"{format_plan(engine.plan)}\nstart-up {startup}\nserving {server.model_name!r} (max_model_len "
            f"{engine.scheduler.config.max_model_len}) at {server.url}/v1")
