"""Start-up time on separate hosts: our node agent under dstack's contract against Ray's
own `ray symmetric-run`, side by side in one run (the machine is noisy: compare ratios).

    .venv/bin/python benchmarks/startup.py [--rounds 5] [--nodes 3,5] [--checkout DIR]   # as root
        [--base DIR] [--floor] [--job-floor] [--set preflight=off ...]

Hosts are the project's namespace testbed (tests/testbed.py, needs root). Per run:

ours:    `rlhf-tasks render TASK --provider dstack` of a `command` job (token auth, no
         services, submit: head), from the checkout measured (PYTHONPATH); the rendered
         `files` are placed on every host (/opt/rlhf-tasks is a private tmpfs per host) and the
         rendered `commands` start on every host with the environment dstack's runner sets.
symmetric-run: `ray symmetric-run --address HEAD:6379 --min-nodes N -- CMD` on every
         host, with the same Ray start flags and the same token auth.
ray-start floor (--floor): plain `ray start --block` on every host (the head with --head,
         the others with --address HEAD:6379), the same flags and token auth, and no command:
         its result is when the poller sees every node ALIVE. That is the cluster alone, a
         floor for anything that forms it with one `ray start` per host and runs the command
         once every node is in.
ray job floor (--job-floor): the ray-start floor, and a Ray job the poller submits as soon as
         the head's dashboard answers, whose driver waits for every node ALIVE, then execs CMD:
         the least a launcher that runs the command as a Ray job once the nodes are in does
         (a job supervisor and a driver; no agent, no checks).

CMD writes the wall-clock time it starts into a directory every host sees. t0 is taken
just before the nodes' processes are spawned; the result is t_cmd - t0. A light poller
on the head host records when the GCS port opens, the dashboard answers, each node turns
ALIVE and the job changes state, which splits the time. Each node's launcher (the agent,
or symmetric-run's python) is sampled for its peak RSS (VmHWM). Until the command starts,
every process on the hosts is sampled for its CPU time (/proc, by what it is: Ray's daemons,
the job supervisor, preflight's probes, ...), which says where the CPU of shared cores went;
for ours, preflight's steps come from the result the head agent keeps. Every run ends with a
reboot of the hosts (their whole PID namespaces are killed), so nothing carries over.
Runs alternate ours[, base], symmetric-run[, ray-start floor][, ray job floor], ours, ... `--base DIR` runs
ours from a second checkout too (a change against what it changes), `--set KEY=VALUE`
changes our task (a dotted key, a YAML value). Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import testbed as tbmod  # noqa: E402

BIN = Path(sys.executable).parent
TOKEN = secrets.token_hex(16)  # this benchmark's cluster token: in environments only, never printed
RAY_FLAGS = ["--num-cpus", "1", "--object-store-memory", "80000000"]  # what the task renders for ours
NAME = "startup-bench"
KINDS = ("ours", "base", "symmetric-run", "ray-start floor", "ray job floor")  # base: ours from --base's checkout


# --------------------------------------------------------------------------- the job

def job_command(started: Path) -> list[str]:
    """The job both sides run: record the wall-clock time it starts, in a shared dir."""
    return ["python3", "-c", f"import time; open({str(started)!r}, 'w').write(repr(time.time()))"]


@dataclass
class Start:
    """What to start on each host, prepared before t0."""
    commands: list[str]                 # one bash command per rank
    envs: list[dict[str, str]]          # its exact environment per rank
    launcher: str                       # a string in the launcher process's argv (for its RSS)
    poll_jobs: bool                     # whether the head submits a Ray job
    started_when_alive: bool = False    # no command: the poller marks the start when all are ALIVE
    head_exits: bool = True             # False: `ray start --block`, which runs until the host reboots
    submit: str | None = None           # a Ray job's entrypoint the poller submits once the dashboard answers
    beacon_port: int | None = None      # the head agent's ready beacon


# --------------------------------------------------------------------------- ours

def render_ours(checkout: Path, run_dir: Path, nodes: int, started: Path, overrides: dict) -> dict:
    """Render the task through the public CLI of the checkout measured; return the dstack config."""
    task = {"name": NAME, "nodes": nodes, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"},
            "job": {"recipe": "command", "submit": "head", "working_dir": None,
                    "args": {"entrypoint": job_command(started)}}}
    for key, value in overrides.items():  # --set: dotted task keys
        *parents, last = key.split(".")
        where = task
        for parent in parents:
            where = where.setdefault(parent, {})
        where[last] = value
    (run_dir / "task.yaml").write_text(yaml.safe_dump(task))
    out = run_dir / "rendered"
    subprocess.run([str(BIN / "rlhf-tasks"), "render", str(run_dir / "task.yaml"), "--provider", "dstack",
                    "-o", str(out / f"{NAME}.dstack.yml")], env=dict(os.environ, PYTHONPATH=str(checkout)),
                   check=True, capture_output=True, text=True)
    # The agent: a package under lib/ (rlhf_tasks/agent/), or node.py beside the plan in an older checkout.
    packaged = (checkout / "rlhf_tasks" / "agent").is_dir()
    source = checkout / "rlhf_tasks" / ("agent/head.py" if packaged else "node.py")
    rendered = out / "rlhf-tasks" / ("lib/rlhf_tasks/agent/head.py" if packaged else "node.py")
    if rendered.read_bytes() != source.read_bytes():
        raise SystemExit(f"the rendered agent is not {checkout}'s: check PYTHONPATH and the install")
    return yaml.safe_load((out / f"{NAME}.dstack.yml").read_text()) | {"_dir": out}


#: Each host's own tmpfs, below which the rendered files go: only what the agent owns, never
#: /opt itself (a machine whose Python lives under /opt lost it on every host).
HOST_DIR = "/opt/rlhf-tasks"


def place(tb, rank: int, config: dict) -> None:
    """Put the rendered `files` where dstack would upload them; HOST_DIR is the host's own tmpfs."""
    script = [f"mkdir -p {HOST_DIR}", f"(mountpoint -q {HOST_DIR} || mount -t tmpfs tmpfs {HOST_DIR})"]
    for pair in config["files"]:
        local, remote = pair.split(":")
        if not remote.startswith(HOST_DIR + "/"):
            raise SystemExit(f"the rendered file {remote} lies outside {HOST_DIR}, the hosts' own tmpfs")
        script += [f"mkdir -p {shlex.quote(str(Path(remote).parent))}",
                   f"cp {shlex.quote(str(config['_dir'] / local))} {shlex.quote(remote)}"]
    tb.sh(rank, " && ".join(script))


def dstack_env(tb, rank: int, nodes: int, rendered_env: list[str]) -> dict[str, str]:
    """What dstack's runner sets, plus the config's `env` (bare names filled at apply time)."""
    local = {"RAY_AUTH_TOKEN": TOKEN}
    env = {}
    for entry in rendered_env:
        key, sep, value = entry.partition("=")
        env[key] = value if sep else local[key]
    ips = [h.ip for h in tb.hosts[:nodes]]
    return tb.env(**env, DSTACK_NODE_RANK=str(rank), DSTACK_MASTER_NODE_IP=ips[0], DSTACK_NODES_IPS="\n".join(ips),
                  DSTACK_NODES_NUM=str(nodes), DSTACK_GPUS_PER_NODE="0", DSTACK_GPUS_NUM="0",
                  DSTACK_RUN_NAME=NAME + "-run")


def prepare_ours(tb, nodes: int, run_dir: Path, started: Path, checkout: Path, overrides: dict) -> Start:
    config = render_ours(checkout, run_dir, nodes, started, overrides)
    plan = json.loads((config["_dir"] / "rlhf-tasks" / f"{NAME}.plan.json").read_text())
    for rank in range(nodes):
        place(tb, rank, config)
    command = " && ".join(config["commands"])
    return Start([command] * nodes, [dstack_env(tb, r, nodes, config.get("env", [])) for r in range(nodes)],
                 launcher="--plan", poll_jobs=True, beacon_port=plan["ray"]["ready_port"])


# --------------------------------------------------------------------------- symmetric-run

def own_pid_namespace_guard() -> str:
    """Shell that refuses to go on unless it runs inside a host of its own PID namespace, whose
    /proc is that namespace's: symmetric-run ends with `ray stop`, which kills every Ray
    process it can see."""
    outer = os.readlink("/proc/self/ns/pid")
    return ('me=$(readlink /proc/self/ns/pid); '
            f'if [ "$me" = {shlex.quote(outer)} ] || [ "$(readlink /proc/1/ns/pid)" != "$me" ]; then '
            'echo "refusing: not inside a host with its own PID namespace and /proc" >&2; exit 97; fi; ')


def prepare_symmetric(tb, nodes: int, started: Path) -> Start:
    argv = ["ray", "symmetric-run", "--address", f"{tb.hosts[0].ip}:6379", "--min-nodes", str(nodes),
            *RAY_FLAGS, "--", *job_command(started)]
    command = own_pid_namespace_guard() + "exec " + shlex.join(argv)
    # the same token auth as ours; a longer deadline only avoids failures on a busy machine
    env = tb.env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN, RAY_SYMMETRIC_RUN_CLUSTER_WAIT_TIMEOUT="180")
    return Start([command] * nodes, [env] * nodes, launcher="symmetric-run", poll_jobs=False)


def prepare_floor(tb, nodes: int) -> Start:
    head = tb.hosts[0].ip
    commands = [own_pid_namespace_guard() + "exec " + shlex.join(
        ["ray", "start", "--block", "--node-ip-address", tb.hosts[rank].ip, *RAY_FLAGS,
         *(["--head", "--port", "6379"] if rank == 0 else ["--address", f"{head}:6379"])])
        for rank in range(nodes)]
    env = tb.env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    return Start(commands, [env] * nodes, launcher="start", poll_jobs=False, started_when_alive=True, head_exits=False)


def prepare_job_floor(tb, nodes: int, started: Path) -> Start:
    """The floor with a Ray job: as soon as the head's dashboard answers, the poller submits a job
    whose driver waits for every node ALIVE and then execs CMD; the least a launcher that runs
    the command as a Ray job once the nodes are in can do (no agent, no checks)."""
    floor = prepare_floor(tb, nodes)
    script = "\n".join(["import json, os, time, ray", "ray.init()",
                        f"while sum(1 for n in ray.nodes() if n['Alive']) < {nodes}:", "    time.sleep(0.1)",
                        "ray.shutdown()", f"command = json.loads({json.dumps(job_command(started))!r})",
                        "os.execvp(command[0], command)"])
    return Start(floor.commands, floor.envs, launcher="start", poll_jobs=True, head_exits=False,
                 submit=shlex.join([sys.executable, "-c", script]))


# --------------------------------------------------------------------------- the poller (head host)

# Standard library only; runs inside the head host so the head's 127.0.0.1 dashboard is
# reachable. Writes one JSON line per change it sees; exits when the command has started.
POLLER = r'''
import json, os, socket, sys, threading, time, urllib.error, urllib.request
spec = json.loads(sys.argv[1])
token = os.environ.get("RAY_AUTH_TOKEN")
headers = {"Authorization": "Bearer " + token} if token else {}
out = open(spec["out"], "a")

def note(event, **fields):
    fields.update(t=time.time(), event=event)
    out.write(json.dumps(fields) + "\n")
    out.flush()

def submit(entrypoint):  # in a thread: the dashboard answers a submission only once its supervisor is up
    request = urllib.request.Request(spec["dashboard"] + "/api/jobs/", method="POST", headers=dict(
        headers, **{"Content-Type": "application/json"}), data=json.dumps(
        {"entrypoint": entrypoint, "submission_id": "job-floor"}).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            note("submitted", status=r.status)
    except urllib.error.HTTPError as e:
        note("submitted", status=e.code)
    except OSError as e:
        note("submitted", status=None, error=str(e))

def get(path, as_json=True, auth=True):
    request = urllib.request.Request(spec["dashboard"] + path, headers=headers if auth else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as r:
            body = r.read()
            return r.status, json.loads(body) if as_json else body
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return None, None

def tcp(port, want=None):
    try:
        with socket.create_connection((spec["head"], port), timeout=1) as s:
            return want is None or s.recv(16).startswith(want)
    except OSError:
        return False

note("ready")
gcs = dashboard = beacon = False
alive, job_status = {}, {}
deadline = time.time() + spec["timeout"]
while time.time() < deadline and not os.path.exists(spec["started"]):
    if not gcs and tcp(spec["gcs_port"]):
        gcs = True
        note("gcs_open")
    if gcs and not dashboard and get("/api/gcs_healthz", as_json=False)[0] == 200:
        dashboard = True
        note("dashboard_up")
        note("no_token", status=get("/api/v0/nodes?limit=1", auth=False)[0])  # is token auth enforced?
        if spec["submit"]:
            threading.Thread(target=submit, args=(spec["submit"],), daemon=True).start()
    if spec["beacon_port"] and not beacon and tcp(spec["beacon_port"], b"ready"):
        beacon = True
        note("beacon")
    if dashboard and len(alive) < spec["nodes"]:
        status, body = get("/api/v0/nodes?limit=100&detail=true&filter_keys=state&filter_predicates=%3D"
                           "&filter_values=ALIVE")
        nodes = body["data"]["result"]["result"] if status == 200 else []
        for node in nodes:
            if node["node_ip"] not in alive:
                alive[node["node_ip"]] = True
                note("alive", ip=node["node_ip"], head=node.get("is_head_node"), start_time_ms=node.get("start_time_ms"))
        if spec["started_when_alive"] and len(alive) == spec["nodes"]:
            with open(spec["started"] + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.rename(spec["started"] + ".tmp", spec["started"])
    if spec["poll_jobs"] and dashboard:  # the head submits preflight and the job before the nodes are in
        status, jobs = get("/api/jobs/")
        for job in jobs if status == 200 else []:
            sid = job.get("submission_id")
            if job.get("type") == "SUBMISSION" and job.get("status") != job_status.get(sid):
                job_status[sid] = job["status"]
                note("job", sid=sid, status=job["status"], start_time_ms=job.get("start_time"))
    time.sleep(spec["interval"])
note("done")
'''


def start_poller(tb, nodes: int, start: Start, run_dir: Path, started: Path) -> Path:
    """Start the poller on the head host and return its output file once it is polling."""
    out = run_dir / "poller.jsonl"
    script = run_dir.parent / "poller.py"
    script.write_text(POLLER.lstrip())
    spec = {"out": str(out), "started": str(started), "head": tb.hosts[0].ip, "gcs_port": 6379,
            "dashboard": "http://127.0.0.1:8265", "nodes": nodes, "beacon_port": start.beacon_port,
            "poll_jobs": start.poll_jobs, "started_when_alive": start.started_when_alive, "submit": start.submit,
            "interval": 0.1, "timeout": 600}
    tb.run(0, [sys.executable, "-I", "-S", str(script), json.dumps(spec)], env=tb.env(RAY_AUTH_TOKEN=TOKEN),
           name="poller")
    tbmod.poll(lambda: out.exists() and out.read_text().startswith("{"), 30, "the poller to start", 0.02)
    return out


# --------------------------------------------------------------------------- peak RSS of the launchers

class RssSampler:
    """VmHWM (peak RSS) of each host's launcher process, read from /proc until it exits."""

    def __init__(self, tb, nodes: int, needle: str):
        self.tb, self.nodes, self.needle = tb, nodes, needle
        self.pids: dict[int, int] = {}
        self.peak_kib: dict[int, int] = {}

    def _find(self, rank: int) -> int | None:
        for pid in self.tb.processes(rank):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # the python process itself, not the bash or nsenter that started it
            words = [a.decode(errors="replace") for a in argv[:4]]
            if "python" in Path(words[0]).name and any(self.needle in w for w in words[1:]):
                return pid
        return None

    def sample(self) -> None:
        for rank in range(self.nodes):
            pid = self.pids.get(rank) or self._find(rank)
            if pid is None:
                continue
            self.pids[rank] = pid
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue  # it exited: its last sample stands
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_kib[rank] = max(self.peak_kib.get(rank, 0), int(line.split()[1]))


# --------------------------------------------------------------------------- CPU time by process

CLK_TCK = os.sysconf("SC_CLK_TCK")
CPU_LABELS = [("dashboard/agent.py", "dashboard agent"), ("runtime_env/agent", "runtime env agent"),
              ("dashboard/dashboard.py", "dashboard"), ("log_monitor", "log monitor"),
              ("autoscaler/_private/monitor", "autoscaler monitor"), ("ray-dashboard-", "dashboard modules"),
              ("default_worker.py", "ray::IDLE"), ("rlhf_tasks.agent gate", "our job's gate (preflight's driver)"),
              ("rlhf_tasks.agent.preflight", "preflight driver"),
              ("agent/__main__.py gate", "our job's gate (preflight's driver)"),  # started by its path since
              ("agent/__main__.py preflight", "preflight driver"),                 # issue 32, item 2
              ("rlhf_tasks", "our node agent"),
              ("ray.scripts.scripts import main", "ray CLI"), ("symmetric-run", "ray CLI"), ("ray start", "ray CLI"),
              ("ray.nodes()", "the job floor's driver"), ("import time; open(", "the command"), ("poller.py", None)]


def cpu_label(argv: str) -> str | None:
    """What a process is, for the CPU table (None: the benchmark's own poller, not counted)."""
    words = argv.split()
    if not words:
        return None  # a zombie
    if Path(words[0]).name in ("raylet", "gcs_server"):
        return Path(words[0]).name
    if argv.startswith("ray::"):
        title = words[0].split(".")[0]  # the Ray worker's title: ray::IDLE, ray::NodeProbe, ...
        return "ray::JobSupervisor" if title.endswith("JobSupervisor") else title
    for needle, label in CPU_LABELS:
        if needle in argv:
            return label
    return " ".join(Path(words[0]).name if i == 0 else w for i, w in enumerate(words[:3]))[:60]


class CpuSampler:
    """CPU seconds (user + system) the hosts' processes use, by what they are, summed over the
    hosts: each process's own time at its last sample (a process that exits between samples
    loses at most one interval; a process's children count as themselves). A process is
    what its last sample says (a child between fork and exec looks like its parent; a Ray
    worker takes its task's title), but the command keeps the label of the gate that exec'd it."""

    def __init__(self, tb, nodes: int):
        self.namespaces = {os.readlink(f"/proc/{tb.host(r).init_pid}/ns/pid") for r in range(nodes)}
        self.seen: dict[int, tuple[str, int]] = {}  # pid -> (label, ticks)

    def sample(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") not in self.namespaces:
                    continue
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                before = self.seen.get(int(entry), (None,))[0]
                label = cpu_label(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                                  .decode(errors="replace").strip())
                if before is not None and label == "the command":  # the gate exec'd it: the time was the gate's
                    label = before
            except OSError:
                continue
            if label is not None:
                self.seen[int(entry)] = (label, int(stat[11]) + int(stat[12]))  # utime stime

    def seconds(self) -> dict[str, float]:
        used: dict[str, float] = {}
        for label, ticks in self.seen.values():
            used[label] = used.get(label, 0.0) + ticks / CLK_TCK
        return used


# --------------------------------------------------------------------------- one run

@dataclass
class Run:
    kind: str
    nodes: int
    seconds: float                                          # t_cmd - t0
    marks: dict[str, float] = field(default_factory=dict)   # event -> seconds after t0
    peak_rss_mib: dict[int, float] = field(default_factory=dict)
    no_token_status: int | None = None                      # HTTP status of a request without the token
    cpu: dict[str, float] = field(default_factory=dict)     # CPU seconds by process when the command started
    preflight: dict[str, float] = field(default_factory=dict)  # ours: preflight's steps, seconds each
    t0: float = 0.0                                         # wall clock when the nodes were spawned
    load: list[float] = field(default_factory=list)         # the 1-minute load average before and after the run


def run_once(tb, kind: str, nodes: int, run_dir: Path, checkout: Path, timeout: float,
             overrides: dict | None = None) -> Run:
    run_dir.mkdir(parents=True)
    started = run_dir / "started"
    start = (prepare_ours(tb, nodes, run_dir, started, checkout, overrides or {}) if kind in ("ours", "base")
             else prepare_symmetric(tb, nodes, started) if kind == "symmetric-run"
             else prepare_job_floor(tb, nodes, started) if kind == "ray job floor" else prepare_floor(tb, nodes))
    poller = start_poller(tb, nodes, start, run_dir, started)
    rss = RssSampler(tb, nodes, start.launcher)
    cpu = CpuSampler(tb, nodes)
    load = [load_average()]
    t0 = time.time()
    # In a directory of the run's own: `python3 -m rlhf_tasks.agent` puts its working directory
    # first on sys.path, so from a checkout every host would run that checkout's agent (and its
    # jobs, whose PYTHONPATH the agent builds from where it was imported), not the one measured.
    procs = [tb.run(rank, start.commands[rank], env=start.envs[rank], name=f"{kind}-node{rank}", cwd=run_dir)
             for rank in range(nodes)]
    head = procs[0]

    def command_started():
        rss.sample()
        if not head.running() and not started.exists():
            raise RuntimeError(f"{kind}: the head exited ({head.returncode}) before the command ran:\n"
                               + head.output[-3000:])
        cpu.sample()
        return started.exists() and started.read_text()
    t_cmd = float(tbmod.poll(command_started, timeout, f"{kind}: the command to start", 0.1))

    def head_done():  # keep sampling: the head agent follows the job and stops Ray before it exits
        rss.sample()
        return not head.running()
    try:
        if start.head_exits:  # a bare `ray start --block` never exits by itself
            tbmod.poll(head_done, 90, f"{kind}: the head to exit", 0.2)
    except TimeoutError:
        print(f"  ({kind}: the head did not exit within 90 s after the command; its RSS is sampled up to now)")
    rss.sample()
    for rank, proc in enumerate(procs):  # each node's output, for a look at where the time went
        shutil.copy(proc.log, run_dir / f"node{rank}.log")
    load.append(load_average())
    run = Run(kind, nodes, t_cmd - t0, t0=t0, cpu=cpu.seconds(), peak_rss_mib={r: kib / 1024 for r, kib in rss.peak_kib.items()},
              load=load)
    run.marks = marks(poller, t0, nodes) | {"command started": t_cmd - t0}
    run.no_token_status = next((e["status"] for e in map(json.loads, poller.read_text().splitlines())
                                if e["event"] == "no_token"), None)
    if kind in ("ours", "base"):
        run.marks |= agent_marks(head.output, run.marks)
        run.preflight = preflight_steps(tb)
    return run


def load_average() -> float:
    """The machine's 1-minute load average (what `uptime` prints first)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def split(run: Run) -> float | None:
    """Last node ALIVE (Ray's own time for it) -> the command started: what is left after the nodes are in."""
    alive = run.marks.get(f"all {run.nodes} nodes ALIVE (Ray's time)")
    return None if alive is None else run.seconds - alive


def marks(poller: Path, t0: float, nodes: int) -> dict[str, float]:
    """The poller's events as seconds after t0 (Ray's own timestamps where it has them)."""
    out = {}
    workers = []
    for line in poller.read_text().splitlines():
        event = json.loads(line)
        t = event["t"] - t0
        if event["event"] in ("gcs_open", "dashboard_up", "beacon"):
            out[{"gcs_open": "head GCS port open", "dashboard_up": "head dashboard healthy",
                 "beacon": "head ready beacon (ours)"}[event["event"]]] = t
        elif event["event"] == "alive" and not event["head"]:
            workers.append((t, event["start_time_ms"] / 1000 - t0))
        elif event["event"] == "job" and event.get("start_time_ms"):
            what = "preflight" if (event.get("sid") or "").startswith("preflight_") else "job"
            out.setdefault(f"{what} submitted (Ray's time)", event["start_time_ms"] / 1000 - t0)
    if workers:
        out["first worker ALIVE (seen)"] = min(w[0] for w in workers)
    if len(workers) == nodes - 1:
        out[f"all {nodes} nodes ALIVE (Ray's time)"] = max(w[1] for w in workers)
        out[f"all {nodes} nodes ALIVE (seen)"] = max(w[0] for w in workers)
    return out


def agent_marks(head_log: str, seen: dict[str, float]) -> dict[str, float]:
    """When the head agent decided the cluster was ready. Its log says how long after it began
    starting Ray; the poller saw the beacon it opens right before "Ray head's GCS up in X s"."""
    up = re.search(r"Ray head's GCS up in ([\d.]+)s", head_log) or re.search(r"Ray head up in ([\d.]+)s", head_log)
    ready = re.search(r"cluster ready: .*\(([\d.]+)s after the head started\)", head_log)
    if not (up and ready and "head ready beacon (ours)" in seen):
        return {}
    began = seen["head ready beacon (ours)"] - float(up.group(1))
    return {"head agent: cluster ready (its log)": began + float(ready.group(1))}


def preflight_steps(tb) -> dict[str, float]:
    """Preflight's steps and their seconds, from the result the head agent keeps (the nodes
    step counts from when preflight began: it waits for the nodes to join)."""
    try:
        result = json.loads(tb.sh(0, "cat /opt/rlhf-tasks/logs/preflight.json"))
    except (tbmod.TestbedError, ValueError):
        return {}
    return {step["step"]: step["seconds"] for step in result.get("steps", [])}


def reset(tb, nodes: int) -> None:
    """Tear down completely: kill each host's whole PID namespace and boot it again (fresh /tmp, /opt/rlhf-tasks)."""
    for rank in range(nodes):
        tb.reboot(rank)


# --------------------------------------------------------------------------- report

MARK_ORDER = ["head GCS port open", "head dashboard healthy", "head ready beacon (ours)", "first worker ALIVE (seen)",
              "preflight submitted (Ray's time)", "job submitted (Ray's time)",
              "all {n} nodes ALIVE (Ray's time)", "all {n} nodes ALIVE (seen)", "head agent: cluster ready (its log)",
              "command started"]


def report(runs: list[Run], nodes: int) -> str:
    kinds = [k for k in KINDS if any(r.kind == k for r in runs)]
    by_kind = {k: [r for r in runs if r.kind == k and r.nodes == nodes] for k in kinds}
    header = "| {} | " + " | ".join(kinds) + " |"
    rule = "|---|" + "---|" * len(kinds)
    lines = [f"#### {nodes} hosts", "", header.format("round"), rule]
    for i in range(max(len(v) for v in by_kind.values())):
        cells = [f"{by_kind[k][i].seconds:.1f} s" if i < len(by_kind[k]) else "failed" for k in kinds]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    medians = {k: statistics.median(r.seconds for r in v) if v else None for k, v in by_kind.items()}
    reference = medians.get("symmetric-run")
    ratios = [f"{medians[k] / reference:.2f}" if medians[k] and reference else "-" for k in kinds]
    floor = medians.get("ray-start floor")
    splits = {k: [x for x in map(split, v) if x is not None] for k, v in by_kind.items()}
    loads = [x for r in runs if r.nodes == nodes for x in r.load]
    lines += ["| median | " + " | ".join(f"{medians[k]:.1f} s" if medians[k] else "-" for k in kinds) + " |",
              "| ratio to symmetric-run | " + " | ".join(ratios) + " |",
              "| ratio to ray-start floor | " + " | ".join(
                  f"{medians[k] / floor:.2f}" if medians[k] and floor else "-" for k in kinds) + " |",
              "| last node ALIVE -> command started, median (rounds) | " + " | ".join(
                  f"{statistics.median(splits[k]):.2f} s ({', '.join(f'{x:.2f}' for x in splits[k])})"
                  if splits[k] and k != "ray-start floor" else "-" for k in kinds) + " |", "",
              f"1-minute load average before and after each run: {min(loads):.1f} to {max(loads):.1f}, median "
              f"{statistics.median(loads):.1f}." if loads else "", "",
              "Where the time goes: median seconds after t0 (in brackets: since the row above):", "",
              header.format("mark"), rule]
    previous = {k: 0.0 for k in kinds}
    for mark in MARK_ORDER:
        mark = mark.format(n=nodes)
        cells = []
        for k in kinds:
            values = [r.marks[mark] for r in by_kind[k] if mark in r.marks]
            if not values:
                cells.append("-")
                continue
            median = statistics.median(values)
            cells.append(f"{median:.1f} ({median - previous[k]:+.1f})")
            previous[k] = median
        if any(c != "-" for c in cells):
            lines.append(f"| {mark} | " + " | ".join(cells) + " |")
    steps = {k: [r.preflight for r in by_kind[k] if r.preflight] for k in kinds}
    names = list(dict.fromkeys(name for k in kinds for result in steps[k] for name in result))
    if names:
        lines += ["", "Preflight's steps (median seconds; `nodes` counts from when preflight began, as it waits for "
                  "the nodes):", "", header.format("step"), rule]
        for name in names:
            cells = [f"{statistics.median(r.get(name, 0.0) for r in steps[k]):.2f}" if steps[k] else "-" for k in kinds]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "CPU seconds the hosts used until the command started (median over rounds, summed over hosts):", "",
              header.format("process"), rule]
    labels = sorted({label for r in runs if r.nodes == nodes for label in r.cpu},
                    key=lambda label: -max(r.cpu.get(label, 0.0) for r in runs if r.nodes == nodes))
    for label in ["total", *labels]:
        cells = []
        for k in kinds:
            values = [sum(r.cpu.values()) if label == "total" else r.cpu.get(label, 0.0) for r in by_kind[k] if r.cpu]
            cells.append(f"{statistics.median(values):.1f}" if values else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Peak RSS of each node's launcher process (VmHWM, MiB, max over rounds):", "",
              "| launcher | head | workers (max) |", "|---|---|---|"]
    labels = {"ours": "ours: node agent", "base": "base: node agent", "symmetric-run": "symmetric-run (python)"}
    for kind, label in [(k, labels[k]) for k in kinds if k in labels]:
        head = [r.peak_rss_mib[0] for r in by_kind[kind] if 0 in r.peak_rss_mib]
        workers = [mib for r in by_kind[kind] for rank, mib in r.peak_rss_mib.items() if rank]
        lines.append(f"| {label} | {max(head):.1f} | {max(workers):.1f} |" if head and workers else f"| {label} | - | - |")
    refused = {k: sorted({str(r.no_token_status) for r in v}) for k, v in by_kind.items()}
    lines += ["", "Token auth: HTTP status of a State API request without the token, per run: "
              + "; ".join(f"{k} {', '.join(refused[k])}" for k in kinds) + " (401/403: enforced)."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", default="3,5", help="host counts, comma-separated")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the rlhf-tasks checkout to measure")
    parser.add_argument("--timeout", type=float, default=240, help="per run, until the command starts")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, rendered files)")
    parser.add_argument("--base", type=Path, help="also run ours from this checkout (a git worktree), as 'base'")
    parser.add_argument("--floor", action="store_true", help="also run the ray-start floor (the cluster alone)")
    parser.add_argument("--job-floor", action="store_true",
                        help="also run the ray job floor (the cluster, and a Ray job that waits for its nodes)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted key of our task, its value as YAML (e.g. preflight=off); repeatable")
    args = parser.parse_args()
    reason = tbmod.require_root()
    if reason:
        raise SystemExit(reason)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (finally, testbed close) on SIGTERM too
    checkout = args.checkout.resolve()
    wanted = {"ours": True, "base": args.base is not None, "symmetric-run": True, "ray-start floor": args.floor,
              "ray job floor": args.job_floor}
    kinds = [k for k in KINDS if wanted[k]]
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--set {item!r}: write it as KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    workdir = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    runs: list[Run] = []
    failed = False
    began = time.monotonic()
    try:
        for nodes in [int(n) for n in args.nodes.split(",")]:
            with tbmod.Testbed(nodes, workdir / f"testbed{nodes}", shared=[workdir]) as tb:
                for round_ in range(1, args.rounds + 1):
                    for kind in kinds:
                        run_dir = workdir / f"{nodes}hosts" / f"round{round_}-{kind}"
                        try:
                            source = args.base.resolve() if kind == "base" else checkout
                            runs.append(run_once(tb, kind, nodes, run_dir, source, args.timeout, overrides))
                            print(f"{nodes} hosts, round {round_}, {kind}: {runs[-1].seconds:.1f} s", flush=True)
                        except (RuntimeError, TimeoutError, tbmod.TestbedError, subprocess.CalledProcessError) as exc:
                            failed = True
                            print(f"{nodes} hosts, round {round_}, {kind}: FAILED: {exc}", flush=True)
                        reset(tb, nodes)
    except KeyboardInterrupt:
        print("interrupted: the hosts and their processes are torn down")
        return 130
    finally:
        if args.json:
            args.json.write_text(json.dumps([r.__dict__ for r in runs], indent=1))
        if args.keep or failed:
            print(f"work dir kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nchecked out: {checkout}{f'; base: {args.base.resolve()}' if args.base else ''}; {args.rounds} rounds; "
          f"our task with {overrides or 'no overrides'}; "
          f"took {time.monotonic() - began:.0f} s\n")
    for nodes in sorted({r.nodes for r in runs}):
        print(report(runs, nodes))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
