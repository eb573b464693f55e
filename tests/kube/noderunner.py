"""The kubelet's part, played for the real control plane (controlplane.py): Node objects that
the real scheduler binds pods to, and each bound pod run on a namespace host of its own
(tests/testbed.py: its own IP, hostname, /tmp, /dev/shm and mounts).

What it plays, in the kubelet's order: the pod's volumes (configMap, secret, emptyDir incl.
`medium: Memory`, projected and downwardAPI, hostPath, a persistentVolumeClaim through its
bound hostPath PersistentVolume, a directory every pod sees), init containers in order
(`restartPolicy: Always` ones as sidecars), then the containers with the environment
resolved (`value` with `$(VAR)`, `fieldRef`, `resourceFieldRef`, `secretKeyRef`,
`configMapKeyRef`, `envFrom`) and `command`/`args` joined with the image's entrypoint as a
runtime does; startup, readiness and liveness probes (exec, httpGet, tcpSocket) deciding the
Ready condition and restarts; `restartPolicy` with the kubelet's back-off; graceful deletion;
the pod's status written back through the API server. Service names resolve, through the hosts
file every host shares, to the addresses the real EndpointSlice controller lists.
`kubectl logs` and `kubectl port-forward` reach the pods through the API server and
kube-streams (streams/main.go), the kubelet's own streaming library.

Images: no registry is reachable, so each image name maps to a root of its own (`Image`): the
directories its containers see first on PATH (a virtualenv, say). An image the runner does not
know fails to pull, and an image without Ray has no `ray`, exactly as on a node.

Not played (a test that relies on it would be wrong): cgroups and resource limits, a container
seeing only its own volumes (a pod's mounts are its host's), image layers, network policies,
kube-proxy's ClusterIPs (a Service name resolves to its pods' addresses), per-service
environment variables (only KUBERNETES_SERVICE_HOST/PORT are set).
"""
from __future__ import annotations

import base64
import datetime
import json
import os
import queue
import re
import shlex
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import testbed as tbmod

from .controlplane import CLUSTER_DOMAIN, ControlPlane, die_with_parent, end_process, free_port

KUBELET_VERSION = "v1.37.2"
POLL_S = 0.3
LEASE_S = 5.0
BACKOFF_S, BACKOFF_MAX_S = 10.0, 300.0
#: Mount points that would hide what every host runs on (the machine's own system).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev", "/root", "/work",
               "/boot")
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

def pod_mounts(pod: dict) -> dict[str, dict]:
    """A pod's volume mounts by path, outermost first (the first container naming a path wins)."""
    mounts: dict[str, dict] = {}
    for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
        for m in c.get("volumeMounts", []):
            mounts.setdefault(m["mountPath"], m)
    return dict(sorted(mounts.items()))


def mount_points(pod: dict) -> list[str]:
    """Every path the node runner mounts over for a pod's volumes: each volume at its exact path,
    never a directory above it (a tmpfs over /var for the service-account token at
    /var/run/secrets/... hid a checkout under /var/tmp, its virtualenv with it, from the pods)."""
    return list(pod_mounts(pod))


_PROBE = r"""
import json, socket, sys, urllib.request
check = json.loads(sys.argv[1])
try:
    if check["kind"] == "tcp":
        socket.create_connection((check["host"], check["port"]), timeout=check["timeout"]).close()
    else:
        req = urllib.request.Request(check["url"], headers=check["headers"])
        with urllib.request.urlopen(req, timeout=check["timeout"]) as r:
            if not 200 <= r.status < 400:
                sys.exit("HTTP %d" % r.status)
except Exception as exc:
    sys.exit(repr(exc))
"""


def now_iso(t: float | None = None) -> str:
    return datetime.datetime.fromtimestamp(time.time() if t is None else t, datetime.timezone.utc) \
        .strftime("%Y-%m-%dT%H:%M:%SZ")


def quantity(value) -> float:
    """A Kubernetes quantity as a number ("500m" -> 0.5, "1Gi" -> 1073741824)."""
    text = str(value).strip()
    binary = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    decimal = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    for suffix, factor in binary.items():
        if text.endswith(suffix):
            return float(text[:-2]) * factor
    if text and text[-1] in decimal:
        return float(text[:-1]) * decimal[text[-1]]
    return float(text)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined name is replaced, `$$` is a literal `$`,
    anything else stays as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


@dataclass
class Image:
    """What a container of this image sees: `path` first on PATH (e.g. a virtualenv's bin), the
    image's ENTRYPOINT and CMD, and its own environment."""
    path: list[str]
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Node:
    """A Node object: its name, capacity (cpu, memory, nvidia.com/gpu, ...), labels and taints."""
    name: str
    capacity: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict] = field(default_factory=list)


class Api:
    """The API server as the kubelet sees it (REST, JSON)."""

    def __init__(self, cp: ControlPlane):
        tls = ssl.create_default_context(cafile=cp.pki["ca.crt"])
        tls.load_cert_chain(cp.pki["admin.crt"], cp.pki["admin.key"])
        self.http = httpx.Client(base_url=cp.server, verify=tls, timeout=15)

    def __call__(self, method: str, path: str, body=None, *, ok=(200, 201), patch: bool = False):
        headers = {"Content-Type": "application/merge-patch+json"} if patch else {}
        r = self.http.request(method, path, content=None if body is None else json.dumps(body), headers=headers)
        if r.status_code not in ok:
            raise RuntimeError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def get(self, path: str):
        return self(method="GET", path=path, ok=(200, 404))


class ContainerRun:
    """One container of a pod: its process and what the kubelet reports of it."""

    def __init__(self, spec: dict, init: bool):
        self.spec, self.name, self.init = spec, spec["name"], init
        self.sidecar = init and spec.get("restartPolicy") == "Always"
        self.proc = None
        self.state: dict = {"waiting": {"reason": "PodInitializing"}}
        self.last_state: dict = {}
        self.restarts = 0
        self.started_at = 0.0
        self.next_start = 0.0
        self.ready = False
        self.started = False  # the startup probe passed (or there is none)
        self.probes: dict[str, "Probe"] = {}
        self.env: dict[str, str] = {}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.running()

    def status(self, image: str) -> dict:
        out = {"name": self.name, "image": image, "imageID": "", "ready": self.ready, "started": self.started,
               "restartCount": self.restarts, "state": self.state, "lastState": self.last_state}
        if self.proc is not None or "terminated" in self.state:
            out["containerID"] = f"noderunner://{self.name}-{self.restarts}"
        return out


class Probe:
    """One probe of one container: runs on the pod's host every periodSeconds, counts
    successes and failures against the thresholds, as the kubelet's prober does."""

    def __init__(self, kind: str, spec: dict):
        self.kind, self.spec = kind, spec
        self.period = spec.get("periodSeconds", 10)
        self.timeout = spec.get("timeoutSeconds", 1)
        self.success_needed = spec.get("successThreshold", 1)
        self.failures_allowed = spec.get("failureThreshold", 3)
        self.proc = None
        self.started = 0.0
        self.next_at = 0.0
        self.successes = self.failures = 0
        self.result: bool | None = None  # None: not decided yet

    def reset(self, started_at: float) -> None:
        self.proc, self.successes, self.failures, self.result = None, 0, 0, None
        self.next_at = started_at + self.spec.get("initialDelaySeconds", 0)


class PodRun:
    """One bound pod on one testbed host."""

    def __init__(self, runner: "NodeRunner", pod: dict, host: int):
        self.runner, self.pod, self.host = runner, pod, host
        meta = pod["metadata"]
        self.name, self.ns, self.uid = meta["name"], meta["namespace"], meta["uid"]
        self.started_at = time.time()
        self.inits = [ContainerRun(c, True) for c in pod["spec"].get("initContainers", [])]
        self.containers = [ContainerRun(c, False) for c in pod["spec"]["containers"]]
        self.init_index = 0
        self.volumes_ready = False
        self.phase, self.reason, self.message = "Pending", None, None
        self.deleting_since: float | None = None
        self.host_freed = False  # its processes ended and its host went back to the pool
        self.written = None
        self.dir = runner.state / self.ns / self.name
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.dir / "netns").write_text(f"/run/netns/{runner.tb.hosts[host].netns}\n")

    @property
    def ip(self) -> str:
        return self.runner.tb.hosts[self.host].ip

    # ------------------------------------------------------------ status

    def conditions(self) -> list[dict]:
        t = now_iso(self.started_at)
        initialized = self.init_index >= len(self.inits)
        ready = self.phase == "Running" and all(c.ready for c in self.containers) and \
            all(c.ready for c in self.inits if c.sidecar)

        def cond(kind, ok, reason=None):
            c = {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None, "lastTransitionTime": t}
            if reason and not ok:
                c["reason"] = reason
            return c
        scheduled = next((c for c in self.pod.get("status", {}).get("conditions", [])
                          if c["type"] == "PodScheduled"), {"type": "PodScheduled", "status": "True"})
        return [cond("PodReadyToStartContainers", self.volumes_ready),
                cond("Initialized", initialized, "ContainersNotInitialized"),
                cond("Ready", ready, "ContainersNotReady"),
                cond("ContainersReady", ready, "ContainersNotReady"), scheduled]

    def status(self) -> dict:
        images = {c["name"]: c.get("image", "") for c in
                  self.pod["spec"].get("initContainers", []) + self.pod["spec"]["containers"]}
        status = {"phase": self.phase, "conditions": self.conditions(), "hostIP": "127.0.0.1",
                  "hostIPs": [{"ip": "127.0.0.1"}], "podIP": self.ip, "podIPs": [{"ip": self.ip}],
                  "startTime": now_iso(self.started_at), "qosClass": self.pod.get("status", {}).get("qosClass"),
                  "initContainerStatuses": [c.status(images[c.name]) for c in self.inits],
                  "containerStatuses": [c.status(images[c.name]) for c in self.containers]}
        if self.reason:
            status["reason"] = self.reason
        if self.message:
            status["message"] = self.message
        return status

    def write(self) -> None:
        status = self.status()
        if status != self.written:
            self.runner.api("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status", {"status": status},
                            patch=True, ok=(200, 404))
            self.written = status

    # ------------------------------------------------------------ environment

    def field(self, path: str) -> str:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        simple = {"metadata.name": self.name, "metadata.namespace": self.ns, "metadata.uid": self.uid,
                  "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": "127.0.0.1",
                  "status.hostIPs": "127.0.0.1", "spec.nodeName": spec.get("nodeName", ""),
                  "spec.serviceAccountName": spec.get("serviceAccountName", "default")}
        if path in simple:
            return simple[path]
        m = re.match(r"^metadata\.(labels|annotations)\['(.+)'\]$", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        if path in ("metadata.labels", "metadata.annotations"):
            items = meta.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
        raise ValueError(f"fieldRef {path} is not supported by the node runner")

    def resource_field(self, ref: dict, container: dict) -> str:
        name = ref.get("containerName") or container["name"]
        spec = next(c for c in self.pod["spec"]["containers"] + self.pod["spec"].get("initContainers", [])
                    if c["name"] == name)
        kind, res = ref["resource"].split(".", 1)
        value = (spec.get("resources", {}).get(kind) or {}).get(res)
        if value is None:  # unset: the node's allocatable
            value = self.runner.node_of(self.pod).capacity.get(res, "0")
        divisor = quantity(ref.get("divisor", "1"))
        return str(int(-(-quantity(value) // divisor)))

    def ref_value(self, kind: str, ref: dict) -> str | None:
        obj = self.runner.api.get(f"/api/v1/namespaces/{self.ns}/{kind}s/{ref['name']}")
        if obj is None or obj.get("kind") == "Status":
            if ref.get("optional"):
                return None
            raise LookupError(f'{kind} "{ref["name"]}" not found')
        data = obj.get("data") or {}
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise LookupError(f"couldn't find key {ref['key']} in {kind.capitalize()} {ref['name']}")
        return base64.b64decode(data[ref["key"]]).decode() if kind == "secret" else data[ref["key"]]

    def env(self, container: dict, image: Image) -> dict[str, str]:
        """What the container's process gets: the image's environment, the kubelet's own
        variables, then envFrom and env in order (later wins), with `$(VAR)` expanded."""
        env = {"PATH": ":".join([*image.path, "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin",
                                 "/sbin", "/bin"]), "HOME": "/root", "LANG": "C.UTF-8", **image.env,
               "HOSTNAME": self.name, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
               # names resolve through the hosts file (no cluster DNS here); gRPC's default resolver
               # (c-ares) asks a nameserver only, so gRPC is told to use the system's
               "GRPC_DNS_RESOLVER": "native"}
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            for kind in ("configMap", "secret"):
                ref = source.get(f"{kind}Ref")
                if ref:
                    obj = self.runner.api.get(f"/api/v1/namespaces/{self.ns}/{kind.lower()}s/{ref['name']}")
                    if obj is None or obj.get("kind") == "Status":
                        if ref.get("optional"):
                            continue
                        raise LookupError(f'{kind.lower()} "{ref["name"]}" not found')
                    for k, v in (obj.get("data") or {}).items():
                        env[prefix + k] = base64.b64decode(v).decode() if kind == "secret" else v
        for entry in container.get("env", []):
            if "valueFrom" not in entry:
                env[entry["name"]] = expand(str(entry.get("value", "")), env)
                continue
            source = entry["valueFrom"]
            if "fieldRef" in source:
                value = self.field(source["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in source:
                value = self.resource_field(source["resourceFieldRef"], container)
            elif "secretKeyRef" in source:
                value = self.ref_value("secret", source["secretKeyRef"])
            elif "configMapKeyRef" in source:
                value = self.ref_value("configmap", source["configMapKeyRef"])
            else:
                raise ValueError(f"env {entry['name']}: {source} is not supported by the node runner")
            if value is not None:
                env[entry["name"]] = value
        return env

    # ------------------------------------------------------------ volumes

    def volume_files(self, volume: dict) -> dict[str, tuple[bytes, int]] | None:
        """The files a configMap, secret, projected or downwardAPI volume shows, each with its
        mode (an item's `mode`, else the volume's `defaultMode`, else 0644); None when a source
        it needs is missing (the pod waits, as on a node)."""
        spec_of = volume.get("configMap") or volume.get("secret") or volume.get("downwardAPI") or \
            volume.get("projected") or {}
        default_mode = spec_of.get("defaultMode", 0o644)

        def items(data: dict, spec: dict) -> dict[str, tuple[bytes, int]]:
            chosen = spec.get("items") or [{"key": k, "path": k} for k in sorted(data)]
            return {i["path"]: (data[i["key"]], i.get("mode", default_mode)) for i in chosen if i["key"] in data}

        def object_files(kind: str, spec: dict) -> dict[str, bytes] | None:
            name = spec.get("name") or spec.get("secretName")
            obj = self.runner.api.get(f"/api/v1/namespaces/{self.ns}/{kind}s/{name}")
            if obj is None or obj.get("kind") == "Status":
                return {} if spec.get("optional") else None
            if kind == "secret":
                data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            else:
                data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
                data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
            return items(data, spec)

        def downward(spec: dict) -> dict[str, tuple[bytes, int]]:
            return {i["path"]: (self.field(i["fieldRef"]["fieldPath"]).encode(), i.get("mode", default_mode))
                    for i in spec.get("items", []) if "fieldRef" in i}

        if "configMap" in volume:
            return object_files("configmap", volume["configMap"])
        if "secret" in volume:
            return object_files("secret", volume["secret"])
        if "downwardAPI" in volume:
            return downward(volume["downwardAPI"])
        out: dict[str, tuple[bytes, int]] = {}
        for source in volume["projected"].get("sources", []):
            if "configMap" in source or "secret" in source:
                kind = "configmap" if "configMap" in source else "secret"
                files = object_files(kind, source.get("configMap") or source.get("secret"))
                if files is None:
                    return None
                out.update(files)
            elif "downwardAPI" in source:
                out.update(downward(source["downwardAPI"]))
            elif "serviceAccountToken" in source:
                sa = self.pod["spec"].get("serviceAccountName", "default")
                token = self.runner.api("POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token",
                                        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                         "spec": {"expirationSeconds": source["serviceAccountToken"].get(
                                             "expirationSeconds", 3607)}})
                out[source["serviceAccountToken"]["path"]] = (token["status"]["token"].encode(), default_mode)
        return out

    def claim_dir(self, claim: str) -> str | None:
        pvc = self.runner.api.get(f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{claim}")
        if pvc is None or pvc.get("kind") == "Status" or pvc.get("status", {}).get("phase") != "Bound":
            return None
        pv = self.runner.api.get(f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
        return (pv.get("spec", {}).get("hostPath") or {}).get("path") if pv else None

    def setup_volumes(self) -> str | None:
        """Mount the pod's volumes on its host; the reason it cannot start yet, or None."""
        script = ["set -e", f"hostname {shlex.quote(self.name)}"]
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        mounts = pod_mounts(self.pod)
        plan: list[tuple[str | None, str]] = []  # what the script mounts, for tests/testbed.py check_plan
        for path, mount in mounts.items():
            volume, target = volumes[mount["name"]], shlex.quote(path)
            if path.startswith(SYSTEM_DIRS) and path != "/dev/shm":
                return f"a volume at {path} would hide the machine's own system (node runner)"
            sub = mount.get("subPath", "")
            if any(k in volume for k in ("configMap", "secret", "projected", "downwardAPI")):
                files = self.volume_files(volume)
                if files is None:
                    return f"MountVolume.SetUp failed for volume {mount['name']!r}: its source is not found"
                staged = self.dir / "volumes" / mount["name"]
                for rel, (data, mode) in files.items():
                    dest = staged / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
                    dest.chmod(mode)
                source = staged / sub
            elif "emptyDir" in volume:
                size = volume["emptyDir"].get("sizeLimit")
                source = self.dir / "volumes" / mount["name"]
                if not source.is_dir():
                    source.mkdir(parents=True)
                    opts = f"-o size={int(quantity(size))}" if size else ""
                    script.append(f"mount -t tmpfs {opts} tmpfs {shlex.quote(str(source))}")
                    plan.append((None, str(source)))
                source = source / sub
            elif "persistentVolumeClaim" in volume or "hostPath" in volume:
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                base = self.claim_dir(claim) if claim else volume["hostPath"]["path"]
                if base is None:
                    return f'persistentvolumeclaim "{claim}" is not bound to a hostPath PersistentVolume'
                source = Path(base) / sub
                Path(source).mkdir(parents=True, exist_ok=True)
            else:
                return f"volume {mount['name']}: {sorted(volume)} is not supported by the node runner"
            # at the exact path, as a runtime mounts into a container: an empty mount point on this
            # machine's disk at most, the volume's content never (it is staged, or a tmpfs, or the claim's)
            script += [f"mkdir -p {target}", f"mount --bind {shlex.quote(str(source))} {target}"]
            plan.append((str(source), path))
            if mount.get("readOnly"):
                script.append(f"mount -o remount,bind,ro {target}")
        what = f"pod {self.ns}/{self.name}'s volumes (tests/kube/noderunner.py setup_volumes)"
        tbmod.check_plan(plan, what)
        self.runner.tb.sh(self.host, " && ".join(script))
        self.runner.tb.check_sees(self.host, what)
        return None

    # ------------------------------------------------------------ containers

    def start(self, c: ContainerRun) -> None:
        image = self.runner.images.get(c.spec.get("image", ""))
        if image is None:
            c.state = {"waiting": {"reason": "ErrImagePull",
                                   "message": f"image {c.spec.get('image')!r} is not known to the node runner"}}
            c.next_start = time.time() + BACKOFF_S
            return
        try:
            env = self.env(c.spec, image)
        except (LookupError, ValueError) as exc:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            c.next_start = time.time() + 2.0
            return
        command = [expand(a, env) for a in c.spec.get("command", [])] or image.entrypoint
        args = [expand(a, env) for a in c.spec.get("args", [])] if "args" in c.spec or c.spec.get("command") \
            else image.cmd
        argv = command + args
        if not argv:
            c.state = {"waiting": {"reason": "CreateContainerError", "message": "no command specified"}}
            return
        log = self.dir / "logs" / f"{c.name}.log"
        if log.exists():
            log.replace(self.dir / "logs" / f"{c.name}.previous.log")
        (self.dir / "logs" / f"{c.name}.exited").unlink(missing_ok=True)
        c.env = env
        c.proc = self.runner.tb.run(self.host, argv, env=env, cwd=c.spec.get("workingDir", "/"), log=log,
                                    name=f"{self.name}-{c.name}")
        c.started_at = time.time()
        c.state = {"running": {"startedAt": now_iso(c.started_at)}}
        c.ready = False
        c.probes = {kind: Probe(kind, c.spec[f"{kind}Probe"]) for kind in ("startup", "readiness", "liveness")
                    if c.spec.get(f"{kind}Probe")}
        for p in c.probes.values():
            p.reset(c.started_at)
        c.started = "startup" not in c.probes

    def reap(self, c: ContainerRun) -> int | None:
        if c.proc is None or c.proc.running():
            return None
        code = c.proc.returncode
        c.state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                  "startedAt": now_iso(c.started_at), "finishedAt": now_iso()}}
        c.proc, c.ready, c.started = None, False, False
        (self.dir / "logs" / f"{c.name}.exited").touch()
        return code

    def restart_later(self, c: ContainerRun) -> None:
        delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** c.restarts)
        c.restarts += 1
        c.last_state = c.state
        c.next_start = time.time() + delay
        c.state = {"waiting": {"reason": "CrashLoopBackOff",
                               "message": f"back-off {delay:.0f}s restarting failed container={c.name} pod={self.name}"}}

    def kill(self, c: ContainerRun) -> None:
        if c.proc is not None:
            c.proc.kill()
            c.proc.wait(15)

    def step(self) -> None:
        if self.deleting_since is not None or self.phase in ("Succeeded", "Failed"):
            return
        now = time.time()
        if not self.volumes_ready:
            reason = self.setup_volumes()
            if reason:
                self.reason, self.message = "FailedMount", reason
                return
            self.volumes_ready, self.reason, self.message = True, None, None
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.inits[:self.init_index]:
            if c.sidecar:
                self.keep_running(c, "Always", now)
        if self.init_index < len(self.inits):
            c = self.inits[self.init_index]
            if c.proc is None and "terminated" not in c.state and now >= c.next_start:
                self.start(c)
            if c.sidecar:
                self.probe(c, now)
                if c.running and c.started:
                    self.init_index += 1
                return
            code = self.reap(c)
            if code == 0:
                self.init_index += 1
            elif code is not None:
                if policy == "Never":
                    self.phase, self.reason = "Failed", "Init:Error"
                else:
                    self.restart_later(c)
            return
        for c in self.containers:
            self.keep_running(c, policy, now)
        if any(c.proc is not None or "waiting" in c.state for c in self.containers):
            self.phase = "Running" if any(c.proc is not None or c.restarts for c in self.containers) else "Pending"
        else:
            self.phase = "Succeeded" if all(c.state["terminated"]["exitCode"] == 0 for c in self.containers) \
                else "Failed"
            for c in self.inits:
                self.kill(c)

    def keep_running(self, c: ContainerRun, policy: str, now: float) -> None:
        if c.proc is None and "terminated" not in c.state and now >= c.next_start:
            self.start(c)  # also the retry after a config error, as the kubelet does
        code = self.reap(c)
        if code is not None and (policy == "Always" or (policy == "OnFailure" and code != 0)):
            self.restart_later(c)
        self.probe(c, now)

    # ------------------------------------------------------------ probes

    def probe(self, c: ContainerRun, now: float) -> None:
        if not c.running:
            c.ready = False
            return
        for kind, p in c.probes.items():
            if kind != "startup" and not c.started:
                continue
            if kind == "startup" and c.started:
                continue
            if p.proc is not None:
                if p.proc.running():
                    if now - p.started > p.timeout:
                        p.proc.kill()
                    continue
                ok = p.proc.returncode == 0
                p.proc = None
                p.successes, p.failures = (p.successes + 1, 0) if ok else (0, p.failures + 1)
                if p.successes >= (1 if kind != "readiness" else p.success_needed):
                    p.result = True
                elif p.failures >= p.failures_allowed:
                    p.result = False
                if kind == "startup" and p.result:
                    c.started = True
                elif kind == "readiness" and p.result is not None:
                    c.ready = p.result
                elif kind in ("startup", "liveness") and p.result is False:
                    self.kill(c)  # the kubelet restarts a container that failed these
                    return
            if p.proc is None and now >= p.next_at:
                p.next_at, p.started = now + p.period, now
                p.proc = self.run_probe(c, p)
        if "readiness" not in c.probes:
            c.ready = c.started

    def run_probe(self, c: ContainerRun, p: Probe):
        spec = p.spec
        if "exec" in spec:
            return self.runner.tb.run(self.host, spec["exec"]["command"], env=c.env, cwd="/",
                                      log=self.dir / "probes.log")
        if "httpGet" in spec:
            h = spec["httpGet"]
            url = f"{h.get('scheme', 'HTTP').lower()}://{h.get('host') or self.ip}:{self.port(c, h['port'])}" \
                  f"{h.get('path', '/')}"
            check = {"kind": "http", "url": url, "timeout": p.timeout,
                     "headers": {x["name"]: x["value"] for x in h.get("httpHeaders", [])}}
        elif "tcpSocket" in spec:
            check = {"kind": "tcp", "host": spec["tcpSocket"].get("host") or self.ip,
                     "port": self.port(c, spec["tcpSocket"]["port"]), "timeout": p.timeout}
        else:
            raise ValueError(f"probe {spec} is not supported by the node runner")
        return self.runner.tb.run(self.host, [*self.runner.python, "-c", _PROBE, json.dumps(check)], cwd="/",
                                  log=self.dir / "probes.log")

    @staticmethod
    def port(c: ContainerRun, port) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        return next(p["containerPort"] for p in c.spec.get("ports", []) if p.get("name") == port)

    # ------------------------------------------------------------ the end

    def end(self, grace: float) -> None:
        """Every process of the pod ended (SIGTERM, then the host's reboot after `grace`): the host
        boots afresh (new /tmp, /dev/shm, mounts) for the next pod; kube-streams no longer enters it."""
        began = time.time()
        for c in self.inits + self.containers:
            if c.proc is not None and c.proc.running():
                c.proc.send_signal()
        deadline = time.time() + min(grace, 30)
        while time.time() < deadline and any(c.running for c in self.inits + self.containers):
            time.sleep(0.1)
        left = [c.name for c in self.inits + self.containers if c.running]
        self.runner.note(f"pod {self.ns}/{self.name}: ended {time.time() - began:.1f}s after SIGTERM (grace {grace}s)"
                         + (f", {', '.join(left)} still running: the host goes down with it" if left else ""))
        (self.dir / "netns").unlink(missing_ok=True)
        self.runner.tb.reboot(self.host)


class NodeRunner:
    """Registers `nodes`, runs what the scheduler binds to them on the testbed's hosts
    (`pod_hosts`: their indexes; one pod per host at a time), keeps the hosts file's Service
    names, and serves logs and port-forward through kube-streams. Runs in a thread of its
    own until :meth:`stop`."""

    def __init__(self, cp: ControlPlane, tb, nodes: list[Node], images: dict[str, Image], pod_hosts: list[int]):
        self.cp, self.tb, self.nodes, self.images = cp, tb, {n.name: n for n in nodes}, images
        self.api = Api(cp)
        self.free = list(pod_hosts)
        self.pods: dict[str, PodRun] = {}  # uid -> run
        self.state = Path(tb.dir) / "kubelet"
        self.state.mkdir(parents=True, exist_ok=True)
        self.python = [sys.executable, "-I", "-S"]
        self.streams_port = free_port()
        self.log = self.state / "noderunner.log"
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="noderunner", daemon=True)
        self.heartbeat = threading.Thread(target=self._heartbeat, name="noderunner-leases", daemon=True)
        # Pods end on threads of their own, off the loop (a grace period must not stall every other
        # pod), one per host as each kubelet ends its own pods at the same time (a worker pod's Ray
        # takes its whole grace period once the head is gone: one after another, a cluster's `down`
        # took a minute). Long-lived threads: a host booted again dies with the thread that booted it.
        self.ending: queue.Queue = queue.Queue()
        self.freed: queue.Queue = queue.Queue()
        self.enders = [threading.Thread(target=self._ender, name=f"noderunner-ender-{i}", daemon=True)
                       for i in range(len(pod_hosts))]
        self.streams = None

    def note(self, text: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    def node_of(self, pod: dict) -> Node:
        return self.nodes[pod["spec"]["nodeName"]]

    def start(self) -> "NodeRunner":
        with open(self.state / "kube-streams.log", "ab") as out:
            self.streams = subprocess.Popen(
                [str(self.cp.bin / "kube-streams"), "-listen", f"127.0.0.1:{self.streams_port}",
                 "-state", str(self.state)], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent, start_new_session=True)
        for node in self.nodes.values():
            self.register(node)
        for thread in (self.heartbeat, *self.enders, self.thread):
            thread.start()
        return self

    def register(self, node: Node) -> None:
        labels = {"kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                  **node.labels}
        self.api("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                           "metadata": {"name": node.name, "labels": labels},
                                           "spec": {"taints": node.taints}}, ok=(201, 409))
        capacity = {"pods": "110", **node.capacity}
        t = now_iso()
        self.api("PATCH", f"/api/v1/nodes/{node.name}/status", {"status": {
            "capacity": capacity, "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": node.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.streams_port}},
            "nodeInfo": {"kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "noderunner://1",
                         "osImage": "rlhf-tasks node runner", "kernelVersion": os.uname().release,
                         "machineID": node.name, "systemUUID": node.name, "bootID": node.name},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "the node runner is posting ready status",
                            "lastHeartbeatTime": t, "lastTransitionTime": t}]}}, patch=True)
        self.renew_lease(node.name)

    def renew_lease(self, name: str) -> None:
        """The node's heartbeat: its Lease in kube-node-lease, renewed every LEASE_S."""
        t = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": t}
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        if self.api("PATCH", f"{path}/{name}", {"spec": spec}, patch=True, ok=(200, 404)).get("kind") == "Status":
            self.api("POST", path, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                    "metadata": {"name": name, "namespace": "kube-node-lease"}, "spec": spec},
                     ok=(201, 409))

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.sync()
            except BaseException as exc:  # noqa: BLE001 - kept for the test to see
                self.note(f"error: {exc!r}")
                self.error = exc
            self.stopping.wait(POLL_S)

    def _heartbeat(self) -> None:
        while not self.stopping.wait(LEASE_S):
            for name in self.nodes:
                try:
                    self.renew_lease(name)
                except Exception as exc:  # noqa: BLE001 - the next beat tries again
                    self.note(f"renewing the lease of {name}: {exc!r}")

    def _ender(self) -> None:
        """End pods handed over by the loop: (run, grace, delete): its processes, then (deleted
        through the API) the kubelet's final delete; its host goes back to the pool."""
        while True:
            run, grace, delete = self.ending.get()
            if run is None:
                return
            try:
                run.end(grace)
                if delete:
                    self.api("DELETE", f"/api/v1/namespaces/{run.ns}/pods/{run.name}",
                             {"gracePeriodSeconds": 0, "preconditions": {"uid": run.uid}}, ok=(200, 404, 409))
                    subprocess.run(["rm", "-rf", str(run.dir)], check=False)
            except Exception as exc:  # noqa: BLE001 - said, and the host is not lost
                self.note(f"ending pod {run.ns}/{run.name}: {exc!r}")
            self.freed.put(run.host)

    def sync(self) -> None:
        while not self.freed.empty():
            self.free.append(self.freed.get())
        listed = self.api("GET", "/api/v1/pods")["items"]
        mine = {p["metadata"]["uid"]: p for p in listed if p["spec"].get("nodeName") in self.nodes}
        for uid, run in list(self.pods.items()):
            pod = mine.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                if pod is not None:
                    run.pod = pod
                self.remove(run, delete=pod is not None)
        for uid, pod in mine.items():
            if uid in self.pods or pod["metadata"].get("deletionTimestamp"):
                continue
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue  # ran here before (a restart of the runner is not played)
            if not self.free:
                self.note(f"no free host for pod {pod['metadata']['namespace']}/{pod['metadata']['name']}")
                continue
            run = PodRun(self, pod, self.free.pop(0))
            self.pods[uid] = run
            self.note(f"pod {run.ns}/{run.name} on host {self.tb.hosts[run.host].name} ({run.ip})")
        self.update_names()
        for uid, run in list(self.pods.items()):
            run.pod = {**mine[uid], "status": mine[uid].get("status", {})}
            run.step()
            run.write()
            if run.phase in ("Succeeded", "Failed") and not run.host_freed:
                run.host_freed = True  # nothing runs on it any more: its host serves the next pod
                self.ending.put((run, 0, False))

    def remove(self, run: PodRun, delete: bool) -> None:
        """A pod deleted through the API: its processes end within its grace period, then the
        kubelet's final delete (grace 0) lets the API server forget it."""
        self.pods.pop(run.uid, None)
        self.note(f"pod {run.ns}/{run.name} deleted")
        run.deleting_since = time.time()
        if run.host_freed:
            self.api("DELETE", f"/api/v1/namespaces/{run.ns}/pods/{run.name}",
                     {"gracePeriodSeconds": 0, "preconditions": {"uid": run.uid}}, ok=(200, 404, 409))
            subprocess.run(["rm", "-rf", str(run.dir)], check=False)
            return
        run.host_freed = True
        self.ending.put((run, run.pod["metadata"].get("deletionGracePeriodSeconds") or 0, delete))

    def update_names(self) -> None:
        """Pod names and Service names (`svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local`)
        resolve on every host: a Service to the first address its EndpointSlices list."""
        by_ip = {self.tb.hosts[r.host].ip: r.host for r in self.pods.values()}
        names = {r.name: r.host for r in self.pods.values()}
        slices = self.api("GET", "/apis/discovery.k8s.io/v1/endpointslices")["items"]
        for s in slices:
            svc = (s["metadata"].get("labels") or {}).get("kubernetes.io/service-name")
            ns = s["metadata"]["namespace"]
            ips = [a for e in s.get("endpoints") or [] for a in e.get("addresses", [])
                   if (e.get("conditions") or {}).get("ready") is not False or
                   (e.get("conditions") or {}).get("serving")]
            host = next((by_ip[ip] for ip in ips if ip in by_ip), None)
            if svc and host is not None:
                for alias in (svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.{CLUSTER_DOMAIN}"):
                    names.setdefault(alias, host)
        self.tb.set_aliases(names)

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(30)
        for run in list(self.pods.values()):
            if not run.host_freed:
                run.host_freed = True
                self.ending.put((run, 0, False))
        self.pods.clear()
        for _ in self.enders:
            self.ending.put((None, 0, False))
        for ender in self.enders:
            if ender.is_alive():
                ender.join(120)
        if self.streams is not None:
            end_process(self.streams)
