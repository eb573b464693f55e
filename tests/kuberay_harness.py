"""The KubeRay operator and the kubelets, played on namespace hosts (tests/testbed.py): the
controller half of the Kubernetes stand-in (/work/wt/KUBE_STANDIN.md's layout of the state
directory). No API server runs here, so this reads the applied objects from the state
directory and does, for each RayJob, what KubeRay v1.7.0 does (facts and sources in
shared/kuberay/README.md; ray-project/kuberay @ feeaf72f):

- the operator's pod building (`build_pod`): its generated `ray start` appended to the Ray
  container's command with `&&`, the environment it injects, the `wait-gcs-ready` init
  container on workers, the token Secret and env of `authOptions: {mode: token}`, the
  SidecarMode submitter `ray-job-submitter` in the head pod, the /dev/shm emptyDir;
- the kubelet: one pod per testbed host (the head on host 0, worker slot k on host k),
  volumes materialised at their mountPath (ConfigMap data and binaryData, items, emptyDirs as tmpfs, a
  PersistentVolumeClaim as a directory the test names), env resolved (fieldRef,
  secretKeyRef), init containers in order, then the containers, restartPolicy (Never on the
  SidecarMode head, Always on workers, with back-off), the startup and readiness probes;
- the RayJob's status: Initializing until the cluster is ready, Running, then Complete or
  Failed once Ray's job status is terminal and the submitter exited (GET /api/jobs/<id>
  every 3 s, with the operator's token header); a deleted worker pod is replaced by a new
  pod with a new name; the deadlines; the cluster deleted `ttlSecondsAfterFinished` after.

What is not emulated (a test relying on it would be wrong): liveness probes, networkPolicy
(no traffic is filtered), $(VAR) expansion in env/args, image pulls (the host's Python and
Ray stand for the image), a container seeing only its own volumes (a pod's mounts are its
host's), a RayCluster's autoscaling, HTTPMode, K8sJobMode.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import random
import re
import secrets
import shlex
import threading
import time
from pathlib import Path
from typing import Callable

import testbed as tbmod

KUBERAY_VERSION = "v1.7.0"
DEFAULT_HEAD_PORT = "6379"
DASHBOARD_PORT = 8265
METRICS_PORT = 8080
AGENT_PORT = 52365
SUBMITTER = "ray-job-submitter"
WAIT_GCS = "wait-gcs-ready"
SHM_VOLUME = "shared-mem"
JOB_POLL_S = 3.0  # the operator's GET /api/jobs/<id> period
#: k8s.io/apimachinery/pkg/util/rand's alphabet: KubeRay's `<rayjob>-<5>` and generateName's suffixes.
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
CLUSTER_DOMAIN = "cluster.local"

# pod.go DefaultWorkerPodTemplate, verbatim (the two %s:%s are the head's FQDN and port).
WAIT_GCS_SCRIPT = """
					SECONDS=0
					while true; do
						if (( SECONDS <= 120 )); then
							if ray health-check --address %s:%s > /dev/null 2>&1; then
								echo "GCS is ready."
								break
							fi
							echo "$SECONDS seconds elapsed: Waiting for GCS to be ready."
						else
							if ray health-check --address %s:%s; then
								echo "GCS is ready. Any error messages above can be safely ignored."
								break
							fi
							echo "$SECONDS seconds elapsed: Still waiting for GCS to be ready. For troubleshooting, refer to the FAQ at https://docs.ray.io/en/master/cluster/kubernetes/troubleshooting.html."
						fi
						sleep 5
					done
				"""
# utils/constant.go BasePythonHealthCommand
PYTHON_HEALTH = ('python -c "import urllib.request; r=urllib.request.urlopen(\'%s\', timeout=%d); '
                 'exit(0 if b\'success\' in r.read() else 1)"')


# --------------------------------------------------------------------------- the operator (pure)


def quantity(value) -> float:
    """A Kubernetes resource quantity as a number (cpu "500m" -> 0.5, memory "1Gi" -> 1073741824)."""
    text = str(value).strip()
    binary = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    decimal = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    for suffix, factor in binary.items():
        if text.endswith(suffix):
            return float(text[:-2]) * factor
    if text and text[-1] in decimal:
        return float(text[:-1]) * decimal[text[-1]]
    return float(text)


def ceil_int(value) -> str:
    """resource.Quantity.Value(): rounded up to an integer."""
    return str(int(math.ceil(quantity(value) - 1e-12)))


def convert_param_map(params: dict) -> str:
    """pod.go convertParamMap: sorted keys, "true" -> ` --k `, "false" dropped (but for three), else ` --k=v `."""
    special = ("log-color", "include-dashboard", "include-log-monitor")
    out = ""
    for key in sorted(params):
        value = str(params[key])
        if value.lower() in ("true", "false") and key not in special:
            if value.lower() == "true":
                out += " --%s " % key
        else:
            out += " --%s=%s " % (key, value)
    return out


def head_port(params: dict) -> str:
    return str(params.get("port", DEFAULT_HEAD_PORT))


def set_missing_params(params: dict, head: bool, fqdn: str) -> dict:
    """pod.go setMissingRayStartParams."""
    params = dict(params)
    if not head:
        params.setdefault("address", "%s:%s" % (fqdn, DEFAULT_HEAD_PORT))
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", str(METRICS_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(AGENT_PORT))
    return params


def ray_start_command(head: bool, params: dict, resources: dict) -> str:
    """pod.go generateRayStartCommand: the resources fill what the params leave out."""
    params = dict(params)
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    if "num-cpus" not in params:
        cpu = limits.get("cpu") or requests.get("cpu")
        if cpu is not None and quantity(cpu) > 0:
            params["num-cpus"] = ceil_int(cpu)
    if "memory" not in params and limits.get("memory") is not None and quantity(limits["memory"]) > 0:
        params["memory"] = ceil_int(limits["memory"])
    if "num-gpus" not in params:
        for key in sorted(limits):
            if key.endswith("gpu") and quantity(limits[key]) > 0:
                params["num-gpus"] = ceil_int(limits[key])
                break
    return ("ray start --head %s" if head else "ray start %s") % convert_param_map(params)


def names(cluster: str, namespace: str) -> dict:
    svc = "%s-head-svc" % cluster
    return {"svc": svc, "fqdn": "%s.%s.svc.%s" % (svc, namespace, CLUSTER_DOMAIN)}


def _env_exists(name: str, env: list) -> bool:
    return any(e["name"] == name for e in env)


def token_env(container: dict, cluster: str) -> None:
    """pod.go SetContainerTokenAuthEnvVars (Secret `<cluster>`, key auth_token)."""
    env = container.setdefault("env", [])
    if not _env_exists("RAY_AUTH_MODE", env):
        env.append({"name": "RAY_AUTH_MODE", "value": "token"})
    if not _env_exists("RAY_AUTH_TOKEN", env):
        env.append({"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": cluster, "key": "auth_token"}}})


def submit_command(rayjob: dict, job_id: str) -> str:
    """job.go BuildJobSubmitCommand for SidecarMode (gate SidecarSubmitterRestart off): the
    GCS-health wait, then the plain blocking `ray job submit`, joined with spaces."""
    spec = rayjob["spec"]
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    port = next((p["containerPort"] for p in head.get("ports", []) if p.get("name") == "dashboard"), DASHBOARD_PORT)
    address = "http://127.0.0.1:%d" % port
    health = PYTHON_HEALTH % ("http://localhost:%d/api/gcs_healthz" % port, 10)
    cmd = ["until", health, ">/dev/null", "2>&1", ";", "do", "echo",
           json.dumps("Waiting for Ray Dashboard GCS to become healthy at %s ..." % address), ";", "sleep", "2", ";",
           "done", ";", "ray", "job", "submit", "--address", address]
    if spec.get("runtimeEnvYAML"):
        raise NotImplementedError("runtimeEnvYAML")
    if spec.get("metadata"):
        cmd += ["--metadata-json", json.dumps(json.dumps(spec["metadata"], separators=(",", ":")))]
    cmd += ["--submission-id", job_id]
    for field, flag in (("entrypointNumCpus", "--entrypoint-num-cpus"), ("entrypointNumGpus", "--entrypoint-num-gpus")):
        if spec.get(field):
            cmd += [flag, "%f" % spec[field]]
    if spec.get("entrypointResources"):
        cmd += ["--entrypoint-resources", json.dumps(spec["entrypointResources"])]
    cmd += ["--", spec["entrypoint"].strip(), ";"]
    return " ".join(cmd)


def labels(cluster: str, head: bool, group: str, template_labels: dict) -> dict:
    """pod.go labelPod."""
    kind = "head" if head else "worker"
    return {**template_labels, "ray.io/cluster": cluster, "ray.io/node-type": kind, "ray.io/group": group,
            "ray.io/is-ray-node": "yes", "ray.io/identifier": "%s-%s" % (cluster, kind),
            "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}


def build_pod(rayjob: dict, cluster: str, job_id: str, pod_name: str, group: str | None = None) -> dict:
    """The Pod KubeRay creates for the RayJob's cluster: the head (group None) or a worker of
    `group`, as DefaultHeadPodTemplate/DefaultWorkerPodTemplate, BuildPod and (the head in
    SidecarMode) constructRayClusterForRayJob make it. `dashboardURL` is not known yet when
    the sidecar is built, so RAY_DASHBOARD_ADDRESS is empty (README: inferred)."""
    namespace = rayjob["metadata"].get("namespace", "default")
    spec = rayjob["spec"]
    cspec = spec["rayClusterSpec"]
    head = group is None
    gspec = cspec["headGroupSpec"] if head else next(g for g in cspec["workerGroupSpecs"] if g["groupName"] == group)
    n = names(cluster, namespace)
    template = copy.deepcopy(gspec["template"])
    pod_spec = template["spec"]
    ray = pod_spec["containers"][0]
    params = set_missing_params(gspec.get("rayStartParams", {}), head, n["fqdn"])
    port = head_port(cspec["headGroupSpec"].get("rayStartParams", {}))
    if not head:  # DefaultWorkerPodTemplate: wait-gcs-ready, from the Ray container as the user wrote it
        pod_spec.setdefault("initContainers", []).append({
            "name": WAIT_GCS, "image": ray["image"], "command": ["/bin/bash", "-c", "--"],
            "args": [WAIT_GCS_SCRIPT % (n["fqdn"], port, n["fqdn"], port)],
            "env": copy.deepcopy(ray.get("env", [])), "volumeMounts": copy.deepcopy(ray.get("volumeMounts", [])),
            "resources": {"limits": {"cpu": "200m", "memory": "256Mi"}, "requests": {"cpu": "200m", "memory": "256Mi"}}})
        if not any(p.get("name") == "metrics" for p in ray.get("ports", [])):
            ray.setdefault("ports", []).append({"name": "metrics", "containerPort": METRICS_PORT})
    auth = (cspec.get("authOptions") or {}).get("mode") == "token"
    if auth:  # configureTokenAuth: the Ray container and wait-gcs-ready
        token_env(ray, cluster)
        for init in pod_spec.get("initContainers", []):
            if init["name"] == WAIT_GCS:
                token_env(init, cluster)
    # BuildPod: /dev/shm, the command, init containers' env, the Ray container's env
    if "plasma-directory" not in params and not any(m.get("mountPath") == "/dev/shm"
                                                    for m in ray.get("volumeMounts", [])):
        if not any(v["name"] == SHM_VOLUME for v in pod_spec.get("volumes", [])):
            memory = ray.get("resources", {}).get("limits", {}).get("memory") or \
                ray.get("resources", {}).get("requests", {}).get("memory")
            pod_spec.setdefault("volumes", []).append(
                {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", **({"sizeLimit": memory} if memory else {})}})
        ray.setdefault("volumeMounts", []).append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    user = "".join(" %s " % part for part in ray.get("command", [])) + \
        "".join(" %s " % part for part in ray.get("args", []))
    start = ray_start_command(head, params, ray.get("resources", {}))
    overwrite = str((template.get("metadata", {}).get("annotations") or {}).get(
        "ray.io/overwrite-container-cmd", "")).lower() == "true"
    if not overwrite and "ray start" not in user:
        generated = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; %s" % start
        ray["command"] = ["/bin/bash", "-c", "--"]
        ray["args"] = ["%s && %s" % (user, generated) if user else generated]
    for init in pod_spec.get("initContainers", []):
        init.setdefault("env", []).extend([{"name": "FQ_RAY_IP", "value": n["fqdn"]}, {"name": "RAY_IP", "value": n["svc"]}])
    env = ray.setdefault("env", [])
    if not head:
        env += [{"name": "FQ_RAY_IP", "value": n["fqdn"]}, {"name": "RAY_IP", "value": n["svc"]}]
    env += [{"name": "RAY_CLUSTER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}}},
            {"name": "RAY_CLUSTER_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "RAY_CLOUD_INSTANCE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "RAY_NODE_TYPE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/group']"}}},
            {"name": "KUBERAY_GEN_RAY_START_CMD", "value": start}]
    for name, value in (("RAY_PORT", port), ("RAY_ADDRESS", "%s:%s" % ("127.0.0.1" if head else n["fqdn"], port)),
                        ("RAY_USAGE_STATS_KUBERAY_IN_USE", "1")):
        if not _env_exists(name, env):
            env.append({"name": name, "value": value})
    if head:
        env.append({"name": "RAY_USAGE_STATS_EXTRA_TAGS", "value": "kuberay_version=%s;kuberay_crd=RayJob"
                    % KUBERAY_VERSION})
    if not _env_exists("RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", env):
        env.append({"name": "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "value": "1"})
    if head and spec.get("submissionMode") == "SidecarMode":
        submitter = {"name": SUBMITTER, "image": ray["image"], "command": ["/bin/bash", "-ce", "--"],
                     "args": [submit_command(rayjob, job_id)],
                     "resources": {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "500m", "memory": "200Mi"}},
                     "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "RAY_DASHBOARD_ADDRESS", "value": ""},
                             {"name": "RAY_JOB_SUBMISSION_ID", "value": job_id}]}
        if auth:
            token_env(submitter, cluster)
        pod_spec["containers"].append(submitter)
        pod_spec["restartPolicy"] = "Never"
    pod_spec.setdefault("restartPolicy", "Always")
    meta = {"name": pod_name, "namespace": namespace,
            "labels": labels(cluster, head, "headgroup" if head else group, template.get("metadata", {}).get("labels", {}))}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def readiness_checks(pod: dict, ray_version: str) -> list[dict]:
    """pod.go initLivenessAndReadinessProbe's readiness probe of the Ray container (where the
    user set none), as checks the probe script runs: >= 2.53.0 httpGet :52365/api/healthz,
    else the wget commands' URLs (the body must hold "success")."""
    ray = pod["spec"]["containers"][0]
    if ray.get("readinessProbe"):
        raise NotImplementedError("a user-set readinessProbe")
    version = tuple(int(x) for x in ray_version.split(".")) if ray_version else (0,)
    head = pod["metadata"]["labels"]["ray.io/node-type"] == "head"
    if version >= (2, 53, 0):
        return [{"kind": "http", "url": "http://localhost:%d/api/healthz" % AGENT_PORT}]
    checks = [{"kind": "http", "url": "http://localhost:%d/api/local_raylet_healthz" % AGENT_PORT, "grep": "success"}]
    if head:
        checks.append({"kind": "http", "url": "http://localhost:%d/api/gcs_healthz" % DASHBOARD_PORT, "grep": "success"})
    return checks


def random_suffix(rng: random.Random, n: int = 5) -> str:
    return "".join(rng.choice(NAME_ALPHABET) for _ in range(n))


# --------------------------------------------------------------------------- state directory


def write_json(path: Path, data) -> None:
    """Whole files, atomically (the stand-in's rule)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / (".%s.%d.tmp" % (path.name, threading.get_ident()))
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def now_iso(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


_PROBE = r"""
import json, socket, sys, urllib.request
out = []
for check in json.loads(sys.argv[1]):
    try:
        if check["kind"] == "tcp":
            socket.create_connection((check["host"], check["port"]), timeout=2).close()
        else:
            with urllib.request.urlopen(check["url"], timeout=check.get("timeout", 2)) as r:
                body = r.read()
            if check.get("grep") and check["grep"].encode() not in body:
                raise RuntimeError("no %r in the answer" % check["grep"])
        out.append(True)
    except Exception as exc:
        out.append(repr(exc))
print(json.dumps(out))
"""

_HTTP_GET = r"""
import json, sys, urllib.request, urllib.error
url, headers = sys.argv[1], json.loads(sys.argv[2])
try:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode("utf-8", "replace")}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode("utf-8", "replace")}))
except Exception as e:
    print(json.dumps({"status": None, "body": repr(e)}))
"""

#: Mount points that would hide what the hosts run on: a volume there is refused.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev", "/root", "/work", "/var",
                "/run", "/boot")


# --------------------------------------------------------------------------- the kubelet's part


class _Booter(object):
    """Boots testbed hosts again from one thread that lives as long as the test process: a host's
    init dies with the thread that started it (PR_SET_PDEATHSIG), and the controller's thread
    ends with the controller, while the testbed (module-scoped, say) may outlive it."""

    _lock = threading.Lock()
    _thread = None
    _requests: list = []
    _wake = threading.Condition(_lock)

    @classmethod
    def reboot(cls, tb, host: int) -> None:
        done, box = threading.Event(), {}
        with cls._lock:
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._serve, name="kuberay-harness-booter", daemon=True)
                cls._thread.start()
            cls._requests.append((tb, host, done, box))
            cls._wake.notify()
        done.wait()
        if "error" in box:
            raise box["error"]

    @classmethod
    def _serve(cls) -> None:
        while True:
            with cls._lock:
                while not cls._requests:
                    cls._wake.wait()
                tb, host, done, box = cls._requests.pop(0)
            try:
                tb.reboot(host)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            done.set()


class ContainerRun:
    """One container of a pod: its process on the pod's host and its state as the kubelet reports it."""

    def __init__(self, spec: dict, init: bool):
        self.spec, self.init, self.name = spec, init, spec["name"]
        self.proc = None
        self.state: dict = {"waiting": {"reason": "PodInitializing" if not init else "Waiting"}}
        self.restarts = 0
        self.started_at = self.finished_at = None
        self.next_start = 0.0  # back-off after a restart
        self.ready = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.running()

    def status(self) -> dict:
        return {"name": self.name, "ready": self.ready, "restartCount": self.restarts, "state": self.state,
                "image": self.spec.get("image", "")}


class PodRun:
    """One pod on one testbed host: scheduling (a delay stands for a busy cluster), volumes,
    init containers in order, then every container; restarts by restartPolicy; probes."""

    def __init__(self, ctrl: "KubeRayController", job: "JobRun", pod: dict, host: int, slot: int, schedule_at: float):
        self.ctrl, self.job, self.pod, self.host, self.slot = ctrl, job, pod, host, slot
        self.name = pod["metadata"]["name"]
        self.ns = pod["metadata"]["namespace"]
        self.schedule_at, self.created_at = schedule_at, time.time()
        self.scheduled_at = self.ready_at = None
        self.phase, self.reason, self.message = "Pending", None, None
        self.inits = [ContainerRun(c, True) for c in pod["spec"].get("initContainers", [])]
        self.containers = [ContainerRun(c, False) for c in pod["spec"]["containers"]]
        self.init_index = 0
        self.volumes_ready = False
        self.startup_ok = not pod["spec"]["containers"][0].get("startupProbe")
        self.ready_ok = False
        self.probe_proc, self.next_probe = None, 0.0
        self.deleted = False
        self.events: dict[str, float] = {"created": self.created_at}
        self.ray_version = job.rayjob["spec"]["rayClusterSpec"].get("rayVersion", "")
        self.written = None

    # -- the object the stand-in shows

    def conditions(self) -> list[dict]:
        out = []
        if self.scheduled_at is None:
            out.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/%d nodes are available: %d Insufficient cpu." % (len(self.ctrl.tb.hosts),
                                                                                      len(self.ctrl.tb.hosts))})
            return out
        out.append({"type": "PodScheduled", "status": "True"})
        if self.init_index < len(self.inits):
            out.append({"type": "Initialized", "status": "False", "reason": "ContainersNotInitialized",
                        "message": "containers with incomplete status: [%s]" % self.inits[self.init_index].name})
        else:
            out.append({"type": "Initialized", "status": "True"})
        ready = self.is_ready()
        out.append({"type": "ContainersReady", "status": "True" if ready else "False"})
        out.append({"type": "Ready", "status": "True" if ready else "False"})
        return out

    def is_ready(self) -> bool:
        return self.phase == "Running" and all(c.ready and c.running for c in self.containers)

    def obj(self) -> dict:
        obj = copy.deepcopy(self.pod)
        obj["metadata"]["creationTimestamp"] = now_iso(self.created_at)
        status = {"phase": self.phase, "conditions": self.conditions(),
                  "initContainerStatuses": [c.status() for c in self.inits],
                  "containerStatuses": [c.status() for c in self.containers]}
        if self.scheduled_at is not None:
            status["podIP"] = status["hostIP"] = self.ctrl.tb.hosts[self.host].ip
            obj["spec"]["nodeName"] = self.ctrl.tb.hosts[self.host].name
        if self.reason:
            status["reason"] = self.reason
        if self.message:
            status["message"] = self.message
        obj["status"] = status
        return obj

    def write(self) -> None:
        obj = self.obj()
        if obj != self.written:
            write_json(self.ctrl.dir / "pods" / self.ns / ("%s.json" % self.name), obj)
            self.written = obj

    # -- the kubelet

    @property
    def ip(self) -> str:
        return self.ctrl.tb.hosts[self.host].ip

    def log_path(self, container: str) -> Path:
        return self.ctrl.dir / "logs" / self.ns / self.name / ("%s.log" % container)

    def field(self, path: str) -> str:
        meta = self.pod["metadata"]
        simple = {"metadata.name": self.name, "metadata.namespace": self.ns, "status.podIP": self.ip,
                  "status.hostIP": self.ip, "spec.nodeName": self.ctrl.tb.hosts[self.host].name,
                  "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName", "default")}
        if path in simple:
            return simple[path]
        m = re.match(r"^metadata\.(labels|annotations)\['(.+)'\]$", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        raise NotImplementedError("fieldRef %s" % path)

    def env(self, spec: dict) -> dict[str, str]:
        """The container's environment: the image's (the host's PATH, HOME), the pod's hostname,
        then the spec's entries in order (later ones win), references resolved."""
        env = self.ctrl.tb.env(HOSTNAME=self.name)
        for entry in spec.get("env", []):
            if "value" in entry:
                env[entry["name"]] = str(entry["value"])
                continue
            source = entry.get("valueFrom", {})
            if "fieldRef" in source:
                env[entry["name"]] = self.field(source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                kind, ref = ("secret", source["secretKeyRef"]) if "secretKeyRef" in source \
                    else ("configmap", source["configMapKeyRef"])
                value = self.ctrl.object_value(self.ns, kind, ref["name"], ref["key"])
                if value is None:
                    if ref.get("optional"):
                        continue
                    raise ConfigError("%s %r not found" % ("secret" if kind == "secret" else "configmap", ref["name"])
                                      if self.ctrl.object(self.ns, kind, ref["name"]) is None else
                                      "couldn't find key %s in %s %s" % (ref["key"], kind.capitalize(), ref["name"]))
                env[entry["name"]] = value
            else:
                raise NotImplementedError("env %s: %s" % (entry["name"], source))
        return env

    def setup_volumes(self) -> str | None:
        """Mount the pod's volumes on its host; a reason the pod cannot start yet, or None."""
        tb, script = self.ctrl.tb, ["set -e", "hostname %s" % shlex.quote(self.name)]
        mounts = {}
        for c in self.pod["spec"].get("initContainers", []) + self.pod["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                mounts.setdefault(m["mountPath"], m)
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        staged = self.ctrl.dir / "volumes" / self.ns / self.name
        tops = set()
        for path, mount in sorted(mounts.items()):
            volume = volumes[mount["name"]]
            target = shlex.quote(path)
            if path.startswith(_SYSTEM_DIRS) and path != "/dev/shm":
                raise NotImplementedError("a volume at %s would hide the host's system" % path)
            shared = path.startswith(("/tmp/", "/dev/shm")) or any(path.startswith(s + "/") or path == s
                                                                   for s in tb.shared)
            top = "/" + path.strip("/").split("/")[0]
            if not shared and top not in tops:  # a tmpfs of the host's own, so nothing lands on the machine's disk
                tops.add(top)
                script.append("mountpoint -q %s || mount -t tmpfs tmpfs %s" % (top, top))
            if "configMap" in volume:
                cm = self.ctrl.object(self.ns, "configmap", volume["configMap"]["name"])
                if cm is None:
                    if volume["configMap"].get("optional"):
                        continue
                    return 'configmap "%s" not found' % volume["configMap"]["name"]
                # the kubelet projects both maps: data as UTF-8 text, binaryData base64-decoded, byte for byte
                data = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
                data.update({k: base64.b64decode(v, validate=True) for k, v in (cm.get("binaryData") or {}).items()})
                items = volume["configMap"].get("items") or [{"key": k, "path": k} for k in sorted(data)]
                root = staged / mount["name"]
                for item in items:
                    if item["key"] not in data:
                        return "configmap %s has no key %s" % (volume["configMap"]["name"], item["key"])
                    dest = root / item["path"]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data[item["key"]])
                script += ["mkdir -p %s" % target, "mount --bind %s %s" % (shlex.quote(str(root)), target),
                           "mount -o remount,bind,ro %s" % target]
            elif "emptyDir" in volume:
                size = volume["emptyDir"].get("sizeLimit")
                opts = "-o size=%d" % int(quantity(size)) if size else ""
                script += ["mkdir -p %s" % target, "mount -t tmpfs %s tmpfs %s" % (opts, target)]
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                source = self.ctrl.claims.get(claim)
                if source is None:
                    return 'persistentvolumeclaim "%s" not found' % claim
                Path(source).mkdir(parents=True, exist_ok=True)
                if Path(source).resolve() != Path(path):
                    script += ["mkdir -p %s" % target, "mount --bind %s %s" % (shlex.quote(str(source)), target)]
            else:
                raise NotImplementedError("volume %s" % volume)
        tb.sh(self.host, " && ".join(script))
        return None

    def start(self, c: ContainerRun) -> None:
        try:
            env = self.env(c.spec)
        except ConfigError as exc:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            c.next_start = time.time() + 2.0
            return
        argv = list(c.spec.get("command", [])) + list(c.spec.get("args", []))
        if not argv:
            raise NotImplementedError("a container without command (the image's entrypoint)")
        log = self.log_path(c.name)
        log.parent.mkdir(parents=True, exist_ok=True)
        c.proc = self.ctrl.tb.run(self.host, argv, env=env, cwd="/", log=log, name="%s-%s" % (self.name, c.name))
        c.started_at = time.time()
        c.state = {"running": {"startedAt": now_iso(c.started_at)}}
        c.ready = False
        self.events.setdefault("started:" + c.name, c.started_at)

    def reap(self, c: ContainerRun) -> int | None:
        if c.proc is None or c.proc.running():
            return None
        code = c.proc.returncode
        c.finished_at = time.time()
        c.state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                  "finishedAt": now_iso(c.finished_at)}}
        c.proc, c.ready = None, False
        self.events.setdefault("terminated:" + c.name, c.finished_at)
        return code

    def backoff(self, c: ContainerRun) -> None:
        delay = min(300.0, 10.0 * 2 ** c.restarts)
        c.restarts += 1
        c.next_start = time.time() + delay
        c.state = {"waiting": {"reason": "CrashLoopBackOff",
                               "message": "back-off %ds restarting failed container=%s pod=%s" % (delay, c.name, self.name)}}

    def step(self) -> None:
        if self.deleted or self.phase in ("Succeeded", "Failed"):
            return
        now = time.time()
        if self.scheduled_at is None:
            if now < self.schedule_at:
                return
            self.scheduled_at = now
            self.events["scheduled"] = now
            self.ctrl.tb.add_alias(self.name, self.host)  # the kubelet's /etc/hosts entry for the pod
        if not self.volumes_ready:
            reason = self.setup_volumes()
            if reason:
                self.reason, self.message = "FailedMount", reason
                return
            self.volumes_ready, self.reason, self.message = True, None, None
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if self.init_index < len(self.inits):
            c = self.inits[self.init_index]
            if c.proc is None and "terminated" not in c.state and now >= c.next_start:
                self.start(c)
                return
            code = self.reap(c)
            if code == 0:
                self.init_index += 1
                if self.init_index == len(self.inits):
                    self.events["initialized"] = now
            elif code is not None:
                if policy == "Never":
                    self.phase, self.reason = "Failed", "Init:Error"
                else:
                    self.backoff(c)
            return
        for c in self.containers:
            if c.proc is None and "terminated" not in c.state and now >= c.next_start:
                self.start(c)  # also a retry after CreateContainerConfigError, as the kubelet does
            code = self.reap(c)
            if code is not None and (policy == "Always" or (policy == "OnFailure" and code != 0)):
                self.backoff(c)
        if any(c.proc is not None for c in self.containers) or any(
                "waiting" in c.state and c.state["waiting"]["reason"] == "CrashLoopBackOff" for c in self.containers):
            self.phase = "Running"
        elif all("terminated" in c.state for c in self.containers):
            self.phase = "Succeeded" if all(c.state["terminated"]["exitCode"] == 0 for c in self.containers) \
                else "Failed"
        self.probe(now)
        if self.is_ready() and self.ready_at is None:
            self.ready_at = self.events["ready"] = now

    def probe(self, now: float) -> None:
        """The startup probe (tcpSocket) every periodSeconds; once it passed, KubeRay's readiness
        probe every 5 s after 10 s. Containers without probes are ready while running."""
        for c in self.containers[1:]:
            c.ready = c.running
        ray = self.containers[0]
        if not ray.running:
            ray.ready = False
            return
        if self.probe_proc is not None:
            if self.probe_proc.running():
                return
            try:
                result = json.loads(self.probe_proc.output.strip().splitlines()[-1])
            except (IndexError, ValueError):
                result = None
            self.probe_proc = None
            if result is not None:
                if not self.startup_ok:
                    self.startup_ok = result[0] is True
                    if self.startup_ok:
                        self.events["startup"] = now
                else:
                    ray.ready = all(r is True for r in result)
        if now < self.next_probe:
            return
        spec = ray.spec
        if not self.startup_ok:
            probe = spec["startupProbe"]
            checks = [{"kind": "tcp", "host": self.ip, "port": probe["tcpSocket"]["port"]}]
            self.next_probe = now + probe.get("periodSeconds", 10)
        else:
            if now - ray.started_at < 10:
                self.next_probe = ray.started_at + 10
                return
            checks = readiness_checks(self.pod, self.ray_version)
            self.next_probe = now + 5
        self.probe_proc = self.ctrl.tb.run(self.host, [tbmod.PYTHON, "-I", "-S", str(self.ctrl.script("probe", _PROBE)),
                                                      json.dumps(checks)],
                                           log=self.ctrl.dir / "probes" / ("%s.log" % self.name))

    def delete(self) -> None:
        """The pod is gone: every process on its host killed (the host booted again, so the
        next pod there starts with fresh /tmp, /dev/shm and mounts), its file removed."""
        if self.deleted:
            return
        self.deleted = True
        self.events["deleted"] = time.time()
        _Booter.reboot(self.ctrl.tb, self.host)
        try:
            (self.ctrl.dir / "pods" / self.ns / ("%s.json" % self.name)).unlink()
        except FileNotFoundError:
            pass


class ConfigError(Exception):
    """A container's env names a Secret or key that is not there (CreateContainerConfigError)."""


# --------------------------------------------------------------------------- the operator's part


class JobRun:
    """One RayJob: its RayCluster's pods, its status."""

    def __init__(self, ctrl: "KubeRayController", ns: str, name: str, rayjob: dict):
        self.ctrl, self.ns, self.name, self.rayjob = ctrl, ns, name, rayjob
        spec = rayjob["spec"]
        if spec.get("submissionMode", "K8sJobMode") != "SidecarMode":
            raise NotImplementedError("submissionMode %s (the harness plays SidecarMode)" % spec.get("submissionMode"))
        rng = ctrl.rng
        self.cluster = "%s-%s" % (name, random_suffix(rng))
        self.job_id = spec.get("jobId") or "%s-%s" % (name, random_suffix(rng))
        self.fqdn = names(self.cluster, ns)["fqdn"]
        self.started = time.time()
        self.status = {"jobDeploymentStatus": "Initializing", "jobStatus": "", "rayClusterName": self.cluster,
                       "jobId": self.job_id, "dashboardURL": "", "reason": "", "message": "",
                       "startTime": now_iso(self.started), "endTime": None}
        self.token = None
        self.pods: list[PodRun] = []
        self.poll_proc, self.next_poll = None, 0.0
        self.ended = None
        self.torn_down = False
        self.history: list[tuple[float, str]] = []  # (when, jobDeploymentStatus) as it changed
        cspec = spec["rayClusterSpec"]
        if (cspec.get("authOptions") or {}).get("mode") == "token":  # rcc.go createAuthSecret
            self.token = base64.b64encode(secrets.token_bytes(32)).decode()
            ctrl.write_object({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                               "metadata": {"name": self.cluster, "namespace": ns,
                                            "labels": {"ray.io/cluster": self.cluster}},
                               "data": {"auth_token": base64.b64encode(self.token.encode()).decode()}})
        n = names(self.cluster, ns)
        ctrl.tb.add_alias(n["fqdn"], 0)  # the head service: headless, so its name is the head pod's IP
        ctrl.tb.add_alias(n["svc"], 0)
        self.slots = {}  # slot -> (group, host)
        slot = 1
        for group in cspec.get("workerGroupSpecs", []):
            for _ in range(group.get("replicas", 0)):
                self.slots[slot] = group["groupName"]
                slot += 1
        if slot > len(ctrl.tb.hosts):
            raise NotImplementedError("%d pods for %d testbed hosts" % (slot, len(ctrl.tb.hosts)))
        self.new_pod(0)
        for s in self.slots:
            self.new_pod(s)
        self.write_status()

    def new_pod(self, slot: int) -> PodRun:
        group = None if slot == 0 else self.slots[slot]
        name = ("%s-head-%s" if slot == 0 else "%s-" + group + "-worker-%s") % (self.cluster, random_suffix(self.ctrl.rng))
        pod = build_pod(self.rayjob, self.cluster, self.job_id, name, group)
        first = not any(p.slot == slot for p in self.pods)
        delay = self.ctrl.worker_delays.get(slot, 0) if first else 0
        run = PodRun(self.ctrl, self, pod, slot, slot, time.time() + delay)
        self.pods.append(run)
        return run

    def live(self) -> list[PodRun]:
        return [p for p in self.pods if not p.deleted]

    def head(self) -> PodRun | None:
        return next((p for p in self.live() if p.slot == 0), None)

    def write_status(self) -> None:
        state = self.status["jobDeploymentStatus"]
        if not self.history or self.history[-1][1] != state:
            self.history.append((time.time(), state))
        write_json(self.ctrl.dir / "status" / self.ns / "rayjob" / ("%s.json" % self.name), self.status)

    def fail(self, reason: str, message: str) -> None:
        self.status.update(jobDeploymentStatus="Failed", reason=reason, message=message)
        self.end()

    def end(self) -> None:
        self.ended = time.time()
        self.status["endTime"] = now_iso(self.ended)

    def step(self) -> None:
        if self.torn_down:
            return
        if self.ended is None:  # the RayCluster controller: a deleted worker pod is replaced
            for slot in self.slots:
                if not any(p.slot == slot for p in self.live()):
                    self.new_pod(slot)
        for pod in self.live():
            pod.step()
            pod.write()
        before = dict(self.status)
        state = self.status["jobDeploymentStatus"]
        spec = self.rayjob["spec"]
        elapsed = time.time() - self.started
        if state in ("Initializing", "Running") and spec.get("activeDeadlineSeconds") and \
                elapsed > spec["activeDeadlineSeconds"]:
            self.fail("DeadlineExceeded", "The RayJob has passed the activeDeadlineSeconds.")
        elif state == "Initializing":
            if spec.get("preRunningDeadlineSeconds") and elapsed > spec["preRunningDeadlineSeconds"]:
                self.fail("PreRunningDeadlineExceeded", "The RayJob has passed the preRunningDeadlineSeconds.")
            elif len(self.live()) == 1 + len(self.slots) and all(p.is_ready() for p in self.live()):
                # the RayCluster is ready: head and every desired worker Running and Ready
                self.status.update(dashboardURL="%s:%d" % (self.fqdn, DASHBOARD_PORT), jobDeploymentStatus="Running")
                self.ctrl.note("%s: cluster ready, Running" % self.name)
        elif state == "Running":
            self.running()
        if self.ended is not None and spec.get("shutdownAfterJobFinishes") and \
                time.time() >= self.ended + spec.get("ttlSecondsAfterFinished", 0):
            self.teardown()
        if self.status != before:
            self.write_status()

    def running(self) -> None:
        head = self.head()
        if head is None:
            return self.fail("AppFailed", "Ray head pod not found.")
        submitter = next(c for c in head.containers if c.name == SUBMITTER)
        finished = "terminated" in submitter.state
        if finished and submitter.state["terminated"]["exitCode"] != 0:
            return self.fail("AppFailed" if self.status["jobStatus"] == "FAILED" else "SubmissionFailed",
                             "the submitter exited with code %d" % submitter.state["terminated"]["exitCode"])
        if self.poll_proc is not None:
            if self.poll_proc.running():
                return
            answer = None
            try:
                answer = json.loads(self.poll_proc.output.strip().splitlines()[-1])
            except (IndexError, ValueError):
                pass
            self.poll_proc = None
            if answer and answer["status"] == 200:
                info = json.loads(answer["body"])
                status = info.get("status") or ""
                self.status.update(jobStatus=status, message=info.get("message") or "", reason="")
                if status in ("SUCCEEDED", "STOPPED", "FAILED") and finished:
                    if status == "FAILED":
                        self.status.update(jobDeploymentStatus="Failed", reason="AppFailed")
                    else:
                        self.status["jobDeploymentStatus"] = "Complete"
                    self.end()
                    self.ctrl.note("%s: %s" % (self.name, self.status["jobDeploymentStatus"]))
                    return
            elif answer and answer["status"] in (400, 404) and finished:
                return self.fail("AppFailed", "Submitter completed but Ray job not found in RayCluster.")
        if time.time() >= self.next_poll:
            self.next_poll = time.time() + JOB_POLL_S
            headers = {"x-ray-authorization": "Bearer %s" % self.token} if self.token else {}
            url = "http://%s/api/jobs/%s" % (self.status["dashboardURL"], self.job_id)
            self.poll_proc = self.ctrl.tb.run("laptop", [tbmod.PYTHON, "-I", "-S", str(self.ctrl.script("get", _HTTP_GET)),
                                                         url, json.dumps(headers)],
                                              log=self.ctrl.dir / "probes" / ("operator-%s.log" % self.name))

    def teardown(self) -> None:
        """The RayCluster deleted (the job deleted, or its TTL after it finished): its pods go."""
        if self.torn_down:
            return
        self.torn_down = True
        for pod in self.live():
            pod.delete()
        self.ctrl.note("%s: cluster %s deleted" % (self.name, self.cluster))


class KubeRayController:
    """Watches `state_dir/objects/<ns>/rayjob/*.json` and plays KubeRay and the kubelets for each
    RayJob on the testbed's hosts (one pod per host; the head on host 0). A context manager.

    Options: `worker_delays={slot: seconds}`: worker slot k (on host k) is scheduled that long
    after the RayJob (its first pod only; a replacement is scheduled at once); `claims={name:
    directory}`: what a PersistentVolumeClaim mounts (one the test does not name leaves the pod
    Pending); `seed`: the random names."""

    def __init__(self, tb, state_dir: Path, *, worker_delays: dict[int, float] | None = None,
                 claims: dict[str, Path] | None = None, seed: int | None = None, interval: float = 0.2):
        self.tb, self.dir = tb, Path(state_dir)
        self.worker_delays = dict(worker_delays or {})
        self.claims = {k: Path(v) for k, v in (claims or {}).items()}
        self.rng = random.Random(seed)
        self.interval = interval
        self.jobs: dict[tuple[str, str], JobRun] = {}
        self.lock = threading.RLock()
        self.thread = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.notes: list[tuple[float, str]] = []
        self.lines: dict[tuple[str, str], list[tuple[float, str]]] = {}  # (pod, container) -> (time seen, line)
        self._tails: dict[Path, tuple[int, bytes]] = {}
        (self.dir / "crds").mkdir(parents=True, exist_ok=True)
        (self.dir / "crds" / "rayjobs.ray.io").touch()

    # -- lifecycle

    def start(self) -> "KubeRayController":
        self.thread = threading.Thread(target=self._loop, name="kuberay-controller", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and kill every process the pods started (their hosts booted again)."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(30)
        with self.lock:
            for job in self.jobs.values():
                job.teardown()

    def __enter__(self) -> "KubeRayController":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def note(self, message: str) -> None:
        self.notes.append((time.time(), message))

    def script(self, name: str, source: str) -> Path:
        (self.dir / "probes").mkdir(parents=True, exist_ok=True)  # where the probes' output goes
        path = self.dir / "bin" / ("%s.py" % name)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source.lstrip())
        return path

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                with self.lock:
                    self.reconcile()
                    self.tail()
            except BaseException as exc:  # a harness bug: the test sees it in wait_status
                self.error = exc
                self.note("controller error: %r" % exc)
                return
            self.stopping.wait(self.interval)

    def reconcile(self) -> None:
        seen = set()
        for path in sorted(self.dir.glob("objects/*/rayjob/*.json")):
            key = (path.parent.parent.name, path.stem)
            seen.add(key)
            if key not in self.jobs:
                obj = read_json(path)
                if obj is None:
                    continue
                self.jobs[key] = JobRun(self, key[0], key[1], obj)
                self.note("%s/%s: RayJob seen, cluster %s" % (key[0], key[1], self.jobs[key].cluster))
        for key, job in list(self.jobs.items()):
            if key not in seen and not job.torn_down:  # kubectl delete rayjob
                job.teardown()
                for pod in job.pods:
                    pod.delete()
                (self.dir / "status" / key[0] / "rayjob" / ("%s.json" % key[1])).unlink(missing_ok=True)
                del self.jobs[key]
                continue
            job.step()

    def tail(self) -> None:
        """Each container log's new lines, with when they were seen (for tests that order events)."""
        for log in self.dir.glob("logs/*/*/*.log"):
            offset, rest = self._tails.get(log, (0, b""))
            try:
                size = log.stat().st_size
            except FileNotFoundError:
                continue
            if size < offset:  # the container restarted: a new log
                offset, rest = 0, b""
            if size == offset:
                continue
            with open(log, "rb") as handle:
                handle.seek(offset)
                data = rest + handle.read()
            *complete, rest = data.split(b"\n")
            now = time.time()
            key = (log.parent.name, log.stem)
            self.lines.setdefault(key, []).extend((now, line.decode("utf-8", "replace")) for line in complete)
            self._tails[log] = (size, rest)

    # -- objects

    def object(self, ns: str, kind: str, name: str):
        return read_json(self.dir / "objects" / ns / kind / ("%s.json" % name))

    def object_value(self, ns: str, kind: str, name: str, key: str) -> str | None:
        obj = self.object(ns, kind, name)
        if obj is None:
            return None
        if kind == "secret":
            if key in (obj.get("stringData") or {}):
                return obj["stringData"][key]
            if key in (obj.get("data") or {}):
                return base64.b64decode(obj["data"][key]).decode()
            return None
        return (obj.get("data") or {}).get(key)

    def write_object(self, obj: dict) -> None:
        ns = obj["metadata"].get("namespace") or "default"
        write_json(self.dir / "objects" / ns / obj["kind"].lower() / ("%s.json" % obj["metadata"]["name"]), obj)

    def apply(self, objects: list[dict]) -> None:
        """What `kubectl apply` leaves in the state directory (tests that do not use the stand-in kubectl)."""
        for obj in objects:
            self.write_object(obj)

    def delete(self, kind: str, name: str, ns: str = "default") -> None:
        (self.dir / "objects" / ns / kind.lower() / ("%s.json" % name)).unlink(missing_ok=True)

    # -- what tests ask

    def job(self, rayjob: str, ns: str = "default") -> JobRun | None:
        return self.jobs.get((ns, rayjob))

    def status(self, rayjob: str, ns: str = "default") -> dict | None:
        return read_json(self.dir / "status" / ns / "rayjob" / ("%s.json" % rayjob))

    def pods(self, ns: str = "default") -> list[dict]:
        return [p for p in (read_json(path) for path in sorted(self.dir.glob("pods/%s/*.json" % ns))) if p]

    def pod_run(self, name: str) -> PodRun:
        with self.lock:
            return next(p for job in self.jobs.values() for p in job.pods if p.name == name)

    def kill_pod(self, name: str) -> None:
        """The pod dies at once (every process SIGKILLed, as a lost node); KubeRay creates a new
        worker pod in its place (a new name), on the same host."""
        with self.lock:
            pod = self.pod_run(name)
            pod.delete()
            self.note("pod %s killed" % name)

    def log(self, pod: str, container: str, ns: str = "default") -> str:
        try:
            return (self.dir / "logs" / ns / pod / ("%s.log" % container)).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def line_seen(self, pod: str, container: str, text: str) -> float | None:
        """When the first line holding `text` appeared in that container's log (within the loop's interval)."""
        with self.lock:
            return next((t for t, line in self.lines.get((pod, container), []) if text in line), None)

    def wait_status(self, rayjob: str, predicate: Callable[[dict], bool], timeout: float,
                    ns: str = "default") -> dict:
        """The RayJob's status once `predicate(status)` holds; TimeoutError naming the last one
        (RuntimeError at once if the harness itself failed)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.error is not None:
                raise RuntimeError("the KubeRay harness failed: %r" % self.error) from self.error
            status = self.status(rayjob, ns)
            if status and predicate(status):
                return status
            if time.monotonic() >= deadline:
                raise TimeoutError("RayJob %s: no status as expected after %.0fs; last %s; harness notes %s"
                                   % (rayjob, timeout, status, self.notes[-10:]))
            time.sleep(0.2)

    def describe(self, ns: str = "default") -> str:
        """Every pod's phase and containers, and the tail of each container's log (for a failing test's message)."""
        out = []
        for pod in self.pods(ns):
            st = pod["status"]
            out.append("pod %s %s %s" % (pod["metadata"]["name"], st["phase"], [
                (c["name"], c["state"]) for c in st["initContainerStatuses"] + st["containerStatuses"]]))
            for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
                out.append("--- %s/%s:\n%s" % (pod["metadata"]["name"], c["name"],
                                               self.log(pod["metadata"]["name"], c["name"], ns)[-2500:]))
        return "\n".join(out)
