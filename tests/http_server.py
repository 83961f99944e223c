"""An app served over real HTTP on a free loopback port, in a thread, for the tests that talk to it."""

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import uvicorn
from ports import free_port


@contextmanager
def serving(app, ready_s: float = 60.0) -> Iterator[str]:
    """Run ``app`` until the block ends; yields its URL once ``/readyz`` answers 200."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + ready_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
