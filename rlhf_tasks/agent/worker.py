"""Every other rank, and job.mode every_node: WorkerFlow joins when the head's beacon
answers, starts the every-node services and keeps the raylet up (rejoining when it dies)
until the head goes away; EveryNodeFlow (torchrun and the like: no Ray) runs the job's
command on every node once the head is ready, and ends with its exit code.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import threading
import time
from typing import List, Optional

from .beacon import RUN_OVER, ReadyBeacon, probe_ready, reachable, say_hello
from .contract import NodeInfo
from .early import node_probe
from .forensics import keeper
from .hub import fetch_models, online
from .processes import Child
from .protocol import JOB_STARTS, AgentError, log, submission_id, wait_for
from .raynode import Node


class WorkerFlow(object):
    """Every other rank: join when the head's beacon answers, start the every-node
    services, keep the raylet up (rejoin when it dies) until the head goes away."""

    def __init__(self, node: Node):
        self.node = node
        self.beacon = (node.info.head, node.plan["ray"]["ready_port"])
        self.probe = None

    def run(self) -> int:
        node = self.node
        fetch_models(node)  # without a cache every node sees, each node fetches its own
        node.prestart_ray()
        self.probe = node_probe(node)  # preflight's checks of this node, as soon as the head hears of it
        with node.step("head"):
            started = time.monotonic()
            wait_for("the head at %s:%s" % self.beacon, reachable(probe_ready, *self.beacon),
                     node.plan["wait"]["head_s"], interval=0.1, max_interval=0.2)
            log("head ready after %.1fs" % (time.monotonic() - started))
        if self.probe is not None:  # in the background: Ray starts now
            threading.Thread(target=self.hello, name="hello", daemon=True).start()
        with node.step("ray worker"):
            node.start_ray(head=False)
        keeper(node).tick()  # this node's files where the head reads them, before a job can fail
        node.start_services(("every_node",))
        return self.supervise()

    def hello(self) -> None:
        """Announce this node (and its probe) to the head, whose preflight checks it at once."""
        why = say_hello(self.beacon[0], self.beacon[1], self.probe.hello())
        if why is not None:
            log("preflight: could not announce this node to the head (%s); preflight's probe actor checks it" % why)

    def supervise(self, head_gone_s: float = 10.0, max_rejoins: int = 3) -> int:
        """Keep the raylet up (rejoin if it dies) until the head goes away: then the run is over."""
        node = self.node
        unreachable_since = None
        rejoins = 0
        while True:
            reason = probe_ready(*self.beacon)
            now = time.monotonic()
            if reason == RUN_OVER:
                log("%s: stopping this node" % reason)
                return 0
            if reason is None:
                unreachable_since = None
            elif unreachable_since is None:
                unreachable_since = now
                log("head unreachable (%s); waiting up to %.0fs before leaving" % (reason, head_gone_s))
            elif now - unreachable_since > head_gone_s:
                log("the head is gone (%s): the run is over, stopping this node" % reason)
                return 0
            if not node.ray.alive() and reason is None:
                if rejoins >= max_rejoins:
                    raise AgentError("supervising the raylet", "it died %d times:\n%s" % (rejoins + 1, node.ray.tail()))
                rejoins += 1
                log("the raylet exited (code %s); rejoining (%d/%d)" % (node.ray.proc.returncode, rejoins, max_rejoins))
                node.start_ray(head=False)
            keeper(node).tick()  # this node's evidence where the head can read it
            time.sleep(1.0)

    def result(self) -> dict:
        return {}

    def stop(self, signalled: bool = False) -> None:
        if self.probe is not None:
            self.probe.close()


class EveryNodeFlow(object):
    """job.mode every_node (torchrun and the like): no Ray. Every node runs the job's
    command itself once the head is ready (prepare done, its services answering, the ready
    beacon open) and ends with that command's exit code."""

    def __init__(self, node: Node):
        self.node, self.plan, self.info = node, node.plan, node.info
        self.beacon = None  # type: Optional[ReadyBeacon]
        self.job = {}  # type: dict

    def run(self) -> int:
        node, plan, info = self.node, self.plan, self.info
        fetch_models(node)
        if info.rank == 0:
            if plan["prepare"]:
                node.run_commands("prepare", plan["prepare"], online(node.env, plan))
            node.start_services(("head", "every_node"))
            self.beacon = ReadyBeacon(info.node_addr, plan["ray"]["ready_port"])
        else:
            beacon = (info.head, plan["ray"]["ready_port"])
            with node.step("head"):
                started = time.monotonic()
                wait_for("the head at %s:%s" % beacon, reachable(probe_ready, *beacon), plan["wait"]["head_s"],
                         interval=0.2, max_interval=0.5)
                log("head ready after %.1fs" % (time.monotonic() - started))
            node.start_services(("every_node",))
        argv = every_node_argv(plan["job"], info)
        if info.rank == 0:  # the launcher's word that Ctrl-C no longer cancels the job
            log(JOB_STARTS % submission_id(plan["name"], node.cluster_key()) + " on every node")
        log("running the job on node %d: %s" % (info.rank, " ".join(shlex.quote(a) for a in argv)))
        started = time.monotonic()
        with node.step("job"):
            node.job = Child("job", argv, node.env)  # its output is this agent's
            code = self.wait(node.job, plan["job"].get("timeout_s"))
        code = code if code >= 0 else 128 - code  # killed by a signal
        self.job = {"status": "SUCCEEDED" if code == 0 else "FAILED", "exit_code": code}
        log("the job's command ended with exit code %d after %.1fs" % (code, time.monotonic() - started))
        if code != 0:
            raise AgentError("running the job on node %d" % info.rank, "exit code %d" % code, code=code)
        return 0

    @staticmethod
    def wait(child: Child, timeout_s: Optional[float]) -> int:
        try:
            return child.proc.wait(timeout=timeout_s or None)
        except subprocess.TimeoutExpired:
            child.stop(grace=10.0)
            raise AgentError("running the job", "still running after the job timeout of %.0fs; stopped it" % timeout_s)

    def result(self) -> dict:
        return {"job": self.job or None}

    def stop(self, signalled: bool = False) -> None:
        if self.beacon is not None:
            self.beacon.close()


def every_node_argv(job: dict, info: NodeInfo) -> List[str]:
    """The job's command on this node: {rank}, {nodes}, {head_addr} and {node_addr} filled in."""
    values = {"rank": str(info.rank), "nodes": str(info.nodes), "head_addr": info.head, "node_addr": info.node_addr}
    return [re.sub(r"\{(rank|nodes|head_addr|node_addr)\}", lambda m: values[m.group(1)], arg) for arg in job["entrypoint"]]
