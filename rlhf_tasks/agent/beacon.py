"""The head's ready beacon and the waits on it: a tiny TCP server on the head that answers
"ready" once the head's GCS serves (and "done" once the run is over, so the workers leave at
once rather than after a silence), the probe a worker polls it with, and `reachable`, which
turns any such probe into a wait_for check.
"""

from __future__ import annotations

import json
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


#: What probe_ready returns when the head says the run is over: leave now.
RUN_OVER = "the head says the run is over"


def say_hello(host: str, port: int, hello: dict, timeout: float = 5.0) -> Optional[str]:
    """Announce this node on the head's beacon (after it answered "ready"); None when said."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            answer = sock.recv(16)
            if not answer.startswith(b"ready"):
                return "the beacon answered %r" % answer
            sock.sendall(b"hello " + json.dumps(hello).encode() + b"\n")
    except OSError as exc:
        return str(exc)
    return None


def probe_ready(host: str, port: int, timeout: float = 2.0) -> Optional[str]:
    """None when the head's ready beacon at host:port answers "ready", else why not
    (RUN_OVER when it answers "done")."""
    reason = probe_tcp(host, port, timeout)
    if reason is not None:
        return reason
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            answer = sock.recv(16)
    except OSError as exc:
        return "the ready beacon at %s:%s failed (%s)" % (host, port, exc)
    if answer.startswith(b"done"):
        return RUN_OVER
    return None if answer.startswith(b"ready") else "%s:%s is not a ready beacon" % (host, port)


class ReadyBeacon(object):
    """A tiny TCP server on the head that answers "ready" once the head's GCS serves.

    Workers join when it answers (their `ray start` has its CLI imported by then, see
    Node.prestart_ray), not on a port that might be anyone's, and leave when it says "done"
    (`done()`) or goes."""

    def __init__(self, host: str, port: int, on_hello: Optional[Callable[[dict], None]] = None):
        self.answer = b"ready\n"
        self.on_hello = on_hello  # a worker announcing itself after "ready": `hello {json}` (early.py)
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
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.sendall(self.answer)
            if self.on_hello is None:
                return
            conn.settimeout(5.0)
            data = b""
            while not data.endswith(b"\n") and len(data) < 1 << 20:
                chunk = conn.recv(65536)
                if not chunk:
                    break  # a plain probe: it closed after the answer
                data += chunk
            if data.startswith(b"hello "):
                self.on_hello(json.loads(data[6:].decode()))
        except (OSError, ValueError):
            pass
        finally:
            conn.close()

    def done(self) -> None:
        """The run is over: the workers that ask now leave at once (none joins any more)."""
        self.answer = b"done\n"

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
