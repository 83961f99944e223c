"""Stopping only the Ray cluster a test started: ``ray stop`` would stop every cluster on the machine."""

import os
import signal
import time
from pathlib import Path


def processes_under(temp_dir: Path) -> list[int]:
    """Process ids whose command line names ``temp_dir`` (every process of a cluster started with it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(temp_dir) in command:
            found.append(int(entry.name))
    return found


def stop_cluster(temp_dir: Path, grace_s: float = 10.0) -> None:
    """SIGTERM the cluster's processes, then SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_under(temp_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while time.time() < deadline and processes_under(temp_dir):
            time.sleep(0.2)
