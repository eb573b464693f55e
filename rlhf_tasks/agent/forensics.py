"""Failure forensics, the node's side: every node agent keeps its own evidence where Ray's
log API can read it (a `rlhf-tasks/` directory inside the node's Ray logs directory: the
agent's log, `ray start`'s and the services' output, a facts file with disk, /dev/shm and
memory usage and the kernel's OOM kills since the agent started), so one path reads any
node's files through the head's dashboard on every provider. When the run fails, the head
gathers every node's files before anything is torn down (protocol/bundle.py: the reading,
each node's first error, the scrubbing and the bundle, which the launcher uses too), writes
the bundle beside its own logs and links it where the launcher can fetch it.

Standard library only, Python >= 3.8 (it runs on the nodes).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

from .protocol import log
from .protocol.bundle import OWN, RayLogs, describe, finding, gather, result_part, write_bundle

FACTS = "node-facts.txt"
FACTS_EVERY_S = 5.0


# ------------------------------------------------------------------ every node keeps its evidence


def ray_logs_dir(plan: dict, rank: int) -> str:
    """This node's Ray logs directory (its current session's)."""
    temp = ("%s/n%d" % (plan["ray"]["temp_dir"], rank)) if plan["ray"].get("temp_dir") else "/tmp/ray"
    return os.path.join(temp, "session_latest", "logs")


def uptime() -> Optional[float]:
    try:
        with open("/proc/uptime") as handle:
            return float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Tee(object):
    """The agent's stdout, also written to a file (its log, for the bundle)."""

    def __init__(self, stream, path: str):
        self.stream, self.file = stream, open(path, "a")

    def write(self, text: str) -> int:
        try:
            self.file.write(text)
        except (OSError, ValueError):
            pass
        return self.stream.write(text)

    def flush(self) -> None:
        try:
            self.file.flush()
        except (OSError, ValueError):
            pass
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def tee_stdout(log_dir: str, rank: int) -> str:
    """From now on the agent's own lines also go to `agent-node<rank>.log` in its log directory."""
    path = os.path.join(log_dir, "agent-node%d.log" % rank)
    if not isinstance(sys.stdout, Tee):
        sys.stdout = Tee(sys.stdout, path)
    return path


class Keeper(object):
    """On every node: link the agent's files into Ray's logs directory (where the log API
    reads them), keep the facts file current, and say when a service the agent started
    has exited (a non-zero exit is a first error)."""

    def __init__(self, node):
        self.node = node
        self.rank = node.info.rank
        self.linked = None  # type: Optional[str]
        self.started_uptime = uptime()
        self.facts_at = 0.0
        self.told = set()  # services whose exit was said

    def own_files(self) -> List[str]:
        node, rank = self.node, self.rank
        names = ["agent-node%d.log" % rank, "ray-node%d.log" % rank, FACTS, "preflight.json"]
        names += ["service-%s-node%d.log" % (s["name"], rank) for s in node.plan["services"]]
        return [os.path.join(node.log_dir, n) for n in names]

    def link(self) -> None:
        logs = ray_logs_dir(self.node.plan, self.rank)
        if not os.path.isdir(logs):
            return
        own = os.path.join(logs, OWN)
        try:
            os.makedirs(own, exist_ok=True)
            for path in self.own_files():
                target = os.path.join(own, os.path.basename(path))
                if os.path.exists(path) and not os.path.lexists(target):
                    os.symlink(os.path.abspath(path), target)
        except OSError:
            return
        self.linked = own

    def facts(self, shared: bool = False) -> str:
        """Disk, /dev/shm and memory usage, and the kernel's OOM kills since this agent started
        (`shared`: the checkpoint directory too, whose network filesystem could hang a
        supervising loop, so only when gathering)."""
        node = self.node
        stamp = "[%s] node%d: " % (time.strftime("%H:%M:%S"), self.rank)
        lines = ["%sfacts at %s on %s" % (stamp, time.strftime("%Y-%m-%d %H:%M:%S %Z"), os.uname()[1])]
        places = ["/", "/tmp", "/dev/shm", node.log_dir, (node.plan.get("checkpoint_dir") or "") if shared else "",
                  os.path.dirname(os.path.dirname(ray_logs_dir(node.plan, self.rank)))]
        seen = set()
        for place in places:
            if not place or not os.path.isdir(place):
                continue
            try:
                st = os.statvfs(place)
            except OSError:
                continue
            key = (st.f_blocks, st.f_bfree, st.f_files)
            if key in seen and place != "/dev/shm":
                continue
            seen.add(key)
            total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
            used = 100.0 * (total - free) / total if total else 0.0
            lines.append("%sdisk %s: %.1f of %.1f GiB used (%.0f%%), %.1f GiB free" % (
                stamp, place, (total - free) / 2.0 ** 30, total / 2.0 ** 30, used, free / 2.0 ** 30))
            if total and free < 64 * 2 ** 20:
                lines.append("%sdisk full: %s has %.0f MiB left of %.1f GiB" % (stamp, place, free / 2.0 ** 20,
                                                                                 total / 2.0 ** 30))
        try:
            with open("/proc/meminfo") as handle:
                mem = dict((l.split(":")[0], l.split(":")[1].strip()) for l in handle if ":" in l)
            lines.append("%smemory: %s total, %s available" % (stamp, mem.get("MemTotal"), mem.get("MemAvailable")))
        except OSError:
            pass
        lines += ["%skernel: %s" % (stamp, line) for line in oom_lines(self.started_uptime)]
        return "\n".join(lines) + "\n"

    def tick(self, force: bool = False) -> None:
        """Cheap; call it from a supervising loop. Never raises."""
        try:
            self.say_exits()
            now = time.monotonic()
            if force or now - self.facts_at >= FACTS_EVERY_S:
                self.facts_at = now
                path = os.path.join(self.node.log_dir, FACTS)
                with open(path + ".tmp", "w") as handle:
                    handle.write(self.facts(shared=force))
                os.replace(path + ".tmp", path)
            self.link()  # every time: a file the agent makes later (a service's log) is linked too
        except Exception as exc:  # forensics must never fail the run
            if force:
                log("forensics: could not keep this node's facts: %s" % exc)

    def say_exits(self) -> None:
        for child in self.node.services:
            if child.name not in self.told and not child.alive():
                self.told.add(child.name)
                code = child.proc.returncode
                code = code if code >= 0 else "%d (killed by signal %d)" % (code, -code)
                log("service %s exited with code %s; its last lines:\n%s" % (child.name, code, child.tail(10)))


_DMESG_REFUSED = []  # type: List[bool]


def oom_lines(since_uptime: Optional[float]) -> List[str]:
    """The kernel's lines about OOM kills since `since_uptime` (seconds since boot), where
    `dmesg` is readable; [] otherwise."""
    if _DMESG_REFUSED or not shutil.which("dmesg"):
        return []
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is None or out.returncode != 0:  # not readable here (a container without CAP_SYSLOG): stop asking
        _DMESG_REFUSED.append(True)
        return []
    found = []
    for line in out.stdout.splitlines():
        if not re.search(r"Out of memory|oom-kill|oom_reaper|invoked oom-killer", line):
            continue
        boot = re.match(r"^\[\s*(\d+\.\d+)\]", line)
        if since_uptime is not None and boot is not None and float(boot.group(1)) < since_uptime:
            continue
        found.append(line)
    return found[-50:]


def keeper(node) -> Keeper:
    """The node's Keeper (made once)."""
    kept = getattr(node, "_forensics_keeper", None)
    if kept is None:
        kept = Keeper(node)
        node._forensics_keeper = kept
    return kept


# ------------------------------------------------------------------ the head, when the run fails


def preflight_findings(result: Optional[dict], at: Optional[str] = None) -> Dict[str, List[dict]]:
    """Preflight's failures (its verdict came at `at`), on the node each one names first (`nodeN (address)`)."""
    found = {}  # type: Dict[str, List[dict]]
    for failure in (result or {}).get("failures") or []:
        match = re.match(r"^(node\d+) \(([^)]+)\)", failure.get("message", ""))
        if match:
            found.setdefault(match.group(2), []).append(finding(
                "preflight", "preflight (%s): %s" % (failure["step"], failure["message"]), at,
                "preflight.json", 0))
    return found


def on_failure(node, reason: str, preflight: Optional[dict] = None, started_ms: int = 0,
               preflight_at: Optional[str] = None) -> dict:
    """The head, when the run failed and before anything is torn down: gather every node's
    files, write the bundle beside the head's logs, log each node's first error; the part
    of the result line that says so. Never raises."""
    try:
        keeper(node).tick(force=True)
        plan = node.plan
        secrets = {name: node.env.get(name, "") for name in plan.get("secrets") or []}
        if node.token:
            secrets["RAY_AUTH_TOKEN"] = node.token
        started = time.monotonic()
        ray = RayLogs(node.dashboard, node.token) if node.ray is not None and node.ray.alive() else None
        gathered = gather(ray, secrets, reason, local=(node.info.node_addr, ray_logs_dir(plan, node.info.rank)),
                          started_ms=started_ms, extra=preflight_findings(preflight, preflight_at))
        bundle = write_bundle(gathered, node.log_dir, plan["name"])
        own = os.path.join(ray_logs_dir(plan, node.info.rank), OWN)
        if os.path.isdir(own):  # where the launcher can fetch it through the dashboard
            try:
                os.symlink(os.path.abspath(bundle), os.path.join(own, os.path.basename(bundle)))
            except OSError:
                pass
        part = result_part(gathered, bundle)
        log("forensics: %d files from %d nodes in %.1fs; first errors: %s; every node's logs: %s" % (
            len(gathered["files"]), len(gathered["nodes"]), time.monotonic() - started,
            "; ".join(describe(e) for e in gathered["first_errors"]) or "none found", bundle))
        return part
    except Exception as exc:  # the run's own failure is what matters: never hide it behind this one
        log("forensics: gathering the nodes' logs failed: %s" % exc)
        return {"bundle": None, "gathered": False, "problem": str(exc), "first_errors": []}
