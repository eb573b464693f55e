"""Node agent: runs on every node of the cluster and turns it into a Ray node.

Standard library only and Python >= 3.8, so this one file can be shipped into any
training image beside the plan (`python3 node.py --plan plan.json`). It knows no
provider: the plan carries the provider's environment contract as data (which
variable, which item of which list, which template, which command), and this file
only interprets those rules. Then:

  head (rank 0): prepare data, `ray start --head` on the private address, open the ready
                 beacon once its GCS serves; once its dashboard answers, submit preflight
                 and (job.submit: head) the job behind a gate, so that both start up while
                 the workers join; start the services and wait until they answer, wait
                 until every node is ALIVE and preflight passed, then open the gate,
                 follow the job, exit with its result.
  worker:        wait for the head's ready beacon, `ray start --address`, start the
                 every-node services, supervise the raylet until the head goes away.
  both:          `ray start`'s interpreter is started first and imports Ray's CLI while
                 the node waits (for prepare, or for the head).

In `job.mode: every_node` (torchrun and the like) there is no Ray: every node runs the
job's command itself, with {rank}, {nodes} and {head_addr} filled in, once the head has
prepared and its beacon answers, and exits with that command's code. What the agent
starts runs in sessions of its own and dies with the agent, even by SIGKILL.

Every step prints one timestamped line; the agent ends with one structured result
line (`RLHF_TASKS_RESULT {json}`) that the launcher reads. Secrets are passed by
variable name and never printed. No fixed sleeps: every wait polls its condition
against a deadline.

The jobs core (submission ids, the entrypoint with its W&B decision, following a job)
lives here too, and the launcher's Jobs client uses the same functions.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

#: The plan format this agent reads; the launcher writes the same number.
PLAN_VERSION = 3
RESULT_PREFIX = "RLHF_TASKS_RESULT "
TERMINAL_JOB_STATES = ("SUCCEEDED", "FAILED", "STOPPED")
JOB_LOG_TAIL_CHARS = 64 * 1024  # how much of the job's log the result line repeats


class _Log(object):
    label = "node"

    def __call__(self, message: str) -> None:
        print("[%s] %s: %s" % (time.strftime("%H:%M:%S"), self.label, message), flush=True)


log = _Log()


class AgentError(Exception):
    """A step failed; the message names it. `code` 2 means the plan or environment is wrong."""

    def __init__(self, step: str, message: str, code: int = 1):
        Exception.__init__(self, "%s failed: %s" % (step, message))
        self.step, self.code = step, code


# ======================================================================================
# The provider's environment contract, read through the plan's rules.
# ======================================================================================

class NodeInfo(object):
    """This node's place in the cluster."""

    def __init__(self, rank: int, nodes: int, head: Optional[str], node_addr: Optional[str] = None,
                 cluster_id: Optional[str] = None, gpus: Optional[int] = None, peer: Optional[str] = None):
        self.rank, self.nodes, self.head, self.node_addr = rank, nodes, head, node_addr
        self.cluster_id, self.gpus, self.peer = cluster_id, gpus, peer

    def __repr__(self) -> str:
        return "NodeInfo(%r)" % self.__dict__


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


# ======================================================================================
# Waiting: poll a condition against a deadline, with progress and a diagnosis.
# ======================================================================================

def wait_for(what: str, check: Callable[[], Tuple[bool, object]], timeout_s: float, interval: float = 0.2,
             max_interval: float = 2.0, progress_every: float = 10.0, report: Callable[[str], None] = None):
    """Call `check()` until it returns (True, value); it returns (False, reason) otherwise.

    Backs off from `interval` to `max_interval`, prints progress every `progress_every`
    seconds, and raises AgentError naming what was awaited, for how long, and the last
    reason when `timeout_s` passes."""
    report = report or log
    start = time.monotonic()
    next_report = start + progress_every
    delay = interval
    while True:
        done, value = check()
        if done:
            return value
        now = time.monotonic()
        if now - start >= timeout_s:
            raise AgentError("waiting for %s" % what, "not ready after %.0fs (last: %s)" % (now - start, value))
        if now >= next_report:
            report("waiting for %s: %.0fs of %.0fs (%s)" % (what, now - start, timeout_s, value))
            next_report = now + progress_every
        time.sleep(min(delay, max(0.0, timeout_s - (now - start))))
        delay = min(delay * 1.5, max_interval)


def probe_tcp(host: str, port: int, timeout: float = 2.0) -> Optional[str]:
    """None when host:port accepts a connection, else why not, in words."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return "name %s does not resolve (%s)" % (host, exc.strerror)
    last = "no address"
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(addr)
            return None
        except socket.timeout:
            last = "connecting to %s:%s timed out" % (addr[0], port)
        except ConnectionRefusedError:
            last = "connection to %s:%s refused" % (addr[0], port)
        except OSError as exc:
            last = "cannot reach %s:%s (%s)" % (addr[0], port, os.strerror(exc.errno) if exc.errno else exc)
        finally:
            sock.close()
    return last


def reachable(probe: Callable[..., Optional[str]], *args) -> Callable[[], Tuple[bool, object]]:
    """A wait_for check from a probe that returns None when ready, else the reason why not."""
    def check():
        reason = probe(*args)
        return reason is None, reason
    return check


def probe_ready(host: str, port: int, timeout: float = 2.0) -> Optional[str]:
    """None when the head's ready beacon at host:port answers "ready", else why not."""
    reason = probe_tcp(host, port, timeout)
    if reason is not None:
        return reason
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            answer = sock.recv(16)
    except OSError as exc:
        return "the ready beacon at %s:%s failed (%s)" % (host, port, exc)
    return None if answer.startswith(b"ready") else "%s:%s is not a ready beacon" % (host, port)


class ReadyBeacon(object):
    """A tiny TCP server on the head that answers "ready" once the head's GCS serves.

    Workers join when it answers (their `ray start` has its CLI imported by then, see
    Node.prestart_ray), not on a port that might be anyone's, and leave when it goes."""

    def __init__(self, host: str, port: int):
        import threading

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        threading.Thread(target=self._serve, name="ready-beacon", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            try:
                conn.sendall(b"ready\n")
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def http_request(url: str, method: str = "GET", body=None, headers: Optional[dict] = None,
                 timeout: float = 5.0) -> Tuple[int, bytes]:
    """(status, body bytes); raises OSError with a readable reason when there is no answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, socket.gaierror):
            raise OSError("name in %s does not resolve" % url)
        if isinstance(reason, ConnectionRefusedError):
            raise OSError("connection to %s refused" % url)
        raise OSError("no answer from %s (%s)" % (url, reason))
    except socket.timeout:
        raise OSError("request to %s timed out" % url)


def http_check(url: str, method: str = "GET", body=None, headers: Optional[dict] = None) -> Tuple[bool, object]:
    """A wait_for check: ready when the request answers below 400."""
    try:
        status, _ = http_request(url, method, body, headers, timeout=5.0)
    except OSError as exc:
        return False, str(exc)
    return (True, status) if status < 400 else (False, "HTTP %d from %s %s" % (status, method, url))


# ======================================================================================
# Ray through its dashboard REST API (no ray import: this runs before Ray exists).
# ======================================================================================

def auth_headers(token: Optional[str]) -> Dict[str, str]:
    return {"Authorization": "Bearer %s" % token} if token else {}


def alive_nodes(dashboard: str, token: Optional[str]) -> List[dict]:
    """Nodes the GCS reports ALIVE, from the State API (fast; `ray status` lags)."""
    url = (dashboard + "/api/v0/nodes?limit=1000&detail=true"
           "&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE")
    status, body = http_request(url, headers=auth_headers(token), timeout=10.0)
    if status in (401, 403):
        raise AgentError("asking Ray for its nodes", "the dashboard refused our token (HTTP %d)" % status)
    if status != 200:
        raise OSError("HTTP %d from %s" % (status, url))
    return json.loads(body)["data"]["result"]["result"]


def head_address(dashboard: str, token: Optional[str]) -> str:
    """The head node's address as Ray knows it; a named failure when no head is alive."""
    try:
        nodes = alive_nodes(dashboard, token)
    except OSError as exc:
        raise AgentError("finding the Ray head", str(exc))
    for node in nodes:
        if node.get("is_head_node"):
            return node["node_ip"]
    raise AgentError("finding the Ray head", "no head node is alive in the cluster at %s (%d nodes alive)"
                     % (dashboard, len(nodes)))


def cluster_check(dashboard: str, token: Optional[str], nodes: int, cpus: float = 0, gpus: float = 0):
    """A wait_for check: every expected node ALIVE, with its CPUs and GPUs registered."""
    def check():
        try:
            alive = alive_nodes(dashboard, token)
        except OSError as exc:
            return False, str(exc)
        total = {"CPU": 0.0, "GPU": 0.0}
        for node in alive:
            for key in total:
                total[key] += node.get("resources_total", {}).get(key, 0.0)
        have = "%d/%d nodes alive, %g CPUs, %g GPUs" % (len(alive), nodes, total["CPU"], total["GPU"])
        if len(alive) < nodes or total["CPU"] < (cpus or 0) or total["GPU"] < (gpus or 0):
            return False, have
        return True, have
    return check


# ======================================================================================
# Jobs: one core for the head agent and the launcher's client.
# ======================================================================================

def submission_id(name: str, cluster_key: str, attempt: int = 0) -> str:
    """The job's id on its cluster: `<task>-<cluster>` (`-r<k>` for the k-th restart).
    Stable, so a retried submission finds the first one instead of starting a second."""
    sid = re.sub(r"[^A-Za-z0-9_-]+", "-", "%s-%s" % (name, cluster_key)).strip("-")
    return "%s-r%d" % (sid, attempt) if attempt else sid


def next_submission_id(sid: str) -> str:
    """The id of the restart after `sid` (`<task>-<cluster>-r<k+1>`)."""
    match = re.match(r"^(.*)-r(\d+)$", sid)
    return "%s-r%d" % (match.group(1), int(match.group(2)) + 1) if match else sid + "-r1"


def is_submission_of(name: str, sid: str) -> bool:
    return sid.startswith(name + "-")


def job_argv(job: dict, head_addr: str, node_addr: str, env: Dict[str, str]) -> Tuple[List[str], Optional[str]]:
    """The job's command line on this cluster, and what was decided about W&B (None when
    the recipe has no W&B flags): W&B flags are added only when WANDB_API_KEY is given."""
    argv = [arg.replace("{head_addr}", head_addr).replace("{node_addr}", node_addr) for arg in job["entrypoint"]]
    if not job.get("wandb_args"):
        return argv, None
    if env.get("WANDB_API_KEY"):
        return argv + list(job["wandb_args"]), "W&B logging on (WANDB_API_KEY provided)"
    return argv, "W&B logging off: WANDB_API_KEY was not provided"


class DashboardJobs(object):
    """The Ray Jobs REST API with the standard library (the launcher uses Ray's own client)."""

    def __init__(self, dashboard: str, token: Optional[str]):
        self.dashboard, self.token = dashboard, token

    def status(self, sid: str) -> Optional[str]:
        """The job's status, or None when no such job exists."""
        status, body = http_request("%s/api/jobs/%s" % (self.dashboard, sid), headers=auth_headers(self.token))
        if status == 404:
            return None
        if status != 200:
            raise OSError("HTTP %d asking for job %s" % (status, sid))
        return json.loads(body)["status"]

    def logs(self, sid: str) -> str:
        status, body = http_request("%s/api/jobs/%s/logs" % (self.dashboard, sid), headers=auth_headers(self.token))
        return json.loads(body).get("logs", "") if status == 200 else ""

    def stop(self, sid: str) -> bool:
        status, _ = http_request("%s/api/jobs/%s/stop" % (self.dashboard, sid), "POST", {}, auth_headers(self.token))
        return status < 400

    def submit(self, sid: str, argv: List[str], timeout_s: float = 120.0) -> None:
        request = {"entrypoint": " ".join(shlex.quote(a) for a in argv), "submission_id": sid}

        def send():
            status, body = http_request(self.dashboard + "/api/jobs/", "POST", request, auth_headers(self.token),
                                        timeout=30.0)
            if status < 400:
                return None
            return status >= 500, "HTTP %d: %s" % (status, body.decode("utf-8", "replace")[:2000])
        self.submit_with(sid, send, timeout_s)

    def submit_with(self, sid: str, send: Callable[[], Optional[Tuple[bool, str]]], timeout_s: float = 120.0) -> None:
        """Submit job `sid` with `send()` (None when it was taken, else whether to try again
        and why not). The dashboard takes a job only once the head's job agent is up (it
        waits 10 s for it, then answers 500), which may be later than the dashboard itself:
        retry until `timeout_s`. A try that timed out may have landed: look before each."""
        def attempt():
            try:
                if self.status(sid) is not None:
                    return True, sid
                refused = send()
                if refused is None or self.status(sid) is not None:
                    return True, sid
            except OSError as exc:
                return False, str(exc)
            again, why = refused
            if not again:
                raise AgentError("submitting job %s" % sid, why)
            return False, why
        wait_for("the Jobs API to take job %s" % sid, attempt, timeout_s, interval=0.5, max_interval=2.0)


class JobFollower(object):
    """Print a job's log as it grows until the job ends. `jobs` is anything with
    status/logs/stop (DashboardJobs here, the launcher's Jobs client there); `shown` is
    how much of the log has been printed, so a caller that loses the dashboard knows
    where to go on from."""

    def __init__(self, jobs, sid: str, out=None):
        self.jobs, self.sid, self.out = jobs, sid, out or sys.stdout
        self.shown = 0
        self.log_text = ""
        self.last_growth = time.monotonic()  # when the log last grew (for stall detection)

    def run(self, timeout_s: Optional[float] = None, watch: Optional[Callable[[str], None]] = None) -> str:
        """The job's final status. `watch(status)` runs on every poll and may raise to
        give up (e.g. the Ray head died). At `timeout_s` the job is stopped and this fails."""
        started, delay = time.monotonic(), 0.5
        while True:
            status = self.jobs.status(self.sid)
            text = self.jobs.logs(self.sid)
            if len(text) > self.shown:
                self.out.write(text[self.shown:])
                self.out.flush()
                self.shown, self.log_text, delay = len(text), text, 0.5
                self.last_growth = time.monotonic()
            if status in TERMINAL_JOB_STATES:
                return status
            if timeout_s and time.monotonic() - started > timeout_s:
                self.jobs.stop(self.sid)
                raise AgentError("running job %s" % self.sid,
                                 "still %s after the job timeout of %.0fs; stopped it" % (status, timeout_s))
            if watch is not None:
                watch(status)
            time.sleep(delay)
            delay = min(delay * 1.5, 3.0)


class Gate(object):
    """A file on the head that a job submitted early waits behind (`node.py gate FILE ...`,
    its entrypoint's wrapper): the job's supervisor and driver start while the nodes are
    still joining, and its command runs the moment the head writes "go" (every node ALIVE,
    preflight passed), or never, when the head writes "stop: why"."""

    def __init__(self, path: str):
        self.path = path
        if os.path.exists(path):
            os.remove(path)

    def wrap(self, argv: List[str], timeout_s: float) -> List[str]:
        return ["python3", os.path.abspath(__file__), "gate", self.path, "%.0f" % timeout_s, "--"] + argv

    def open(self) -> None:
        self._write("go\n")

    def close(self, why: str) -> None:
        self._write("stop: %s\n" % why)

    def _write(self, word: str) -> None:
        with open(self.path + ".tmp", "w") as handle:
            handle.write(word)
        os.replace(self.path + ".tmp", self.path)


def gate_main(argv: List[str]) -> int:
    """`node.py gate FILE TIMEOUT_S -- CMD...`: wait for the head's word in FILE, then
    become CMD (exec: the job's process is the command's), or exit 1 saying why not."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: node.py gate FILE TIMEOUT_S -- CMD...", file=sys.stderr)
        return 2
    path, timeout_s, command = argv[0], float(argv[1]), argv[3:]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as handle:
                word = handle.read()
        except FileNotFoundError:
            word = ""
        if word.startswith("go"):
            try:
                os.execvp(command[0], command)
            except OSError as exc:
                print("rlhf-tasks: cannot run %s: %s" % (command[0], exc), file=sys.stderr, flush=True)
                return 127
        if word.startswith("stop"):
            print("rlhf-tasks: the job's command was not started: %s" % word[5:].strip(), flush=True)
            return 1
        if time.monotonic() > deadline:
            print("rlhf-tasks: the job's command was not started: the head gave no word within %.0fs" % timeout_s,
                  flush=True)
            return 1
        time.sleep(0.05)


def result_line(result: dict) -> str:
    return RESULT_PREFIX + json.dumps(result, sort_keys=True)


def last_json_line(text: str, prefix: str) -> Optional[dict]:
    """The JSON after `prefix` on the last line of `text` that holds it, or None. The prefix
    may stand after another (SkyPilot's `(head, rank=0, pid=N) ` on a log it relays)."""
    for line in reversed(text.splitlines()):
        at = line.find(prefix)
        if at >= 0:
            try:
                return json.loads(line[at + len(prefix):])
            except ValueError:
                return None
    return None


def parse_result(text: str) -> Optional[dict]:
    """The last result line an agent printed in `text`, or None."""
    return last_json_line(text, RESULT_PREFIX)


# ======================================================================================
# This node's environment: auth, the network preset, debugging.
# ======================================================================================

def interface_of(ip: str) -> Optional[str]:
    """Name of the local interface that holds `ip` (Linux ioctl; no iproute2 needed)."""
    if ip.startswith("127."):
        return "lo"
    import fcntl
    import struct
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    finally:
        sock.close()
    return None


def source_address(host: str) -> str:
    """This node's address on the route to `host` (no packet is sent)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect((host, 9))
        return sock.getsockname()[0]
    finally:
        sock.close()


def network_env(preset: Dict[str, str], info: NodeInfo) -> Dict[str, str]:
    """The preset's variables with `{iface}` set to the interface that carries this
    node's address (or its route to the head); those are dropped when there is none."""
    iface = interface_of(info.node_addr) or (interface_of(source_address(info.head)) if info.head else None)
    env = {}
    for key, value in preset.items():
        if "{iface}" in value:
            if not iface:
                log("no interface carries %s: leaving %s unset" % (info.node_addr, key))
                continue
            value = value.replace("{iface}", iface)
        env[key] = value
    return env


def node_env(plan: dict, info: NodeInfo, base: Dict[str, str]) -> Dict[str, str]:
    """The environment for Ray and the services on this node."""
    env = dict(base)
    # The preset fills what the node's environment leaves unset (an image or a machine that
    # sets NCCL_SOCKET_IFNAME knows its network); the task's env wins over both.
    env.update({k: v for k, v in network_env(plan["network_env"], info).items() if not base.get(k)})
    env.update(plan.get("env", {}))
    env.update({"RLHF_TASKS_HEAD_ADDR": info.head, "RLHF_TASKS_NODE_ADDR": info.node_addr,
                "RLHF_TASKS_NODE_RANK": str(info.rank), "RLHF_TASKS_NUM_NODES": str(info.nodes)})
    token_env = plan.get("token_env")
    if token_env:
        token = base.get(token_env)
        if not token:
            raise AgentError("setting up Ray auth", "token auth is on but $%s is not set; the launcher passes "
                             "the cluster's token in it" % token_env, code=2)
        env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN"] = "token", token
    else:
        env["RAY_AUTH_MODE"] = "disabled"
        env.pop("RAY_AUTH_TOKEN", None)
    debug = plan["ray"].get("debug", "off")
    if debug == "legacy":
        env["RAY_DEBUG"] = "legacy"
    elif debug == "post_mortem":
        env["RAY_DEBUG_POST_MORTEM"] = "1"
    return env


def fill(text: str, info: NodeInfo) -> str:
    """Replace the {head_addr} and {node_addr} placeholders (nothing else: shell braces stay)."""
    return text.replace("{head_addr}", info.head).replace("{node_addr}", info.node_addr)


def ray_start_command(plan: dict, info: NodeInfo, head: bool) -> List[str]:
    ray = plan["ray"]
    cmd = ["ray", "start", "--block", "--node-ip-address", info.node_addr,
           "--dashboard-agent-listen-port", str(ray["agent_listen_port"])]
    if head:
        cmd += ["--head", "--port", str(ray["port"]), "--dashboard-host", fill(ray["dashboard_host"], info),
                "--dashboard-port", str(ray["dashboard_port"]), "--ray-client-server-port", str(ray["client_server_port"])]
    else:
        cmd += ["--address", "%s:%s" % (info.head, ray["port"])]
    if ray.get("temp_dir"):  # one per node: raylets sharing a session dir race for socket names
        cmd += ["--temp-dir", "%s/n%d" % (ray["temp_dir"], info.rank)]
    for flag, key in (("--object-store-memory", "object_store_memory"), ("--num-cpus", "num_cpus"), ("--num-gpus", "num_gpus")):
        if ray.get(key) is not None:
            cmd += [flag, str(ray[key])]
    if ray.get("debug") == "legacy":
        cmd.append("--ray-debugger-external")
    return cmd


#: A `ray start` whose interpreter has already imported Ray's CLI (over a second, more on a
#: busy node) and waits for its arguments: one JSON line on stdin (an empty line: exit).
PRESTARTED_RAY = (
    "import json, sys\n"
    "from ray.scripts.scripts import main\n"
    "line = sys.stdin.readline()\n"
    "if not line.strip():\n"
    "    sys.exit(0)\n"
    "sys.argv = json.loads(line)\n"
    "sys.exit(main())\n")


def console_script_python(path: Optional[str]) -> Optional[List[str]]:
    """The interpreter line of the `ray` console script pip writes (`#!/path/python` and
    `from ray.scripts.scripts import main`), or None when `ray` is something else."""
    try:
        with open(path or "", "rb") as handle:
            text = handle.read(4096).decode("utf-8", "replace")
    except OSError:
        return None
    first = text.splitlines()[0] if text else ""
    argv = first[2:].split() if first.startswith("#!") else []
    program = argv[-1] if argv and os.path.basename(argv[0]) == "env" else (argv or [""])[0]
    if "python" not in os.path.basename(program) or "from ray.scripts.scripts import main" not in text:
        return None
    return argv


# ======================================================================================
# Processes this agent starts: each in its own session, stopped by process group.
# ======================================================================================

_LIBC = []  # type: list


def _die_with_agent() -> None:
    """preexec_fn: the kernel kills this child when the agent dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG). A child in a session of its own is invisible to a scheduler that
    tracks processes by ancestry once the agent is gone; `ray start --block` then takes
    its own processes with it (Ray's kernel fate sharing)."""
    if _LIBC and _LIBC[0] is not None:
        _LIBC[0].prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _load_libc() -> None:
    """Load libc before forking (an import in the child could deadlock)."""
    if not _LIBC:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            _LIBC.append(libc if sys.platform.startswith("linux") and hasattr(libc, "prctl") else None)
        except (OSError, ImportError):
            _LIBC.append(None)


class Child(object):
    """A process in its own session whose group id is recorded in `pgid_file`, so a
    restarted agent stops exactly its own stale Ray, never anyone else's; it dies with
    the agent."""

    def __init__(self, name: str, argv, env: Dict[str, str], log_path: Optional[str] = None,
                 pgid_file: Optional[str] = None, shell: bool = False, stdin=None):
        self.name, self.pgid_file, self.log_path = name, pgid_file, log_path
        out = open(log_path, "ab") if log_path else None
        _load_libc()
        self.proc = subprocess.Popen(argv, env=env, shell=shell, executable="/bin/bash" if shell and os.path.exists("/bin/bash") else None,
                                     stdin=stdin, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, preexec_fn=_die_with_agent)
        if out:
            out.close()
        if pgid_file:
            with open(pgid_file, "w") as handle:
                handle.write(str(self.proc.pid))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        if self.alive():
            _kill_group(self.proc.pid, grace, lambda: self.proc.poll() is not None)
        else:
            _kill_group(self.proc.pid, 0.0, lambda: True)  # leftovers of an exited leader
        if self.pgid_file and os.path.exists(self.pgid_file):
            os.remove(self.pgid_file)

    def tail(self, lines: int = 20) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - 8192))
            return "\n".join(handle.read().decode("utf-8", "replace").splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except OSError as exc:
        return exc.errno == errno.EPERM


def _kill_group(pgid: int, grace: float, gone: Callable[[], bool]) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not (gone() and not _group_alive(pgid)):
        time.sleep(0.1)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


def stop_stale(pgid_file: str) -> None:
    """Stop a Ray (or service) an earlier agent on this node started and left behind."""
    try:
        with open(pgid_file) as handle:
            pgid = int(handle.read().strip())
    except (OSError, ValueError):
        return
    if _group_alive(pgid):
        log("stopping a stale process group %d left by an earlier agent (%s)" % (pgid, os.path.basename(pgid_file)))
        _kill_group(pgid, 15.0, lambda: True)
    os.remove(pgid_file)


# ======================================================================================
# The node: what head and worker share (Ray, services, commands, step timings).
# ======================================================================================

class Node(object):
    def __init__(self, plan: dict, info: NodeInfo, env: Dict[str, str], state_dir: str, log_dir: str):
        self.plan, self.info, self.env, self.state_dir, self.log_dir = plan, info, env, state_dir, log_dir
        self.token = env.get("RAY_AUTH_TOKEN") if plan.get("token_env") else None
        self.ray = None  # type: Optional[Child]
        self.prestarted = None  # type: Optional[Child]  (`ray start` waiting for its arguments)
        self.job = None  # type: Optional[Child]  (job.mode every_node: this node's command)
        self.services = []  # type: List[Child]
        self.steps = []  # type: List[dict]
        host = "127.0.0.1" if plan["ray"]["dashboard_host"] == "127.0.0.1" else info.node_addr
        self.dashboard = "http://%s:%s" % (host, plan["ray"]["dashboard_port"])

    def cluster_key(self) -> str:
        """What tells this cluster's jobs from another's (submission ids)."""
        return self.info.cluster_id or self.plan.get("cluster_id") or self.info.head

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time one step for the result line."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.steps.append({"step": name, "seconds": round(time.monotonic() - started, 2)})

    def _pgid_file(self, what: str) -> str:
        return os.path.join(self.state_dir, "%s-node%d-%s.pgid" % (self.plan["name"], self.info.rank, what))

    def run_commands(self, step: str, commands: List[str]) -> None:
        with self.step(step):
            for index, command in enumerate(commands):
                log("%s %d/%d: %s" % (step, index + 1, len(commands), command))
                started = time.monotonic()
                code = subprocess.call(fill(command, self.info), shell=True, env=self.env,
                                       executable="/bin/bash" if os.path.exists("/bin/bash") else None)
                if code != 0:
                    raise AgentError("%s step %d (%s)" % (step, index + 1, command), "exit code %d" % code)
                log("%s %d/%d done in %.1fs" % (step, index + 1, len(commands), time.monotonic() - started))

    def prestart_ray(self) -> None:
        """Start `ray start`'s interpreter now, so that it imports Ray's CLI while this node
        waits (for prepare, or for the head): off the critical path. start_ray hands it its
        arguments. Skipped when `ray` is not pip's console script."""
        python = console_script_python(shutil.which("ray", path=self.env.get("PATH")))
        if python is None:
            return
        pgid_file = self._pgid_file("ray")
        stop_stale(pgid_file)
        self.prestarted = Child("ray", python + ["-c", PRESTARTED_RAY], self.env, self._ray_log(), pgid_file,
                                stdin=subprocess.PIPE)

    def _ray_log(self) -> str:
        return os.path.join(self.log_dir, "ray-node%d.log" % self.info.rank)

    def start_ray(self, head: bool) -> None:
        cmd = ray_start_command(self.plan, self.info, head)
        log("starting Ray %s: %s" % ("head" if head else "worker", " ".join(shlex.quote(c) for c in cmd)))
        child, self.prestarted = self.prestarted, None
        if child is not None and child.alive():
            try:
                child.proc.stdin.write((json.dumps(cmd) + "\n").encode())
                child.proc.stdin.close()
                self.ray = child
                return
            except OSError:  # it exited just now
                pass
        if child is not None:  # Ray's CLI would not import there: start it the plain way, and say why
            log("the prestarted `ray start` exited with code %s; starting it the plain way:\n%s"
                % (child.proc.wait(), child.tail()))
            child.stop(grace=0.0)
        pgid_file = self._pgid_file("ray")
        stop_stale(pgid_file)
        self.ray = Child("ray", cmd, self.env, self._ray_log(), pgid_file)

    def ray_alive(self, check: Callable[[], Tuple[bool, object]]) -> Callable[[], Tuple[bool, object]]:
        """A wait_for check that fails at once when `ray start` has exited."""
        def wrapped():
            if not self.ray.alive():
                raise AgentError("starting Ray", "`ray start` exited with code %s:\n%s" % (self.ray.proc.returncode, self.ray.tail()))
            return check()
        return wrapped

    def start_services(self, where: Tuple[str, ...]) -> None:
        for service in self.plan["services"]:
            if service["where"] not in where:
                continue
            with self.step("service " + service["name"]):
                pgid_file = self._pgid_file("service-" + service["name"])
                stop_stale(pgid_file)
                env = dict(self.env)
                env.update(service.get("env", {}))
                command = fill(service["command"], self.info)
                log("starting service %s: %s" % (service["name"], command))
                child = Child(service["name"], command, env,
                              os.path.join(self.log_dir, "service-%s-node%d.log" % (service["name"], self.info.rank)),
                              pgid_file, shell=True)
                self.services.append(child)
                self.wait_service(service, child)

    def wait_service(self, service: dict, child: Child) -> None:
        ready = service.get("ready")
        if not ready:
            return
        if ready.get("http"):
            url = fill(ready["http"], self.info)
            method = ready.get("method", "GET")
            probe = lambda: http_check(url, method, ready.get("json"))  # noqa: E731
            what = "service %s (%s %s)" % (service["name"], method, url)
        else:
            host = fill(ready.get("host", "{node_addr}"), self.info)
            probe = reachable(probe_tcp, host, ready["tcp"])
            what = "service %s (tcp %s:%s)" % (service["name"], host, ready["tcp"])

        def check():
            if not child.alive():
                raise AgentError("starting service %s" % service["name"],
                                 "it exited with code %s before it was ready:\n%s" % (child.proc.returncode, child.tail()))
            return probe()
        started = time.monotonic()
        wait_for(what, check, service["timeout"])
        log("service %s ready after %.1fs" % (service["name"], time.monotonic() - started))

    def stop_all(self) -> None:
        if self.prestarted is not None:
            self.prestarted.stop(grace=0.0)
        if self.job is not None:
            self.job.stop(grace=10.0)
        for child in reversed(self.services):
            child.stop()
        if self.ray is not None:  # the node is going away: no need to let a raylet drain
            self.ray.stop(grace=5.0)


#: How long a head that ends on its own waits for the workers to leave (they leave ~10 s
#: after its beacon closes) before it stops its own Ray.
WORKER_LEAVE_S = 20.0
#: A failure this soon after submission, twice the same way, with no new checkpoint, is a bug.
FAST_FAILURE_S = 120.0


class Restart(Exception):
    """The running job must be stopped and submitted again: why, and whether it looks like a
    bug in the job (the same `fingerprint` twice) rather than a fault of the cluster."""

    def __init__(self, reason: str, bug: bool = False, fingerprint: Optional[str] = None):
        Exception.__init__(self, reason)
        self.reason, self.bug, self.fingerprint = reason, bug, fingerprint


def checkpoint_mark(directory: Optional[str], limit: int = 20000) -> Optional[float]:
    """The newest modification time under the checkpoint directory: changes when a new
    checkpoint is written (bounded walk: a huge tree is not scanned to its end)."""
    if not directory or not os.path.isdir(directory):
        return None
    newest, seen = os.path.getmtime(directory), 0
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            seen += 1
            try:
                newest = max(newest, os.path.getmtime(os.path.join(root, name)))
            except OSError:
                pass
            if seen >= limit:
                return newest
    return newest


class HeadFlow(object):
    """Rank 0: prepare, start the head and its services, wait for every node, then
    submit and follow the job (or keep the cluster up for a client's submission)."""

    def __init__(self, node: Node):
        self.node, self.plan, self.info = node, node.plan, node.info
        self.beacon = None  # type: Optional[ReadyBeacon]
        self.job = {}  # type: dict  (submission_id, status; for the result line)
        self.follower = None  # type: Optional[JobFollower]

    def run(self) -> int:
        node, plan = self.node, self.plan
        node.prestart_ray()
        if plan["prepare"]:
            node.run_commands("prepare", plan["prepare"])
        started = time.monotonic()
        with node.step("ray head"):
            node.start_ray(head=True)
            gcs = (self.info.node_addr, plan["ray"]["port"])
            # Local probes of a few ms each: poll flat and fast, every tenth of a second counts here.
            wait_for("the Ray head's GCS on %s:%s" % gcs, node.ray_alive(reachable(probe_tcp, *gcs)), 180,
                     interval=0.1, max_interval=0.2)
            self.beacon = ReadyBeacon(self.info.node_addr, plan["ray"]["ready_port"])  # the workers join now
            log("Ray head's GCS up in %.1fs: the workers may join" % (time.monotonic() - started))
            wait_for("the Ray dashboard at %s" % node.dashboard,
                     node.ray_alive(lambda: http_check(node.dashboard + "/api/gcs_healthz")), 180,
                     interval=0.1, max_interval=0.2)
        where = "" if node.dashboard.startswith("http://127.0.0.1") and self.info.node_addr.startswith("127.") \
            else " (reach it through the provider's port forward)" if "127.0.0.1" in node.dashboard else ""
        log("Ray head up in %.1fs; dashboard %s%s" % (time.monotonic() - started, node.dashboard, where))
        # What waits for the nodes is submitted now, so that its start-up overlaps their joining:
        # preflight (it waits for them itself), then the job behind a gate that opens once preflight passed.
        jobs = DashboardJobs(node.dashboard, node.token)
        preflight = HeadPreflight(node, jobs) if plan["preflight"]["enabled"] else None
        gate = None
        try:
            if preflight is not None:
                preflight.submit()
            if plan["job"]["submit"] == "head":
                gate = self.submit_gated(jobs)
            node.start_services(("head", "every_node"))
            with node.step("nodes"):
                nodes = plan["nodes"]
                have = wait_for("%d nodes to join" % nodes,
                                node.ray_alive(cluster_check(node.dashboard, node.token, nodes,
                                                             (plan["ray"].get("num_cpus") or 0) * nodes,
                                                             (plan["ray"].get("num_gpus") or 0) * nodes)),
                                plan["wait"]["nodes_s"], interval=0.2, max_interval=0.25)
            log("cluster ready: %s (%.1fs after the head started)" % (have, time.monotonic() - started))
            if preflight is not None:
                with node.step("preflight"):
                    preflight.follow()
        except BaseException as exc:
            if gate is not None:
                gate.close(str(exc) if isinstance(exc, AgentError) else "the head agent stopped")
            if preflight is not None:
                preflight.stop()
            raise
        if plan["job"]["submit"] == "head":
            return self.submit_and_follow(jobs, gate)
        log("cluster ready for a client submission: forward port %s and run `rlhf-tasks submit`"
            % plan["ray"]["dashboard_port"])
        return self.supervise()

    def submit_gated(self, jobs: DashboardJobs) -> Optional[Gate]:
        """Submit the job's first attempt now, behind a gate (see Gate); None when this cluster
        already has it (an agent that restarted follows it instead)."""
        sid = submission_id(self.plan["name"], self.node.cluster_key(), 0)
        if jobs.status(sid) is not None:
            return None
        gate = Gate(os.path.join(self.node.state_dir, "%s.gate" % sid))
        plan = self.plan  # the longest the head may take to say: its services, the nodes, preflight
        limit = sum(s["timeout"] for s in plan["services"] if s["where"] in ("head", "every_node")) + \
            plan["wait"]["nodes_s"] + (plan["preflight"]["timeout_s"] + PREFLIGHT_GRACE_S
                                       if plan["preflight"]["enabled"] else 0) + 60
        self.submit(jobs, sid, gate.wrap, limit)
        return gate

    def submit_and_follow(self, jobs: DashboardJobs, gate: Optional[Gate]) -> int:
        """Open the gate of the job's first attempt (or submit it) and follow it; when it
        fails, stalls or loses a node, stop it, wait until every node is back, and resubmit
        it (it resumes from the latest checkpoint), up to `job.max_restarts` times."""
        node, job = self.node, self.plan["job"]
        key = self.node.cluster_key()
        alive = alive_nodes(node.dashboard, node.token)
        self.expected_ips = sorted(n["node_ip"] for n in alive)
        self.node_ids = sorted(n["node_id"] for n in alive)  # the launcher's summary: which metrics are this run's
        max_restarts = job.get("max_restarts", 0)
        attempts = []  # type: List[dict]
        self.job = {"submission_id": None, "status": None, "attempts": attempts}
        attempt = 0
        while True:
            sid = submission_id(self.plan["name"], key, attempt)
            self.job["submission_id"] = sid
            mark = checkpoint_mark(self.plan.get("checkpoint_dir"))
            status, cause, seconds = self.run_attempt(jobs, sid, attempt, can_restart=attempt < max_restarts,
                                                      gate=gate if attempt == 0 else None)
            self.job["status"] = status
            attempts.append({"submission_id": sid, "status": status, "cause": cause and cause.reason,
                             "seconds": round(seconds, 1)})
            if cause is None:
                break
            last = "%s (job %s)" % (cause.reason, sid)
            if attempt >= max_restarts:
                self.stop_job(jobs, sid)
                self.finish()
                raise AgentError("running job %s" % sid, "%s; no restarts left (job.max_restarts is %d)"
                                 % (cause.reason, max_restarts))
            if cause.bug and len(attempts) >= 2 and attempts[-2].get("fingerprint") == cause.fingerprint \
                    and seconds < FAST_FAILURE_S and checkpoint_mark(self.plan.get("checkpoint_dir")) == mark:
                self.finish()
                raise AgentError("running job %s" % sid, "it failed the same way twice in a row within %.0fs, with no "
                                 "new checkpoint between: a bug, not a fault, so it is not restarted (last: %s)"
                                 % (FAST_FAILURE_S, last))
            attempts[-1]["fingerprint"] = cause.fingerprint if seconds < FAST_FAILURE_S else None
            attempt += 1
            log("restarting the job, attempt %d of %d: %s" % (attempt, max_restarts, last))
            with node.step("restart %d" % attempt):
                self.stop_job(jobs, sid)
                self.wait_for_every_node()
        self.finish()
        if status != "SUCCEEDED":
            raise AgentError("running job %s" % sid, "it ended %s" % status)
        return 0

    def run_attempt(self, jobs: DashboardJobs, sid: str, attempt: int, can_restart: bool = True,
                    gate: Optional[Gate] = None) -> Tuple[Optional[str], Optional[Restart], float]:
        """Start (submit once, or open its gate) and follow one attempt: its final status
        (None when it was interrupted), why it must be restarted (None when it must not), and
        how long it ran. With no restart left, a failure is reported at once."""
        node, job = self.node, self.plan["job"]
        with node.step("submit" if attempt == 0 else "resubmit %d" % attempt):
            if gate is not None:
                log("starting job %s: it was submitted while the nodes joined; its command runs now" % sid)
                gate.open()
            elif jobs.status(sid) is not None:
                log("job %s was already submitted to this cluster; following it" % sid)
            else:
                self.submit(jobs, sid)
        log("following job %s" % sid)
        self.follower = follower = JobFollower(jobs, sid)
        started = checked = time.monotonic()

        def watch(status):
            nonlocal checked
            if not node.ray.alive():
                raise AgentError("running job %s" % sid, "the Ray head exited while the job was %s" % status)
            now = time.monotonic()
            stall = job.get("stall_timeout_s")
            if stall and now - follower.last_growth > stall:
                raise Restart("its log has not grown for %.0fs (job.stall_timeout)" % stall)
            if now - checked >= 2.0:
                checked = now
                missing = self.missing_nodes()
                if missing:
                    raise Restart("node %s left the cluster" % ", ".join(missing))

        try:
            with node.step("job" if attempt == 0 else "job attempt %d" % attempt):
                status = follower.run(job.get("timeout_s"), watch)
        except Restart as restart:
            return None, restart, time.monotonic() - started
        seconds = time.monotonic() - started
        log("job %s %s after %.1fs" % (sid, status, seconds))
        if status != "FAILED":  # SUCCEEDED, or STOPPED by someone: nothing to restart
            return status, None, seconds
        missing = self.lost_after_failure() if can_restart else self.missing_nodes(True)
        if missing:
            return status, Restart("node %s left the cluster and the job FAILED" % ", ".join(missing)), seconds
        last_line = ([line for line in follower.log_text.splitlines() if line.strip()] or [""])[-1]
        return status, Restart("the job FAILED", bug=True, fingerprint=last_line[-300:]), seconds

    def missing_nodes(self, replaced: bool = False) -> List[str]:
        """Addresses of the nodes the cluster had when the job started that are not ALIVE now
        (with `replaced`, also those ALIVE twice: a new machine joined before Ray noticed the old
        one's death)."""
        try:
            alive = [n["node_ip"] for n in alive_nodes(self.node.dashboard, self.node.token)]
        except OSError:
            return []
        missing = list(self.expected_ips)
        for ip in alive:
            if ip in missing:
                missing.remove(ip)
        twice = sorted({ip for ip in alive if alive.count(ip) > 1}) if replaced else []
        return missing + [ip for ip in twice if ip not in missing]

    def lost_after_failure(self) -> List[str]:
        """After a failure, the nodes that were lost, if any: Ray marks a dead node only after
        its health checks fail, so poll for that a little (`wait.node_loss`) before blaming
        the job itself."""
        grace_s = self.plan["wait"].get("node_loss_s", 40.0)
        try:
            return wait_for("Ray to notice a lost node", lambda: (lambda m: (bool(m), m))(self.missing_nodes(True)),
                            grace_s, interval=0.5, max_interval=1.0, progress_every=grace_s + 1)
        except AgentError:
            return []

    def stop_job(self, jobs: DashboardJobs, sid: str) -> None:
        if jobs.status(sid) in TERMINAL_JOB_STATES:
            return
        log("stopping job %s" % sid)
        jobs.stop(sid)
        wait_for("job %s to stop" % sid, lambda: (lambda s: (s in TERMINAL_JOB_STATES, s))(jobs.status(sid)), 120)

    def wait_for_every_node(self) -> None:
        """Every node the job started with ALIVE again, and no more (a lost node's stale entry gone)."""
        expected = self.expected_ips

        def check():
            try:
                alive = sorted(n["node_ip"] for n in alive_nodes(self.node.dashboard, self.node.token))
            except OSError as exc:
                return False, str(exc)
            if alive == expected:
                return True, "%d/%d nodes alive" % (len(alive), len(expected))
            missing = [ip for ip in expected if ip not in alive] or ["none; %d nodes alive, %d expected"
                                                                     % (len(alive), len(expected))]
            return False, "missing: %s" % ", ".join(missing)
        have = wait_for("every node to be ALIVE again", self.node.ray_alive(check), self.plan["wait"]["nodes_s"],
                        interval=0.5, max_interval=2.0)
        log("cluster ready again: %s" % have)

    def finish(self) -> None:
        """The job is over: say so in a result line now (the launcher reads it), and keep the
        cluster up when the plan says so."""
        if self.plan.get("keep_cluster"):
            print(result_line(dict(self.result(), exit_code=None, rank=0, steps=self.node.steps)), flush=True)
            log("the cluster stays up until `rlhf-tasks down %s`" % self.plan["name"])
            self.supervise()

    def submit(self, jobs: DashboardJobs, sid: str, wrap: Optional[Callable[[List[str], float], List[str]]] = None,
               wait_s: float = 0.0) -> None:
        """Submit the job's entrypoint, or (`wrap`) the entrypoint behind a gate it may wait
        at for up to `wait_s` seconds."""
        job = self.plan["job"]
        argv, wandb = job_argv(job, self.info.head, self.info.node_addr, self.node.env)
        if wandb:
            log(wandb)
        entrypoint = " ".join(shlex.quote(a) for a in argv)
        gated = " (its command waits until every node is ALIVE%s)" % (
            " and preflight passed" if self.plan["preflight"]["enabled"] else "") if wrap else ""
        argv = wrap(argv, wait_s) if wrap else argv
        if not job.get("working_dir"):
            log("submitting job %s%s: %s" % (sid, gated, entrypoint))
            return jobs.submit(sid, argv)
        # Packing and uploading a working_dir is Ray's own code: use its CLI.
        cmd = ["ray", "job", "submit", "--address", self.node.dashboard, "--submission-id", sid, "--no-wait",
               "--working-dir", job["working_dir"], "--runtime-env-json", json.dumps({"excludes": job["excludes"]}),
               "--"] + argv
        log("submitting job %s with working_dir %s%s: %s" % (sid, job["working_dir"], gated, entrypoint))

        def send():
            out = subprocess.run(cmd, env=self.node.env, capture_output=True, text=True)
            if out.returncode == 0:
                return None
            why = out.stderr.strip()[-2000:] or out.stdout.strip()[-2000:]
            if "No available agent" in why:  # Ray's own words: the head's job agent is not up yet, try again
                return True, why.splitlines()[-1]
            return False, why
        jobs.submit_with(sid, send)

    def supervise(self) -> int:
        while self.node.ray.alive():
            time.sleep(1.0)
        raise AgentError("supervising the Ray head", "`ray start` exited with code %s:\n%s"
                         % (self.node.ray.proc.returncode, self.node.ray.tail()))

    def result(self) -> dict:
        out = {"job": self.job or None, "node_ids": getattr(self, "node_ids", [])}
        if self.follower is not None:
            out["job_log_chars"] = self.follower.shown
            out["job_log_tail"] = self.follower.log_text[-JOB_LOG_TAIL_CHARS:]
        return out

    def stop(self, signalled: bool = False) -> None:
        """Close the beacon; unless the cluster is being torn down (a signal), let the workers
        see it and leave before the head's Ray stops, so the head is the last to exit (a
        scheduler that kills the rest when one task fails then kills nothing)."""
        if self.beacon is None:
            return
        self.beacon.close()
        if signalled or self.node.ray is None or not self.node.ray.alive():
            return

        def workers_gone():
            try:
                left = [n for n in alive_nodes(self.node.dashboard, self.node.token) if not n.get("is_head_node")]
            except (OSError, AgentError):
                return True, 0
            return not left, "%d workers still up" % len(left)
        try:
            wait_for("the workers to leave", workers_gone, WORKER_LEAVE_S, interval=0.5, max_interval=1.0,
                     progress_every=WORKER_LEAVE_S + 1)
        except AgentError:
            log("the workers did not leave within %.0fs; stopping anyway" % WORKER_LEAVE_S)


class WorkerFlow(object):
    """Every other rank: join when the head's beacon answers, start the every-node
    services, keep the raylet up (rejoin when it dies) until the head goes away."""

    def __init__(self, node: Node):
        self.node = node
        self.beacon = (node.info.head, node.plan["ray"]["ready_port"])

    def run(self) -> int:
        node = self.node
        node.prestart_ray()
        with node.step("head"):
            started = time.monotonic()
            wait_for("the head at %s:%s" % self.beacon, reachable(probe_ready, *self.beacon),
                     node.plan["wait"]["head_s"], interval=0.1, max_interval=0.2)
            log("head ready after %.1fs" % (time.monotonic() - started))
        with node.step("ray worker"):
            node.start_ray(head=False)
        node.start_services(("every_node",))
        return self.supervise()

    def supervise(self, head_gone_s: float = 10.0, max_rejoins: int = 3) -> int:
        """Keep the raylet up (rejoin if it dies) until the head goes away: then the run is over."""
        node = self.node
        unreachable_since = None
        rejoins = 0
        while True:
            reason = probe_ready(*self.beacon)
            now = time.monotonic()
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
            time.sleep(1.0)

    def result(self) -> dict:
        return {}

    def stop(self, signalled: bool = False) -> None:
        pass


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
        if info.rank == 0:
            if plan["prepare"]:
                node.run_commands("prepare", plan["prepare"])
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


# ======================================================================================
# Preflight: before the job, prove the nodes can talk (preflight.py, shipped beside this file).
# ======================================================================================

PREFLIGHT_PREFIX = "RLHF_TASKS_PREFLIGHT "
PREFLIGHT_GRACE_S = 15.0  # beyond the checks' own deadline: for the Ray job to start and end


def preflight_script() -> str:
    """preflight.py beside this agent (rlhf_tasks/ locally, /opt/rlhf-tasks/ on a node)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "preflight.py")


def preflight_submission_id(cluster_key: str) -> str:
    """`preflight_<cluster>`: never taken for a job's own id, since task names have no underscore."""
    return "preflight_" + re.sub(r"[^A-Za-z0-9_-]+", "-", cluster_key).strip("-")


def preflight_argv(settings: dict, nodes: int, script: str, timeout: float, wait_nodes: float = 0.0,
                   checks: Optional[dict] = None) -> List[str]:
    """The preflight job's command line: it waits up to `wait_nodes` seconds for every node
    (the head submits it while the workers join), then its checks have `timeout` seconds."""
    argv = ["python3", script, "--nodes", str(nodes), "--timeout", "%.1f" % timeout,
            "--min-bandwidth-bits", "%g" % settings["min_bandwidth_bits"]]
    if wait_nodes:
        argv += ["--wait-nodes", "%.0f" % wait_nodes]
    if not settings.get("torch", True):
        argv.append("--no-torch")
    if settings.get("model"):
        argv += ["--model", settings["model"]]
    if settings.get("weight_bytes"):
        argv += ["--weight-bytes", str(settings["weight_bytes"])]
    if checks:
        argv += ["--checks", json.dumps(checks)]
    return argv


def parse_preflight(text: str) -> Optional[dict]:
    """The preflight job's result line in its log, or None."""
    return last_json_line(text, PREFLIGHT_PREFIX)


def follow_preflight(jobs, sid: str, deadline: float, report: Callable[[str], None]) -> dict:
    """Echo the preflight job's progress lines until it ends and return its result; at the
    deadline (absolute, time.time()) stop it and fail naming the last step it reached."""
    shown, status, text = 0, None, ""
    while True:
        try:
            status, text = jobs.status(sid), jobs.logs(sid)
        except OSError as exc:
            status = "unknown (%s)" % exc
        complete = text[:text.rfind("\n") + 1]
        lines = complete.splitlines()
        for line in lines[shown:]:
            if line.startswith("preflight: "):
                report(line)
        shown = max(shown, len(lines))
        result = parse_preflight(complete)
        if result is not None:  # its last word: no need to wait for Ray to mark the job ended
            return result
        if status in TERMINAL_JOB_STATES:
            break
        if time.time() > deadline + PREFLIGHT_GRACE_S:
            jobs.stop(sid)
            steps = [line for line in lines if line.startswith("preflight: ")]
            raise AgentError("preflight", "no result %.0fs after its deadline (the preflight job is %s; its last word: "
                             "%s); stopped it" % (PREFLIGHT_GRACE_S, status, steps[-1] if steps else "none"))
        time.sleep(0.15)  # the command waits on this result: a local poll of a few ms, kept flat
    result = parse_preflight(text)
    if result is None:
        raise AgentError("preflight", "the preflight job ended %s without a result; its log ends:\n%s"
                         % (status, "\n".join(text.splitlines()[-20:])))
    return result


def preflight_report(result: dict, report: Callable[[str], None]) -> None:
    """The table, then warnings and notes, as the head (and `rlhf-tasks doctor`) print them."""
    verdict = "passed" if result["passed"] else "FAILED (%s)" % result["failed_step"]
    report("preflight %s in %.1fs: %d nodes" % (verdict, result["seconds"], len(result["nodes"])))
    print("\n".join(result["table"]), flush=True)
    for note in result["notes"]:
        report("preflight: " + note)
    for warning in result["warnings"]:
        report("preflight WARNING: " + warning)
    for failure in result["failures"]:
        report("preflight FAILED (%s): %s" % (failure["step"], failure["message"]))


class HeadPreflight(object):
    """The head's preflight: run preflight.py as a Ray job of its own across every node,
    print its table, keep its JSON beside the node logs, and fail (naming the step) before
    the job's command starts when a check failed. Low bandwidth is a warning.

    It is submitted as soon as the head is up and waits for the nodes itself: its driver
    and its probe on each node start while the others are still joining."""

    def __init__(self, node: "Node", jobs: DashboardJobs):
        self.node, self.jobs = node, jobs
        self.sid = preflight_submission_id(node.cluster_key())

    def submit(self) -> None:
        node, settings = self.node, self.node.plan["preflight"]
        script = preflight_script()
        if not os.path.exists(script):
            raise AgentError("preflight", "%s is missing beside the agent: ship it with node.py (render again), "
                             "or set `preflight: off`" % script, code=2)
        if self.jobs.status(self.sid) is not None:
            self.sid = "%s-%d" % (self.sid, int(time.time()))
        log("preflight: checking %d nodes (versions, interfaces, %severy pair's bandwidth) as Ray job %s, once they "
            "are ALIVE; deadline %.0fs" % (node.plan["nodes"], "a Gloo all_reduce, " if settings.get("torch", True)
                                           else "", self.sid, settings["timeout_s"]))
        self.jobs.submit(self.sid, preflight_argv(settings, node.plan["nodes"], script, settings["timeout_s"],
                                                  wait_nodes=node.plan["wait"]["nodes_s"]))

    def follow(self) -> dict:
        """Once every node is ALIVE: its checks have `preflight.timeout` from now."""
        node = self.node
        result = follow_preflight(self.jobs, self.sid, time.time() + node.plan["preflight"]["timeout_s"], log)
        path = os.path.join(node.log_dir, "preflight.json")
        with open(path, "w") as handle:
            json.dump(result, handle, indent=2, sort_keys=True)
        preflight_report(result, log)
        if not result["passed"]:
            failure = result["failures"][0]
            raise AgentError("preflight (%s)" % failure["step"], "%s; the job's command was not started (details: %s)"
                             % (failure["message"], path))
        log("preflight: the result is in %s" % path)
        return result

    def stop(self) -> None:
        try:
            if self.jobs.status(self.sid) not in TERMINAL_JOB_STATES + (None,):
                self.jobs.stop(self.sid)
        except OSError:
            pass


# ======================================================================================
# Entry point.
# ======================================================================================

def load_plan(path: str) -> dict:
    try:
        with open(path) as handle:
            plan = json.load(handle)
    except (OSError, ValueError) as exc:
        raise AgentError("reading the plan %s" % path, str(exc), code=2)
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        found = plan.get("version") if isinstance(plan, dict) else None
        raise AgentError("reading the plan %s" % path, "it is plan version %s, and this agent reads version %d: "
                         "render it again with the rlhf-tasks that shipped this agent" % (found, PLAN_VERSION), code=2)
    return plan


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gate"]:
        return gate_main(argv[1:])
    parser = argparse.ArgumentParser(prog="rlhf_tasks.node", description="rlhf-tasks node agent (runs on every node)")
    parser.add_argument("--plan", required=True, help="the cluster plan (JSON) rendered by rlhf-tasks")
    parser.add_argument("--skip-setup", action="store_true", help="the provider already ran the setup commands")
    parser.add_argument("--state-dir", default=None, help="where process-group files live (default: /tmp/rlhf-tasks)")
    parser.add_argument("--log-dir", default=None, help="where Ray's and the services' output goes (default: state dir)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    result = {"exit_code": 2, "rank": None, "error": None, "steps": []}  # type: dict
    node = flow = None
    signalled = False  # the cluster is being torn down: no waiting for anyone
    try:
        plan = load_plan(args.plan)
        info = locate(read_contract(plan["contract"], os.environ))
        result["rank"] = info.rank
        log.label = "node%d" % info.rank
        log("%s node %d of %d, address %s, head %s" % (plan["provider"], info.rank, info.nodes, info.node_addr, info.head))
        env = node_env(plan, info, os.environ)
        net = {k: env[k] for k in sorted(plan["network_env"]) if k in env}
        log("network preset %s: %s" % (plan["network"], " ".join(
            "%s=%s%s" % (k, v, " (from the node's environment)" if os.environ.get(k) and k not in plan["env"] else "")
            for k, v in net.items()) or "none"))
        state_dir = args.state_dir or os.path.join(plan["ray"].get("temp_dir") or "/tmp", "rlhf-tasks")
        log_dir = args.log_dir or state_dir
        for directory in (state_dir, log_dir):
            os.makedirs(directory, exist_ok=True)
        node = Node(plan, info, env, state_dir, log_dir)
        if plan["setup"] and not args.skip_setup:
            node.run_commands("setup", plan["setup"])
        if plan["job"].get("mode") == "every_node":
            flow = EveryNodeFlow(node)
        else:
            flow = HeadFlow(node) if info.rank == 0 else WorkerFlow(node)
        result["exit_code"] = flow.run()
    except AgentError as exc:
        log("ERROR: %s" % exc)
        result.update(exit_code=exc.code, error=str(exc), failed_step=exc.step)
    except OSError as exc:  # the dashboard stopped answering, a disk filled up: say it in one line
        log("ERROR: %s" % exc)
        result.update(exit_code=1, error=str(exc))
    except KeyboardInterrupt:
        signalled = True
        log("interrupted")
        result.update(exit_code=130, error="interrupted")
    except SystemExit as exc:
        signalled = True
        log("stopping (signal)")
        result.update(exit_code=exc.code, error="stopped by signal %d" % (exc.code - 128))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        if flow is not None:
            flow.stop(signalled=signalled)
            result.update(flow.result())
        if node is not None:
            node.stop_all()
            result["steps"] = node.steps
            log("stopped the processes this agent started")
        print(result_line(result), flush=True)
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
