"""dstack's shim and runner, played by one program of ours (tests/dstack/README.md): the one part of the
dstack tests that is not dstack's own code.

Installed on a fleet host by the real dstack server (its SSH fleet setup downloads it from
DSTACK_SHIM_DOWNLOAD_URL to /usr/local/bin/dstack-shim and starts it as the `dstack-shim` systemd unit; the
shim downloads it again from DSTACK_RUNNER_DOWNLOAD_URL as dstack-runner). What it does is decided by the
name it runs under. It serves the HTTP APIs exactly as the server's client calls them
(dstack/_internal/server/services/runner/client.py, schemas in dstack/_internal/server/schemas/runner.py)
and runs the job as dstack's runner does (runner/internal/runner/executor/executor.go in
github.com/dstackai/dstack; README.md cites the lines), on the host: there is no container, the "image" is
this host with the test virtualenv first on PATH (@IMAGE_PATH@ is filled in when it is served).

Standard library only.
"""
import base64
import io
import json
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

VERSION = "@DSTACK_VERSION@"
IMAGE_PATH = "@IMAGE_PATH@"
DOCKER_ROOT = "/var/lib/docker"
#: The CPUs each host's shim reports, by hostname (@PLAYED_CPUS@ is filled in when it is served: server.py
#: PLAYED_CPUS): hosts that differ, so that dstack's own offer matching puts each node group on its hosts.
PLAYED_CPUS = json.loads('@PLAYED_CPUS@')
#: The one variable of ours in a job's environment: it marks the task's processes, which a container's
#: teardown would kill (there is no container here).
CONTAINER_MARK = "DSTACK_TEST_CONTAINER"


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, flush=True)


class Handler(BaseHTTPRequestHandler):
    routes = []  # (method, regex, function)
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        log("http", self.command, self.path, *args[1:2])

    def _handle(self, method):
        path = urlparse(self.path).path
        if method == "GET" and path == "/logs_ws" and RUNNER is not None:
            return self.logs_ws()
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        for m, rx, fn in self.routes:
            match = re.fullmatch(rx, path)
            if m == method and match:
                try:
                    status, out = fn(self, body, *match.groups())
                except Exception as exc:  # noqa: BLE001 - answer 500 with the message, as the Go servers do
                    log("error", method, path, repr(exc))
                    status, out = 500, {"error": repr(exc)}
                break
        else:
            status, out = 404, {"error": f"no route {method} {path}"}
        data = b"" if out is None else json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def logs_ws(self):
        """runner/internal/runner/api/ws.go: the job's output as binary WebSocket messages from `start_time`
        on, then a close once the job is over and everything is sent (what `dstack apply`/`attach` read)."""
        import hashlib
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept.decode())
        self.end_headers()
        self.close_connection = True
        start = 0
        st = self.query().get("start_time")
        if st:
            from datetime import datetime
            start = int(datetime.fromisoformat(st.replace("Z", "+00:00")).timestamp()) * 1000
        pos = sum(1 for ts, _ in RUNNER.ws_logs if ts < start) if start else 0
        try:
            while True:
                if pos < len(RUNNER.ws_logs):
                    data = RUNNER.ws_logs[pos][1]
                    n = len(data)
                    head = bytes([0x82, n]) if n < 126 else (bytes([0x82, 126]) + n.to_bytes(2, "big") if n < 65536
                                                               else bytes([0x82, 127]) + n.to_bytes(8, "big"))
                    self.wfile.write(head + data)
                    self.wfile.flush()
                    pos += 1
                elif RUNNER.done.is_set():  # ws.go: closed at the runner's shutdown, after the server's last pull
                    self.wfile.write(bytes([0x88, 0]))
                    self.wfile.flush()
                    return
                else:
                    time.sleep(0.1)
        except OSError:
            return

    def query(self):
        return {k: v[-1] for k, v in parse_qs(urlparse(self.path).query).items()}


def route(method, rx):
    def deco(fn):
        Handler.routes.append((method, rx, fn))
        return fn
    return deco


def serve(port):
    ThreadingHTTPServer.allow_reuse_address = True
    server = ThreadingHTTPServer(("", port), Handler)
    server.daemon_threads = True
    return server


def download(url, path):
    tmp = f"{path}.download"
    with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)


# ============================================================================ shim

TASKS = {}
LOCK = threading.Lock()


def host_info():
    """runner/internal/shim/host_info.go: what `host_info.json` holds (bytes, MiB for GPU memory)."""
    mem = 0
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    # host/host.go GetDiskSize: the space free (Bavail) under Docker's root dir, where dstack's containers live
    st = os.statvfs(DOCKER_ROOT if os.path.isdir(DOCKER_ROOT) else "/")
    addrs = []
    try:
        for iface in json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True).stdout):
            for a in iface.get("addr_info", []):
                if a.get("family") == "inet" and iface.get("ifname") != "lo":
                    addrs.append(f"{a['local']}/{a['prefixlen']}")
    except (OSError, ValueError):
        pass
    return {"gpu_vendor": "", "gpu_name": "", "gpu_memory": 0, "gpu_count": 0, "addresses": addrs,
            "disk_size": st.f_bavail * st.f_bsize, "cpus": PLAYED_CPUS.get(socket.gethostname(), os.cpu_count() or 1),
            "memory": mem}


class Task:
    def __init__(self, req):
        self.req = req
        self.id = req["id"]
        self.status = "pending"
        self.reason = ""
        self.message = ""
        self.proc = None

    def info(self):
        return {"id": self.id, "status": self.status, "termination_reason": self.reason,
                "termination_message": self.message, "ports": []}

    def start(self):
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            self.status = "preparing"
            runner = os.environ.get("DSTACK_RUNNER_BINARY_PATH", "/usr/local/bin/dstack-runner")
            if not os.path.exists(runner):
                download(os.environ["DSTACK_RUNNER_DOWNLOAD_URL"], runner)
            self.status = "pulling"  # no image to pull: the job runs on the host
            self.status = "creating"
            temp = "/tmp/runner"
            shutil.rmtree(temp, ignore_errors=True)
            os.makedirs(temp)
            add_host_keys(self.req.get("host_ssh_keys") or [])
            keys = list(self.req.get("container_ssh_keys") or [])
            with open(os.path.join(temp, "authorized_keys"), "w") as f:
                f.write("\n".join(keys) + "\n")
            env = {"PATH": IMAGE_PATH, "HOME": "/root", "LANG": "C.UTF-8", "USER": "root", CONTAINER_MARK: self.id,
                   "DSTACK_RUNNER_LOG": os.path.join(temp, "runner.out")}
            logf = open(os.path.join(temp, "runner.out"), "ab")
            # the shim's runner command, runner/internal/shim/docker.go getRunnerCmd: `dstack-runner --log-level
            # N start --temp-dir /tmp/runner --http-port 10999 --ssh-port 10022`; cwd is the image's WORKDIR, `/`
            self.proc = subprocess.Popen(
                [runner, "--log-level", "6", "start", "--temp-dir", temp,
                 "--http-port", os.environ.get("DSTACK_RUNNER_HTTP_PORT", "10999"),
                 "--ssh-port", os.environ.get("DSTACK_RUNNER_SSH_PORT", "10022")],
                cwd="/", env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True)
            self.status = "running"
            code = self.proc.wait()
            kill_container(self.id)  # the container ends with its main process: everything in it goes
            if self.status == "running":
                self.status = "terminated"
                if code == 0:
                    self.reason = "done_by_runner"
                else:
                    self.reason = "container_exited_with_error"
                    self.message = f"runner exited with {code}"
        except Exception as exc:  # noqa: BLE001
            log("task", self.id, "failed", repr(exc))
            self.status = "terminated"
            self.reason = "creating_container_error"
            self.message = str(exc)

    def terminate(self, reason, message, timeout):
        if self.status == "terminated":
            return
        p = self.proc
        self.status = "terminated"
        self.reason = reason or "terminated_by_server"
        self.message = message
        if p and p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)  # `docker stop -t timeout`: SIGTERM, then SIGKILL to all
            try:
                p.wait(max(timeout, 1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        kill_container(self.id)


def container_pids(task_id):
    """The processes of the task's "container": every process carrying its mark in its environment (the runner
    gets it from the shim, the job from the runner, their children inherit it), in place of a cgroup."""
    mark = f"{CONTAINER_MARK}={task_id}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def kill_container(task_id, timeout=15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = container_pids(task_id)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    log("task", task_id, "processes left after", timeout, "s:", container_pids(task_id))


def add_host_keys(keys):
    """runner/internal/shim/authorized_keys.go: the task's host keys (the jump host for `dstack attach`)
    in the host user's ~/.ssh/authorized_keys, marked as the shim's."""
    path = os.path.expanduser("~/.ssh/authorized_keys")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    have = open(path).read().splitlines() if os.path.exists(path) else []
    mine = [k.strip() + " # added by dstack-shim" for k in keys if k.strip()]
    kept = [line for line in have if not line.endswith("# added by dstack-shim")]
    with open(path, "w") as f:
        f.write("\n".join(kept + mine) + "\n")


@route("GET", "/api/healthcheck")
def shim_health(h, body):
    return 200, {"service": "dstack-shim", "version": VERSION}


@route("GET", "/api/instance/health")
def shim_instance_health(h, body):
    return 200, {"dcgm": None}


@route("GET", "/api/instance/info")
def shim_instance_info(h, body):
    return 200, {}


@route("GET", "/api/components")
def shim_components(h, body):
    runner = os.environ.get("DSTACK_RUNNER_BINARY_PATH", "/usr/local/bin/dstack-runner")
    return 200, {"components": [
        {"name": "dstack-runner", "version": VERSION if os.path.exists(runner) else "",
         "status": "installed" if os.path.exists(runner) else "not-installed"},
        {"name": "dstack-shim", "version": VERSION, "status": "installed"}]}


@route("POST", "/api/components/install")
def shim_install(h, body):
    req = json.loads(body)
    if req["name"] == "dstack-runner":
        download(req["url"], os.environ.get("DSTACK_RUNNER_BINARY_PATH", "/usr/local/bin/dstack-runner"))
    return 200, None


@route("GET", "/api/tasks")
def shim_tasks(h, body):
    with LOCK:
        return 200, {"tasks": [{"id": t.id, "status": t.status} for t in TASKS.values()]}


@route("GET", r"/api/tasks/([^/]+)")
def shim_task(h, body, task_id):
    t = TASKS.get(task_id)
    return (200, t.info()) if t else (404, {"error": "task not found"})


@route("POST", "/api/tasks")
def shim_submit(h, body):
    req = json.loads(body)
    log("submit task", req["id"], req["name"], "image", req["image_name"], "network", req["network_mode"])
    with LOCK:
        if req["id"] in TASKS:
            return 409, {"error": "task exists"}
        busy = [t for t in TASKS.values() if t.status != "terminated"]
        if busy:  # one job per host: there is one runner port
            return 409, {"error": f"host busy with task {busy[0].id}"}
        t = TASKS[req["id"]] = Task(req)
    t.start()
    return 200, None


@route("POST", r"/api/tasks/([^/]+)/terminate")
def shim_terminate(h, body, task_id):
    req = json.loads(body or b"{}")
    t = TASKS.get(task_id)
    if not t:
        return 404, {"error": "task not found"}
    t.terminate(req.get("termination_reason", ""), req.get("termination_message", ""), req.get("timeout", 10))
    return 200, None


@route("POST", r"/api/tasks/([^/]+)/remove")
def shim_remove(h, body, task_id):
    with LOCK:
        t = TASKS.get(task_id)
        if not t:
            return 404, {"error": "task not found"}
        if t.status != "terminated":
            return 409, {"error": "task is not terminated"}
        del TASKS[task_id]
    return 200, None


@route("POST", "/api/shutdown")
def shim_shutdown(h, body):
    return 200, None


def shim_main():
    home = os.environ.get("DSTACK_SHIM_HOME", "/root/.dstack")
    os.makedirs(home, exist_ok=True)
    if os.environ.get("DSTACK_SERVICE_MODE"):
        with open(os.path.join(home, "host_info.json.tmp"), "w") as f:
            json.dump(host_info(), f)
        os.replace(os.path.join(home, "host_info.json.tmp"), os.path.join(home, "host_info.json"))
    server = serve(int(os.environ.get("DSTACK_SHIM_HTTP_PORT", "10998")))
    log("dstack-shim (played, tests/dstack/agent.py)", VERSION, "listening on", server.server_address)
    signal.signal(signal.SIGTERM, lambda *a: (shutdown_tasks(), os._exit(0)))
    server.serve_forever()


def shutdown_tasks():
    for t in list(TASKS.values()):
        t.terminate("terminated_by_server", "shim stopped", 2)


# ============================================================================ runner

class Runner:
    """runner/internal/runner/executor: states WaitSubmit -> WaitCode -> WaitRun -> ServeLogs -> WaitLogsFinished."""

    def __init__(self, temp):
        self.temp = temp
        self.dstack_dir = "/dstack"  # consts.RunnerDstackDir: the host's own here (tests/dstack/server.py)
        self.archives = os.path.join(temp, "file_archives")
        self.state = "WaitSubmit"
        self.body = None
        self.code = None
        self.states = []
        self.job_logs = []
        self.ws_logs = []  # (timestamp, bytes): jobWsLogs, what /logs_ws streams
        self.runner_logs = []
        self.t0 = time.time()
        self.counter = 0
        self.last = 0
        self.proc = None
        self.mu = threading.Lock()
        self.done = threading.Event()
        self.working_dir = None
        self.canceled = False

    def stamp(self):
        # MonotonicTimestamp (executor/timestamp.go): unix seconds * 1000 + a counter, strictly increasing
        with self.mu:
            now = int(time.time()) * 1000
            self.last = max(now, self.last + 1)
            return self.last

    def rlog(self, msg):
        log("runner:", msg)
        self.runner_logs.append({"timestamp": self.stamp(), "message": base64.b64encode(
            (msg + "\n").encode()).decode()})

    def set_state(self, state, reason=None, message=None, exit_status=None):
        self.states.append({"timestamp": self.stamp(), "state": state, "termination_reason": reason,
                            "termination_message": message, "exit_status": exit_status})
        self.rlog(f"job state: {state} {reason or ''} {message or ''} exit_status={exit_status}")

    def working_directory(self):
        spec = self.body["job_spec"]
        wd = spec.get("working_dir")
        if wd is None:
            return os.getcwd()  # executor.go setJobWorkingDir: the runner's own cwd, the image's WORKDIR
        wd = os.path.expanduser(wd) if wd.startswith("~") else wd
        return wd if os.path.isabs(wd) else os.path.join(os.path.expanduser("~"), wd)

    def setup_files(self):
        # executor/files.go extractFileArchive: the archive's top-level entry is renamed to the target's
        # base name and extracted into the target's parent directory; a relative target is under the
        # working directory, `~` the home.
        for fa in self.body["job_spec"].get("file_archives") or []:
            dest = fa["path"]
            if dest.startswith("~"):
                dest = os.path.expanduser(dest)
            elif not os.path.isabs(dest):
                dest = os.path.join(self.working_dir, dest)
            base, name = os.path.split(dest.rstrip("/"))
            os.makedirs(base, exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True) if os.path.isdir(dest) else (
                os.path.exists(dest) and os.remove(dest))
            with tarfile.open(os.path.join(self.archives, fa["id"])) as tar:
                members = []
                for m in tar.getmembers():
                    m.name = re.sub(r"^([^/]*)(/|$)", lambda mm: name + mm.group(2), m.name, count=1)
                    members.append(m)
                tar.extractall(base, members=members)
        shutil.rmtree(self.archives, ignore_errors=True)

    def setup_repo(self):
        spec = self.body["job_spec"]
        repo_dir = spec.get("repo_dir") or "/workflow"
        self.repo_dir = repo_dir if os.path.isabs(repo_dir) else os.path.join(self.working_dir, repo_dir)
        if self.code:
            os.makedirs(self.repo_dir, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(self.code)) as tar:
                tar.extractall(self.repo_dir)

    def env(self):
        spec, cluster, run = self.body["job_spec"], self.body.get("cluster_info") or {}, self.body["run"]
        ips = cluster.get("job_ips") or []
        per_node = cluster.get("gpus_per_job") or 0
        gpus_per_node = cluster.get("gpus_per_node") or []
        hostfile = os.path.join(self.dstack_dir, "mpi", "hostfile")
        os.makedirs(os.path.dirname(hostfile), exist_ok=True)
        with open(hostfile, "w") as f:
            slots = gpus_per_node or [per_node] * len(ips)
            if all(ips):
                f.write("".join(f"{ip} slots={s}\n" if s else f"{ip}\n" for ip, s in zip(ips, slots)))
        # executor.go execJob: the dstack variables, then os.Environ() < these < secrets < job_spec.env
        jobenv = {
            "DSTACK_RUN_ID": run["id"], "DSTACK_JOB_ID": self.body["job_submission"]["id"],
            "DSTACK_RUN_NAME": run["run_spec"]["run_name"], "DSTACK_REPO_ID": run["run_spec"].get("repo_id") or "",
            "DSTACK_REPO_DIR": self.repo_dir, "DSTACK_WORKING_DIR": self.working_dir,
            "DSTACK_NODES_IPS": "\n".join(ips), "DSTACK_MASTER_NODE_IP": cluster.get("master_job_ip") or "",
            "DSTACK_NODE_RANK": str(spec["job_num"]), "DSTACK_NODES_NUM": str(spec["jobs_per_replica"]),
            "DSTACK_GPUS_PER_NODE": str(per_node),
            "DSTACK_GPUS_NUM": str(sum(gpus_per_node) if gpus_per_node else per_node * spec["jobs_per_replica"]),
            "DSTACK_MPI_HOSTFILE": hostfile,
        }
        env = dict(os.environ)
        env.pop("DSTACK_RUNNER_LOG", None)
        env.update(jobenv)
        env.update(self.body.get("secrets") or {})
        env.update(spec.get("env") or {})
        env["HOME"] = os.path.expanduser("~")
        return env

    def run(self):
        spec = self.body["job_spec"]
        try:
            self.setup_repo()
            self.setup_files()
        except Exception as exc:  # noqa: BLE001
            self.set_state("failed", "executor_error", f"Failed to set up files ({exc})")
            return self.finish()
        self.set_state("running")
        env = self.env()
        cmd = spec["commands"]
        self.rlog(f"exec {cmd!r} in {self.working_dir}")
        os.makedirs(self.working_dir, exist_ok=True)
        joblog = open(os.path.join(self.temp, "job.log"), "ab")
        # startCommand: the job on a PTY (stdin, stdout and stderr), its own session
        pid, fd = pty.fork()
        if pid == 0:
            try:
                os.chdir(self.working_dir)
                os.execvpe(cmd[0], cmd, env)
            finally:
                os._exit(127)
        self.proc = pid
        max_duration = spec.get("max_duration") or 0
        deadline = time.monotonic() + max_duration if max_duration else None
        timed_out = False
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            joblog.write(data)
            joblog.flush()
            ts = self.stamp()
            self.job_logs.append({"timestamp": ts, "message": base64.b64encode(data).decode()})
            self.ws_logs.append((ts, data))
            if deadline and time.monotonic() > deadline and not timed_out:
                timed_out = True
                os.kill(pid, signal.SIGINT)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if self.canceled:
            self.set_state("terminated")
        elif timed_out:
            self.set_state("terminated", "max_duration_exceeded", "Max duration exceeded")
        elif code != 0:
            # exec.ExitError.ExitCode(): -1 when killed by a signal
            self.set_state("failed", exit_status=code if code >= 0 else -1)
        else:
            self.set_state("done", exit_status=0)
        self.finish()

    def finish(self):
        self.state = "WaitLogsFinished"

    def stop(self):
        self.canceled = True
        if self.proc:
            try:
                os.kill(self.proc, signal.SIGINT)  # cmd.Cancel: os.Interrupt, then killed after killDelay
            except ProcessLookupError:
                return
            threading.Timer(10, lambda: _kill(self.proc)).start()
        elif self.state in ("WaitSubmit", "WaitCode", "WaitRun"):
            self.set_state("terminated")
            self.finish()


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


RUNNER = None


def runner_routes():
    Handler.routes = []  # the shim's are not the runner's
    R = RUNNER

    @route("GET", "/api/healthcheck")
    def health(h, body):
        return 200, {"service": "dstack-runner", "version": VERSION}

    @route("GET", "/api/metrics")
    def metrics(h, body):
        return 404, {"error": "Metrics collector is not available"}

    @route("POST", "/api/submit")
    def submit(h, body):
        if R.state != "WaitSubmit":
            return 409, None
        R.body = json.loads(body)
        spec = R.body["job_spec"]
        R.rlog(f"submitted job {spec.get('job_num')}/{spec.get('jobs_per_replica')} of run "
               f"{R.body['run']['run_spec']['run_name']}")
        R.state = "WaitCode"
        return 200, None

    @route("POST", "/api/upload_archive")
    def upload_archive(h, body):
        if R.state != "WaitCode":
            return 409, None
        ctype = h.headers.get("Content-Type", "")
        boundary = re.search(r"boundary=\"?([^\";]+)", ctype)
        if not boundary:
            return 400, {"error": "missing boundary"}
        sep = b"--" + boundary.group(1).encode()
        for part in body.split(sep):
            if b"\r\n\r\n" not in part:
                continue
            head, _, data = part.partition(b"\r\n\r\n")
            name = re.search(rb'filename="([^"]+)"', head)
            if not name:
                continue
            os.makedirs(R.archives, exist_ok=True)
            with open(os.path.join(R.archives, name.group(1).decode()), "wb") as f:
                f.write(data[:-2] if data.endswith(b"\r\n") else data)
        return 200, None

    @route("POST", "/api/upload_code")
    def upload_code(h, body):
        if R.state != "WaitCode":
            return 409, None
        R.code = body or None
        R.state = "WaitRun"
        return 200, None

    @route("POST", "/api/run")
    def run(h, body):
        if R.state not in ("WaitCode", "WaitRun"):
            return 409, None
        R.state = "ServeLogs"
        R.working_dir = R.working_directory()
        threading.Thread(target=R.run, daemon=True).start()
        return 200, {"working_dir": R.working_dir, "username": "root"}

    @route("GET", "/api/pull")
    def pull(h, body):
        ts = int(h.query().get("timestamp", 0))
        after = lambda events: [e for e in events if e["timestamp"] > ts]  # noqa: E731
        finished = R.state == "WaitLogsFinished"
        out = {"job_states": after(R.states), "job_logs": after(R.job_logs), "runner_logs": after(R.runner_logs),
               "last_updated": R.last, "no_connections_secs": 0, "has_more": not finished}
        if finished:
            R.done.set()  # http.go pullGetHandler: the last pull after the logs are finished ends the runner
        return 200, out

    @route("POST", "/api/stop")
    def stop(h, body):
        R.stop()
        return 200, None


def runner_main(argv):
    global RUNNER
    args = {}
    it = iter(argv)
    for a in it:
        if a.startswith("--"):
            args[a] = next(it, "")
    temp = args.get("--temp-dir", "/tmp/runner")
    os.makedirs(temp, exist_ok=True)
    RUNNER = Runner(temp)
    runner_routes()
    sshd = start_sshd(temp, int(args.get("--ssh-port", "10022")))
    server = serve(int(args.get("--http-port", "10999")))
    log("dstack-runner (played, tests/dstack/agent.py)", VERSION, "listening on", server.server_address)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def on_term(*a):
        RUNNER.stop()
    signal.signal(signal.SIGTERM, on_term)
    RUNNER.done.wait()
    time.sleep(1)  # let the last pull's answer and the WebSocket's close go out (ws.go waits for wsDoneCh)
    if sshd:
        sshd.terminate()
    server.shutdown()


def start_sshd(temp, port):
    """The runner's sshd (runner/internal/runner/ssh/sshd.go): the container's keys, for `dstack attach`/`ssh`."""
    sshd = "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        return None
    d = os.path.join(temp, "sshd")
    os.makedirs(d, exist_ok=True)
    key = os.path.join(d, "host_key")
    if not os.path.exists(key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    conf = os.path.join(d, "sshd_config")
    with open(conf, "w") as f:
        f.write(f"Port {port}\nHostKey {key}\nAuthorizedKeysFile {os.path.join(temp, 'authorized_keys')}\n"
                "PermitRootLogin yes\nPasswordAuthentication no\nUsePAM no\nStrictModes no\n"
                "AllowTcpForwarding yes\nPidFile none\nUseDNS no\nSubsystem sftp internal-sftp\n")
    os.makedirs("/run/sshd", exist_ok=True)
    return subprocess.Popen([sshd, "-D", "-e", "-f", conf], stdout=open(os.path.join(d, "sshd.log"), "ab"),
                            stderr=subprocess.STDOUT)


if __name__ == "__main__":
    me = os.path.basename(sys.argv[0])
    if "runner" in me:
        argv = [a for a in sys.argv[1:] if a != "start"]
        if "--log-level" in argv:
            i = argv.index("--log-level")
            del argv[i:i + 2]
        runner_main(argv)
    else:
        shim_main()
