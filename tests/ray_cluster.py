"""Ray clusters a test starts itself (``ray start``, each node in its own temp dir, every port it opens a free one),
and stopping only those: ``ray stop`` would stop every cluster on the machine."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ports import free_port

RAY = str(Path(sys.executable).with_name("ray"))
REPO = Path(__file__).resolve().parent.parent
# A throwaway cluster: no token authentication (its token would have to reach every client), workers at normal
# priority and able to import thinkpool, and a dead node noticed within about two seconds.
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
       "RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
       "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}


def processes_under(temp_dir: Path) -> list[int]:
    """Process ids of a node or cluster started with ``temp_dir``: those whose command line names it, and their
    descendants (Ray's worker processes rename themselves ``ray::...``)."""
    parents: dict[int, int] = {}
    named = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if str(temp_dir) in command:
            named.append(int(entry.name))
    found = set(named)
    while True:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        if not children:
            return sorted(found)
        found |= children


def stop_cluster(temp_dir: Path, grace_s: float = 3.0) -> None:
    """SIGTERM the cluster's processes, then SIGKILL what is left after ``grace_s`` (a head's GCS can take 10 s to
    exit on SIGTERM; a throwaway cluster needs no graceful end)."""
    seen = set(processes_under(temp_dir))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        seen |= set(processes_under(temp_dir))
        signal_all(seen, sig)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(running(pid) for pid in seen):
            time.sleep(0.2)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (an exited one its parent has not reaped yet is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_node(temp_dir: Path) -> list[int]:
    """SIGKILL every process of a node at once, as a crash or a pulled plug would; returns their ids."""
    pids = processes_under(temp_dir)
    signal_all(pids, signal.SIGKILL)
    return pids


def signal_all(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def ray_start(temp_dir: Path, *args: str, resources: dict | None = None, num_cpus: float = 1) -> None:
    """``ray start`` one node in ``temp_dir``, every port it opens a free one."""
    ports = [f"--{name}={free_port()}" for name in ("node-manager-port", "object-manager-port", "metrics-export-port",
                                                  "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                  "runtime-env-agent-port")]
    command = [RAY, "start", *args, *ports, "--min-worker-port=0", "--max-worker-port=0",
               f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources or {})}", f"--temp-dir={temp_dir}",
               "--disable-usage-stats"]
    started = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=180, cwd=REPO)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]


def start_head(temp_dir: Path, resources: dict | None = None, num_cpus: float = 1) -> str:
    """A head node (no dashboard); returns its GCS address."""
    port = free_port()
    ray_start(temp_dir, "--head", f"--port={port}", "--include-dashboard=false", f"--dashboard-port={free_port()}",
              f"--ray-client-server-port={free_port()}", resources=resources, num_cpus=num_cpus)
    return f"127.0.0.1:{port}"


def start_node(address: str, temp_dir: Path, resources: dict | None = None, num_cpus: float = 1) -> None:
    """A node joining the cluster at ``address``."""
    ray_start(temp_dir, f"--address={address}", resources=resources, num_cpus=num_cpus)
