"""Node agent: runs on every node of the cluster and turns it into a Ray node.

Standard library only and Python >= 3.8, so this one file can be shipped into any
training image beside the plan (`python3 node.py --plan plan.json`). It maps the
provider's environment contract to (rank, head address, node count), then:

  head (rank 0): prepare data, `ray start --head` on the private address, start the
                 services and wait until they answer, wait until every node is ALIVE,
                 then (job.submit: head) submit the job, follow it, exit with its result.
  worker:        wait for the head's GCS port, `ray start --address`, start the
                 every-node services, supervise the raylet until the head goes away.

Every step prints one timestamped line. Secrets are passed by variable name and never
printed. No fixed sleeps: every wait polls its condition against a deadline.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

TERMINAL_JOB_STATES = ("SUCCEEDED", "FAILED", "STOPPED")
_rank_label = "node"


def log(message: str) -> None:
    print("[%s] %s: %s" % (time.strftime("%H:%M:%S"), _rank_label, message), flush=True)


class AgentError(Exception):
    """A step failed; the message names it. `code` 2 means the plan or environment is wrong."""

    def __init__(self, step, message, code=1):
        Exception.__init__(self, "%s failed: %s" % (step, message))
        self.code = code


# --------------------------------------------------------------------------------------
# Provider environment contracts: the one place that knows each provider's variables.
# --------------------------------------------------------------------------------------

class NodeInfo(object):
    def __init__(self, provider, rank, nodes, head, node_addr=None, cluster_id=None, gpus=None):
        self.provider, self.rank, self.nodes, self.head = provider, rank, nodes, head
        self.node_addr, self.cluster_id, self.gpus = node_addr, cluster_id, gpus

    def __repr__(self):
        return "NodeInfo(%r)" % self.__dict__


def _need(env, name, provider):
    value = env.get(name)
    if value is None or value == "":
        raise AgentError("reading the %s environment" % provider, "$%s is not set" % name, code=2)
    return value


def _int(env, name, provider):
    value = _need(env, name, provider)
    try:
        return int(value)
    except ValueError:
        raise AgentError("reading the %s environment" % provider, "$%s=%r is not an integer" % (name, value), code=2)


def _lines(value):
    return [line.strip() for line in value.replace(",", "\n").splitlines() if line.strip()]


def node_info(provider, env, run=subprocess.run):
    """Map a provider's environment variables to this node's place in the cluster."""
    p = provider
    if p == "local":
        return NodeInfo(p, _int(env, "RLHF_TASKS_NODE_RANK", p), _int(env, "RLHF_TASKS_NUM_NODES", p),
                        _need(env, "RLHF_TASKS_HEAD_ADDR", p), env.get("RLHF_TASKS_NODE_ADDR"),
                        env.get("RLHF_TASKS_CLUSTER_ID"))
    if p == "dstack":
        rank = _int(env, "DSTACK_NODE_RANK", p)
        ips = _lines(env.get("DSTACK_NODES_IPS", ""))
        return NodeInfo(p, rank, _int(env, "DSTACK_NODES_NUM", p), _need(env, "DSTACK_MASTER_NODE_IP", p),
                        ips[rank] if rank < len(ips) else None, env.get("DSTACK_RUN_NAME"),
                        env.get("DSTACK_GPUS_PER_NODE"))
    if p == "sky":
        rank = _int(env, "SKYPILOT_NODE_RANK", p)
        ips = _lines(_need(env, "SKYPILOT_NODE_IPS", p))
        return NodeInfo(p, rank, _int(env, "SKYPILOT_NUM_NODES", p), ips[0],
                        ips[rank] if rank < len(ips) else None, env.get("SKYPILOT_TASK_ID"),
                        env.get("SKYPILOT_NUM_GPUS_PER_NODE"))
    if p == "runpod-global":
        rank = 0 if env.get("RAY_WORKER", "0") in ("", "0") else 1
        head_pod = env.get("HEAD_POD_ID") or (env.get("RUNPOD_POD_ID") if rank == 0 else None)
        if not head_pod:
            raise AgentError("reading the RunPod environment", "$HEAD_POD_ID is not set on a worker pod", code=2)
        return NodeInfo(p, rank, _int(env, "EXPECTED_WORKERS", p) + 1, "%s.runpod.internal" % head_pod,
                        None, env.get("RLHF_TASKS_CLUSTER_ID") or head_pod)
    if p == "runpod-cluster":
        return NodeInfo(p, _int(env, "NODE_RANK", p), _int(env, "NUM_NODES", p), _need(env, "PRIMARY_ADDR", p),
                        env.get("NODE_ADDR"), env.get("RLHF_TASKS_CLUSTER_ID"), env.get("NUM_TRAINERS"))
    if p == "slurm":
        rank = _int(env, "SLURM_NODEID", p)
        nodelist = _need(env, "SLURM_JOB_NODELIST", p)
        out = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
        hosts = _lines(out.stdout)
        if out.returncode != 0 or not hosts:
            raise AgentError("reading the Slurm environment", "scontrol show hostnames %s: %s" % (nodelist, out.stderr.strip()))
        return NodeInfo(p, rank, _int(env, "SLURM_JOB_NUM_NODES", p), hosts[0], None, env.get("SLURM_JOB_ID"))
    raise AgentError("reading the environment", "unknown provider %r" % provider, code=2)


# --------------------------------------------------------------------------------------
# Waiting: poll a condition against a deadline, with progress and a diagnosis.
# --------------------------------------------------------------------------------------

def wait_for(what, check, timeout_s, interval=0.2, max_interval=2.0, progress_every=10.0, report=None):
    """Call `check()` until it returns (True, value); it returns (False, reason) otherwise.

    Backs off from `interval` to `max_interval`, prints progress every `progress_every`
    seconds, and raises AgentError naming what was awaited, for how long, and the last
    reason when `timeout_s` passes."""
    report = report or log
    start = time.monotonic()
    next_report = start + progress_every
    reason = "not checked yet"
    delay = interval
    while True:
        done, value = check()
        if done:
            return value
        reason = value
        now = time.monotonic()
        if now - start >= timeout_s:
            raise AgentError("waiting for %s" % what, "not ready after %.0fs (last: %s)" % (now - start, reason))
        if now >= next_report:
            report("waiting for %s: %.0fs of %.0fs (%s)" % (what, now - start, timeout_s, reason))
            next_report = now + progress_every
        time.sleep(min(delay, max(0.0, timeout_s - (now - start))))
        delay = min(delay * 1.5, max_interval)


def probe_tcp(host, port, timeout=2.0):
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


def reachable(probe, *args):
    """A wait_for check from a probe that returns None when ready, else the reason why not."""
    def check():
        reason = probe(*args)
        return reason is None, reason
    return check


def probe_ready(host, port, timeout=2.0):
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
    """A tiny TCP server on the head that answers "ready" once the head is fully up.

    Workers join when it answers, not when the GCS port merely opens (a raylet that
    registers while the head is still starting can time out), and leave when it goes."""

    def __init__(self, host, port):
        import threading

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        threading.Thread(target=self._serve, name="ready-beacon", daemon=True).start()

    def _serve(self):
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

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def http_request(url, method="GET", body=None, headers=None, timeout=5.0):
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


def http_check(url, method="GET", body=None, headers=None):
    """A wait_for check: ready when the request answers below 400."""
    try:
        status, _ = http_request(url, method, body, headers, timeout=5.0)
    except OSError as exc:
        return False, str(exc)
    return (True, status) if status < 400 else (False, "HTTP %d from %s %s" % (status, method, url))


# --------------------------------------------------------------------------------------
# Ray through its dashboard REST API (no ray import: this runs before Ray exists).
# --------------------------------------------------------------------------------------

def auth_headers(token):
    return {"Authorization": "Bearer %s" % token} if token else {}


def alive_nodes(dashboard, token):
    """Nodes the GCS reports ALIVE, from the State API (fast; `ray status` lags)."""
    url = (dashboard + "/api/v0/nodes?limit=1000&detail=true"
           "&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE")
    status, body = http_request(url, headers=auth_headers(token), timeout=10.0)
    if status in (401, 403):
        raise AgentError("asking Ray for its nodes", "the dashboard refused our token (HTTP %d)" % status)
    if status != 200:
        raise OSError("HTTP %d from %s" % (status, url))
    return json.loads(body)["data"]["result"]["result"]


def cluster_check(dashboard, token, nodes, cpus=None, gpus=None):
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


def job_status(dashboard, token, submission_id):
    """The job's status string, or None when no such job exists."""
    status, body = http_request("%s/api/jobs/%s" % (dashboard, submission_id), headers=auth_headers(token))
    if status == 404:
        return None
    if status != 200:
        raise OSError("HTTP %d asking for job %s" % (status, submission_id))
    return json.loads(body)["status"]


def job_logs(dashboard, token, submission_id):
    status, body = http_request("%s/api/jobs/%s/logs" % (dashboard, submission_id), headers=auth_headers(token))
    return json.loads(body).get("logs", "") if status == 200 else ""


# --------------------------------------------------------------------------------------
# Environment: auth, network presets, debugging.
# --------------------------------------------------------------------------------------

def _interface_of(ip):
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


def source_address(host):
    """This node's address on the route to `host` (no packet is sent)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect((host, 9))
        return sock.getsockname()[0]
    finally:
        sock.close()


def network_env(preset, node_addr):
    """NCCL/GLOO variables for the network preset; user env in the task overrides them."""
    fixed = {"runpod-global": "podnet1", "runpod-cluster": "ens1"}
    iface = fixed.get(preset) or _interface_of(node_addr)
    env = {}
    if iface:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = iface
    if preset in ("runpod-global", "ethernet"):
        env["NCCL_IB_DISABLE"] = "1"
    if preset == "infiniband":
        env["NCCL_IB_DISABLE"] = "0"
    return env


def node_env(plan, info, base):
    """The environment for Ray and the services on this node."""
    env = dict(base)
    env.update(network_env(plan["network"], info.node_addr))
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


def fill(text, info):
    """Replace the {head_addr} and {node_addr} placeholders (nothing else: shell braces stay)."""
    return text.replace("{head_addr}", info.head).replace("{node_addr}", info.node_addr)


def ray_start_command(plan, info, head):
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


# --------------------------------------------------------------------------------------
# Processes this agent starts: each in its own session, stopped by process group.
# --------------------------------------------------------------------------------------

class Child(object):
    """A process in its own session whose group id is recorded in `pgid_file`, so a
    restarted agent stops exactly its own stale Ray, never anyone else's."""

    def __init__(self, name, argv, env, log_path=None, pgid_file=None, shell=False):
        self.name, self.pgid_file, self.log_path = name, pgid_file, log_path
        out = open(log_path, "ab") if log_path else None
        self.proc = subprocess.Popen(argv, env=env, shell=shell, executable="/bin/bash" if shell and os.path.exists("/bin/bash") else None,
                                     stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        if out:
            out.close()
        if pgid_file:
            with open(pgid_file, "w") as handle:
                handle.write(str(self.proc.pid))

    def alive(self):
        return self.proc.poll() is None

    def stop(self, grace=15.0):
        if self.alive():
            _kill_group(self.proc.pid, grace, lambda: self.proc.poll() is not None)
        else:
            _kill_group(self.proc.pid, 0.0, lambda: True)  # leftovers of an exited leader
        if self.pgid_file and os.path.exists(self.pgid_file):
            os.remove(self.pgid_file)

    def tail(self, lines=20):
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - 8192))
            return "\n".join(handle.read().decode("utf-8", "replace").splitlines()[-lines:])


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except OSError as exc:
        return exc.errno == errno.EPERM


def _kill_group(pgid, grace, gone):
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


def stop_stale(pgid_file):
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


# --------------------------------------------------------------------------------------
# The agent.
# --------------------------------------------------------------------------------------

class Agent(object):
    def __init__(self, plan, info, env, state_dir, log_dir):
        self.plan, self.info, self.state_dir, self.log_dir = plan, info, state_dir, log_dir
        self.env = env
        self.token = env.get("RAY_AUTH_TOKEN") if plan.get("token_env") else None
        self.ray = None
        self.beacon = None
        self.services = []
        self.dashboard = "http://%s:%s" % (
            "127.0.0.1" if plan["ray"]["dashboard_host"] == "127.0.0.1" else info.node_addr, plan["ray"]["dashboard_port"])

    # -- shared steps
    def _pgid_file(self, what):
        return os.path.join(self.state_dir, "%s-node%d-%s.pgid" % (self.plan["name"], self.info.rank, what))

    def run_commands(self, step, commands):
        for index, command in enumerate(commands):
            log("%s %d/%d: %s" % (step, index + 1, len(commands), command))
            started = time.monotonic()
            code = subprocess.call(fill(command, self.info), shell=True, env=self.env,
                                   executable="/bin/bash" if os.path.exists("/bin/bash") else None)
            if code != 0:
                raise AgentError("%s step %d (%s)" % (step, index + 1, command), "exit code %d" % code)
            log("%s %d/%d done in %.1fs" % (step, index + 1, len(commands), time.monotonic() - started))

    def start_ray(self, head):
        pgid_file = self._pgid_file("ray")
        stop_stale(pgid_file)
        cmd = ray_start_command(self.plan, self.info, head)
        log("starting Ray %s: %s" % ("head" if head else "worker", " ".join(shlex.quote(c) for c in cmd)))
        self.ray = Child("ray", cmd, self.env, os.path.join(self.log_dir, "ray-node%d.log" % self.info.rank), pgid_file)

    def _ray_check(self, check):
        def wrapped():
            if not self.ray.alive():
                raise AgentError("starting Ray", "`ray start` exited with code %s:\n%s" % (self.ray.proc.returncode, self.ray.tail()))
            return check()
        return wrapped

    def start_services(self, where):
        for service in self.plan["services"]:
            if service["where"] not in where:
                continue
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

    def wait_service(self, service, child):
        ready = service.get("ready")
        if not ready:
            return
        if ready["kind"] == "http":
            url = fill(ready["url"], self.info)
            probe = lambda: http_check(url, ready["method"], ready.get("json"))
            what = "service %s (%s %s)" % (service["name"], ready["method"], url)
        else:
            host = fill(ready["host"], self.info)
            probe = reachable(probe_tcp, host, ready["port"])
            what = "service %s (tcp %s:%s)" % (service["name"], host, ready["port"])

        def check():
            if not child.alive():
                raise AgentError("starting service %s" % service["name"],
                                 "it exited with code %s before it was ready:\n%s" % (child.proc.returncode, child.tail()))
            return probe()
        started = time.monotonic()
        wait_for(what, check, service["timeout_s"])
        log("service %s ready after %.1fs" % (service["name"], time.monotonic() - started))

    def stop_all(self):
        if self.beacon is not None:
            self.beacon.close()
        for child in reversed(self.services):
            child.stop()
        if self.ray is not None:  # a worker's raylet would drain for 30 s for a head that is gone
            self.ray.stop(grace=15.0 if self.info.rank == 0 else 5.0)

    # -- head
    def run_head(self):
        plan = self.plan
        if plan["prepare"]:
            self.run_commands("prepare", plan["prepare"])
        started = time.monotonic()
        self.start_ray(head=True)
        gcs = (self.info.node_addr, plan["ray"]["port"])
        wait_for("the Ray head's GCS on %s:%s" % gcs, self._ray_check(reachable(probe_tcp, *gcs)), 180)
        wait_for("the Ray dashboard at %s" % self.dashboard,
                 self._ray_check(lambda: http_check(self.dashboard + "/api/gcs_healthz")), 180)
        self.beacon = ReadyBeacon(self.info.node_addr, plan["ray"]["ready_port"])
        log("Ray head up in %.1fs; dashboard %s (reach it through the provider's port forward)"
            % (time.monotonic() - started, self.dashboard))
        self.start_services(("head", "every_node"))
        expected_cpus = (plan["ray"].get("num_cpus") or 0) * plan["nodes"]
        expected_gpus = (plan["ray"].get("num_gpus") or 0) * plan["nodes"]
        have = wait_for("%d nodes to join" % plan["nodes"],
                        self._ray_check(cluster_check(self.dashboard, self.token, plan["nodes"], expected_cpus, expected_gpus)),
                        plan["wait"]["nodes_s"], interval=0.5, max_interval=2.0)
        log("cluster ready: %s (%.1fs after the head started)" % (have, time.monotonic() - started))
        if plan["job"]["submit"] == "head":
            return self.submit_and_follow()
        log("cluster ready for a client submission: forward port %s and run `rlhf-tasks submit`" % plan["ray"]["dashboard_port"])
        return self.supervise_head()

    def submission_id(self):
        key = self.info.cluster_id or self.info.head
        return re.sub(r"[^A-Za-z0-9_-]+", "-", "%s-%s" % (self.plan["name"], key)).strip("-")

    def submit_and_follow(self):
        job = self.plan["job"]
        sid = self.submission_id()
        argv = [fill(arg, self.info) for arg in job["entrypoint"]]
        if job.get("wandb_args"):
            if self.env.get("WANDB_API_KEY"):
                argv += job["wandb_args"]
                log("W&B logging on (WANDB_API_KEY provided)")
            else:
                log("W&B logging off: WANDB_API_KEY was not provided")
        entrypoint = " ".join(shlex.quote(a) for a in argv)
        if job_status(self.dashboard, self.token, sid) is not None:
            log("job %s was already submitted to this cluster; following it" % sid)
        elif job.get("working_dir"):
            runtime_env = {"excludes": job["excludes"]}
            cmd = ["ray", "job", "submit", "--address", self.dashboard, "--submission-id", sid, "--no-wait",
                   "--working-dir", job["working_dir"], "--runtime-env-json", json.dumps(runtime_env), "--"] + argv
            log("submitting job %s with working_dir %s: %s" % (sid, job["working_dir"], entrypoint))
            out = subprocess.run(cmd, env=self.env, capture_output=True, text=True)
            if out.returncode != 0:
                raise AgentError("submitting job %s" % sid, out.stderr.strip()[-2000:] or out.stdout.strip()[-2000:])
        else:
            log("submitting job %s: %s" % (sid, entrypoint))
            status, body = http_request(self.dashboard + "/api/jobs/", "POST",
                                        {"entrypoint": entrypoint, "submission_id": sid}, auth_headers(self.token))
            if status >= 400:
                raise AgentError("submitting job %s" % sid, "HTTP %d: %s" % (status, body.decode("utf-8", "replace")[:2000]))
        return self.follow(sid)

    def follow(self, sid):
        """Print the job's log as it grows; return 0 when it succeeded, 1 otherwise."""
        timeout = self.plan["job"].get("timeout_s")
        started = time.monotonic()
        printed = 0
        state = None
        delay = 0.5
        while True:
            state = job_status(self.dashboard, self.token, sid)
            logs = job_logs(self.dashboard, self.token, sid)
            if len(logs) > printed:
                sys.stdout.write(logs[printed:])
                sys.stdout.flush()
                printed = len(logs)
                delay = 0.5
            if state in TERMINAL_JOB_STATES:
                break
            if timeout and time.monotonic() - started > timeout:
                http_request("%s/api/jobs/%s/stop" % (self.dashboard, sid), "POST", {}, auth_headers(self.token))
                raise AgentError("running job %s" % sid, "still %s after the job timeout of %.0fs; stopped it" % (state, timeout))
            if not self.ray.alive():
                raise AgentError("running job %s" % sid, "the Ray head exited while the job was %s" % state)
            time.sleep(delay)
            delay = min(delay * 1.5, 3.0)
        log("job %s %s after %.1fs" % (sid, state, time.monotonic() - started))
        return 0 if state == "SUCCEEDED" else 1

    def supervise_head(self):
        while self.ray.alive():
            time.sleep(1.0)
        raise AgentError("supervising the Ray head", "`ray start` exited with code %s:\n%s" % (self.ray.proc.returncode, self.ray.tail()))

    # -- worker
    def run_worker(self):
        beacon = (self.info.head, self.plan["ray"]["ready_port"])
        started = time.monotonic()
        wait_for("the head at %s:%s" % beacon, reachable(probe_ready, *beacon),
                 self.plan["wait"]["head_s"], interval=0.2, max_interval=0.5)
        log("head ready after %.1fs" % (time.monotonic() - started))
        self.start_ray(head=False)
        self.start_services(("every_node",))
        return self.supervise_worker(beacon)

    def supervise_worker(self, beacon, head_gone_s=10.0, max_rejoins=3):
        """Keep the raylet up (rejoin if it dies) until the head goes away: then the run is over."""
        unreachable_since = None
        rejoins = 0
        while True:
            reason = probe_ready(*beacon)
            now = time.monotonic()
            if reason is None:
                unreachable_since = None
            elif unreachable_since is None:
                unreachable_since = now
                log("head unreachable (%s); waiting up to %.0fs before leaving" % (reason, head_gone_s))
            elif now - unreachable_since > head_gone_s:
                log("the head is gone (%s): the run is over, stopping this node" % reason)
                return 0
            if not self.ray.alive() and reason is None:
                if rejoins >= max_rejoins:
                    raise AgentError("supervising the raylet", "it died %d times:\n%s" % (rejoins + 1, self.ray.tail()))
                rejoins += 1
                log("the raylet exited (code %s); rejoining (%d/%d)" % (self.ray.proc.returncode, rejoins, max_rejoins))
                self.start_ray(head=False)
            time.sleep(1.0)


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    global _rank_label
    parser = argparse.ArgumentParser(prog="rlhf_tasks.node", description="rlhf-tasks node agent (runs on every node)")
    parser.add_argument("--plan", required=True, help="the cluster plan (JSON) rendered by rlhf-tasks")
    parser.add_argument("--provider", help="environment contract to read (default: the plan's provider)")
    parser.add_argument("--skip-setup", action="store_true", help="the provider already ran the setup commands")
    parser.add_argument("--state-dir", default=None, help="where process-group files live (default: /tmp/rlhf-tasks)")
    parser.add_argument("--log-dir", default=None, help="where Ray's and the services' output goes (default: state dir)")
    args = parser.parse_args(argv)
    try:
        with open(args.plan) as handle:
            plan = json.load(handle)
    except (OSError, ValueError) as exc:
        log("cannot read the plan %s: %s" % (args.plan, exc))
        return 2
    signal.signal(signal.SIGTERM, _on_signal)
    agent = None
    try:
        info = node_info(args.provider or plan["provider"], os.environ)
        _rank_label = "node%d" % info.rank
        if info.rank == 0:
            head_ip = socket.gethostbyname(info.head) if not re.match(r"^[\d.]+$", info.head) else info.head
            info.node_addr = info.node_addr or head_ip
            info.head = head_ip
        elif not info.node_addr:
            info.node_addr = source_address(socket.gethostbyname(info.head))
        log("%s node %d of %d, address %s, head %s" % (info.provider, info.rank, info.nodes, info.node_addr, info.head))
        env = node_env(plan, info, os.environ)
        net = {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE") if k in env}
        log("network preset %s: %s" % (plan["network"], " ".join("%s=%s" % kv for kv in sorted(net.items())) or "none"))
        state_dir = args.state_dir or os.path.join(plan["ray"].get("temp_dir") or "/tmp", "rlhf-tasks")
        log_dir = args.log_dir or state_dir
        for directory in (state_dir, log_dir):
            os.makedirs(directory, exist_ok=True)
        agent = Agent(plan, info, env, state_dir, log_dir)
        if plan["setup"] and not args.skip_setup:
            agent.run_commands("setup", plan["setup"])
        return agent.run_head() if info.rank == 0 else agent.run_worker()
    except AgentError as exc:
        log("ERROR: %s" % exc)
        return exc.code
    except socket.gaierror as exc:
        log("ERROR: resolving the head's address failed: %s" % exc)
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except SystemExit as exc:
        log("stopping (signal)")
        return exc.code
    finally:
        if agent is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
            agent.stop_all()
            log("stopped the processes this agent started")


if __name__ == "__main__":
    sys.exit(main())
