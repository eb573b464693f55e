"""Free ports for servers another process binds later (a local cluster's Ray, a forward, the
probe's all_reduce), picked at random below the kernel's ephemeral range, where it never picks
a port itself: one it picked and we let go was taken by another server before Ray bound it.
Standard library only, Python >= 3.8.
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
_GIVEN = set()  # type: set  (handed out by this process, maybe not bound yet: never again)


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
    avoid = set(avoid) | _GIVEN
    candidates = [port for port in range(start, stop) if port not in WORKER_PORTS and port not in avoid]
    random.SystemRandom().shuffle(candidates)  # not `random`, which a job may seed (and a SystemRandom does not pickle)
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
    _GIVEN.update(ports)
    return ports


def free_port(host: str = "127.0.0.1", span: tuple[int, int] | None = None) -> int:
    return free_ports(1, host, span)[0]
