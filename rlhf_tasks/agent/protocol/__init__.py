"""What the launcher and the agent both speak, and the only part of the agent that code
outside rlhf_tasks/agent/ imports (this package and its submodule `bundle`, a failure's
bundle: every node's logs read through Ray's log API, each node's first error, the .tar.gz
and the summary's lines about it): the plan's version, the result lines, Ray job states,
waits with a deadline, small HTTP and TCP probes, the dashboard's REST API (nodes, jobs),
submission ids, the job's command line, and running preflight on a running cluster
(`rlhf-tasks doctor`). Standard library only, Python >= 3.8 (it runs on the nodes too).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Callable, Dict, List, Optional, Tuple

#: The plan format this agent reads; the launcher writes the same number.
PLAN_VERSION = 3
#: The Ray label each node of a node group carries, its value the group's name (`ray start --labels`).
GROUP_LABEL = "rlhf-tasks/group"
RESULT_PREFIX = "RLHF_TASKS_RESULT "
TERMINAL_JOB_STATES = ("SUCCEEDED", "FAILED", "STOPPED")
#: The preflight job's result line, and how long past its checks' deadline it may take.
PREFLIGHT_PREFIX = "RLHF_TASKS_PREFLIGHT "
PREFLIGHT_GRACE_S = 15.0  # beyond the checks' own deadline: for the Ray job to start and end
#: The agent's entry file below its package root (lib/ on a node). The agent, the job's gate and
#: preflight's job are started by this file's path (`python3 LIB/rlhf_tasks/agent/__main__.py ...`),
#: never as a module (`python3 -m`), which puts the working directory first on sys.path, where an
#: `rlhf_tasks/` (a fork of this project, a job's working_dir) would be what runs.
AGENT_ENTRY = "rlhf_tasks/agent/__main__.py"
#: The entry's subcommand that runs preflight (`python3 ENTRY preflight --nodes N ...`).
PREFLIGHT_COMMAND = "preflight"
#: The head agent's log line when the job's command is let run (its gate opens; with job.mode
#: every_node, when the head runs it): before this line a launch can still cancel the job.
JOB_STARTS = "starting job %s: its command runs now"
#: The caches' directory in a checkpoint directory on shared storage (HF_HOME's parent: Provider.cache_dir),
#: which `launch --fresh` leaves in place.
CACHE_DIR = ".cache"


def agents_own(name: str) -> bool:
    """A name at the top of a checkpoint directory that the agent keeps there, not the job: the training's spend
    record (and its file while rewritten) and the models' cache. Neither is a checkpoint, nor a sign of one."""
    from .spend import SPEND_FILE

    return name == CACHE_DIR or name.startswith(SPEND_FILE)


def started_job(text: str) -> Optional[str]:
    """The id of the job whose command the head let run, from its log `text`; None before that."""
    found = re.findall(re.escape(JOB_STARTS).replace("%s", r"(\S+)"), text)
    return found[-1] if found else None


class _Log(object):
    """The agent's timestamped lines (`[12:00:01] node0: ...`); also wait_for's default report."""

    label = "node"

    def __call__(self, message: str) -> None:
        print("[%s] %s: %s" % (time.strftime("%H:%M:%S"), self.label, message), flush=True)


log = _Log()


class AgentError(Exception):
    """A step failed; the message names it. `code` 2 means the plan or environment is wrong."""

    def __init__(self, step: str, message: str, code: int = 1):
        Exception.__init__(self, "%s failed: %s" % (step, message))
        self.step, self.code = step, code

def wait_for(what: str, check: Callable[[], Tuple[bool, object]], timeout_s: float, interval: float = 0.2,
             max_interval: float = 2.0, progress_every: float = 10.0, report: Callable[[str], None] = None):
    """Call `check()` until it returns (True, value); it returns (False, reason) otherwise.

    Backs off from `interval` to `max_interval`, prints progress every `progress_every`
    seconds, and raises AgentError naming what was awaited, for how long, and the last
    reason when `timeout_s` passes. A Ctrl-C meanwhile carries the same as `waiting_for`."""
    report = report or log
    start = time.monotonic()
    next_report = start + progress_every
    delay = interval
    value = "not asked yet"
    try:
        while True:
            done, value = check()
            if done:
                return value
            now = time.monotonic()
            if now - start >= timeout_s:
                raise AgentError("waiting for %s" % what, "still not so after %.0fs (last: %s)" % (now - start, value))
            if now >= next_report:
                report("waiting for %s: %.0fs of %.0fs (%s)" % (what, now - start, timeout_s, value))
                next_report = now + progress_every
            time.sleep(min(delay, max(0.0, timeout_s - (now - start))))
            delay = min(delay * 1.5, max_interval)
    except KeyboardInterrupt as exc:  # Ctrl-C: whoever catches it can say what was awaited (the innermost wait)
        if not hasattr(exc, "waiting_for"):
            exc.waiting_for = "%s, %.0fs of %.0fs (last: %s)" % (what, time.monotonic() - start, timeout_s, value)
        raise


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
    except http.client.HTTPException as exc:  # the server went away while it answered
        raise OSError("the answer from %s broke off (%s)" % (url, type(exc).__name__))


def http_check(url: str, method: str = "GET", body=None, headers: Optional[dict] = None) -> Tuple[bool, object]:
    """A wait_for check: ready when the request answers below 400."""
    try:
        status, _ = http_request(url, method, body, headers, timeout=5.0)
    except OSError as exc:
        return False, str(exc)
    return (True, status) if status < 400 else (False, "HTTP %d from %s %s" % (status, method, url))


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


def cluster_check(dashboard: str, token: Optional[str], nodes: int, cpus: float = 0, gpus: float = 0,
                  exact: bool = False):
    """A wait_for check: every expected node ALIVE, with its CPUs and GPUs registered (with
    `exact`, no more nodes than that: one more is a lost node Ray has not declared dead yet)."""
    def check():
        try:
            alive = alive_nodes(dashboard, token)
        except OSError as exc:
            return False, str(exc)
        check.alive = alive  # the nodes as last seen (the head hands them to preflight)
        total = {"CPU": 0.0, "GPU": 0.0}
        for node in alive:
            for key in total:
                total[key] += node.get("resources_total", {}).get(key, 0.0)
        have = "%d/%d nodes alive, %g CPUs, %g GPUs" % (len(alive), nodes, total["CPU"], total["GPU"])
        if len(alive) < nodes or total["CPU"] < (cpus or 0) or total["GPU"] < (gpus or 0):
            return False, have
        if exact and len(alive) > nodes:
            return False, have + " (waiting for Ray to declare the lost one dead)"
        return True, have
    check.alive = []
    return check


def _in_group(node: dict, group: dict) -> bool:
    """A node of Ray's records that is of `group`: its label, and its resources registered."""
    if (node.get("labels") or {}).get(GROUP_LABEL) != group["name"]:
        return False
    have = node.get("resources_total") or {}
    return all(have.get(name, 0.0) >= amount for name, amount in group["resources"].items())


def group_counts(alive: List[dict], groups: List[dict]) -> Tuple[bool, str]:
    """Whether every group has all its nodes among `alive` (Ray's records: its label and resources), and
    each group's count ("group reward: 0 of 1 nodes"), the short ones first."""
    counts = [(group, sum(1 for node in alive if _in_group(node, group))) for group in groups]
    short = [(g, n) for g, n in counts if n < g["nodes"]]
    words = ["group %s: %d of %d nodes" % (g["name"], n, g["nodes"]) for g, n in short + [
        (g, n) for g, n in counts if n >= g["nodes"]]]
    stray = sum(1 for node in alive if not any(_in_group(node, g) for g in groups))
    return not short, "; ".join(words) + ("; %d ALIVE without a group's label and resources" % stray if stray else "")


#: `{group_addr:NAME}` in the job's command: the address of the node of group NAME with the lowest address
#: (its node, for a group of one), filled once every group is in (fill_group_addrs).
GROUP_ADDR = re.compile(r"\{group_addr:([a-z0-9][a-z0-9-]*)\}")


def group_addrs(alive: List[dict], groups: List[dict]) -> Dict[str, str]:
    """Each group's address for `{group_addr:NAME}`: of its nodes among `alive`, the lowest address."""
    out = {}
    for group in groups:
        ips = sorted((node["node_ip"] for node in alive if _in_group(node, group)),
                     key=lambda ip: tuple(int(part) for part in ip.split(".")) if ip.count(".") == 3 else (ip,))
        if ips:
            out[group["name"]] = ips[0]
    return out


def fill_group_addrs(argv: List[str], addrs: Dict[str, str]) -> List[str]:
    """The command with `{group_addr:NAME}` filled; a group not in `addrs` is an AgentError naming it (the plan
    names only the task's groups, and the head fills them once every group is in)."""
    def one(match):
        if match.group(1) not in addrs:
            raise AgentError("filling the job's command", "{group_addr:%s}: no node of group %s is in the cluster"
                             % (match.group(1), match.group(1)))
        return addrs[match.group(1)]
    return [GROUP_ADDR.sub(one, arg) for arg in argv]


def groups_check(dashboard: str, token: Optional[str], groups: List[dict]):
    """A wait_for check: every group has all its nodes ALIVE with its label and resources (group_counts says
    each group's count); `check.alive` the nodes as last seen (the head hands them to preflight), as
    protocol.cluster_check's."""
    def check():
        try:
            alive = alive_nodes(dashboard, token)
        except OSError as exc:
            return False, str(exc)
        check.alive = alive
        return group_counts(alive, groups)
    check.alive = []
    return check


def submission_id(name: str, cluster_key: str, attempt: int = 0) -> str:
    """The job's id on its cluster: `<task>-<cluster>` (`-r<k>` for the k-th restart).
    Stable, so a retried submission finds the first one instead of starting a second."""
    sid = re.sub(r"[^A-Za-z0-9_-]+", "-", "%s-%s" % (name, cluster_key)).strip("-")
    return "%s-r%d" % (sid, attempt) if attempt else sid


def split_attempt(sid: str) -> Tuple[str, int]:
    """The first attempt's id and which attempt `sid` is: 0 for the first, k for `-r<k>`."""
    match = re.match(r"^(.*)-r(\d+)$", sid)
    return (match.group(1), int(match.group(2))) if match else (sid, 0)


def attempt_of(sid: str) -> int:
    return split_attempt(sid)[1]


def next_submission_id(sid: str) -> str:
    """The id of the restart after `sid` (`<task>-<cluster>-r<k+1>`)."""
    first, attempt = split_attempt(sid)
    return "%s-r%d" % (first, attempt + 1)


def is_submission_of(name: str, sid: str) -> bool:
    return sid.startswith(name + "-")


def job_runtime_env(job: dict) -> Dict:
    """The Ray runtime environment the job is submitted with, besides its working_dir (given apart: `ray
    job submit --working-dir`, the SDK's working_dir): the plan's runtime_env (pip, uv, env_vars,
    py_modules) with its excludes where there is something to pack. A relative py_module is of the
    job's working_dir (the plan names those inside it so, wherever a provider puts the working_dir);
    a path with a URL scheme is a URI, as Ray reads it (ray/_private/path_utils.py: is_path)."""
    from urllib.parse import urlparse

    env = dict(job.get("runtime_env") or {})
    if env.get("py_modules"):
        env["py_modules"] = [module if urlparse(module).scheme or os.path.isabs(module) else
                             os.path.join(job.get("working_dir") or ".", module) for module in env["py_modules"]]
    if job.get("excludes") and (job.get("working_dir") or env.get("py_modules")):
        env["excludes"] = list(job["excludes"])
    return env


def job_argv(job: dict, head_addr: str, node_addr: str, env: Dict[str, str],
             addrs: Optional[Dict[str, str]] = None) -> Tuple[List[str], Optional[str]]:
    """The job's command line on this cluster, and what was decided about W&B (None when
    the recipe has no W&B flags): W&B flags are added only when WANDB_API_KEY is given.
    `addrs`: the groups' addresses (group_addrs), when known; else `{group_addr:NAME}` stays for the gate."""
    argv = [arg.replace("{head_addr}", head_addr).replace("{node_addr}", node_addr) for arg in job["entrypoint"]]
    if addrs is not None:
        argv = fill_group_addrs(argv, addrs)
    if not job.get("wandb_args"):
        return argv, None
    if env.get("WANDB_API_KEY"):
        return argv + list(job["wandb_args"]), "W&B logging on (WANDB_API_KEY provided)"
    return argv, "W&B logging off: WANDB_API_KEY was not provided"


class DashboardJobs(object):
    """The Ray Jobs REST API with the standard library (the head agent's jobs client)."""

    def __init__(self, dashboard: str, token: Optional[str]):
        self.dashboard, self.token = dashboard, token

    def jobs(self) -> List[dict]:
        """Every job on the cluster (submission_id, status, entrypoint, ...), as the API gives them."""
        status, body = http_request(self.dashboard + "/api/jobs/", headers=auth_headers(self.token), timeout=10.0)
        if status != 200:
            raise OSError("HTTP %d listing jobs: %s" % (status, body.decode("utf-8", "replace")[:500]))
        return json.loads(body)

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

    def __init__(self, jobs, sid: str, out=None, after: Optional[str] = None):
        self.jobs, self.sid, self.out = jobs, sid, out or sys.stdout
        self.shown = 0
        #: A line prefix: the log up to the end of the first such line is not shown. A gated job's
        #: log starts with preflight's run, up to its result line; the head reports preflight itself.
        self.after = after
        self.log_text = ""
        self.last_growth = time.monotonic()  # when the log last grew (for stall detection)

    def run(self, timeout_s: Optional[float] = None, watch: Optional[Callable[[str], None]] = None) -> str:
        """The job's final status. `watch(status)` runs on every poll and may raise to
        give up (e.g. the Ray head died). At `timeout_s` the job is stopped and this fails."""
        started, delay = time.monotonic(), 0.5
        while True:
            status = self.jobs.status(self.sid)
            text = self.jobs.logs(self.sid)
            if self.after is not None:
                end = line_end(text, self.after)
                if end is None and status not in TERMINAL_JOB_STATES:
                    text = ""  # still in its preflight part
                else:
                    self.shown, self.after = max(self.shown, end or 0), None
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


def line_end(text: str, prefix: str) -> Optional[int]:
    """The offset just past the first complete line of `text` that starts with `prefix`; None
    while there is none."""
    start = 0 if text.startswith(prefix) else text.find("\n" + prefix) + 1
    end = text.find("\n", start) if start or text.startswith(prefix) else -1
    return None if end < 0 else end + 1


def result_line(result: dict) -> str:
    return RESULT_PREFIX + json.dumps(result, sort_keys=True)


def last_json_line(text: str, prefix: str) -> Optional[dict]:
    """The JSON after `prefix` on the last line of `text` that holds it, or None. The prefix
    may stand after another: a scheduler that relays the log may prefix every line."""
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


def preflight_submission_id(cluster_key: str) -> str:
    """`preflight_<cluster>`: never taken for a job's own id, since task names have no underscore."""
    return "preflight_" + re.sub(r"[^A-Za-z0-9_-]+", "-", cluster_key).strip("-")


def preflight_argv(settings: dict, nodes: int, timeout: float, wait_nodes: float = 0.0,
                   checks: Optional[dict] = None, root: str = "") -> List[str]:
    """The preflight job's command line: it waits up to `wait_nodes` seconds for every node
    (the head submits it while the workers join), then its checks have `timeout` seconds.
    `root` holds the agent's package where the job runs (the head's lib/; doctor uploads the
    package as the job's working_dir, so there it is relative)."""
    argv = ["python3", os.path.join(root, AGENT_ENTRY), PREFLIGHT_COMMAND, "--nodes", str(nodes),
            "--timeout", "%.1f" % timeout,
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


def follow_preflight(jobs, sid: str, deadline: float, report: Callable[[str], None], interval: float = 0.15,
                     local: Optional[str] = None) -> dict:
    """Echo the preflight job's progress lines until it ends and return its result; at the
    deadline (absolute, time.time()) stop it and fail naming the last step it reached. `local`:
    a file on this machine where preflight writes its lines and result too (the job's gate on the
    head), read every few ms between the dashboard's answers."""
    shown, status, text = 0, None, ""
    asked, reported = 0.0, 0
    while True:
        if local and os.path.exists(local):
            with open(local) as handle:
                written = json.load(handle)
            for line in written["said"][reported:]:
                report(line)
            return written["result"]
        if time.monotonic() - asked < interval:
            time.sleep(0.01)
            continue
        asked = time.monotonic()
        try:
            status, text = jobs.status(sid), jobs.logs(sid)
        except OSError as exc:
            status = "unknown (%s)" % exc
        complete = text[:text.rfind("\n") + 1]
        lines = complete.splitlines()
        for line in lines[shown:]:
            if line.startswith("preflight: "):
                report(line)
                reported += 1
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
        if not local:
            time.sleep(interval)  # the command waits on this result: a local poll of a few ms, kept flat
    result = parse_preflight(text)
    if result is None:
        raise AgentError("preflight", "the preflight job ended %s without a result; its log ends:\n%s"
                         % (status, "\n".join(text.splitlines()[-20:])))
    return result


def preflight_report(result: dict, report: Callable[[str], None]) -> None:
    """The table, then warnings and notes, as the head (and `rlhf-tasks doctor`) print them."""
    heading, table, said = preflight_parts(result)
    report(heading)
    print("\n".join(table), flush=True)
    for line in said:
        report(line)


def preflight_parts(result: dict) -> Tuple[str, List[str], List[str]]:
    """Preflight's result as people read it: its verdict line, its table, and its notes,
    warnings and failures (one line each)."""
    verdict = "passed" if result.get("passed") else "FAILED (%s)" % result.get("failed_step")
    heading = "preflight %s in %.1fs: %d nodes" % (verdict, result.get("seconds") or 0, len(result.get("nodes") or []))
    said = ["preflight: " + note for note in result.get("notes") or []]
    said += ["preflight WARNING: " + warning for warning in result.get("warnings") or []]
    said += ["preflight FAILED (%s): %s" % (f.get("step"), f.get("message")) for f in result.get("failures") or []]
    return heading, list(result.get("table") or []), said
