"""Preflight: prove the nodes can talk before the job starts; the driver of the preflight job.

Runs as a Ray job of its own on the head (`python3 LIB/rlhf_tasks/agent/__main__.py preflight
--nodes N ...`), submitted by the head agent as soon as its dashboard answers (it waits for the
nodes itself), or by `rlhf-tasks doctor` on a running cluster. One probe actor (probe.py)
is pinned to each node; it runs in a Ray worker there, so it sees the environment the
job's tasks will get on that node (the node agent sets GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME before `ray start`). Steps, each against a deadline that names the
nodes that did not answer:

  nodes       every expected node ALIVE and answering, with its versions (Python, Ray)
  interfaces  the interface and address Gloo (and NCCL) will use on each node; every node
              connects to its peers' addresses from its own, as the libraries do, all at
              once: every other node in a small cluster, else ring neighbours and a seeded
              sample (at least REACH_PEERS, whatever the node count)
  torch       torch on every node, with CUDA/ROCm and NCCL where present
  pairs       TCP streams both ways over those addresses, in rounds of disjoint pairs (a node
              sends one stream and receives one at a time): every pair in a small cluster, else ring neighbours
              and a seeded sample, at most PAIR_ROUNDS rounds at any node count; each node's
              slowest send and receive, the slowest pair
  gloo        torch.distributed all_reduce with Gloo on CPU tensors, 1 MiB .. 64 MiB,
              the bus bandwidth per size (without torch: the TCP figures, and it says so)
  nccl        the same with NCCL on one GPU per node, among the nodes Ray has GPUs on (a node group whose
              GPUs a recipe serves outside Ray joins with none: its NCCL is not the job's)
  doctor      (`--checks`) each service's readiness, the checkpoint directory shared and
              writable, free disk and /dev/shm

With `--early FILE` (the head agent passes it) the nodes, interfaces and pairs steps judge what
the node agents measured as each node came up (early.py) instead of running their probes again:
probe actors start only where the job uses torch, or for a node that never announced itself.

Prints `preflight: ...` progress lines and ends with one `RLHF_TASKS_PREFLIGHT {json}`
line: failures (the step, the nodes, what to do), warnings (bandwidth below the task's
threshold, with what it means for the weight sync), notes, and the table. Exit 0 when no
check failed, 1 otherwise. Needs the standard library, ray, and torch where present;
Python >= 3.8 (ray and torch are imported inside the functions that use them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

from .grouplinks import group_links, rank_of
from .probe import MiB, NodeProbe
from .report import rate, size_text, table  # noqa: F401 - table: preflight's own, re-exported
from .schedule import (PAIR_BUDGET_S, PAIR_DISTANCES, PAIR_MAX_BYTES, PAIR_PEERS, PAIR_ROUNDS,  # noqa: F401
                       PAIR_SAMPLE_ROUNDS, REACH_DISTANCES, REACH_PEERS, REACH_SAMPLE_ROUNDS, partners, rounds,
                       schedule)
from .protocol import GROUP_LABEL, PREFLIGHT_PREFIX

SIZES = (MiB, 4 * MiB, 16 * MiB, 64 * MiB)
SIZE_BUDGET_S = 1.0        # the all_reduce stops growing once a size would take longer than this
#: How long after every node is ALIVE a node that never announced itself to the head agent is
#: waited for before preflight's own probes check every node.
EARLY_GRACE_S = 3.0
#: What a node's own time limit leaves of a step's: this share of the time left, and at least
#: ANSWER_MIN_S, for the call to reach the node and its answer to come back through a loaded head.
ANSWER_SHARE, ANSWER_MIN_S = 0.25, 2.0
#: The longest each step may take (less when the overall deadline is nearer).
STEP_CAPS = {"nodes": 60.0, "interfaces": 15.0, "torch": 90.0, "pairs": 30.0, "gloo": 60.0, "nccl": 90.0,
             "services": 30.0, "checkpoints": 20.0, "disk": 10.0}


SAID = []  # type: List[str]   every progress line, for the result file beside the gate (main's `result_file`)


def say(message: str) -> None:
    SAID.append("preflight: " + message)
    print("preflight: " + message, flush=True)


class Failed(Exception):
    """A check failed and the later steps need it: stop here."""

    def __init__(self, step: str, message: str):
        Exception.__init__(self, message)
        self.step = step


class Preflight(object):
    """The driver on the head: one step after another, each against its deadline."""

    def __init__(self, args):
        self.args = args
        self.started = time.time()
        self.deadline = self.started + args.wait_nodes + args.timeout  # from when the nodes are there: step_nodes
        self.nodes = []       # type: List[dict]   one per node, head first, then by the agent's rank
        self.actors = []      # type: list
        self.failures = []    # type: List[dict]
        self.warnings = []    # type: List[str]
        self.notes = []       # type: List[str]
        self.steps = []       # type: List[dict]
        self.checks = []      # type: List[dict]   doctor: {"check", "ok", "detail"}
        self.pairs = []       # type: List[dict]
        self.pair_plan = {}   # type: dict   how many pairs and rounds the pairs step measured
        self.reach = {}       # type: dict   how many connections the interfaces step made
        self.collectives = {}  # type: Dict[str, dict]
        self.early = None  # type: Optional[dict]   the head agent's record (early.py), when it covers every node

    # ---------------------------------------------------------------- helpers

    def step_deadline(self, step: str) -> float:
        return min(self.deadline, time.time() + STEP_CAPS[step])

    def label(self, index: int) -> str:
        node = self.nodes[index]
        return node["label"]

    def gather(self, step: str, refs: list, who: List[int], deadline: float) -> list:
        """The results of one remote call per node; Failed naming the nodes that did not answer."""
        import ray

        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.time()))
        if pending:
            missing = [self.label(who[i]) for i, ref in enumerate(refs) if ref in pending]
            raise Failed(step, "no answer from %s by the step's deadline (%.0fs into preflight)"
                         % (", ".join(missing), time.time() - self.started))
        out = []
        for index, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except Exception as exc:
                raise Failed(step, "%s failed: %s" % (self.label(who[index]), str(exc).strip().splitlines()[-1]))
        return out

    def fail(self, step: str, message: str) -> None:
        self.failures.append({"step": step, "message": message})

    def run_step(self, name: str, func) -> None:
        started = time.time()
        say("%s ..." % name)
        try:
            func()
        finally:
            self.steps.append({"step": name, "seconds": round(time.time() - started, 2)})

    # ---------------------------------------------------------------- the steps

    def head_nodes(self) -> bool:
        """Whether the head agent's word says which nodes are ALIVE (`--early`, no torch, no doctor's
        checks): then this process needs no Ray of its own unless a node never announced itself."""
        return bool(self.args.early) and not self.args.torch and not self.args.checks

    def connect(self):
        import ray

        if not ray.is_initialized():
            ray.init(log_to_driver=False)
            ship_by_value(ray)
        return ray

    def alive(self) -> List[dict]:
        """The nodes ALIVE now, as ray.nodes() gives them (from the head agent's file, written once
        it saw every node ALIVE, when `head_nodes`)."""
        if not self.head_nodes():
            return [n for n in self.connect().nodes() if n.get("Alive")]
        try:
            with open(self.args.early + ".nodes") as handle:
                return json.load(handle)
        except (OSError, ValueError):
            return []

    def probe_actor(self, node_id: str):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = self.connect().remote(num_cpus=0, max_concurrency=8)(NodeProbe)
        return probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
            self.args.torch)

    def run(self) -> None:
        if not self.head_nodes():
            self.connect()
        self.run_step("nodes", self.step_nodes)
        network_error = None
        try:
            self.run_step("versions", self.step_versions)
            self.run_step("interfaces", self.step_interfaces)
            if self.args.torch:
                self.run_step("torch", self.step_torch)
            else:
                self.notes.append("the job does not use torch (preflight.torch: false): checked the network with "
                                  "TCP streams between the nodes, without a Gloo all_reduce")
            if len(self.nodes) > 1:
                self.run_step("pairs", self.step_pairs)
                if all(n.get("torch") for n in self.nodes):
                    self.run_step("gloo", lambda: self.step_allreduce("gloo"))
                if self.args.torch and self.nccl_nodes():
                    self.run_step("nccl", lambda: self.step_allreduce("nccl"))
            else:
                self.notes.append("one node: there is no network between nodes to check")
            self.bandwidth_verdict()
        except Failed as exc:
            network_error = exc
        if self.args.checks:  # doctor's checks do not need the network ones: run them anyway
            checks = json.loads(self.args.checks)
            for name, step in (("services", lambda: self.step_services(checks.get("services") or [])),
                               ("checkpoints", lambda: self.step_checkpoints(checks.get("checkpoint_dir"))),
                               ("disk", lambda: self.step_disk(checks))):
                try:
                    self.run_step(name, step)
                except Failed as exc:
                    self.checks.append({"check": name, "ok": False, "detail": str(exc), "fix": None})
        if network_error is not None:
            raise network_error

    def step_nodes(self) -> None:
        """Every expected node alive (waiting up to --wait-nodes for them to join) with a probe
        pinned to it; each probe is created as its node appears, so that its worker process
        starts while the rest join."""
        join_deadline = time.time() + self.args.wait_nodes
        while True:
            alive = self.alive()
            for n in alive:
                if n["NodeID"] not in (p["node_id"] for p in self.nodes):
                    self.nodes.append({"label": n["NodeManagerAddress"], "node_id": n["NodeID"],
                                       "head": "node:__internal_head__" in n.get("Resources", {}),
                                       "gpus": int(n.get("Resources", {}).get("GPU", 0)),
                                       "group": (n.get("Labels") or {}).get(GROUP_LABEL)})
                    if not self.args.early or self.args.torch:  # the node agents check the network themselves
                        self.actors.append(self.probe_actor(n["NodeID"]))
                    else:
                        self.actors.append(None)
            if len(alive) >= self.args.nodes:
                break
            if time.time() >= join_deadline:
                raise Failed("nodes", "%d of %d nodes are alive (%s)" % (
                    len(alive), self.args.nodes, ", ".join(n["NodeManagerAddress"] for n in alive)))
            time.sleep(self.join_poll())  # polling the GCS for the nodes still joining
        now_alive = {n["NodeID"] for n in alive}
        keep = [i for i, n in enumerate(self.nodes) if n["node_id"] in now_alive]  # not one that joined and died
        self.nodes, self.actors = [self.nodes[i] for i in keep], [self.actors[i] for i in keep]
        self.deadline = min(self.deadline, time.time() + self.args.timeout)
        early = self.early_record() if self.args.early else None
        if early is not None:  # what each node's agent said of it (its versions, interfaces)
            by_address = {n["address"]: n["info"] for n in early["nodes"].values()}
            for node in self.nodes:
                node.update(by_address[node["label"]])
            self.early = early
        else:
            for index, node in enumerate(self.nodes):  # a node its agent did not check: preflight's own probes
                if self.actors[index] is None:
                    self.actors[index] = self.probe_actor(node["node_id"])
            infos = self.gather("nodes", [a.info.remote() for a in self.actors], list(range(len(self.nodes))),
                                self.step_deadline("nodes"))
            for node, info in zip(self.nodes, infos):
                node.update(info)
        order = sorted(range(len(self.nodes)), key=lambda i: (not self.nodes[i]["head"], rank_of(self.nodes[i]),
                                                              self.nodes[i]["address"]))
        self.nodes = [self.nodes[i] for i in order]
        self.actors = [self.actors[i] for i in order]
        name_nodes(self.nodes)
        say("%d nodes answered: %s" % (len(self.nodes), ", ".join(n["label"] for n in self.nodes)))

    def join_poll(self) -> float:
        """How long to wait before asking the GCS again: 0.1 s, 0.03 s once every node announced itself
        to the head agent (the last ones are starting their Ray then, and the job waits on this)."""
        if self.args.early:
            from .early import read

            record = read(self.args.early) or {}
            if len(record.get("nodes") or {}) >= record.get("nodes_expected", 1 << 30):
                return 0.03
        return 0.1

    def early_record(self) -> Optional[dict]:
        """The head agent's record once it has every node's checks, or None when a node ALIVE in
        Ray did not announce itself there (its Ray started elsewhere, another agent): preflight's
        own probes check every node then. Waits for what is still running (the last node's
        share); Failed at the step's deadline."""
        from .early import read

        addresses = {n["label"] for n in self.nodes}
        deadline, grace = self.step_deadline("pairs"), time.time() + EARLY_GRACE_S
        while True:
            record = read(self.args.early) or {}
            known = {n["address"] for n in (record.get("nodes") or {}).values()}
            if record.get("errors"):
                raise Failed("interfaces", "; ".join(record["errors"]))
            if not addresses <= known and (len(known) >= record.get("nodes_expected", 0) or time.time() > grace):
                say("%s did not announce itself to the head agent: checking every node with probe actors"
                    % ", ".join(sorted(addresses - known)))
                return None
            if addresses <= known and record.get("complete"):
                return record
            if time.time() > deadline:
                raise Failed("pairs", "the node agents' checks did not finish by the step's deadline (%.0fs into "
                             "preflight): %d pair(s) still to measure" % (time.time() - self.started,
                                                                          record.get("pairs_pending", 0)))
            time.sleep(0.02)  # a local file the head agent rewrites as its checks progress

    def step_versions(self) -> None:
        for key, what, why in (("python", "Python", "Ray needs the same Python (major.minor) on every node"),
                               ("ray", "Ray", "Ray needs the same version on every node")):
            groups = self.groups(key, lambda v: ".".join(v.split(".")[:2]) if key == "python" else v)
            if len(groups) > 1:
                raise Failed("versions", "%s differs: %s. %s: use one image (or one environment) everywhere"
                             % (what, "; ".join("%s on %s" % kv for kv in groups.items()), why))

    def groups(self, key: str, normal=lambda v: v) -> Dict[str, str]:
        """version -> the nodes that have it (when nodes differ, after `normal`)."""
        by = {}  # type: Dict[str, List[str]]
        for node in self.nodes:
            value = node.get(key)
            by.setdefault(normal(value) if value else "none", []).append(node["label"])
        return {value: ", ".join(labels) for value, labels in by.items()}

    def step_interfaces(self) -> None:
        problems = ["%s: %s" % (n["label"], n["gloo_if"]["problem"]) for n in self.nodes if n["gloo_if"]["problem"]]
        nccl = set(self.nccl_nodes())
        problems += ["%s: %s" % (self.nodes[i]["label"], self.nodes[i]["nccl_if"]["problem"]) for i in sorted(nccl)
                     if self.nodes[i]["nccl_if"]["problem"]]
        if problems:
            raise Failed("interfaces", "; ".join(problems) + ". Fix the task's network preset or env")
        if len(self.nodes) < 2:
            return
        deadline = self.step_deadline("interfaces")
        kinds = ["gloo_if"] + (["nccl_if"] if nccl else [])
        peers = partners(len(self.nodes), schedule(len(self.nodes), REACH_DISTANCES, REACH_SAMPLE_ROUNDS))
        if self.early is not None:
            index = self.early_index()
            failed = {(index[a], index[b], kind): why for a, b, kind, why in self.early["reach"]
                      if why and kind in kinds}  # type: Dict[tuple, str]
        else:
            failed = self.reach_now(kinds, peers, deadline)
        # NCCL's addresses matter between the nodes it runs on
        failed = {key: why for key, why in failed.items() if key[2] != "nccl_if" or {key[0], key[1]} <= nccl}
        for index in self.culprits(failed):
            self.fail("interfaces", self.unreachable(index, failed))
        if self.failures:
            raise Failed("interfaces", self.failures[0]["message"])
        fewest = min(len(p) for p in peers)
        self.reach = {"connections": sum(len(p) for p in peers) * len(kinds), "peers_at_least": fewest,
                      "every_pair": fewest == len(self.nodes) - 1}
        say("interfaces: every node reaches %s %s address%s" % (
            "every other node's" if self.reach["every_pair"] else "the %d or more peers' (ring neighbours and a seeded "
            "sample)" % fewest, " and ".join("NCCL" if k == "nccl_if" else "Gloo" for k in kinds),
            " (checked by the node agents as each node came up)" if self.early is not None else ""))

    def early_index(self) -> Dict[int, int]:
        """The agents' ranks (the early record's keys) -> this preflight's node indices."""
        return {int(n["rank"]): i for i, n in enumerate(self.nodes)}

    def reach_now(self, kinds: List[str], peers: List[List[int]], deadline: float) -> Dict[tuple, str]:
        """Every node connects to its peers' collective addresses, through the probe actors."""
        addresses = [sorted({n[k]["address"] for k in kinds if n[k]["address"]}) for n in self.nodes]
        ports = self.gather("interfaces", [a.listen.remote(addrs) for a, addrs in zip(self.actors, addresses)],
                            list(range(len(self.nodes))), deadline)
        calls = []
        for i, actor in enumerate(self.actors):
            targets = []
            for j in peers[i]:
                other = self.nodes[j]
                for kind in kinds:
                    address = other[kind]["address"]
                    if address:
                        targets.append(["%s|%d" % (kind, j), address, ports[j][address], other["token"],
                                        self.nodes[i][kind]["address"]])
            calls.append(actor.reach.remote(targets, max(1.0, min(5.0, deadline - time.time() - 1))))
        results = self.gather("interfaces", calls, list(range(len(self.nodes))), deadline)
        failed = {}  # type: Dict[tuple, str]   (from, to, kind) -> why `from` could not reach `to`
        for i, answers in enumerate(results):
            for key, reason in answers.items():
                if reason:
                    kind, j = key.split("|")
                    failed[(i, int(j), kind)] = reason
        return failed

    def culprits(self, failed: Dict[tuple, str]) -> List[int]:
        """The fewest nodes that explain the failed connections: a node whose collective
        address nobody reaches usually cannot reach anyone either (it binds that address), so
        take the node in most failures first; on a tie, one whose interface is loopback or is
        not the one that carries its Ray address."""
        def suspicious(index):
            endpoint, node = self.nodes[index]["gloo_if"], self.nodes[index]
            return int((endpoint["address"] or "").startswith("127.") and not node["address"].startswith("127.")
                       or endpoint["iface"] != node.get("iface_of_address"))

        blamed, remaining = [], dict(failed)
        while remaining:
            involved = sorted({i for key in remaining for i in key[:2]})
            culprit = max(involved, key=lambda k: (sum(1 for key in remaining if k in key[:2]), suspicious(k)))
            blamed.append(culprit)
            remaining = {key: why for key, why in remaining.items() if culprit not in key[:2]}
        return blamed

    def unreachable(self, index: int, failed: Dict[tuple, str]) -> str:
        node = self.nodes[index]
        kinds = sorted({kind for (_, j, kind) in failed if j == index}) or ["gloo_if"]
        endpoint = node[kinds[-1]]  # NCCL's when only NCCL's address fails
        setting = ("%s=%s" % (endpoint["variable"], endpoint["value"]) if endpoint["value"]
                   else "%s unset (the hostname's address)" % endpoint["variable"])
        inbound = [(self.label(i), why) for (i, j, _), why in sorted(failed.items()) if j == index]
        outbound = [(self.label(j), why) for (i, j, _), why in sorted(failed.items()) if i == index]
        parts = []
        if inbound:
            parts.append("%s cannot reach it (%s)" % (", ".join(sorted({w for w, _ in inbound})), inbound[0][1]))
        if outbound:
            parts.append("it cannot reach %s (%s)" % (", ".join(sorted({w for w, _ in outbound})), outbound[0][1]))
        hint = node.get("iface_of_address")
        return ("%s: %s gives interface %s, address %s: %s. Use an interface the nodes share%s" % (
            node["label"], setting, endpoint["iface"] or "?", endpoint["address"], "; ".join(parts),
            " (this node's Ray address %s is on %s)" % (node["address"], hint) if hint else ""))

    def step_torch(self) -> None:
        deadline = self.step_deadline("torch")
        wait = node_limit(deadline)  # each node says itself that its import is stuck
        infos = self.gather("torch", [a.torch_info.remote(wait) for a in self.actors], list(range(len(self.nodes))),
                            deadline)
        errors = ["%s: %s" % (node["label"], info["error"]) for node, info in zip(self.nodes, infos) if info.get("error")]
        if errors:
            raise Failed("torch", "; ".join(errors))
        for node, info in zip(self.nodes, infos):
            node.update({k: info.get(k) for k in ("torch", "cuda", "rocm", "nccl", "cuda_devices")})
            node["torch_why"] = info.get("why")
        have = [n for n in self.nodes if n["torch"]]
        if not have:
            self.notes.append("torch is not installed on the nodes: checked the network with TCP streams between "
                              "the nodes instead of a Gloo all_reduce")
            return
        if len(have) < len(self.nodes):
            raise Failed("versions", "torch is on %s but not on %s (%s): a torch job cannot run its collectives "
                         "across them; install the same torch everywhere" % (
                             ", ".join(n["label"] for n in have),
                             ", ".join(n["label"] for n in self.nodes if not n["torch"]),
                             next(n["torch_why"] for n in self.nodes if not n["torch"])))
        for key, what, normal in (("torch", "torch", lambda v: ".".join(v.split("+")[0].split(".")[:2])),
                                  ("nccl", "NCCL", lambda v: ".".join(v.split(".")[:2]))):
            groups = self.groups(key, normal)
            if len(groups) > 1:
                raise Failed("versions", "%s differs: %s; collectives between different versions can fail or hang: "
                             "use one image everywhere" % (what, "; ".join("%s on %s" % kv for kv in groups.items())))
        for key, what in (("cuda", "CUDA"), ("rocm", "ROCm")):
            groups = self.groups(key)
            if len(groups) > 1:
                self.warnings.append("%s differs between nodes: %s" % (
                    what, "; ".join("%s on %s" % kv for kv in groups.items())))

    def nccl_nodes(self) -> List[int]:
        """The nodes NCCL is checked among: those Ray has GPUs on, where two or more have (a served group's
        nodes join Ray with none, and the job's NCCL never reaches them); [] otherwise."""
        indices = [i for i, n in enumerate(self.nodes) if n["gpus"] > 0]
        return indices if len(indices) > 1 else []

    def step_pairs(self) -> None:
        if self.early is not None:
            return self.early_pairs()
        deadline = self.step_deadline("pairs")
        ports = self.gather("pairs", [a.listen.remote([n["gloo_if"]["address"]]) for a, n in zip(self.actors, self.nodes)],
                            list(range(len(self.nodes))), deadline)
        plan = schedule(len(self.nodes), PAIR_DISTANCES, PAIR_SAMPLE_ROUNDS)
        peers = partners(len(self.nodes), plan)
        self.pair_plan = {"rounds": len(plan), "directions": 2 * sum(len(r) for r in plan),
                          "of": len(self.nodes) * (len(self.nodes) - 1), "peers_at_least": min(len(p) for p in peers),
                          "round_seconds": PAIR_BUDGET_S}
        for pairs in plan:
            calls, who, directions = [], [], []
            for a, b in pairs:
                for src, dst in ((a, b), (b, a)):
                    address = self.nodes[dst]["gloo_if"]["address"]
                    calls.append(self.actors[src].stream.remote(
                        self.nodes[src]["gloo_if"]["address"], address, ports[dst][address], PAIR_BUDGET_S, PAIR_MAX_BYTES,
                        max(1.0, deadline - time.time())))
                    who.append(src)
                    directions.append((src, dst))
            for (src, dst), result in zip(directions, self.gather("pairs", calls, who, deadline)):
                if result.get("error"):
                    raise Failed("pairs", "%s -> %s: %s" % (self.label(src), self.label(dst), result["error"]))
                self.pairs.append({"src": self.nodes[src]["name"], "dst": self.nodes[dst]["name"],
                                   "src_index": src, "dst_index": dst, "bits_per_s": result["bits_per_s"],
                                   "bytes": result["bytes"], "seconds": round(result["seconds"], 3)})
        slowest = min(self.pairs, key=lambda p: p["bits_per_s"])
        say("pairs: %d of %d directions in %d rounds, slowest %s -> %s at %s" % (
            self.pair_plan["directions"], self.pair_plan["of"], len(plan), slowest["src"], slowest["dst"],
            rate(slowest["bits_per_s"])))

    def early_pairs(self) -> None:
        """The pair streams the node agents ran, each as soon as both its nodes were up."""
        plan = schedule(len(self.nodes), PAIR_DISTANCES, PAIR_SAMPLE_ROUNDS)
        peers = partners(len(self.nodes), plan)
        index = self.early_index()
        self.pair_plan = {"rounds": self.early["rounds"], "directions": 2 * sum(len(r) for r in plan),
                          "of": len(self.nodes) * (len(self.nodes) - 1), "peers_at_least": min(len(p) for p in peers),
                          "round_seconds": PAIR_BUDGET_S, "early": True}
        for pair in sorted(self.early["pairs"], key=lambda p: (p["round"], p["src"], p["dst"])):
            src, dst = index[pair["src"]], index[pair["dst"]]
            if pair.get("error"):
                raise Failed("pairs", "%s -> %s: %s" % (self.label(src), self.label(dst), pair["error"]))
            self.pairs.append({"src": self.nodes[src]["name"], "dst": self.nodes[dst]["name"],
                               "src_index": src, "dst_index": dst, "bits_per_s": pair["bits_per_s"],
                               "bytes": pair["bytes"], "seconds": round(pair["seconds"], 3)})
        slowest = min(self.pairs, key=lambda p: p["bits_per_s"])
        say("pairs: %d of %d directions in %d rounds as the nodes came up, slowest %s -> %s at %s" % (
            len(self.pairs), self.pair_plan["of"], self.pair_plan["rounds"], slowest["src"], slowest["dst"],
            rate(slowest["bits_per_s"])))

    def step_allreduce(self, backend: str) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        deadline = self.step_deadline(backend)
        who, actors = list(range(len(self.nodes))), self.actors
        if backend == "nccl":
            who = self.nccl_nodes()
            left = [self.nodes[i] for i in range(len(self.nodes)) if i not in who]
            if ray.available_resources().get("GPU", 0) < len(who):
                self.notes.append("NCCL not checked: no free GPU on every node Ray has GPUs on (a job is using them)")
                return
            if left:
                self.notes.append("NCCL among the %d nodes Ray has GPUs on, not %s: %s Ray without GPUs" % (
                    len(who), ", ".join(n["label"] + (" (group %s)" % n["group"] if n.get("group") else "")
                                        for n in left), "it joins" if len(left) == 1 else "they join"))
            probe = ray.remote(num_cpus=0, num_gpus=1)(NodeProbe)
            actors = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(self.nodes[i]["node_id"],
                                                                                        soft=False)).remote()
                      for i in who]
            self.gather("nccl", [a.torch_info.remote(STEP_CAPS["torch"] - 5) for a in actors], who, deadline)
        master = self.nodes[who[0]]["address"]
        port = self.gather(backend, [actors[0].free_port.remote()], who[:1], deadline)[0]
        world = len(who)
        calls = [actor.allreduce.remote(backend, master, port, rank, world, list(SIZES), SIZE_BUDGET_S,
                                        node_limit(deadline)) for rank, actor in enumerate(actors)]
        results = self.gather(backend, calls, who, deadline)
        errors = ["%s: %s" % (self.label(i), r["error"]) for i, r in zip(who, results) if r.get("error")]
        if errors:
            raise Failed(backend, "torch.distributed all_reduce with %s failed: %s" % (
                "Gloo" if backend == "gloo" else "NCCL", "; ".join(errors)))
        self.collectives[backend] = {"nodes": world, "sizes": results[0]["sizes"]}
        say("%s all_reduce: %s" % (backend, ", ".join("%s %s" % (size_text(s["bytes"]), rate(s["bus_bits_per_s"]))
                                                       for s in results[0]["sizes"])))

    def bandwidth_verdict(self) -> None:
        """Bandwidth below the task's threshold is a warning (never a failure), with what it
        means for the weight sync."""
        threshold = self.args.min_bandwidth_bits
        slow_pairs = [p for p in self.pairs if p["bits_per_s"] < threshold]
        if slow_pairs:
            culprits = []
            sent, received = {}, {}  # type: Dict[int, List[dict]], Dict[int, List[dict]]
            for pair in self.pairs:
                sent.setdefault(pair["src_index"], []).append(pair)
                received.setdefault(pair["dst_index"], []).append(pair)
            for index, node in enumerate(self.nodes):
                out, into = sent.get(index, []), received.get(index, [])
                if out and all(p["bits_per_s"] < threshold for p in out):
                    culprits.append("%s sends to the other nodes at %s" % (node["label"], rate(max(p["bits_per_s"] for p in out))))
                elif into and all(p["bits_per_s"] < threshold for p in into):
                    culprits.append("%s receives from the other nodes at %s" % (
                        node["label"], rate(max(p["bits_per_s"] for p in into))))
            slowest = min(slow_pairs, key=lambda p: p["bits_per_s"])
            ordered = sorted(slow_pairs, key=lambda p: p["bits_per_s"])
            where = "; ".join(culprits) if culprits else ", ".join(
                "%s -> %s %s" % (p["src"], p["dst"], rate(p["bits_per_s"])) for p in ordered[:8]) + (
                " and %d more of the %d pairs measured" % (len(ordered) - 8, len(self.pairs)) if len(ordered) > 8 else "")
            self.warnings.append("low bandwidth: %s, below the %s the task expects (preflight.min_bandwidth). %s" % (
                where, rate(threshold), self.weight_sync(slowest["bits_per_s"])))
        for link in group_links(self.nodes, self.pairs):  # below the threshold between groups: a failure
            pair = link["pair"]
            words = "group %s -> group %s: slowest %s -> %s at %s" % (
                link["src_group"], link["dst_group"], pair["src"], pair["dst"], rate(pair["bits_per_s"]))
            say("between groups: %s. %s" % (words, self.weight_sync(pair["bits_per_s"])))
            if pair["bits_per_s"] < threshold:
                raise Failed("groups", "%s, below the %s the task expects between the groups that exchange weights "
                             "(preflight.min_bandwidth). %s" % (words, rate(threshold),
                                                                self.weight_sync(pair["bits_per_s"])))
        for backend, result in self.collectives.items():
            best = max(s["bus_bits_per_s"] for s in result["sizes"])
            if best < threshold:
                self.warnings.append("low bandwidth: the %s all_reduce across %d nodes reached %s of bus bandwidth, "
                                     "below the %s the task expects" % (
                                         "Gloo" if backend == "gloo" else "NCCL", result["nodes"], rate(best),
                                         rate(threshold)))

    def weight_sync(self, bits: float) -> str:
        model, weight_bytes = self.args.model, self.args.weight_bytes
        if weight_bytes:
            return ("For the weight sync this means: one bf16 copy of %s (~%.0f GB) takes ~%s to cross this link, "
                    "at every sync from the trainer to rollout engines on other nodes. Put the nodes on one fast "
                    "network (a cluster placement, InfiniBand), or keep the engines on the trainer's nodes" % (
                        model, weight_bytes / 1e9, duration(weight_bytes * 8 / bits)))
        return ("For the weight sync this means: every GB of weights the trainer sends to rollout engines on "
                "other nodes takes ~%s over this link (a 7B model in bf16 is ~14 GB: ~%s)" % (
                    duration(8e9 / bits), duration(14e9 * 8 / bits)))

    def step_services(self, services: List[dict]) -> None:
        calls, who, names = [], [], []
        for service in services:
            if not service.get("ready"):
                continue
            places = [0] if service["where"] == "head" else range(len(self.nodes)) if service["where"] == \
                "every_node" else [i for i, n in enumerate(self.nodes) if "group " + str(n.get("group")) == service["where"]]
            for index in places:
                calls.append(self.actors[index].service_ready.remote(service))
                who.append(index)
                names.append(service["name"])
        results = self.gather("services", calls, who, self.step_deadline("services")) if calls else []
        for name, index, reason in zip(names, who, results):
            self.checks.append({"check": "service %s on %s" % (name, self.label(index)), "ok": reason is None,
                                "detail": reason or "ready",
                                "fix": None if reason is None else "see the service's log on that node "
                                "(service-%s-node*.log in the agent's log dir)" % name})

    def step_checkpoints(self, directory: Optional[str]) -> None:
        if not directory:
            self.checks.append({"check": "checkpoint directory", "ok": True, "detail": "the task names none"})
            return
        deadline = self.step_deadline("checkpoints")
        every = list(range(len(self.nodes)))
        probe_dir = os.path.join(directory, ".rlhf-tasks-doctor-%d" % int(self.started))
        names = ["%d-%s" % (i, n["token"]) for i, n in enumerate(self.nodes)]
        errors = self.gather("checkpoints", [a.write_marker.remote(probe_dir, name) for a, name in zip(self.actors, names)],
                             every, deadline)
        seen = self.gather("checkpoints", [a.list_markers.remote(probe_dir) for a in self.actors], every, deadline)
        self.gather("checkpoints", [a.remove_marker.remote(probe_dir, name) for a, name in zip(self.actors, names)],
                    every, deadline)
        for index, error in enumerate(errors):
            if error:
                self.checks.append({"check": "checkpoint directory on %s" % self.label(index), "ok": False,
                                    "detail": error, "fix": "make %s writable for the job's user on every node" % directory})
        views = {}  # type: Dict[tuple, List[int]]
        for index, files in enumerate(seen):
            views.setdefault(tuple(f for f in files if f in names), []).append(index)
        shared = max(views.items(), key=lambda kv: len(kv[1]))
        for view, members in views.items():
            if view == shared[0] and len(members) > 1:
                continue
            others = [i for i in every if i not in members]
            if not others:
                continue
            self.checks.append({"check": "checkpoint directory shared", "ok": False,
                                "detail": "%s does not share %s with %s: a file written there is not seen on the "
                                "other nodes, and theirs not there" % (
                                    ", ".join(self.label(i) for i in members), directory,
                                    ", ".join(self.label(i) for i in others)),
                                "fix": "mount the same shared volume at %s on every node (a private or local mount "
                                "hides the others' checkpoints, and a resumed run loses them)" % directory})
        if not any(c["check"].startswith("checkpoint") and not c["ok"] for c in self.checks):
            self.checks.append({"check": "checkpoint directory", "ok": True,
                                "detail": "%s is writable on every node and shared by all %d" % (directory, len(self.nodes))})

    def step_disk(self, checks: dict) -> None:
        results = self.gather("disk", [a.disk.remote(checks.get("checkpoint_dir")) for a in self.actors],
                              list(range(len(self.nodes))), self.step_deadline("disk"))
        need_free, shm = checks.get("min_free_bytes") or 0, checks.get("shm_bytes")
        for index, (node, disk) in enumerate(zip(self.nodes, results)):
            node["free_bytes"], node["shm_bytes"] = disk["free_bytes"], disk["shm_bytes"]
            if disk["free_bytes"] is not None:
                ok = disk["free_bytes"] >= need_free
                self.checks.append({"check": "free disk on %s" % node["label"], "ok": ok,
                                    "detail": "%.1f GB free at %s%s" % (disk["free_bytes"] / 1e9, disk["path"],
                                                                         "" if ok else ", need %.1f GB" % (need_free / 1e9)),
                                    "fix": None if ok else "free space at %s or give the nodes larger disks "
                                    "(resources.disk)" % disk["path"]})
            if shm:
                ok = (disk["shm_bytes"] or 0) >= shm * 0.99
                self.checks.append({"check": "/dev/shm on %s" % node["label"], "ok": ok,
                                    "detail": "%s, the task asks for %.1f GB" % (
                                        "%.1f GB" % (disk["shm_bytes"] / 1e9) if disk["shm_bytes"] else "missing",
                                        shm / 1e9),
                                    "fix": None if ok else "give the container a larger /dev/shm (resources.shm_size; "
                                    "docker --shm-size): NCCL and vLLM fail or crawl without it"})

    # ---------------------------------------------------------------- the result

    def result(self, error: Optional[Failed]) -> dict:
        for check in self.checks:
            if not check["ok"]:
                self.fail("doctor", "%s: %s. %s" % (check["check"], check["detail"], check.get("fix") or ""))
        if error is not None and not any(f["message"] == str(error) for f in self.failures):
            self.failures.append({"step": error.step, "message": str(error)})
        nodes = [{k: n.get(k) for k in ("name", "label", "hostname", "address", "rank", "head", "python", "ray",
                                         "torch", "torch_why", "cuda", "rocm", "nccl", "gpus", "gloo_if", "nccl_if",
                                         "free_bytes", "shm_bytes")} for n in self.nodes]
        passed = not self.failures
        result = {"passed": passed, "failed_step": None if passed else self.failures[0]["step"],
                  "failures": self.failures, "warnings": self.warnings, "notes": self.notes, "checks": self.checks,
                  "nodes": nodes, "collectives": self.collectives, "pairs": self.pairs, "pair_plan": self.pair_plan,
                  "reach": self.reach,
                  "slowest_pair": min(self.pairs, key=lambda p: p["bits_per_s"]) if self.pairs else None,
                  "steps": self.steps, "seconds": round(time.time() - self.started, 2)}
        result["table"] = table(result)
        return result

    def stop(self) -> None:
        ray = sys.modules.get("ray")
        for actor in self.actors:
            if actor is None or ray is None:
                continue
            try:
                ray.kill(actor)
            except Exception:
                pass


def ship_by_value(ray) -> None:
    """Ray pickles the probe's class by reference, and each worker would import it from its own
    sys.path, where a job's working_dir comes first (and may hold another `rlhf_tasks`, a fork
    of this project): the agent's package travels by value instead, so that the probe that runs
    is this one."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[NodeProbe.__module__.split(".")[0]])


def disconnect() -> None:
    """Let go of the cluster main() connected this process to (in the job's gate, where the
    job's command runs next in the same job); none when it never connected (the head agent's word)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def name_nodes(nodes: List[dict]) -> None:
    """Each node's name in the report: its hostname; where hostnames repeat (several nodes on
    one machine, as the local provider runs them) node<rank>, else its address."""
    ranks = [node.get("rank") for node in nodes]
    if len({n["hostname"] for n in nodes}) == len(nodes):
        names = [n["hostname"] for n in nodes]
    elif None not in ranks and len(set(ranks)) == len(nodes):
        names = ["node%s" % rank for rank in ranks]
    else:
        names = [n["address"] for n in nodes]
    for node, name in zip(nodes, names):
        node["name"] = name
        node["label"] = "%s (%s)" % (name, node["address"]) if name != node["address"] else name




def node_limit(deadline: float, now: Optional[float] = None) -> float:
    """Seconds a node gets to say for itself that its part is stuck (a torch import, an all_reduce)
    before the step's deadline: the answer must be back by then, or the node is only named as silent."""
    left = deadline - (time.time() if now is None else now)
    return max(1.0, left - max(ANSWER_MIN_S, ANSWER_SHARE * left))


def duration(seconds: float) -> str:
    if seconds < 90:
        return "%.0f s" % seconds
    if seconds < 5400:
        return "%.0f min" % (seconds / 60)
    return "%.1f h" % (seconds / 3600)


def main(argv: Optional[List[str]] = None, result_file: Optional[str] = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 rlhf_tasks/agent/__main__.py preflight", description="rlhf-tasks preflight (runs as a Ray job)")
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes must be alive")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds for the checks, from when every node is alive")
    parser.add_argument("--wait-nodes", type=float, default=0.0,
                        help="seconds to wait for the nodes to be alive (the head submits preflight as they join)")
    parser.add_argument("--no-torch", dest="torch", action="store_false",
                        help="the job does not use torch: no torch import, no all_reduce (TCP streams only)")
    parser.add_argument("--min-bandwidth-bits", type=float, default=1e9)
    parser.add_argument("--model", default=None)
    parser.add_argument("--weight-bytes", type=float, default=None)
    parser.add_argument("--checks", default=None, help="doctor's checks (JSON): services, checkpoint_dir, shm_bytes")
    parser.add_argument("--early", default=None, metavar="FILE",
                        help="the head agent's record of the checks its node agents ran as each node came up "
                             "(early.py): judged here instead of running them again")
    args = parser.parse_args(argv)
    preflight = Preflight(args)
    error = None
    try:
        preflight.run()
    except Failed as exc:
        error = exc
    except Exception as exc:  # a bug or Ray trouble: still one result line, naming it
        error = Failed("preflight", "%s: %s" % (type(exc).__name__, exc))
    result = preflight.result(error)
    if error is not None:
        say("failed in step %s (the result below says why)" % error.step)
    print(PREFLIGHT_PREFIX + json.dumps(result, sort_keys=True), flush=True)  # the head acts on it at once
    if result_file:  # in the job's gate, on the head: the head agent reads it there without asking the dashboard
        with open(result_file + ".tmp", "w") as handle:
            json.dump({"said": SAID, "result": result}, handle)
        os.replace(result_file + ".tmp", result_file)
    try:
        preflight.stop()
    except Exception:
        pass
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
