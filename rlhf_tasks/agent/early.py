"""Preflight's network checks run by the node agents themselves, each node's as soon as it is up.

Every node agent serves a NodeProbe of its own (`ProbeServer`: the same listen, reach and
stream as the probe actor, over a small JSON-line control port), from its start, before its
`ray start`: it computes the interface and address Gloo and NCCL will pick from the very
environment the agent gives Ray, and the Python and Ray versions of the interpreter that runs
`ray`. A worker announces itself on the head's ready beacon (`hello`) before it starts Ray.
The head agent's `EarlyChecks` runs, for each node as it announces itself, what involves it
and the nodes already there: the connections to and from its collective addresses (the
interfaces step's peers) and its share of the pair streams (the pairs step's schedule, run as
soon as both ends are there and free: a node sends one stream and receives one at a time). It
keeps what it measured, raw and by rank, in a JSON file on the head (`EARLY_FILE` in the
agent's state dir), rewritten as the checks progress.

Preflight's driver (preflight.py, `--early FILE`) reads that file once every node is ALIVE
and judges it as it judges its own probes' results; so after the last node joins only what
had not finished for it is left (usually nothing: a worker announces itself before its
`ray start`, which takes seconds), plus torch and the all_reduce where the job uses torch.
A node that did not announce itself (Ray started by someone else, an agent of another
version) leaves the driver to its own probes, as before. Standard library only.
"""

from __future__ import annotations

import hmac
import json
import os
import platform
import socket
import subprocess
import threading
import time
from typing import Callable, Dict, List, Optional

from .contract import interface_of
from .probe import NodeProbe, collective_endpoint
from .protocol import log

EARLY_FILE = "preflight-early.json"
CALL_TIMEOUT_S = 15.0
#: Asks the interpreter that runs `ray` for its versions (no Ray import: a few tens of ms).
VERSIONS = ("import platform\n"
            "try:\n"
            "    from importlib import metadata\n"
            "    ray = metadata.version('ray')\n"
            "except Exception:\n"
            "    ray = ''\n"
            "print(platform.python_version())\n"
            "print(ray)\n")


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _read_line(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise OSError("an answer longer than %d bytes" % limit)
    return data


class ProbeServer(object):
    """The node agent's own probe: NodeProbe's network calls over a control port on the
    node's address (port picked free), asked by the head agent with the cluster's token."""

    def __init__(self, address: str, env: Dict[str, str], rank: int, token: Optional[str],
                 python: Optional[List[str]] = None):
        self.address, self.env, self.rank, self.token = address, env, rank, token
        self.probe = NodeProbe(import_torch=False)
        self.versions = {"python": platform.python_version(), "ray": None}
        self._versions = threading.Thread(target=self._ask_versions, args=(python,), daemon=True)
        self._versions.start()
        self.sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, name="probe-server", daemon=True).start()

    def _ask_versions(self, python: Optional[List[str]]) -> None:
        if not python:
            return
        try:
            out = subprocess.run(python + ["-c", VERSIONS], env=self.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, timeout=60).stdout.decode().split("\n")
            if out[0].strip():
                self.versions = {"python": out[0].strip(), "ray": out[1].strip() or None}
        except (OSError, subprocess.SubprocessError, IndexError):
            pass

    def info(self) -> dict:
        """What the probe actor's info() says, from the environment this agent gives Ray."""
        self._versions.join(60)
        hostname = socket.gethostname()
        try:
            host_address = socket.gethostbyname(hostname)
        except OSError:
            host_address = None
        return {"hostname": hostname, "address": self.address, "token": self.probe.token, "rank": str(self.rank),
                "node_addr": self.address, "python": self.versions["python"], "ray": self.versions["ray"],
                "gloo_if": collective_endpoint("GLOO_SOCKET_IFNAME", self.env, host_address),
                "nccl_if": collective_endpoint("NCCL_SOCKET_IFNAME", self.env, None),
                "iface_of_address": interface_of(self.address)}

    def hello(self) -> dict:
        """What a worker says on the head's beacon: who it is and where its probe answers."""
        return {"rank": self.rank, "address": self.address, "port": self.port, "token": self.token or "",
                "info": self.info()}

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(120)
            request = json.loads(_read_line(conn).decode() or "{}")
            if self.token and not hmac.compare_digest(str(request.get("token") or ""), self.token):
                _send(conn, {"error": "refused: not the cluster's token"})
                return
            method = request.get("method")
            if method not in ("listen", "reach", "stream"):
                _send(conn, {"error": "no such call: %r" % method})
                return
            _send(conn, {"result": getattr(self.probe, method)(*request.get("args", []))})
        except (OSError, ValueError) as exc:
            try:
                _send(conn, {"error": str(exc)})
            except OSError:
                pass
        finally:
            conn.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def node_probe(node) -> Optional[ProbeServer]:
    """This node agent's own probe (raynode.Node `node`), when the plan runs preflight; None when
    it cannot listen (preflight's driver then uses its own probes for this node)."""
    import shutil

    from .raynode import console_script_python

    if not node.plan.get("preflight", {}).get("enabled"):
        return None
    python = console_script_python(shutil.which("ray", path=node.env.get("PATH")))
    try:
        return ProbeServer(node.info.node_addr, node.env, node.info.rank, node.token, python)
    except OSError as exc:
        log("preflight: this node's own probe cannot listen on %s (%s); preflight's probe actor checks it"
            % (node.info.node_addr, exc))
        return None


def head_checks(node, probe: ProbeServer) -> EarlyChecks:
    """The head's EarlyChecks for the plan's node count, with preflight's schedules; the head itself first."""
    from .schedule import (PAIR_BUDGET_S, PAIR_DISTANCES, PAIR_MAX_BYTES, PAIR_SAMPLE_ROUNDS, REACH_DISTANCES,
                            REACH_SAMPLE_ROUNDS, partners, schedule)

    count = node.plan["nodes"]
    checks = EarlyChecks(os.path.join(node.state_dir, EARLY_FILE), count, node.token, PAIR_BUDGET_S, PAIR_MAX_BYTES,
                         partners(count, schedule(count, REACH_DISTANCES, REACH_SAMPLE_ROUNDS)),
                         schedule(count, PAIR_DISTANCES, PAIR_SAMPLE_ROUNDS))
    threading.Thread(target=lambda: checks.add(probe.hello()), name="early-head", daemon=True).start()
    return checks


def call(address: str, port: int, token: Optional[str], method: str, *args, timeout: float = CALL_TIMEOUT_S):
    """One call to a node's ProbeServer; OSError when it fails."""
    with socket.create_connection((address, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        _send(sock, {"token": token or "", "method": method, "args": list(args)})
        answer = json.loads(_read_line(sock).decode() or "{}")
    if "result" not in answer:
        raise OSError(answer.get("error") or "no answer from %s:%s" % (address, port))
    return answer["result"]


class EarlyChecks(object):
    """On the head: each node's network checks as soon as it announced itself (`add`), against
    the nodes already there; the raw results by rank in `path`."""

    def __init__(self, path: str, nodes: int, token: Optional[str], budget_s: float, max_bytes: int,
                 reach_plan: List[List[int]], pair_plan: List[List[tuple]], call_fn: Callable = call):
        self.path, self.count, self.token = path, nodes, token
        self.budget_s, self.max_bytes, self.call = budget_s, max_bytes, call_fn
        self.reach_peers = reach_plan  # rank -> the ranks it connects to (symmetric)
        self.plan = pair_plan
        self.lock = threading.Condition()
        self.nodes = {}     # type: Dict[int, dict]   rank -> {"address", "port", "info", "listen", "done"}
        self.reached = set()  # type: set  (i, j): i connected to j's addresses
        self.reach = []     # type: List[list]   [from_rank, to_rank, kind, why or None]
        self.pairs = []     # type: List[dict]   {"src", "dst", "bits_per_s", "bytes", "seconds"} | {"error"}
        self.pending = [tuple(pair) for round_ in pair_plan for pair in round_]
        self.rounds = 0
        self.inflight = 0
        self.writing = threading.Lock()
        self.errors = []    # type: List[str]   a node's probe that did not answer
        self.closed = False
        self.started = time.time()
        if os.path.exists(path + ".nodes"):  # an earlier run's
            os.remove(path + ".nodes")
        self.write()
        threading.Thread(target=self._pairs, name="early-pairs", daemon=True).start()

    # ------------------------------------------------------------------ arrivals

    def add(self, hello: dict) -> None:
        """A node announced itself (its hello): listen on its collective addresses, then connect
        it to the nodes already there and them to it. Called from the beacon's thread."""
        try:
            rank = int(hello["rank"])
        except (KeyError, TypeError, ValueError):
            return
        if not 0 <= rank < self.count or (self.token and not hmac.compare_digest(str(hello.get("token") or ""), self.token)):
            return
        with self.lock:
            if rank in self.nodes:
                return  # a rejoin: its checks are done or under way
            self.nodes[rank] = {"address": hello["address"], "port": int(hello["port"]), "info": hello["info"],
                                "listen": None, "ready": False, "reached": False, "seen": round(time.time() - self.started, 3)}
        threading.Thread(target=self._arrived, args=(rank,), name="early-node%d" % rank, daemon=True).start()

    def _arrived(self, rank: int) -> None:
        node = self.nodes[rank]
        info = node["info"]
        addresses = sorted({info[k]["address"] for k in ("gloo_if", "nccl_if") if info[k]["address"]})
        try:
            node["listen"] = self.call(node["address"], node["port"], self.token, "listen", addresses)
        except (OSError, ValueError) as exc:
            self._error("node%d's probe at %s:%s did not answer (%s)" % (rank, node["address"], node["port"], exc))
            return
        with self.lock:
            node["ready"] = True
            self.lock.notify_all()  # the pairs it takes part in may start
            peers = [j for j in self.reach_peers[rank] if j in self.nodes and self.nodes[j]["ready"]]
        threads = []
        for a, b in [(rank, j) for j in peers] + [(j, rank) for j in peers]:
            threads.append(threading.Thread(target=self._reach, args=(a, b), daemon=True))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with self.lock:
            node["reached"] = True
        self.write()

    def _reach(self, a: int, b: int) -> None:
        with self.lock:
            if (a, b) in self.reached:
                return
            self.reached.add((a, b))
        src, dst = self.nodes[a], self.nodes[b]
        targets = []
        for kind in ("gloo_if", "nccl_if"):
            address = dst["info"][kind]["address"]
            if address and address in (dst["listen"] or {}):
                targets.append([kind, address, dst["listen"][address], dst["info"]["token"],
                                src["info"][kind]["address"]])
        if not targets:
            return
        try:
            answers = self.call(src["address"], src["port"], self.token, "reach", targets, 5.0)
        except (OSError, ValueError) as exc:
            answers = {t[0]: "node%d's probe did not answer (%s)" % (a, exc) for t in targets}
        with self.lock:
            for kind, why in sorted(answers.items()):
                self.reach.append([a, b, kind, why])

    # ------------------------------------------------------------------ the pair streams

    def _pairs(self) -> None:
        while True:
            with self.lock:
                batch = self._batch()
                while not batch and self.pending and not self.closed:
                    self.lock.wait(1.0)
                    batch = self._batch()
                if not batch:
                    break
                for pair in batch:
                    self.pending.remove(pair)
                self.rounds += 1
                self.inflight += 1
            results = {}  # type: Dict[tuple, dict]
            threads = [threading.Thread(target=self._stream, args=(src, dst, results), daemon=True)
                       for a, b in batch for src, dst in ((a, b), (b, a))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            with self.lock:
                for a, b in batch:
                    for src, dst in ((a, b), (b, a)):
                        self.pairs.append(dict(results[(src, dst)], src=src, dst=dst, round=self.rounds))
                self.inflight -= 1
            self.write()

    def _batch(self) -> List[tuple]:
        """The pending pairs whose both ends are ready, disjoint, in the schedule's order."""
        busy, out = set(), []  # type: set, List[tuple]
        for a, b in self.pending:
            if a in busy or b in busy:
                continue
            if all(n in self.nodes and self.nodes[n]["ready"] for n in (a, b)):
                out.append((a, b))
                busy.update((a, b))
        return out

    def _stream(self, src: int, dst: int, results: dict) -> None:
        source, target = self.nodes[src], self.nodes[dst]
        address = target["info"]["gloo_if"]["address"]
        if not address or address not in (target["listen"] or {}):
            results[(src, dst)] = {"error": "node%d has no Gloo address to stream to" % dst}
            return
        try:
            results[(src, dst)] = self.call(source["address"], source["port"], self.token, "stream",
                                            source["info"]["gloo_if"]["address"], address, target["listen"][address],
                                            self.budget_s, self.max_bytes, 10.0)
        except (OSError, ValueError) as exc:
            results[(src, dst)] = {"error": "node%d's probe did not answer (%s)" % (src, exc)}

    # ------------------------------------------------------------------ the record

    def _error(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)
        log("preflight: %s" % message)
        self.write()

    def announced(self) -> bool:
        """Every node has announced itself (the last ones are starting their Ray)."""
        return len(self.nodes) == self.count

    def complete(self) -> bool:
        """Every node announced, and everything involving it measured."""
        return (len(self.nodes) == self.count and not self.pending and not self.inflight
                and all(n["reached"] for n in self.nodes.values()))

    def state(self) -> dict:
        with self.lock:
            nodes = {str(rank): {"address": n["address"], "info": n["info"], "reached": n["reached"], "seen": n["seen"]}
                     for rank, n in self.nodes.items()}
            return {"nodes_expected": self.count, "nodes": nodes, "reach": list(self.reach),
                    "pairs": list(self.pairs), "pairs_pending": len(self.pending), "rounds": self.rounds,
                    "plan_rounds": len(self.plan), "errors": list(self.errors),
                    "complete": self.complete(),
                    "updated": time.time()}

    def write(self) -> None:
        with self.writing:  # one writer at a time, each with the state as it is now: the newest wins
            state = self.state()
            with open(self.path + ".tmp", "w") as handle:
                json.dump(state, handle)
            os.replace(self.path + ".tmp", self.path)

    def nodes_alive(self, alive: List[dict]) -> None:
        """The head saw every node ALIVE (the State API's records): preflight's driver reads them
        beside the record, as ray.nodes() would give them, instead of connecting to Ray itself."""
        nodes = [{"NodeID": n["node_id"], "NodeManagerAddress": n["node_ip"], "Alive": True,
                  "Resources": dict(n.get("resources_total") or {},
                                    **({"node:__internal_head__": 1.0} if n.get("is_head_node") else {})),
                  "Labels": dict(n.get("labels") or {})}  # its node group's label, which preflight reads
                 for n in alive]
        with open(self.path + ".nodes.tmp", "w") as handle:
            json.dump(nodes, handle)
        os.replace(self.path + ".nodes.tmp", self.path + ".nodes")

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()


def read(path: str) -> Optional[dict]:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None
