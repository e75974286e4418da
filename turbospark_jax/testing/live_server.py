"""A server running on localhost in a background thread, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from turbospark_jax.errors import TurbosparkError
from turbospark_jax.server.build import Server

__all__ = ["free_port", "running"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(server: Server, *, timeout: float = 30.0) -> Iterator[str]:
    """Start ``server`` (engine and uvicorn) on a free port; yield its base URL
    (``http://127.0.0.1:PORT``); stop both on exit.

    Raises:
      TurbosparkError: uvicorn did not start listening within ``timeout`` seconds.
    """
    import uvicorn

    port = free_port()
    config = uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off")
    web = uvicorn.Server(config)
    server.engine.start()
    thread = threading.Thread(target=web.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not web.started:
        if time.monotonic() > deadline or not thread.is_alive():
            web.should_exit = True
            server.engine.stop()
            raise TurbosparkError(f"the server did not start on port {port}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        web.should_exit = True
        thread.join(timeout=10)
        server.engine.stop()
