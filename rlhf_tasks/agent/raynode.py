"""Ray's start command and environment on this node, and the Node that head and worker
share: the network preset's variables, auth, debugging and the agent's own package on
PYTHONPATH (node_env); `ray start`'s command line (with a node group's label and custom
resources), its interpreter started early (prestart); the services (a group's on its nodes)
and their readiness; setup and prepare commands; stopping
everything the node started; the step timings of the result line.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import site
import subprocess
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .beacon import reachable
from .contract import NodeInfo, group_of, interface_of, source_address
from .processes import Child, group_has, stop_stale
from .protocol import AGENT_ENTRY, AgentError, http_check, log, probe_tcp, wait_for

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


#: The variables that choose a node's AMD GPUs. Ray 2.60 reads and sets only HIP's (ray/_private/accelerators/
#: amd_gpu.py, AMDGPUAcceleratorManager): it refuses a node where ROCR's is set without it, and gives each worker
#: its GPUs in HIP's. torch's ROCm build reads HIP's before CUDA's, within ROCR's selection (torch/cuda/__init__.py,
#: _parse_visible_devices). verl refuses a worker where ROCR's is set beside HIP's or CUDA's, and one whose CUDA's
#: is not the HIP's Ray gave it (verl/single_controller/base/worker.py, _setup_env_cuda_visible_devices, 0.4.1 on).
HIP_DEVICES, ROCR_DEVICES, CUDA_DEVICES = "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"


def amd_visible_devices(base: Dict[str, str], gpus: Optional[int]) -> Optional[str]:
    """HIP_VISIBLE_DEVICES for an AMD node, the GPUs its scheduler chose, in the host's terms: ROCR's
    list (what a batch scheduler sets for AMD GPUs), picked by HIP's where both are set (HIP's then
    counts within ROCR's); else HIP's, else CUDA's (which HIP reads where its own is unset; a scheduler
    that names no GPU library sets it too); else the node's first `gpus`. None: no GPUs to name."""
    rocr, hip, cuda = ([d.strip() for d in base[k].split(",")] if base.get(k) else None
                       for k in (ROCR_DEVICES, HIP_DEVICES, CUDA_DEVICES))
    if rocr and hip:
        if not all(d.isdigit() and int(d) < len(rocr) for d in hip):
            raise AgentError("choosing the node's GPUs", "%s=%s does not pick from %s=%s (it counts within it)"
                             % (HIP_DEVICES, base[HIP_DEVICES], ROCR_DEVICES, base[ROCR_DEVICES]), code=2)
        return ",".join(rocr[int(d)] for d in hip)
    chosen = rocr or hip or cuda
    if chosen:
        return ",".join(chosen)
    return ",".join(str(i) for i in range(gpus)) if gpus else None


#: Health checks a silent node fails in a row before Ray's GCS declares it dead.
HEALTH_CHECK_MISSES = 3


#: Ray's drain on SIGTERM, in seconds (ray_constants; <= 0: none); a value the node or the task sets wins.
RAY_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"


#: How long a node's Ray has, at the node's end, for its raylet to leave on SIGTERM.
RAY_STOP_S = 5.0


def stop_ray(ray: Child, grace: float = RAY_STOP_S) -> None:
    """SIGTERM lets the raylet leave the cluster (a killed one is found only by missed health
    checks); the rest of Ray is killed once it has, not waited for (its GCS and monitor take a
    second each, one after the other: 3 s at every node's end)."""
    ray.stop(grace, enough=lambda: not group_has(ray.proc.pid, "raylet"))


def health_check_env(silence_s: Optional[float]) -> Dict[str, str]:
    """Ray's GCS health checks (read from the head's environment; names of Ray 2.60's
    ray_config_def.h) set so that a node that goes silent is declared dead within `silence_s`
    (wait.node_silence). A check every p that times out after p, HEALTH_CHECK_MISSES misses
    in a row: at most MISSES * 2p after the last answer. Ray's own defaults (3 s, 10 s, 5)
    take about 65 s for a silent node; a killed one is seen at once (its connections close)."""
    if not silence_s:
        return {}
    step_ms = max(500, int(silence_s * 1000 / (2 * HEALTH_CHECK_MISSES)))
    return {"RAY_health_check_period_ms": str(step_ms), "RAY_health_check_timeout_ms": str(step_ms),
            "RAY_health_check_failure_threshold": str(HEALTH_CHECK_MISSES)}


def node_env(plan: dict, info: NodeInfo, base: Dict[str, str]) -> Dict[str, str]:
    """The environment for Ray and the services on this node."""
    env = dict(base)
    # The preset fills what the node's environment leaves unset (an image or a machine that
    # sets NCCL_SOCKET_IFNAME knows its network); the task's env wins over both.
    env.update({k: v for k, v in network_env(plan["network_env"], info).items() if not base.get(k)})
    group = group_of(plan, info.rank)
    if plan.get("gpu_vendor") == "amd":  # one variable names the GPUs, for Ray, torch and verl alike
        devices = amd_visible_devices(base, (group or plan).get("gpus_per_node") or info.gpus)
        for key in (ROCR_DEVICES, CUDA_DEVICES):
            env.pop(key, None)
        if devices is not None:
            env[HIP_DEVICES] = devices
    env.update(plan.get("env", {}))
    if info.rank == 0:  # the GCS runs there; a value the node or the task sets wins
        env.update({k: v for k, v in health_check_env(plan.get("wait", {}).get("node_silence_s")).items() if k not in env})
    # The agent stops Ray only when its node is done (or going): Ray 2.60's `ray start --block` would first
    # drain the node for up to 30 s (for Serve's replicas), and a busy head's drain ran out the agent's grace.
    env.setdefault(RAY_DRAIN_ENV, "0")
    env.update({"RLHF_TASKS_HEAD_ADDR": info.head, "RLHF_TASKS_NODE_ADDR": info.node_addr,
                "RLHF_TASKS_NODE_RANK": str(info.rank), "RLHF_TASKS_NUM_NODES": str(info.nodes)})
    if group is not None:
        env["RLHF_TASKS_GROUP"] = group["name"]
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
    path = agent_pythonpath(env.get("PYTHONPATH"))
    if path:
        env["PYTHONPATH"] = path
    debug = plan["ray"].get("debug", "off")
    if debug == "legacy":
        env["RAY_DEBUG"] = "legacy"
    elif debug == "post_mortem":
        env["RAY_DEBUG_POST_MORTEM"] = "1"
    return env


def package_root() -> str:
    """The directory that holds this agent's `rlhf_tasks` package (lib/ on a node)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def agent_entry() -> str:
    """This agent's entry file, which the gate and preflight's job are started by (protocol.AGENT_ENTRY)."""
    return os.path.join(package_root(), AGENT_ENTRY)


def agent_pythonpath(current: Optional[str]) -> str:
    """PYTHONPATH with the agent's package root first, so that the preflight probe's class, which
    Ray pickles by reference, and the packages the recipe ships (the demo's) import in Ray's
    jobs and workers on every node (and in an image's container, whose own PYTHONPATH is kept
    after it). Not when the root is a
    site-packages directory (an installed rlhf-tasks): Ray's interpreter imports it from
    there anyway, and site-packages before the standard library could shadow it."""
    root = package_root()
    parts = [p for p in (current or "").split(os.pathsep) if p]
    installed = set(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    installed.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    if root in installed or parts[:1] == [root]:
        return os.pathsep.join(parts)
    return os.pathsep.join([root] + [p for p in parts if p != root])


def fill(text: str, info: NodeInfo, group: Optional[str] = None) -> str:
    """Replace the {head_addr} and {node_addr} placeholders, and {group} (this node's group) where the
    task has groups (nothing else: shell braces stay)."""
    text = text.replace("{head_addr}", info.head).replace("{node_addr}", info.node_addr)
    return text.replace("{group}", group) if group is not None else text


def group_ray_args(group: Optional[dict]) -> List[str]:
    """`ray start`'s arguments for a node of `group` (Ray 2.60: `--labels "k=v"`, `--resources JSON`)."""
    if group is None:
        return []
    labels = ",".join("%s=%s" % (key, value) for key, value in sorted(group["labels"].items()))
    return ["--labels", labels, "--resources", json.dumps(group["resources"], sort_keys=True)]


def group_where(group: Optional[dict]) -> Tuple[str, ...]:
    """The `where:` of the services that start on a node of `group` beside its every-node ones."""
    return ("group %s" % group["name"],) if group is not None else ()


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
    group = group_of(plan, info.rank)
    if group is not None:  # a group's node: its own CPUs and GPUs (none where a recipe serves them outside Ray:
        # ray_gpus 0), and its label and custom resources
        gpus = group.get("ray_gpus")
        ray = dict(ray, num_cpus=group.get("num_cpus"), num_gpus=(group["gpus_per_node"] or None) if gpus is None else gpus)
    for flag, key in (("--object-store-memory", "object_store_memory"), ("--num-cpus", "num_cpus"), ("--num-gpus", "num_gpus"),
                      ("--min-worker-port", "min_worker_port"), ("--max-worker-port", "max_worker_port")):
        if ray.get(key) is not None:
            cmd += [flag, str(ray[key])]
    cmd += group_ray_args(group)
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


class Node(object):
    """What head and worker share: Ray, services, commands, step timings."""

    def __init__(self, plan: dict, info: NodeInfo, env: Dict[str, str], state_dir: str, log_dir: str):
        self.plan, self.info, self.env, self.state_dir, self.log_dir = plan, info, env, state_dir, log_dir
        self.token = env.get("RAY_AUTH_TOKEN") if plan.get("token_env") else None
        self.ray = None  # type: Optional[Child]
        self.prestarted = None  # type: Optional[Child]  (`ray start` waiting for its arguments)
        self.job = None  # type: Optional[Child]  (job.mode every_node: this node's command)
        self.services = []  # type: List[Child]
        #: The services outlive this agent (it hands them to a `ray start` someone else runs next).
        self.detach_services = False
        self.steps = []  # type: List[dict]
        self.group = group_of(plan, info.rank)  # type: Optional[dict]  (None: the task has no groups)
        self.group_name = self.group["name"] if self.group is not None else None
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

    def run_commands(self, step: str, commands: List[str], env: Optional[Dict[str, str]] = None) -> None:
        """`env`: another environment than the node's (hub.online: setup and prepare reach the hub)."""
        with self.step(step):
            for index, command in enumerate(commands):
                log("%s %d/%d: %s" % (step, index + 1, len(commands), command))
                started = time.monotonic()
                code = subprocess.call(fill(command, self.info, self.group_name), shell=True, env=self.env if env is None else env,
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

    def services_for(self, where: Tuple[str, ...]) -> List[dict]:
        """The plan's services whose `where:` is one of `where`; where the every-node ones start, this
        node's group's too (`where: group NAME`)."""
        if "every_node" in where:
            where = tuple(where) + group_where(self.group)
        return [service for service in self.plan["services"] if service["where"] in where]

    def start_services(self, where: Tuple[str, ...]) -> None:
        for service in self.services_for(where):
            with self.step("service " + service["name"]):
                pgid_file = self._pgid_file("service-" + service["name"])
                stop_stale(pgid_file)
                env = dict(self.env)
                env.update(service.get("env", {}))
                command = fill(service["command"], self.info, self.group_name)
                log("starting service %s: %s" % (service["name"], command))
                child = Child(service["name"], command, env,
                              os.path.join(self.log_dir, "service-%s-node%d.log" % (service["name"], self.info.rank)),
                              pgid_file, shell=True, die_with_agent=not self.detach_services)
                self.services.append(child)
                self.wait_service(service, child)

    def wait_service(self, service: dict, child: Child) -> None:
        ready = service.get("ready")
        if not ready:
            return
        if ready.get("http"):
            url = fill(ready["http"], self.info, self.group_name)
            method = ready.get("method", "GET")
            probe = lambda: http_check(url, method, ready.get("json"))  # noqa: E731
            what = "service %s (%s %s)" % (service["name"], method, url)
        else:
            host = fill(ready.get("host", "{node_addr}"), self.info, self.group_name)
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
        if self.ray is not None:
            stop_ray(self.ray)
