"""The head's ready beacon and the waits on it: a tiny TCP server on the head that answers
"ready" once the head's GCS serves, the probe a worker polls it with, and `reachable`,
which turns any such probe into a wait_for check.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable, Optional, Tuple

from .protocol import probe_tcp


def reachable(probe: Callable[..., Optional[str]], *args) -> Callable[[], Tuple[bool, object]]:
    """A wait_for check from a probe that returns None when ready, else the reason why not."""
    def check():
        reason = probe(*args)
        return reason is None, reason
    return check


def probe_ready(host: str, port: int, timeout: float = 2.0) -> Optional[str]:
    """None when the head's ready beacon at host:port answers "ready", else why not."""
    reason = probe_tcp(host, port, timeout)
    if reason is not None:
        return reason
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            answer = sock.recv(16)
    except OSError as exc:
        return "the ready beacon at %s:%s failed (%s)" % (host, port, exc)
    return None if answer.startswith(b"ready") else "%s:%s is not a ready beacon" % (host, port)


class ReadyBeacon(object):
    """A tiny TCP server on the head that answers "ready" once the head's GCS serves.

    Workers join when it answers (their `ray start` has its CLI imported by then, see
    Node.prestart_ray), not on a port that might be anyone's, and leave when it goes."""

    def __init__(self, host: str, port: int):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        threading.Thread(target=self._serve, name="ready-beacon", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            try:
                conn.sendall(b"ready\n")
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
