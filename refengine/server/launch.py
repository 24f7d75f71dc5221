"""Starting the server: in the foreground (``python -m pagedbench.refengine serve``) or on a thread of
this process (tests, the overhead bench), bound to a port and stopped cleanly either way.

Stopping aborts every request (their streams end), stops uvicorn, then the engine thread.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from pagedbench.refengine.engine.async_llm import AsyncLLM
from pagedbench.refengine.engine.llm import LLM
from pagedbench.refengine.server.app import build_app


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class RunningServer:
    """A server on a thread: ``url`` is its base (``http://host:port``)."""

    url: str
    engine: AsyncLLM
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.engine.shutdown(timeout_s)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _config(llm: LLM, engine: AsyncLLM, *, model_name: str, model_folder: str | None, host: str, port: int,
            log_level: str) -> uvicorn.Config:
    app = build_app(engine, model_name=model_name, model_folder=model_folder)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off",
                          timeout_graceful_shutdown=2)


def start_in_thread(llm: LLM, *, model_name: str, model_folder: str | None = None, host: str = "127.0.0.1",
                    port: int | None = None, log_level: str = "warning", startup_timeout_s: float = 30.0
                    ) -> RunningServer:
    """Serve ``llm`` on a background thread; returns once the port accepts connections."""
    engine = AsyncLLM(llm).start()
    port = free_port(host) if port is None else port
    server = uvicorn.Server(_config(llm, engine, model_name=model_name, model_folder=model_folder, host=host,
                                    port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="pagedbench-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            engine.shutdown()
            raise RuntimeError(f"the server did not start on {host}:{port} within {startup_timeout_s} s")
        time.sleep(0.01)
    return RunningServer(f"http://{host}:{port}", engine, server, thread)


class _AnnouncingServer(uvicorn.Server):
    """Says once, whatever the log level, where it listens: a user's cue that requests can be sent."""

    def __init__(self, config, *, model_name: str) -> None:
        super().__init__(config)
        self.model_name = model_name

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(f"ready on http://{self.config.host}:{self.config.port} (model {self.model_name!r}; "
                  "Ctrl-C stops)", flush=True)


def serve_forever(llm: LLM, *, model_name: str, model_folder: str | None, host: str, port: int,
                  log_level: str = "info") -> None:
    """Serve ``llm`` in the foreground until interrupted (Ctrl-C: requests aborted, engine stopped)."""
    engine = AsyncLLM(llm).start()
    try:
        _AnnouncingServer(_config(llm, engine, model_name=model_name, model_folder=model_folder, host=host,
                                  port=port, log_level=log_level), model_name=model_name).run()
    finally:
        engine.shutdown()
