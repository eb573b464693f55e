"""The dashboard's ssh forward to a SkyPilot cluster's head, through the host entry SkyPilot writes for it
(~/.sky/generated/ssh/NAME): `launch` opens it for the run, `rlhf-tasks forward NAME` again later.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from ...errors import StepFailed
from ..base import end_process

#: How long the dashboard's ssh forward may take to be up: SkyPilot's ssh config for a cluster may go
#: through its API server and the site (on Slurm: a websocket proxy, ssh to the login node, then
#: `srun --overlap ... sshd -i` in the cluster's job).
FORWARD_TIMEOUT_S = 120


def listening(port: int) -> bool:
    """Whether something on this machine already listens on 127.0.0.1:port (ssh -L could not bind it)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def log_tail(path: Path, chars: int = 600) -> str:
    try:
        return " ".join(path.read_text(errors="replace").split())[-chars:]
    except FileNotFoundError:
        return ""


def open_forward(name: str, local: int, remote: int, log: Path, timeout: float = FORWARD_TIMEOUT_S) -> subprocess.Popen:
    """`ssh -N -L LOCAL:127.0.0.1:REMOTE NAME`, SkyPilot's host entry for the cluster's head (on Slurm its
    ProxyCommand is SkyPilot's websocket proxy through its API server, which runs `srun --overlap ...
    sshd -i` on the head node in the cluster's job), returned once ssh holds the local port. A forward
    that fails (ssh exits, or holds no port within `timeout`) is a StepFailed saying what ssh said."""
    argv = ["ssh", "-N", "-o", "ExitOnForwardFailure=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
            "-o", "ServerAliveInterval=15", "-o", "ConnectTimeout=30", "-L", f"{local}:127.0.0.1:{remote}", name]
    what = f"forwarding the dashboard of {name} ({' '.join(argv)})"
    if listening(local):
        raise StepFailed(what, f"127.0.0.1:{local} is taken on this machine (`rlhf-tasks forward {name} --port N` "
                               f"picks another)")
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while not listening(local):
        if proc.poll() is not None:
            raise StepFailed(what, f"ssh exited with code {proc.returncode}: {log_tail(log) or 'no output'} "
                                   f"(SkyPilot's ssh config for the cluster: ~/.sky/generated/ssh/{name}; `ssh {name}` "
                                   f"tries it)")
        if time.monotonic() > deadline:
            end_process(proc)
            raise StepFailed(what, f"no forward after {timeout:.0f}s: {log_tail(log) or 'ssh said nothing'}")
        time.sleep(0.2)
    return proc
