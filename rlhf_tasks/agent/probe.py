"""Preflight's probe: the actor the preflight job pins to each node. It runs in a Ray worker
there, so it sees the environment the job's tasks get on that node, and reports its
versions and the interface and address Gloo and NCCL pick there; it listens, connects and
streams for the reach and bandwidth checks, runs the torch.distributed all_reduce, and the
doctor's checks (services, checkpoint directory, disk).

Preflight sends NodeProbe (and the agent's modules it uses) to the workers by value
(preflight.ship_by_value): a worker's own sys.path starts with the job's working_dir, where
another `rlhf_tasks` could be. Standard library at import; ray and torch only inside.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

from .contract import iface_address, interface_names, interface_of
from .protocol.ports import free_port

MiB = 1 << 20


def collective_endpoint(variable: str, env: Dict[str, str], default_address: Optional[str]) -> dict:
    """The interface and address a collective library picks on this node from `variable`
    (GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME): a comma-separated list whose first entry
    counts here; NCCL also takes a prefix, `=exact` and `^excluded`. Unset, Gloo uses the
    address of the hostname (`default_address`)."""
    value = env.get(variable) or None
    out = {"variable": variable, "value": value, "iface": None, "address": None, "problem": None}
    if value is None:
        out["address"] = default_address
        return out
    first = value.split(",")[0].strip()
    if first.startswith("^"):  # which interfaces remain is the library's choice: not checked here
        out["iface"] = value
        return out
    exact = first.startswith("=") or variable.startswith("GLOO")
    name = first.lstrip("=")
    names = interface_names()
    candidates = [name] if name in names else [] if exact else [n for n in names if n.startswith(name)]
    picked = next((n for n in candidates if iface_address(n)), None)
    if picked is None:
        out["iface"] = name
        out["problem"] = ("%s=%s: %s on this node (it has: %s)" % (
            variable, value, "no such interface" if not candidates else "the interface has no IPv4 address",
            ", ".join(names)))
        return out
    out["iface"], out["address"] = picked, iface_address(picked)
    return out


# ======================================================================================
# Small stdlib clients the actors use.
# ======================================================================================

def _connect(source: Optional[str], address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection from `source` (this node's collective address), as Gloo and NCCL make them."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        if source:
            sock.bind((source, 0))
        sock.connect((address, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise OSError("the connection closed early")
        data += chunk
    return data


def _why(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _http_ok(url: str, method: str, body) -> Optional[str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return None if response.status < 400 else "HTTP %d" % response.status
    except urllib.error.HTTPError as exc:
        return "HTTP %d from %s %s" % (exc.code, method, url)
    except (urllib.error.URLError, OSError) as exc:
        return "no answer from %s %s (%s)" % (method, url, _why(getattr(exc, "reason", exc)))


# ======================================================================================
# The actor pinned to each node.
# ======================================================================================

class NodeProbe(object):
    """Runs in a Ray worker on one node: sees the environment the job's tasks get there."""

    def __init__(self, import_torch: bool = True):
        self.token = "%s-%s" % (socket.gethostname(), os.getpid())
        self.torch = None
        self.torch_error = None if import_torch else "not checked: the job does not use torch"
        self._torch_import = threading.Thread(target=self._import_torch if import_torch else lambda: None, daemon=True)
        self._torch_import.start()  # overlaps the interface checks (importing torch takes seconds)

    def _import_torch(self) -> None:
        try:
            import torch
            self.torch = torch
        except Exception as exc:  # not installed, or broken: either way no torch here
            self.torch_error = "%s: %s" % (type(exc).__name__, exc)

    def info(self) -> dict:
        import ray

        env = os.environ
        hostname = socket.gethostname()
        try:
            host_address = socket.gethostbyname(hostname)
        except OSError:
            host_address = None
        address = ray.util.get_node_ip_address()
        return {"hostname": hostname, "address": address, "token": self.token,
                "rank": env.get("RLHF_TASKS_NODE_RANK"), "node_addr": env.get("RLHF_TASKS_NODE_ADDR"),
                "head_addr": env.get("RLHF_TASKS_HEAD_ADDR"),
                "python": platform.python_version(), "ray": ray.__version__,
                "gloo_if": collective_endpoint("GLOO_SOCKET_IFNAME", env, host_address),
                "nccl_if": collective_endpoint("NCCL_SOCKET_IFNAME", env, None),
                "iface_of_address": interface_of(address)}

    # ---------------------------------------------------------------- TCP: reach and streams

    def listen(self, addresses: List[str]) -> Dict[str, int]:
        """Listen on each address (port picked free); answers reach probes and streams."""
        ports = {}
        for address in addresses:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((address, 0))
            server.listen(64)
            threading.Thread(target=self._serve, args=(server,), daemon=True).start()
            ports[address] = server.getsockname()[1]
        return ports

    def _serve(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(120)
            kind = conn.recv(1)
            if kind == b"R":
                conn.sendall(self.token.encode() + b"\n")
            elif kind == b"S":
                buffer, received = bytearray(MiB), 0
                while True:
                    count = conn.recv_into(buffer)
                    if not count:
                        break
                    received += count
                conn.sendall(struct.pack("!Q", received))
        except OSError:
            pass
        finally:
            conn.close()

    def reach(self, targets: List[list], timeout: float) -> Dict[str, Optional[str]]:
        """For each [key, address, port, token, source]: None when address:port, connected to
        from this node's `source` address, answers with that token; else why not."""
        results = {}  # type: Dict[str, Optional[str]]

        def one(key, address, port, token, source):
            try:
                sock = _connect(source, address, port, timeout)
            except Exception as exc:
                results[key] = "connecting from %s to %s:%s failed (%s)" % (source or "this node", address, port, _why(exc))
                return
            try:
                sock.sendall(b"R")
                answer = b""
                while not answer.endswith(b"\n"):
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    answer += chunk
                results[key] = None if answer.strip().decode(errors="replace") == token else (
                    "%s:%s answered, but it is not the preflight of that node (something else listens there)"
                    % (address, port))
            except Exception as exc:
                results[key] = "no answer from %s:%s (%s)" % (address, port, _why(exc))
            finally:
                sock.close()

        threads = [threading.Thread(target=one, args=tuple(target), daemon=True) for target in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout + 2)
        return {t[0]: results.get(t[0], "no answer within %.0fs" % timeout) for t in targets}

    def stream(self, source: Optional[str], address: str, port: int, budget_s: float, max_bytes: int,
               timeout: float) -> dict:
        """Send for about `budget_s` (at most `max_bytes`); bits per second as the receiver counted them."""
        try:
            chunk = bytes(MiB)
            sock = _connect(source, address, port, timeout)
            try:
                sock.sendall(b"S")
                start, sent = time.perf_counter(), 0
                while sent < max_bytes and time.perf_counter() - start < budget_s:
                    sock.sendall(chunk)
                    sent += len(chunk)
                sock.shutdown(socket.SHUT_WR)
                received = struct.unpack("!Q", _recv_exact(sock, 8))[0]
                seconds = time.perf_counter() - start
            finally:
                sock.close()
            return {"bytes": received, "seconds": seconds, "bits_per_s": received * 8 / max(seconds, 1e-9)}
        except Exception as exc:
            return {"error": "streaming to %s:%s: %s" % (address, port, _why(exc))}

    # ---------------------------------------------------------------- torch

    def torch_info(self, timeout: float) -> dict:
        self._torch_import.join(timeout)
        if self._torch_import.is_alive():
            return {"error": "importing torch took longer than %.0fs" % timeout}
        torch = self.torch
        if torch is None:
            return {"torch": None, "why": self.torch_error}
        out = {"torch": torch.__version__, "cuda": torch.version.cuda, "rocm": getattr(torch.version, "hip", None),
               "nccl": None, "cuda_devices": 0}
        try:
            version = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        except Exception:
            pass
        try:
            out["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:
            pass
        return out

    def free_port(self) -> int:
        return free_port(host="")

    def allreduce(self, backend: str, master: str, port: int, rank: int, world: int, sizes: List[int],
                  budget_s: float, timeout: float) -> dict:
        """Bus bandwidth per size of a torch.distributed all_reduce. Every decision (more
        iterations, a larger size) uses values all-reduced with MAX, so every rank takes it."""
        try:
            import datetime

            import torch
            import torch.distributed as dist

            if backend == "gloo":  # connect only to the peers the ring uses, not all n-1 (torch >= 2.7; older ignore it)
                os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
            dist.init_process_group(backend, init_method="tcp://%s:%d" % (master, port), rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
            device = "cpu"
            if backend == "nccl":
                torch.cuda.set_device(0)
                device = "cuda"

            def timed(tensor):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                if device == "cuda":
                    torch.cuda.synchronize()
                return time.perf_counter() - start

            def slowest(seconds):
                value = torch.tensor([seconds], dtype=torch.float64, device=device)
                dist.all_reduce(value, op=dist.ReduceOp.MAX)
                return float(value.item())

            timed(torch.ones(256, device=device))  # connections up
            results = []
            for size in sizes:
                tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
                first = slowest(timed(tensor))
                times = [first]
                if first * 3 <= budget_s:
                    times += [timed(tensor), timed(tensor)]
                seconds = slowest(sorted(times)[len(times) // 2])
                results.append({"bytes": size, "seconds": seconds,
                                "bus_bits_per_s": size * 8 * 2 * (world - 1) / world / max(seconds, 1e-9)})
                del tensor
                if seconds * 4 > budget_s:  # the next size is 4x larger
                    break
            dist.destroy_process_group()
            return {"sizes": results}
        except Exception as exc:
            return {"error": "%s: %s" % (type(exc).__name__, exc)}

    # ---------------------------------------------------------------- doctor checks

    def service_ready(self, service: dict) -> Optional[str]:
        env = os.environ

        def fill(text):
            text = (text.replace("{node_addr}", env.get("RLHF_TASKS_NODE_ADDR", ""))
                    .replace("{head_addr}", env.get("RLHF_TASKS_HEAD_ADDR", "")))
            return text.replace("{group}", env["RLHF_TASKS_GROUP"]) if env.get("RLHF_TASKS_GROUP") else text
        ready = service.get("ready") or {}
        if ready.get("http"):
            return _http_ok(fill(ready["http"]), ready.get("method", "GET"), ready.get("json"))
        if ready.get("tcp"):
            host = fill(ready.get("host", "{node_addr}"))
            try:
                _connect(None, host, int(ready["tcp"]), 5).close()
                return None
            except Exception as exc:
                return "no connection to %s:%s (%s)" % (host, ready["tcp"], _why(exc))
        return None

    def write_marker(self, directory: str, name: str) -> Optional[str]:
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, name), "w") as handle:
                handle.write(name)
            return None
        except OSError as exc:
            return "cannot write in %s (%s)" % (directory, _why(exc))

    def list_markers(self, directory: str) -> List[str]:
        try:
            return sorted(os.listdir(directory))
        except OSError:
            return []

    def remove_marker(self, directory: str, name: str) -> None:
        for remove, path in ((os.remove, os.path.join(directory, name)), (os.rmdir, directory)):
            try:
                remove(path)
            except OSError:
                pass

    def disk(self, directory: Optional[str]) -> dict:
        out = {"free_bytes": None, "shm_bytes": None, "path": None}
        path = directory or "/"
        while path and not os.path.exists(path):
            path = os.path.dirname(path)
        try:
            stat = os.statvfs(path or "/")
            out["free_bytes"], out["path"] = stat.f_bavail * stat.f_frsize, path or "/"
        except OSError:
            pass
        try:
            stat = os.statvfs("/dev/shm")
            out["shm_bytes"] = stat.f_blocks * stat.f_frsize
        except OSError:
            pass
        return out


# ======================================================================================
# The driver (on the head): one step after another, each against its deadline.
# ======================================================================================
