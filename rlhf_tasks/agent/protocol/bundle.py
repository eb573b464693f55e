"""A failure's bundle, made the same way on the head and from the launcher: every node's
files read through the head's dashboard (Ray's log API: `/api/v0/logs?node_id=...`,
`/api/v0/logs/file?...`; the head reads its own from disk, in case the dashboard is what
failed): the agent's own (its `rlhf-tasks/` directory inside the node's Ray logs directory),
Ray's logs that matter (raylet, GCS, dashboard agent, the job's driver and its workers'
.err/.out), each tail-capped, and the cluster's state (every node, and why Ray says a dead
one died). It finds each node's first error, scrubs the task's secrets and the Ray token out
of everything, writes one .tar.gz with an index, and words the summary's lines about it.
The head runs it when the run fails (agent/forensics.py); the launcher when it follows a
job from outside and for `rlhf-tasks logs NAME --bundle`.

Standard library only, Python >= 3.8 (it runs on the nodes too).
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import time
import urllib.parse
from typing import Dict, List, Optional, Tuple

from . import auth_headers, http_request

#: Our directory inside each node's Ray logs directory.
OWN = "rlhf-tasks"
TAIL_LINES = 2000          # per file, from its end
TAIL_BYTES = 256 * 1024    # per file, from its end, after TAIL_LINES
MAX_WORKER_FILES = 24      # per node: the job's workers' .err/.out (errors first)
#: Ray's own files that matter for a failure (names in the node's Ray logs directory).
RAY_FILES = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err", "dashboard_agent.log", "dashboard.err",
             "monitor.log")
#: How bad a finding is, for choosing a node's first error: lower wins, then the earliest.
#: Preflight's verdict on a node is its diagnosis of why the run failed: it comes first.
PRIORITY = {"oom": 0, "dead": 0, "preflight": 0, "disk": 1, "exit": 1, "traceback": 2, "agent": 3, "ray": 4}
#: The kinds the summary names (Ray's own ERROR lines only when nothing else was found).
MEANINGFUL = ("oom", "dead", "disk", "exit", "preflight", "traceback", "agent")

_AGENT_TS = re.compile(r"^\[(\d\d:\d\d:\d\d)\] (node\d+|node|\S+): ")
_RAY_TS = re.compile(r"^\[(\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d)[,.]\d+ ([IWEF]) ")
_PY_TS = re.compile(r"^(\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d)[,.]\d+\s+(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_PREFIX = re.compile(r"^\((?:[^()]*?)(?:pid=\d+)?(?:, ip=([\d.]+))?\)\s")
_OOM = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+) \(([^)]*)\)")
_RAY_OOM = re.compile(r"(killed due to the node running low on memory|OutOfMemoryError)")
_EXIT = re.compile(r"(exited with code (-?\d+)|exited \(code (-?\d+)\)|exit code (-?\d+))")
_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Fault)|[A-Za-z_][\w.]*\.\w+Error)\b:?(.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Ray's wrapper of an exception a task or an actor's method raised, in its caller's traceback:
#: `ray.exceptions.RayTaskError(RuntimeError): ray::work() (pid=165, ip=10.99.0.12)`; the cause
#: is the traceback's last exception line, below it.
_RAY_RAISED = re.compile(r"^ray\.exceptions\.RayTaskError(?:\(\w+\))?: (\S+) \(pid=(\d+), ip=([\d.]+)")
#: An actor that died (killed, OOM, crashed): its class, pid and ip follow, indented, then why.
_RAY_DIED = re.compile(r"^ray\.exceptions\.(ActorDiedError|RayActorError)\b")
_DIED_FACT = re.compile(r"^\s+(class_name|pid|ip): (\S+)")


# ------------------------------------------------------------------ finding errors (pure)


def finding(kind: str, message: str, at: Optional[str], where: str, order: int) -> dict:
    """One error found: its kind (PRIORITY), its message, when, in which file, its place there."""
    return {"kind": kind, "error": message.strip()[:500], "at": at, "file": where, "order": order}


def find_errors(text: str, where: str, node_ip: Optional[str] = None, since_uptime: Optional[float] = None) -> List[dict]:
    """Every error in one file's `text` (`where`: its name), in file order: kernel OOM kills
    (a dmesg line "[seconds]" counts only after `since_uptime`), a non-zero exit the agent
    reported, a traceback (its exception line), the agent's own ERROR line, Ray's ERROR or
    FATAL lines. Lines a driver relays from another node (`(pid=.., ip=X)` with X not
    `node_ip`) are that node's, not this file's."""
    found = []  # type: List[dict]
    internal = where in RAY_FILES  # Ray's own components: their tracebacks are Ray's noise more often than a cause
    # The agent's log relays the job's log and a dead service's last lines: their tracebacks are
    # found in the files they come from (the job's driver log, the service's log).
    relay = re.search(r"(^|/)agent-node\d+\.log$", where) is not None
    at = None  # the latest timestamp seen: an untimed line (a traceback) happened then or later
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        raw = _ANSI.sub("", lines[index]).rstrip()
        index += 1
        prefix = _PREFIX.match(raw)
        if prefix:
            if prefix.group(1) and node_ip and prefix.group(1) != node_ip:
                continue
            raw = raw[prefix.end():]
        stamp = _AGENT_TS.match(raw) or _RAY_TS.match(raw) or _PY_TS.match(raw)
        body = raw
        level = None
        if stamp is not None:
            at = stamp.group(1) if stamp.re is _AGENT_TS else stamp.group(2)
            level = stamp.group(3) if stamp.re is not _AGENT_TS else None
            body = raw[stamp.end():].strip()
        oom = _OOM.search(raw)
        if oom:
            boot = re.match(r"^\[\s*(\d+\.\d+)\]", raw)
            if since_uptime is None or boot is None or float(boot.group(1)) >= since_uptime:
                found.append(finding("oom", "the kernel killed %s (pid %s): out of memory" % (oom.group(2), oom.group(1)),
                                      at, where, len(found)))
            continue
        if _RAY_OOM.search(body) and (level in ("E", "F", "ERROR", "CRITICAL", None)):
            found.append(finding("oom", "Ray killed a worker: the node ran low on memory (%s)" % body[:300], at, where,
                                  len(found)))
            continue
        if raw.startswith("Traceback (most recent call last):"):
            exception, raised_on, index = _traceback_cause(lines, index)
            if not relay:
                found.append(finding("ray" if internal else "traceback",
                                      exception or "a traceback without its exception line", at, where, len(found)))
                if raised_on:
                    found[-1]["raised_on"] = raised_on
            continue
        if stamp is not None and stamp.re is _AGENT_TS:
            if body.startswith("ERROR: "):
                found.append(finding("agent", body[len("ERROR: "):], at, where, len(found)))
            elif _EXIT.search(body) and re.search(r"\b(exited|exit code)\b", body) and not re.search(
                    r"exit(ed with)? code 0\b|\(code 0\)", body) and "ended with exit code 0" not in body:
                found.append(finding("exit", body, at, where, len(found)))
            elif body.startswith("disk full: "):
                found.append(finding("disk", body[len("disk full: "):], at, where, len(found)))
            continue
        if level in ("E", "F", "ERROR", "CRITICAL"):
            found.append(finding("ray", body, at, where, len(found)))
            continue
        if stamp is None:
            exc = _EXC.match(raw)
            if exc and where.endswith((".err", ".log", ".out")) and "worker" in where and not raw.startswith("["):
                found.append(finding("traceback", raw, at, where, len(found)))
    return found


def _traceback_cause(lines: List[str], index: int) -> Tuple[Optional[str], Optional[str], int]:
    """A traceback's exception line from `lines[index]` on (just past "Traceback ..."), where
    it was raised, and the index after it. Through Ray's wrappers: a task's or an actor method's
    exception on another node is the last exception line, raised at the wrapper's `ip=`; an
    actor that died is named with its class and pid, and why (its first sentence and Ray's
    list of likely causes, not Ray's advice)."""
    raised_on = raised_in = died = None
    facts = {}  # type: Dict[str, str]
    while index < len(lines):
        nxt = _ANSI.sub("", lines[index]).rstrip()
        pre = _PREFIX.match(nxt)
        if pre:
            nxt = nxt[pre.end():]
        index += 1
        if not nxt or nxt.startswith("Traceback"):
            continue
        if nxt.startswith((" ", "\t")):
            fact = _DIED_FACT.match(nxt) if died else None
            if fact:
                facts[fact.group(1)] = fact.group(2)
            continue
        wrapped = _RAY_RAISED.match(nxt)
        if wrapped:  # the cause follows
            raised_in, raised_on = "%s, pid %s" % (wrapped.group(1), wrapped.group(2)), wrapped.group(3)
            continue
        if _RAY_DIED.match(nxt) and not died:  # why follows its facts
            died = _RAY_DIED.match(nxt).group(1)
            continue
        if died:
            why = re.sub(r"^The actor is dead because ", "", nxt).split(" If the process was killed")[0]
            who = "actor %s (pid %s)" % (facts.get("class_name", "?"), facts.get("pid", "?"))
            return "%s: %s died: %s" % (died, who, why), facts.get("ip") or raised_on, index
        if raised_in:
            return "%s (raised in %s)" % (nxt, raised_in), raised_on, index
        if _RAY_OOM.search(nxt):  # Ray's memory monitor: "Memory on the node (IP: 10.0.0.3, ID: ...)" follows
            node = re.search(r"\(IP: ([\d.]+)", "\n".join(lines[index:index + 3]))
            return nxt, node.group(1) if node else None, index
        return nxt, None, index
    if died:
        return "%s: actor %s (pid %s) died" % (died, facts.get("class_name", "?"), facts.get("pid", "?")), \
            facts.get("ip"), index
    return None, None, index


def first_error(findings: List[dict]) -> Optional[dict]:
    """The one finding that says best what went wrong first: the most telling kind (an OOM
    kill or a node's death, then a process's exit or a full disk, then a traceback, then
    the agent's own error, then Ray's ERROR lines), and of that kind the earliest."""
    if not findings:
        return None
    return min(findings, key=lambda f: (PRIORITY.get(f["kind"], 9), f.get("at") or "99", f.get("seq", 0),
                                        f.get("order", 0)))


def describe(entry: dict) -> str:
    """One node's first error as the summary says it: `node2 (10.0.0.3) at 14:02:11: ... [file]`."""
    who = entry["label"] + (" (%s)" % entry["ip"] if entry.get("ip") and entry["ip"] not in entry["label"] else "")
    at = " at %s" % entry["at"] if entry.get("at") else ""
    short = re.sub(r"^worker-[0-9a-f]{12,}-[0-9a-f]+-(\d+)\.", r"worker-...-\1.", entry.get("file") or "")
    where = " [%s]" % short if short else ""
    return "%s%s: %s%s" % (who, at, entry["error"], where)


def summary_lines(forensics: Optional[dict]) -> List[str]:
    """The summary's lines about a failure: each node's first error, earliest first, then
    where the bundle is."""
    if not forensics:
        return []
    lines = []
    named = [n for n in forensics.get("first_errors") or []]
    if named:
        lines.append("first error on each node:")
        lines += ["  " + describe(n) for n in named]
    elif forensics.get("gathered"):
        lines.append("no node's logs name an error (the bundle holds them all)")
    if forensics.get("bundle"):
        lines.append("every node's logs: %s%s" % (forensics["bundle"], " (%s)" % forensics["where"]
                                                  if forensics.get("where") else ""))
    if forensics.get("problem"):
        lines.append("gathering the logs: %s" % forensics["problem"])
    return lines


def node_order(nodes: List[dict]) -> List[dict]:
    """The nodes whose first error the summary names, earliest first (an error with no time,
    such as a worker's traceback, first of all: a worker's failure is what a driver's later
    error usually reports); only telling kinds (Ray's own ERROR lines only when no node has
    anything else)."""
    named = [n for n in nodes if n.get("first_error") and n["first_error"]["kind"] in MEANINGFUL]
    if not named:
        named = [n for n in nodes if n.get("first_error")]
    return sorted(named, key=lambda n: (n["first_error"].get("at") or "", PRIORITY.get(n["first_error"]["kind"], 9),
                                        n.get("rank", 99)))


def scrub(text: str, secrets: Dict[str, str]) -> str:
    """`text` with every secret's value replaced by `[secret NAME]` (values of 4 characters
    or more: a shorter one would blank out ordinary words)."""
    for name, value in sorted(secrets.items(), key=lambda kv: -len(kv[1] or "")):
        if value and len(value) >= 4:
            text = text.replace(value, "[secret %s]" % name)
    return text


def tail(data: bytes, max_bytes: int = TAIL_BYTES) -> Tuple[bytes, bool]:
    """The last `max_bytes` of `data`, from a line's start; whether it was cut."""
    if len(data) <= max_bytes:
        return data, False
    cut = data[-max_bytes:]
    newline = cut.find(b"\n")
    return (cut[newline + 1:] if 0 <= newline < 4096 else cut), True


def wanted(files: List[str]) -> List[str]:
    """Of a node's Ray log files: ours, Ray's own that matter, the job drivers' logs, and
    the jobs' workers' .err/.out (not idle workers', whose job id is ffffffff; every job's:
    one submission may run several drivers, as a gated job does), at most MAX_WORKER_FILES
    of them, .err first."""
    keep = [f for f in files if f.startswith(OWN + "/") and not f.endswith("/") and not f.endswith(".tar.gz")]
    keep += [f for f in files if f in RAY_FILES or re.match(r"^job-driver-.*\.log$", f)]
    workers = []
    for name in files:
        match = re.match(r"^worker-[0-9a-f]+-([0-9a-f]+)-\d+\.(err|out)$", name)
        if match and match.group(1) != "ffffffff":
            workers.append((match.group(2) != "err", name))
    keep += [name for _, name in sorted(workers)[:MAX_WORKER_FILES]]
    return keep


# ------------------------------------------------------------------ reading nodes' files


class RayLogs(object):
    """Any node's log files through the head's dashboard (Ray's log API)."""

    def __init__(self, dashboard: str, token: Optional[str], timeout: float = 15.0):
        self.dashboard, self.headers, self.timeout = dashboard.rstrip("/"), auth_headers(token), timeout

    def nodes(self) -> List[dict]:
        """Every node Ray knows, dead ones too (with why they died)."""
        status, body = http_request(self.dashboard + "/api/v0/nodes?limit=1000&detail=true", headers=self.headers,
                                    timeout=self.timeout)
        if status != 200:
            raise OSError("HTTP %d listing Ray's nodes" % status)
        return json.loads(body)["data"]["result"]["result"]

    def files(self, node_id: str) -> List[str]:
        names = []
        for pattern in ("*", OWN + "/*"):
            url = "%s/api/v0/logs?%s" % (self.dashboard, urllib.parse.urlencode({"node_id": node_id, "glob": pattern}))
            status, body = http_request(url, headers=self.headers, timeout=self.timeout)
            if status != 200:
                raise OSError("HTTP %d listing node %s's logs: %s" % (status, node_id[:8], body[:200]))
            for group in (json.loads(body).get("data", {}).get("result") or {}).values():
                names += [n for n in group if n not in names]
        return names

    def fetch_head(self, name: str) -> bytes:
        """A whole file of the head's (e.g. its bundle, linked into its Ray logs directory)."""
        head = [n for n in self.nodes() if n.get("is_head_node") and n.get("state") == "ALIVE"]
        if not head:
            raise OSError("no head node is alive")
        return self.read(head[0]["node_id"], name, lines=-1)

    def read(self, node_id: str, name: str, lines: int = TAIL_LINES) -> bytes:
        query = urllib.parse.urlencode({"node_id": node_id, "filename": name, "lines": lines})
        status, body = http_request("%s/api/v0/logs/file?%s" % (self.dashboard, query), headers=self.headers,
                                    timeout=self.timeout)
        if status != 200:
            raise OSError("HTTP %d reading %s" % (status, name))
        return body


def read_local(logs_dir: str, name: str) -> bytes:
    """The tail of a file in this node's Ray logs directory (the head reads its own files
    without the dashboard, which may be what failed)."""
    with open(os.path.join(logs_dir, name), "rb") as handle:
        handle.seek(0, 2)
        size = handle.tell()
        handle.seek(max(0, size - TAIL_BYTES * 2))
        data = handle.read()
    lines = data.split(b"\n")
    return b"\n".join(lines[-TAIL_LINES - 1:])


def list_local(logs_dir: str) -> List[str]:
    names = []
    for entry in sorted(os.listdir(logs_dir)):
        if os.path.isdir(os.path.join(logs_dir, entry)):
            if entry == OWN:
                names += [OWN + "/" + e for e in sorted(os.listdir(os.path.join(logs_dir, OWN)))]
        else:
            names.append(entry)
    return names


#: How long the gathering waits for a node that just joined to link its agent's files (its
#: supervising loop does so within a second or two of its Ray starting).
OWN_FILES_WAIT_S = 5.0


def own_files_listed(ray: "RayLogs", node_id: str, deadline: float) -> List[str]:
    """A node's log files, once its agent's own are among them (a job can fail within a
    second of a node's joining), or whatever is there after OWN_FILES_WAIT_S."""
    until = min(deadline, time.monotonic() + OWN_FILES_WAIT_S)
    while True:
        names = ray.files(node_id)
        if any(n.startswith(OWN + "/agent-node") for n in names) or time.monotonic() >= until:
            return names
        time.sleep(0.5)


def gather(ray: Optional[RayLogs], secrets: Dict[str, str], reason: str, local: Optional[Tuple[str, str]] = None,
           started_ms: int = 0, extra: Optional[Dict[str, List[dict]]] = None, deadline_s: float = 90.0) -> dict:
    """Read every node's files (`ray`: through the dashboard; `local`: (the head's address,
    its own Ray logs directory) read here) and find each node's errors. `extra`: findings the
    caller knows of, by node address (e.g. preflight's verdict). The result's "files" hold the
    scrubbed contents, for write_bundle."""
    deadline = time.monotonic() + deadline_s
    problems = []  # type: List[str]
    try:
        known = ray.nodes() if ray is not None else []
    except (OSError, ValueError, KeyError) as exc:
        known, problems = [], ["Ray's node list: %s" % exc]
    if local and not any(n.get("is_head_node") and n.get("state") == "ALIVE" for n in known):
        known = [{"node_id": "", "node_ip": local[0], "is_head_node": True, "state": "ALIVE"}] + \
            [n for n in known if not n.get("is_head_node")]
    nodes, files = [], []  # type: List[dict], List[dict]
    alive_ips = {n.get("node_ip") for n in known if n.get("state") == "ALIVE"}
    for node in sorted(known, key=lambda n: (not n.get("is_head_node"), n.get("state") != "ALIVE", n.get("node_ip"))):
        ip, state = node.get("node_ip"), node.get("state")
        entry = {"node_id": node.get("node_id"), "ip": ip, "state": state, "head": bool(node.get("is_head_node")),
                 "label": "node0" if node.get("is_head_node") else ip, "files": [], "findings": []}
        if state != "ALIVE":
            if (node.get("end_time_ms") or 0) < started_ms or ip in alive_ips:
                continue  # an earlier run's node, or one that came back
            why = node.get("state_message") or "no reason given"
            entry["findings"].append(finding("dead", "lost: Ray marked the node DEAD (%s)" % why,
                                              _clock(node.get("end_time_ms")), "Ray's node list", 0))
            nodes.append(entry)
            continue
        head_here = bool(local) and bool(node.get("is_head_node"))
        try:
            names = list_local(local[1]) if head_here else own_files_listed(ray, node["node_id"], deadline)
        except (OSError, ValueError) as exc:
            problems.append("listing %s's logs: %s" % (ip, exc))
            names = []
        for name in wanted(names):
            if time.monotonic() > deadline:
                problems.append("the gathering's deadline of %.0fs passed; some files are left out" % deadline_s)
                break
            try:
                data = read_local(local[1], name) if head_here else ray.read(node["node_id"], name)
            except (OSError, ValueError) as exc:
                problems.append("reading %s on %s: %s" % (name, ip, exc))
                continue
            data, cut = tail(data)
            text = scrub(data.decode("utf-8", "replace"), secrets)
            rank = re.match(r"^%s/agent-node(\d+)\.log$" % OWN, name)
            if rank:
                entry["label"], entry["rank"] = "node%s" % rank.group(1), int(rank.group(1))
            found = find_errors(text, name, ip)
            for f in found:
                f["seq"] = len(entry["files"])
            entry["files"].append(name)
            entry["findings"] += found
            files.append({"node": ip, "name": name, "text": text, "truncated": cut or len(text.splitlines()) >= TAIL_LINES,
                          "found": [f["kind"] + ": " + f["error"] for f in found][:20]})
        nodes.append(entry)
    for ip, found in (extra or {}).items():
        for entry in nodes:
            if entry["ip"] == ip:
                entry["findings"] = list(found) + entry["findings"]
    by_ip = {entry["ip"]: entry for entry in nodes}
    for entry in nodes:  # a task's or an actor's error, found in its caller's log, is the node's it was raised on
        for f in [f for f in entry["findings"] if by_ip.get(f.get("raised_on"), entry) is not entry]:
            entry["findings"].remove(f)
            f["file"] = "%s/%s" % (entry["label"], f["file"])
            by_ip[f["raised_on"]]["findings"].append(f)
    labels = {}  # the file entries carry their node's label once it is known
    for entry in nodes:
        entry["first_error"] = first_error(entry["findings"])
        if entry["first_error"]:
            entry["first_error"]["error"] = scrub(entry["first_error"]["error"], secrets)
        labels[entry["ip"]] = entry["label"]
    for f in files:
        f["label"] = labels.get(f["node"], f["node"])
    named = node_order(nodes)
    return {"reason": scrub(reason or "", secrets), "made_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "nodes": [{k: v for k, v in n.items() if k != "findings"} for n in nodes],
            "first_errors": [{"label": n["label"], "ip": n["ip"], "error": n["first_error"]["error"],
                              "kind": n["first_error"]["kind"], "at": n["first_error"]["at"],
                              "file": n["first_error"]["file"]} for n in named],
            "files": files, "state": scrub(json.dumps(known, indent=2, sort_keys=True), secrets),
            "problems": [scrub(p, secrets) for p in problems]}


def _clock(ms) -> Optional[str]:
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000.0)) if ms else None


def write_bundle(gathered: dict, directory: str, name: str) -> str:
    """One .tar.gz in `directory`: every file under <node label>/, index.json and index.txt
    (which file came from which node, what was found in it), nodes.json (Ray's view)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = "forensics-%s-%s" % (re.sub(r"[^A-Za-z0-9_.-]+", "-", name), stamp)
    path = os.path.join(directory, stem + ".tar.gz")
    index = {"reason": gathered["reason"], "made_at": gathered["made_at"], "problems": gathered["problems"],
             "first_errors": gathered["first_errors"],
             "nodes": [{"label": n["label"], "ip": n["ip"], "state": n["state"], "head": n["head"],
                        "first_error": n.get("first_error")} for n in gathered["nodes"]], "files": []}
    members = []  # (arcname, bytes)
    for f in gathered["files"]:
        arc = "%s/%s" % (f["label"], f["name"])
        members.append((arc, f["text"].encode("utf-8")))
        index["files"].append({"file": arc, "node": f["label"], "address": f["node"], "from": f["name"],
                               "truncated": f["truncated"], "found": f["found"]})
    text = ["rlhf-tasks failure bundle, made %s" % gathered["made_at"], "why: %s" % gathered["reason"], ""]
    text += summary_lines({"first_errors": gathered["first_errors"], "gathered": True})
    text += ["", "nodes:"] + ["  %s %s %s%s" % (n["label"], n["ip"], n["state"], " (head)" if n["head"] else "")
                               for n in gathered["nodes"]]
    text += ["", "files (node, file, what was found):"]
    for entry in index["files"]:
        text.append("  %s%s" % (entry["file"], " (tail)" if entry["truncated"] else ""))
        text += ["      " + line for line in entry["found"][:5]]
    if gathered["problems"]:
        text += ["", "not gathered:"] + ["  " + p for p in gathered["problems"]]
    members += [("index.json", json.dumps(index, indent=2, sort_keys=True).encode()),
                ("index.txt", ("\n".join(text) + "\n").encode()), ("nodes.json", gathered["state"].encode())]
    os.makedirs(directory, exist_ok=True)
    with tarfile.open(path + ".tmp", "w:gz") as tar:
        for arc, data in members:
            info = tarfile.TarInfo("%s/%s" % (stem, arc))
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
            tar.addfile(info, io.BytesIO(data))
    os.replace(path + ".tmp", path)
    os.chmod(path, 0o600)
    return path


def result_part(gathered: dict, bundle: Optional[str]) -> dict:
    """What the head's result line carries: each node's first error and the bundle's path."""
    return {"bundle": bundle, "gathered": True, "problem": "; ".join(gathered["problems"][:3]) or None,
            "first_errors": gathered["first_errors"]}


def bundle_from(dashboard: str, token: Optional[str], secrets: Dict[str, str], directory: str, name: str,
                reason: str) -> Tuple[str, dict]:
    """A bundle of a running cluster made from outside it (`rlhf-tasks logs NAME --bundle`):
    every node through the dashboard. Its path, and the summary's part."""
    gathered = gather(RayLogs(dashboard, token), secrets, reason)
    bundle = write_bundle(gathered, directory, name)
    return bundle, dict(result_part(gathered, bundle), nodes=len(gathered["nodes"]))
