"""The agent on a cluster whose Ray someone else starts (an operator that runs `ray start`
in every pod itself, as KubeRay does). Three short roles instead of the head's and the
workers' flows, each a separate command the rendered pods run:

  --before-ray FILE     every node, just before the operator's `ray start` in the same shell:
                        setup, rank 0's prepare, a worker's every-node services (ready, and
                        left running), and the environment Ray must start with (network
                        preset, the plan's env, the agent's package on PYTHONPATH) written to
                        FILE to be sourced. Setup runs once per pod, in the container Ray
                        runs in (an init container's installs would not reach it).
  --ray-started         the job runner on the head (the cluster's job entrypoint): the head's
                        services, every node and GPU in, preflight, then the job with its
                        restart policy, exactly as the head's own flow does once its Ray is up.
"""

from __future__ import annotations

import os
import shlex
import time
from typing import Dict

from .forensics import Keeper
from .head import HeadFlow
from .hub import fetch_models, online
from .protocol import http_check, log, probe_tcp, wait_for
from .raynode import Node

#: How often the linker left behind by --before-ray looks for the Ray session the operator starts.
LINK_POLL_S = 0.5

#: Variables the operator sets on its pods itself (the token comes from its Secret): never
#: written to the environment file.
OPERATOR_VARS = ("RAY_AUTH_TOKEN",)


class StartedRay(object):
    """Stands for a `ray start` this agent did not run: alive while the GCS port answers
    (asked at most once a second)."""

    class _Proc(object):
        returncode = "unknown (Ray was started outside this agent)"

    def __init__(self, host: str, port: int):
        self.host, self.port, self.proc = host, port, self._Proc()
        self.asked, self.answer = 0.0, True

    def alive(self) -> bool:
        now = time.monotonic()
        if now - self.asked >= 1.0:
            self.asked, self.answer = now, probe_tcp(self.host, self.port, timeout=2.0) is None
        return self.answer

    def tail(self, lines: int = 20) -> str:
        return "the Ray GCS on %s:%s stopped answering" % (self.host, self.port)

    def stop(self, grace: float = 0.0, enough=None) -> None:
        """Not ours to stop."""


def ray_env_lines(env: Dict[str, str], base: Dict[str, str]) -> str:
    """`export K=V` lines for what the agent's environment adds to or changes in `base`
    (secrets and the operator's token are unchanged, so never written)."""
    lines = ["export %s=%s" % (k, shlex.quote(v)) for k, v in sorted(env.items())
             if base.get(k) != v and k not in OPERATOR_VARS]
    return "\n".join(lines) + ("\n" if lines else "")


class BeforeRayFlow(object):
    """Every node, before the operator's `ray start` (setup has run): the head runs `prepare`,
    a worker starts its every-node services and waits until they answer (they stay up after
    this agent exits: a node that joins Ray has its services ready); then the environment Ray
    must start with goes to `env_file`."""

    def __init__(self, node: Node, env_file: str):
        self.node, self.env_file = node, env_file

    def run(self) -> int:
        node = self.node
        fetch_models(node)  # before Ray starts: the head's, or each node's where no cache is shared
        if node.info.rank == 0 and node.plan["prepare"]:
            node.run_commands("prepare", node.plan["prepare"], online(node.env, node.plan))
        if node.info.rank != 0:  # the head's services are the job runner's (--ray-started)
            node.detach_services = True
            node.start_services(("every_node",))
        directory = os.path.dirname(os.path.abspath(self.env_file))
        os.makedirs(directory, exist_ok=True)
        fd = os.open(self.env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(ray_env_lines(node.env, dict(os.environ)))
        log("the environment for Ray is in %s; Ray starts next" % self.env_file)
        node.services = []  # handed over: they run on beside Ray
        link_when_ray_starts(node)
        return 0

    def result(self) -> dict:
        return {}

    def stop(self, signalled: bool = False) -> None:
        pass


def link_when_ray_starts(node: Node) -> None:
    """Leave behind a process that links this node's agent files into the Ray session the
    operator is about to start (as a node agent does right after its own `ray start`), so a
    failure's bundle, read through Ray's log API, holds them and names the node by its rank.
    It gives up after wait.head; it is the pod's, and ends with it."""
    if os.fork():
        return
    try:  # the child: its own session, no hold on the container's output
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        keeper = Keeper(node)
        deadline = time.monotonic() + node.plan["wait"]["head_s"]
        while keeper.linked is None and time.monotonic() < deadline:
            time.sleep(LINK_POLL_S)
            keeper.link()
    finally:
        os._exit(0)


def bundle_hold(node, result: dict) -> float:
    """How long the job runner keeps its failure bundle reachable after its result line: the
    plan's bundle_hold_s, when the job failed and there is a bundle (0 otherwise)."""
    bundle = (result.get("forensics") or {}).get("bundle")
    if not result.get("exit_code") or not bundle or not os.path.exists(bundle):
        return 0.0
    return float(node.plan.get("bundle_hold_s") or 0.0)


def hold_bundle(path: str, seconds: float) -> None:
    """Stay (and with this runner, the cluster: the operator deletes it once the job ends) until
    the bundle at `path` has been read, or `seconds` pass. The launcher reads it through Ray's log
    API; the first read after a write moves the file's access time (the kernel's relatime, the
    default; where a mount has noatime, the whole time passes)."""
    written = os.stat(path).st_mtime_ns
    deadline = time.monotonic() + seconds
    log("holding the bundle %s for the launcher to fetch (at most %.0fs)" % (path, seconds))
    while time.monotonic() < deadline:
        if os.stat(path).st_atime_ns > written:
            log("the bundle was read; the runner exits")
            return
        time.sleep(0.5)
    log("nobody read the bundle within %.0fs; the runner exits" % seconds)


class StartedHeadFlow(HeadFlow):
    """The head's flow from the moment its Ray is up, on a head whose Ray someone else
    started: the dashboard answering, then HeadFlow.serve (services, every node, preflight,
    the job and its restarts)."""

    def run(self) -> int:
        node, plan = self.node, self.plan
        node.ray = StartedRay(self.info.node_addr, plan["ray"]["port"])
        started = time.monotonic()
        with node.step("ray head"):
            wait_for("the Ray dashboard at %s" % node.dashboard,
                     node.ray_alive(lambda: http_check(node.dashboard + "/api/gcs_healthz")),
                     plan["wait"]["head_s"], interval=0.2, max_interval=1.0)
        log("Ray head up (started outside this agent); dashboard %s" % node.dashboard)
        return self.serve(started)
