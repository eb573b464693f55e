"""The provider's environment contract, read through the plan's rules (which variable,
which item of which list, which template, which command), and this node's addresses:
its rank, the node count, the head's and its own IPv4 address, the interface that holds
an address; and the node group its rank is in (group_of). The agent names no provider: the
rules are data in the plan.
"""

from __future__ import annotations

import re
import socket
import subprocess
from typing import Callable, Dict, List, Optional

from .protocol import AgentError, log


class NodeInfo(object):
    """This node's place in the cluster."""

    def __init__(self, rank: int, nodes: int, head: Optional[str], node_addr: Optional[str] = None,
                 cluster_id: Optional[str] = None, gpus: Optional[int] = None, peer: Optional[str] = None):
        self.rank, self.nodes, self.head, self.node_addr = rank, nodes, head, node_addr
        self.cluster_id, self.gpus, self.peer = cluster_id, gpus, peer

    def __repr__(self) -> str:
        return "NodeInfo(%r)" % self.__dict__


def group_of(plan: dict, rank: int) -> Optional[dict]:
    """The plan's node group holding this rank (its first_rank range, in the task's order); None for a
    plan without groups."""
    for group in plan.get("groups") or []:
        if group["first_rank"] <= rank < group["first_rank"] + group["nodes"]:
            return group
    return None


def _items(text: str) -> List[str]:
    return [part.strip() for part in text.replace(",", "\n").splitlines() if part.strip()]


def _fill_env(text: str, env: Dict[str, str], what: str) -> str:
    def one(match):
        name = match.group(1)
        if not env.get(name):
            raise AgentError("reading the provider's environment", "$%s is not set (needed for %s)" % (name, what), code=2)
        return env[name]
    return re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", one, text)


def read_rule(rule: Optional[dict], env: Dict[str, str], what: str, rank: Optional[int] = None,
              run: Callable = subprocess.run) -> Optional[str]:
    """The value one contract rule gives (see plan.Rule), or None when the rule is absent."""
    if rule is None:
        return None
    step = "reading the provider's environment"
    try:
        if rule.get("env") is not None:
            raw = env.get(rule["env"]) or None
            source = "$%s" % rule["env"]
        elif rule.get("template") is not None:
            raw = _fill_env(rule["template"], env, what)
            source = rule["template"]
        elif rule.get("command") is not None:
            argv = [_fill_env(arg, env, what) for arg in rule["command"]]
            out = run(argv, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise AgentError(step, "%s (for %s): %s" % (" ".join(argv), what, out.stderr.strip()))
            raw, source = out.stdout, " ".join(argv)
        else:
            raw, source = rule.get("value"), "the plan"
    except AgentError:
        if rule.get("default") is not None:
            return rule["default"]
        raise
    if raw is not None and rule.get("item") is not None:
        index = rank if rule["item"] == "rank" else rule["item"]
        items = _items(raw)
        raw = items[index] if index is not None and index < len(items) else None
        source = "item %s of %s" % (rule["item"], source)
    if raw is None or raw == "":
        if rule.get("default") is not None:
            return rule["default"]
        raise AgentError(step, "%s is not set (needed for %s)" % (source, what), code=2)
    if rule.get("plus"):
        return str(_integer(raw, source) + rule["plus"])
    return raw


def _integer(text: str, source: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise AgentError("reading the provider's environment", "%s=%r is not an integer" % (source, text), code=2)


def read_contract(contract: dict, env: Dict[str, str], run: Callable = subprocess.run) -> NodeInfo:
    """Map the provider's environment to this node's place (addresses not resolved yet)."""
    rank = _integer(read_rule(contract["rank"], env, "the node's rank", run=run), "rank")
    nodes = _integer(read_rule(contract["nodes"], env, "the node count", run=run), "node count")
    if not 0 <= rank < nodes:
        raise AgentError("reading the provider's environment", "rank %d is outside 0..%d" % (rank, nodes - 1), code=2)
    optional = {}
    for key, what in (("head", "the head's address"), ("node_addr", "this node's address"),
                      ("cluster_id", "the cluster id"), ("gpus_per_node", "GPUs per node"),
                      ("peer", "another node's name")):
        try:
            optional[key] = read_rule(contract.get(key), env, what, rank=rank, run=run)
        except AgentError:
            if key == "head" and rank != 0:  # a worker must know its head; the head may use its own address
                raise
            optional[key] = None
    gpus = optional["gpus_per_node"]
    return NodeInfo(rank, nodes, optional["head"], optional["node_addr"], optional["cluster_id"],
                    int(gpus) if gpus and gpus.isdigit() else None, optional["peer"])


def resolve_ipv4(name: str) -> str:
    """An IPv4 address for a name, preferring one that is not loopback (some hosts map
    their own name to 127.0.1.1, which no other node can reach)."""
    if re.match(r"^\d+\.\d+\.\d+\.\d+$", name):
        return name
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise AgentError("resolving %s" % name, "the name does not resolve (%s)" % exc.strerror)
    addresses = [info[4][0] for info in infos]
    routable = [a for a in addresses if not a.startswith("127.")]
    return (routable or addresses)[0]


def locate(info: NodeInfo) -> NodeInfo:
    """Resolve the head's and this node's addresses to IPv4 addresses.

    The head never keeps a loopback address in a multi-node cluster: some hosts map
    their own name to 127.0.1.1 only, which no other node can reach. Then the head
    takes its address on the route to another node (the contract's `peer`)."""
    if info.rank == 0:
        if info.node_addr is None and info.head is None:
            raise AgentError("reading the provider's environment",
                             "the contract gives neither the head's address nor this node's", code=2)
        own = resolve_ipv4(info.node_addr or info.head)
        if own.startswith("127.") and info.nodes > 1 and info.peer:
            routed = source_address(resolve_ipv4(info.peer))
            log("%s resolves only to %s here; using %s, this node's address on the route to %s"
                % (info.node_addr or info.head, own, routed, info.peer))
            info.node_addr = info.head = routed
            return info
        info.node_addr = own
        info.head = resolve_ipv4(info.head) if info.head else own
        if info.head.startswith("127.") and not own.startswith("127."):
            info.head = own  # this node is the head
    else:
        info.head = resolve_ipv4(info.head)
        info.node_addr = resolve_ipv4(info.node_addr) if info.node_addr else source_address(info.head)
    return info

def iface_address(name: str) -> Optional[str]:
    """The IPv4 address of a local interface, or None (Linux ioctl; no iproute2 needed)."""
    import fcntl
    import struct

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(raw[20:24])
    except OSError:
        return None
    finally:
        sock.close()


def interface_names() -> List[str]:
    return [name for _, name in socket.if_nameindex()]


def interface_of(ip: str) -> Optional[str]:
    """Name of the local interface that holds `ip` (all of 127/8 is loopback's)."""
    if ip.startswith("127."):
        return "lo"
    for name in interface_names():
        if iface_address(name) == ip:
            return name
    return None


def source_address(host: str) -> str:
    """This node's address on the route to `host` (no packet is sent)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect((host, 9))
        return sock.getsockname()[0]
    finally:
        sock.close()
