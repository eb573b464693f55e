"""Free ports for servers that another process binds later: a local cluster's Ray, a forward's
`ssh -L` or `kubectl port-forward`.

A port the kernel picked (bind to port 0) and that we let go is soon handed out again: the
kernel picks every process's port 0 binds and every outgoing connection's port from its
ephemeral range, and a Ray cluster alone binds dozens of them. CI saw a local head's
dashboard port taken by another test's server in the seconds between our pick and Ray's bind.
So ports are picked at random below that range (and above Ray's worker ports), where the
kernel never picks, each checked by binding it; only where there is no room there does the
kernel pick.

Standard library only, Python >= 3.8 (the probe picks its all_reduce's port on the nodes).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Iterable

#: Ray's default worker ports are 10002-19999: a port of ours there could be taken by a Ray worker.
WORKER_PORTS = range(10002, 20000)
PICK_FROM = WORKER_PORTS.stop
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the ports it picks (net.ipv4.ip_local_port_range), both ends in it."""
    try:
        low, high = map(int, EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _bind(sock: socket.socket, host: str, port: int) -> bool:
    try:
        sock.bind((host, port))
    except OSError:
        if not port:
            raise
        return False
    return True


def free_ports(count: int, host: str = "127.0.0.1", span: tuple[int, int] | None = None,
               avoid: Iterable[int] = ()) -> list[int]:
    """`count` distinct ports free on `host` ("": on every address), picked at random from `span`
    (from, to: to not included; default: above Ray's worker ports, below the ephemeral range),
    none of `avoid` (ports that something binds later, as a service does)."""
    start, stop = span or (PICK_FROM, ephemeral_range()[0])
    avoid = set(avoid)
    candidates = [port for port in range(start, stop) if port not in WORKER_PORTS and port not in avoid]
    random.shuffle(candidates)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            port = candidates.pop() if candidates else 0  # 0: no room left where the kernel never picks
            if not _bind(sock, host, port):
                sock.close()
                continue
            held.append(sock)  # held until every port is picked, so that none is picked twice
            port = sock.getsockname()[1]
            if port not in WORKER_PORTS and port not in avoid:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


def free_port(host: str = "127.0.0.1", span: tuple[int, int] | None = None) -> int:
    return free_ports(1, host, span)[0]
