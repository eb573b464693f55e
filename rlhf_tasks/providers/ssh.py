"""The ssh tunnel providers share: `ssh -N -L` from this machine to a node's SSH endpoint,
which carries the head's dashboard to a local port (RunPod's `submit: client` and
`rlhf-tasks forward NAME` today), kept up while the node's sshd is not yet there."""

from __future__ import annotations

import atexit
import subprocess
import threading
import time
from pathlib import Path

from ..errors import StepFailed
from ..agent.protocol.ports import free_port
from .base import end_process


def ssh_argv(direct: dict, local_port: int, remote_port: int) -> list[str]:
    """`ssh -N -L` to a pod's direct SSH endpoint. Pods are short-lived with new host keys, so
    they are not checked nor kept (RunPod's own advice); your keys come from your ssh setup."""
    return ["ssh", "-N", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ServerAliveInterval=15",
            "-o", "ConnectTimeout=10", "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}",
            "-p", str(direct["port"]), f"{direct['username']}@{direct['host']}"]


class SshTunnel:
    """`ssh -L` to the head pod, started again while it fails to connect (the pod's sshd may
    come up after the pod is RUNNING); a refused key is a failure at once."""

    def __init__(self, direct: dict, remote_port: int, log: Path):
        self.direct, self.remote_port, self.log = direct, remote_port, log
        self.local_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.failures = 0
        self.reported = 0.0

    def start(self) -> None:
        self._spawn()
        threading.Thread(target=self._keep, name="runpod-ssh-tunnel", daemon=True).start()
        atexit.register(self.close)

    def _spawn(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(ssh_argv(self.direct, self.local_port, self.remote_port),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def _keep(self) -> None:
        while not self.closed.wait(1.0):
            with self.lock:
                if not self.closed.is_set() and self.proc is not None and self.proc.poll() is not None:
                    self.failures += 1
                    self._spawn()

    def tend(self) -> list[str]:
        """For the launcher's waits: a refused key ends the launch; other failures are reported."""
        try:
            said = self.log.read_text(errors="replace")
        except OSError:
            said = ""
        if "Permission denied" in said:
            raise StepFailed("forwarding the dashboard through ssh", f"ssh {self.direct['username']}@"
                             f"{self.direct['host']} -p {self.direct['port']}: Permission denied (publickey): the pod "
                             f"has your RunPod account's SSH keys (startSsh); use the matching private key "
                             f"(ssh-agent or ~/.ssh/config)")
        if self.failures and time.monotonic() - self.reported > 15:
            self.reported = time.monotonic()
            last = [line for line in said.splitlines() if line.strip()][-1:] or ["no message"]
            return [f"ssh tunnel to the head: {self.failures} attempt(s) failed so far (last: {last[0]}); retrying"]
        return []

    def close(self) -> None:
        with self.lock:
            self.closed.set()
        end_process(self.proc)
