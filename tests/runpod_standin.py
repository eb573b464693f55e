"""A local stand-in for the part of RunPod's REST API v2 that rlhf-tasks uses.

An HTTP server on 127.0.0.1 (a free port) that answers like https://api.runpod.io/v2:
pods (create, get, list, action, delete, logs as Server-Sent Events), Instant Clusters
(create, get, list, member pods, delete), the catalog (data centers, GPU types) and the
account's secrets (create, list, delete; the value write-only, never returned, and put in a
pod's environment where it says ``{{ RUNPOD_SECRET_<name> }}`` when the pod boots).

It cannot drift from the real API: every request body is validated against RunPod's
own request schema from its OpenAPI document (tests/data/runpod-openapi-v2.json) and
refused with 422 problem+json naming the failing path, as RunPod does; every response
it sends is validated against the documented response schema for that operation and
status (top-level fields strict: nothing undocumented), and a response of its own that
does not match is replaced by a 500 and recorded in ``standin.errors`` for the test.

Pods have RunPod's lifecycle: created PROVISIONING, then STARTING while the pod
runner starts the container, RUNNING while it runs, EXITED when it ends, TERMINATED
(and gone from the list) after terminate/DELETE. What a pod runs is up to a pluggable
runner: :class:`ProcessRunner` (a local process, for fast client tests) or
:class:`TestbedRunner` (a host of a tests/testbed.py Testbed, with
``<podId>.runpod.internal`` resolving to it, and for Instant Clusters an ``ens1``
overlay interface). Both run what the container would: the image's entrypoint with
``args`` split into words like a shell does (RunPod's ``args`` are "Arguments passed
to the container entrypoint"; quotes group words, nothing is expanded), in the
environment RunPod sets inside a pod.

Faults for tests: fail the Nth create (also after it was made), 429 with Retry-After for
the next K requests, 5xx for the next K requests, 401/403 for everything, 400 (no capacity)
or 403 (pool not accessible) for creates in chosen data centers.

Where the document leaves behaviour open, the stand-in plays its least convenient reading
by default, and a test may switch each one (see :class:`RunPodStandIn`): no keep-alive
comments on a log stream; event ids that are plain timestamps (whole seconds, like the
document's example) with a resume that starts after (or, switched, at) that timestamp; a
log stream that ends cleanly every few seconds while the pod runs; ``dataCenterId: null``
while a pod is PROVISIONING; a create that tries only the first of ``dataCenterIds``;
stock per product (pods and Instant Clusters differ).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from jsonschema import Draft202012Validator, FormatChecker
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

OPENAPI = Path(__file__).parent / "data" / "runpod-openapi-v2.json"
DOC_URI = "urn:runpod:openapi-v2"
OVERLAY_PREFIX = "10.78"  # Instant Cluster overlay: 10.78.<cluster>.<10+rank>/24 (testbed uses 10.77.0)
GLOBAL_PREFIX = "10.65"  # Global Networking addresses when the runner has none of its own
PRIMARY_PORT = 29500     # RunPod says "all ports are available"; torch's usual one


def now_rfc3339(t: float | None = None, digits: int = 3) -> str:
    """RFC 3339 in UTC with ``digits`` fraction digits (0: whole seconds)."""
    t = time.time() if t is None else t
    text = datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")
    return (text[:20 + digits] if digits else text[:19]) + "Z"


def parse_rfc3339(value: str) -> datetime:
    """An RFC 3339 date-time (any fraction digits); ValueError when it is not one."""
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", value)
    if match is None:
        raise ValueError(f"{value!r} is not an RFC 3339 date-time")
    base, fraction, zone = match.groups()
    micro = ((fraction or ".")[1:] + "000000")[:6]
    return datetime.fromisoformat(f"{base}.{micro}{'+00:00' if zone == 'Z' else zone}")


def _new_id() -> str:
    """RunPod-like id: 14 lowercase letters and digits (e.g. gfj8b292vyg08g)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(14))


# --------------------------------------------------------------------------- contract


_FORMATS = FormatChecker(formats=())


@_FORMATS.checks("date-time", raises=ValueError)
def _is_datetime(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$", value):
        raise ValueError(f"{value!r} is not an RFC 3339 date-time")
    datetime.fromisoformat(value.replace("Z", "+00:00"))
    return True


def _json_path(path) -> str:
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


class Contract:
    """RunPod's OpenAPI document, with 2020-12 validators for its schemas."""

    def __init__(self, path: Path = OPENAPI):
        self.doc = json.loads(Path(path).read_text())
        resource = Resource.from_contents(self.doc, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(DOC_URI, resource)
        self._validators: dict[tuple[str, bool], Draft202012Validator] = {}

    def schema(self, name: str) -> dict:
        return self.doc["components"]["schemas"][name]

    def errors(self, ref: str, instance: Any, strict: bool = False) -> list[str]:
        """Violations of schema ``ref`` ("#/components/schemas/Pod" or a bare name), as
        "$.path: message". ``strict``: no top-level property the schema does not name,
        and the same for the items of a list response."""
        if not ref.startswith("#"):
            ref = f"#/components/schemas/{ref}"
        errors = []
        for e in self._validator(ref, strict).iter_errors(instance):
            message = e.message
            if e.validator == "unevaluatedProperties" and isinstance(e.instance, dict):
                # 2020-12 counts the properties of a failing subschema as unevaluated too:
                # name only those the schema does not declare (the others failed elsewhere)
                unknown = sorted(k for k in e.instance if k not in self._declared(e.schema))
                if not unknown:
                    continue
                names = ", ".join(map(repr, unknown))
                message = (f"Unevaluated properties are not allowed ({names} "
                           f"{'was' if len(unknown) == 1 else 'were'} unexpected)")
            errors.append(f"{_json_path(e.absolute_path)}: {message}")
        if strict and isinstance(instance, dict):
            for prop, item_ref in self._list_items(ref).items():
                for i, item in enumerate(instance.get(prop) or []):
                    errors += [f"$.{prop}[{i}]{e[1:]}" for e in self.errors(item_ref, item, True)]
        return errors

    def _declared(self, schema: Any) -> set[str]:
        """Property names a schema declares, through $ref and allOf/anyOf/oneOf."""
        if not isinstance(schema, dict):
            return set()
        names = set(schema.get("properties") or {})
        if "$ref" in schema:
            node = self.doc
            for part in schema["$ref"].split("#", 1)[1].strip("/").split("/"):
                node = node[part]
            names |= self._declared(node)
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in schema.get(key) or []:
                names |= self._declared(sub)
        return names

    def _validator(self, ref: str, strict: bool) -> Draft202012Validator:
        key = (ref, strict)
        if key not in self._validators:
            schema: dict = {"$ref": DOC_URI + ref}
            if strict:
                schema["unevaluatedProperties"] = False
            self._validators[key] = Draft202012Validator(schema, registry=self.registry,
                                                         format_checker=_FORMATS)
        return self._validators[key]

    def _list_items(self, ref: str) -> dict[str, str]:
        """{property: item schema ref} for array-of-$ref properties (ListPodsResponse.pods)."""
        node = self.doc
        for part in ref.lstrip("#/").split("/"):
            node = node[part]
        out = {}
        for prop, sub in (node.get("properties") or {}).items():
            items = sub.get("items") if sub.get("type") == "array" else None
            if isinstance(items, dict) and "$ref" in items:
                out[prop] = items["$ref"]
        return out

    def operation(self, method: str, template: str) -> dict:
        return self.doc["paths"][template][method.lower()]

    def query_parameters(self, method: str, template: str) -> dict[str, tuple[dict, str]]:
        """{name: (parameter, JSON pointer of its schema)} for the operation's query parameters
        (the path item's and the operation's own, `$ref`s followed)."""
        escaped = template.replace("~", "~0").replace("/", "~1")
        found = {}
        for where, params in ((f"/paths/{escaped}", self.doc["paths"][template].get("parameters") or []),
                              (f"/paths/{escaped}/{method.lower()}", self.operation(method, template).get("parameters")
                               or [])):
            for i, param in enumerate(params):
                pointer = f"{where}/parameters/{i}"
                if "$ref" in param:
                    pointer = param["$ref"].split("#", 1)[1]
                    param = self._node(pointer)
                if param.get("in") == "query":
                    found[param["name"]] = (param, f"#{pointer}/schema")
        return found

    def query_errors(self, method: str, template: str, query: dict[str, list[str]]) -> list[str]:
        """Violations of the operation's query `parameters` by a parsed query string (`parse_qs`
        with blank values kept): an unknown name, a repeated one, or a value its schema refuses,
        read as OpenAPI's default serialization says (`style: form`, `explode: false` for
        arrays: one comma-separated value; integers and booleans as their JSON text)."""
        known = self.query_parameters(method, template)
        errors = []
        for name, values in query.items():
            if name not in known:
                errors.append(f"query.{name}: unknown query parameter (this operation takes "
                              f"{', '.join(sorted(known)) or 'none'})")
                continue
            if len(values) != 1:
                errors.append(f"query.{name}: given {len(values)} times (once, comma-separated for a list)")
                continue
            param, ref = known[name]
            value = self._query_value(param.get("schema") or {}, values[0])
            errors += [f"query.{name}{e[1:]}" for e in self.errors(ref, value)]
        return errors

    def _query_value(self, schema: dict, text: str) -> Any:
        """A query string's value as the JSON its schema describes; left a string where it does
        not parse, so that the schema says what is wrong with it."""
        if schema.get("type") == "array":
            item = schema.get("items") or {}
            return [self._query_value(item, part) for part in text.split(",")] if text else []
        kind = schema.get("type")
        if kind == "boolean" and text in ("true", "false"):
            return text == "true"
        if kind == "integer" and re.fullmatch(r"-?\d+", text):
            return int(text)
        return text

    def _node(self, pointer: str) -> Any:
        node = self.doc
        for part in pointer.strip("/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def request_ref(self, method: str, template: str) -> str | None:
        body = self.operation(method, template).get("requestBody")
        if not body:
            return None
        return body["content"]["application/json"]["schema"]["$ref"]

    def response(self, method: str, template: str, status: int) -> dict | None:
        """The documented response object for this status (or ``default``), refs resolved."""
        responses = self.operation(method, template)["responses"]
        resp = responses.get(str(status)) or responses.get("default")
        if resp and "$ref" in resp:
            resp = self.doc["components"]["responses"][resp["$ref"].rsplit("/", 1)[1]]
        return resp


# --------------------------------------------------------------------------- catalog


@dataclass
class Catalog:
    """What GET /catalog/* answers, in RunPod's own shapes, plus the stock that decides
    placement: ``stock[(gpu id, data center id)]`` is NONE|LOW|MEDIUM|HIGH (missing: NONE)
    for pods, ``cluster_stock`` the same for Instant Clusters (RunPod: "the same GPU type can
    be scarce for pods and plentiful for serverless, so the context has to be stated")."""
    datacenters: list[dict]
    gpus: list[dict]
    stock: dict[tuple[str, str], str] = field(default_factory=dict)
    cluster_stock: dict[tuple[str, str], str] = field(default_factory=dict)

    def gpu(self, gpu_id: str) -> dict | None:
        return next((g for g in self.gpus if g["id"] == gpu_id), None)

    def datacenter(self, dc_id: str) -> dict | None:
        return next((d for d in self.datacenters if d["id"] == dc_id), None)

    def level(self, gpu_id: str, dc_id: str, product: str = "POD") -> str:
        stock = self.cluster_stock if product == "CLUSTER" else self.stock
        return stock.get((gpu_id, dc_id), "NONE")


H100 = "NVIDIA H100 80GB HBM3"
A40 = "NVIDIA A40"
MI300X = "AMD Instinct MI300X OAM"


def default_catalog() -> Catalog:
    """Two data centers with Global Networking, one without; H100s, A40s and an AMD GPU."""
    def dc(dc_id, name, region, global_network):
        return {"id": dc_id, "name": name, "region": region, "globalNetwork": global_network,
                "networkVolumeTypes": ["STANDARD"], "compliance": ["SOC_2_TYPE_2"]}

    def gpu(gpu_id, name, maker, memory, secure, community, max_secure, max_community):
        return {"id": gpu_id, "name": name, "pool": None, "manufacturer": maker,
                "memory": memory, "secure": True, "community": True,
                "price": {"secure": secure, "community": community},
                "maxCount": {"secure": max_secure, "community": max_community}}

    return Catalog(
        datacenters=[dc("EU-RO-1", "EU Romania 1", "EUROPE", True),
                     dc("US-KS-2", "US Kansas 2", "NORTH_AMERICA", True),
                     dc("CA-MTL-1", "CA Montreal 1", "NORTH_AMERICA", False)],
        gpus=[gpu(H100, "H100 SXM", "NVIDIA", 80, 2.69, 1.99, 8, 8),
              gpu(A40, "A40", "NVIDIA", 48, 0.40, 0.35, 10, 8),
              gpu(MI300X, "MI300X", "AMD", 192, 2.49, 2.49, 8, 8)],
        stock={(H100, "EU-RO-1"): "HIGH", (H100, "US-KS-2"): "LOW", (H100, "CA-MTL-1"): "HIGH",
               (A40, "EU-RO-1"): "MEDIUM", (A40, "CA-MTL-1"): "HIGH",
               (MI300X, "EU-RO-1"): "HIGH"},
        # Instant Clusters: where pods are plentiful, clusters need not be (and the other way)
        cluster_stock={(H100, "EU-RO-1"): "HIGH", (H100, "US-KS-2"): "MEDIUM",
                       (A40, "EU-RO-1"): "HIGH", (A40, "CA-MTL-1"): "NONE"})


# --------------------------------------------------------------------------- runners


@dataclass
class ClusterInfo:
    """What a runner needs to know about an Instant Cluster member it starts."""
    id: str
    rank: int
    size: int
    ip: str             # this pod's overlay address (NODE_ADDR), on interface ens1
    prefix_len: int
    primary_ip: str
    primary_port: int
    gpus_per_pod: int


class PodRunner(Protocol):
    """Runs a pod's container. ``status`` is ("starting"|"running"|"exited", exit code)."""

    def start(self, pod_id: str, env: dict[str, str], args: str | None, image: str,
              cluster: ClusterInfo | None) -> Any: ...
    def status(self, handle: Any) -> tuple[str, int | None]: ...
    def output(self, handle: Any) -> str: ...
    def stop(self, handle: Any) -> None: ...
    def address(self, handle: Any) -> str | None: ...


def container_argv(args: str | None, entrypoint=(), default_command=("sleep", "infinity")) -> list[str]:
    """What the container runs: the image's ENTRYPOINT, then ``args`` split into words
    like a shell would (quotes group, nothing expands), or the image's CMD if no args."""
    words = shlex.split(args) if args and args.strip() else list(default_command)
    return [*entrypoint, *words]


@dataclass
class _LocalPod:
    pod_id: str
    popen: subprocess.Popen | None
    log: Path
    failed: int | None = None  # exit code when the command could not even be exec'd


class ProcessRunner:
    """Each pod is a local process (its own session), output to a file: fast, no root.

    The environment is the pod's only (plus PATH/HOME/LANG, as an image would set),
    never the test runner's own.
    """

    def __init__(self, workdir: str | os.PathLike, *, entrypoint=(),
                 default_command=("sleep", "infinity"), path: str | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.entrypoint, self.default_command = tuple(entrypoint), tuple(default_command)
        bindir = os.path.dirname(sys.executable)
        self.path = path or f"{bindir}:/usr/local/bin:/usr/bin:/bin"
        self.pods: list[_LocalPod] = []
        self.started: list[dict] = []  # (pod_id, env, args, image, cluster) of every start
        self._seq = itertools.count(1)

    def start(self, pod_id, env, args, image, cluster):
        self.started.append({"pod_id": pod_id, "env": dict(env), "args": args, "image": image,
                             "cluster": cluster})
        argv = container_argv(args, self.entrypoint, self.default_command)
        log = self.workdir / f"{pod_id}-{next(self._seq)}.log"
        full_env = {"PATH": self.path, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
                    **env, "RUNPOD_PUBLIC_IP": "127.0.0.1"}
        cwd = self.workdir / pod_id
        cwd.mkdir(exist_ok=True)
        with open(log, "wb") as out:
            try:
                popen = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
            except OSError as exc:  # as the container runtime: exec failed, exit 127
                out.write(f"exec {argv[0]}: {exc.strerror}\n".encode())
                pod = _LocalPod(pod_id, None, log, failed=127)
                self.pods.append(pod)
                return pod
        pod = _LocalPod(pod_id, popen, log)
        self.pods.append(pod)
        return pod

    def status(self, pod: _LocalPod):
        if pod.popen is None:
            return "exited", pod.failed
        rc = pod.popen.poll()
        return ("running", None) if rc is None else ("exited", rc)

    def output(self, pod: _LocalPod) -> str:
        try:
            return pod.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, pod: _LocalPod) -> None:
        """Like a container stop: SIGTERM to everything in it, SIGKILL after 5 s."""
        if pod.popen is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pod.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                pod.popen.wait(5)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM and not _group_alive(pod.popen.pid):
                return

    def address(self, pod: _LocalPod) -> str | None:
        return None  # no address of its own: the stand-in reports made-up ones

    def close(self) -> None:
        for pod in self.pods:
            self.stop(pod)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass
class _HostPod:
    pod_id: str
    index: int
    proc: Any  # testbed.Proc


class TestbedRunner:
    """Each new pod takes the next free host of a tests/testbed.py Testbed.

    ``<podId>.runpod.internal`` resolves to that host on every host (Global Networking);
    an Instant Cluster member gets its overlay address on a second interface ``ens1``
    (a veth on a second bridge, ``br1``, in the testbed's bridge namespace), so traffic
    between members' NODE_ADDRs really flows over ens1. Stopping a pod kills every
    process on its host, as stopping a container would.
    """
    __test__ = False  # not a pytest class

    def __init__(self, testbed, *, entrypoint=(), default_command=("sleep", "infinity")):
        self.tb = testbed
        self.entrypoint, self.default_command = tuple(entrypoint), tuple(default_command)
        self.busy: dict[int, str] = {}
        self._ens1: set[int] = set()
        self._lock = threading.Lock()

    def start(self, pod_id, env, args, image, cluster):
        with self._lock:
            free = [h.index for h in self.tb.hosts if h.index not in self.busy]
            if not free:
                raise RuntimeError(f"testbed has no free host for pod {pod_id} "
                                   f"(busy: {self.busy})")
            index = free[0]
            self.busy[index] = pod_id
        host = self.tb.hosts[index]
        self.tb.add_alias(f"{pod_id}.runpod.internal", index)
        if cluster is not None:
            self._overlay(index, f"{cluster.ip}/{cluster.prefix_len}")
        full_env = self.tb.env(**env, RUNPOD_PUBLIC_IP=host.ip)
        argv = container_argv(args, self.entrypoint, self.default_command)
        # its own working directory, as its own container would have (nsenter opens --wd
        # before entering the host's mounts: a host-private /tmp would be the machine's)
        workdir = self.tb.dir / "pods" / pod_id
        workdir.mkdir(parents=True, exist_ok=True)
        proc = self.tb.run(index, argv, env=full_env, name=f"pod-{pod_id}", cwd=workdir)
        return _HostPod(pod_id, index, proc)

    def _overlay(self, index: int, cidr: str) -> None:
        from testbed import _ip  # the testbed's own `ip` wrapper (raises with stderr)

        br_ns, host_ns = self.tb.bridge_ns, self.tb.hosts[index].netns
        if "br1" not in _ip("-n", br_ns, "-o", "link", "show").stdout:
            _ip("-n", br_ns, "link", "add", "br1", "type", "bridge")
            _ip("-n", br_ns, "link", "set", "br1", "up")
        if index not in self._ens1:
            _ip("-n", br_ns, "link", "add", f"o{index}", "type", "veth",
                "peer", "name", "ens1", "netns", host_ns)
            _ip("-n", br_ns, "link", "set", f"o{index}", "master", "br1", "up")
            _ip("-n", host_ns, "link", "set", "ens1", "up")
            self._ens1.add(index)
        _ip("-n", host_ns, "addr", "flush", "dev", "ens1")
        _ip("-n", host_ns, "addr", "add", cidr, "dev", "ens1")

    def status(self, pod: _HostPod):
        rc = pod.proc.returncode
        return ("running", None) if rc is None else ("exited", rc)

    def output(self, pod: _HostPod) -> str:
        return pod.proc.output

    def stop(self, pod: _HostPod) -> None:
        try:
            self.tb.kill(pod.index)
        finally:
            with self._lock:
                if self.busy.get(pod.index) == pod.pod_id:
                    del self.busy[pod.index]

    def address(self, pod: _HostPod) -> str | None:
        return self.tb.hosts[pod.index].ip


# --------------------------------------------------------------------------- state


ENDED = ("EXITED", "ERROR", "TERMINATED")
ACTIONS_BY_STATUS = {"RUNNING": ["stop", "restart", "terminate"],
                     "EXITED": ["start", "terminate"], "ERROR": ["start", "terminate"],
                     "PROVISIONING": ["stop", "terminate"], "STARTING": ["stop", "terminate"],
                     "TERMINATED": []}


@dataclass
class LogEntry:
    seq: int
    ts: str
    source: str
    line: str

    @property
    def event_id(self) -> str:
        """RunPod: "Log-event `id` values are the event `ts` timestamp" (nothing more)."""
        return self.ts


@dataclass
class PodState:
    id: str
    name: str
    image: str
    args: str
    env: dict[str, str]
    ports: list[str]
    disk: int
    mounts: dict
    registry: str | None
    gpu: dict
    cloud: str
    datacenter: str
    global_networking: bool
    start_ssh: bool
    price: float
    created: float
    status: str = "PROVISIONING"
    queued: float = field(default_factory=time.time)  # when it last entered PROVISIONING
    started: float | None = None
    handle: Any = None
    starting: bool = False        # the driver is inside runner.start
    wanted: str = "RUNNING"       # RUNNING, or EXITED after stop
    public_ip: str | None = None  # where its published ports are (the runner's address)
    global_ip: str | None = None  # its Global Networking address
    exit_code: int | None = None
    cluster_id: str | None = None
    rank: int | None = None
    overlay_ip: str | None = None
    logs: list[LogEntry] = field(default_factory=list)
    out_len: int = 0
    partial: str = ""
    ssh_user: str = field(default_factory=lambda: secrets.token_hex(4))
    #: The key RunPod puts in the pod as RUNPOD_API_KEY: "used to make RunPod API calls to the specific
    #: pod. It's limited in scope to only the pod" (runpod/docs, pods/references/environment-variables).
    pod_key: str = field(default_factory=lambda: "pod-scoped-" + secrets.token_hex(16))


@dataclass
class ClusterState:
    id: str
    name: str
    type: str
    compute: dict
    datacenter: str
    seq: int
    pod_ids: list[str]
    created: float
    ports: list[str]


@dataclass
class Recorded:
    method: str
    path: str
    status: int
    body: Any
    by: str = "user"  # whose key: "user" (the account's) or "pod:<id>" (a pod's own, RUNPOD_API_KEY inside it)


class _Answer(Exception):
    """Raised by a route to answer with a problem+json error."""

    def __init__(self, status: int, title: str, detail: str, errors: list[str] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail
        self.errors, self.headers = errors, headers or {}

    def problem(self) -> dict:
        body = {"title": self.title, "status": self.status, "detail": self.detail}
        if self.errors:
            body["errors"] = self.errors
        return body


class _Stream:
    """A route's answer that is a Server-Sent Events stream of one pod's logs."""

    def __init__(self, pod: PodState, source: str | None, start: int):
        self.pod, self.source, self.start = pod, source, start


# --------------------------------------------------------------------------- server


class RunPodStandIn:
    """``with RunPodStandIn(runner, api_key=KEY) as api:`` then point a client at ``api.url``.

    Behaviour the document leaves open, least convenient by default (attributes a test may
    set at any time):

    - ``keepalive``: seconds between ``: keep-alive`` comments on a quiet log stream; None
      (default): none, as the document promises none.
    - ``resume``: how ``Last-Event-ID`` (and ``since``) are read; the document says only
      that ids are the line's ``ts`` and the header "a timestamp": "after" (default: the
      lines after that timestamp, so others with the same one are not sent) or "from"
      (the lines from that timestamp on, so those already sent come again).
    - ``ts_digits``: fraction digits of a log line's ``ts``; 0 (default): whole seconds, as
      in the document's example ``2026-06-01T12:02:03Z``, so many lines share one.
    - ``stream_lifetime``: a log stream ends cleanly after this many seconds even while the
      pod runs (the document does not say when a stream ends); None: only when the pod ends.
    - ``datacenter_while_provisioning``: False (default): a pod's ``dataCenterId`` is null
      while it is PROVISIONING (the document: "string or null", "assigned by scheduler"),
      and a cluster's is omitted until one of its pods is placed (the document says so).
    - ``search_datacenters``: False (default): a create places only in the first of
      ``dataCenterIds`` (the document: "This endpoint places one specific GPU type. It does
      not search for capacity"); True: the first of them with stock.
    - ``no_capacity`` / ``forbidden``: data centers whose creates answer 400 (no capacity,
      whatever the catalog says: "a create can still fail for capacity on a GPU the catalog
      just reported as available") / 403 ("Your account cannot access the requested pool").
    - ``billed_rate``: a pod's ``cost`` (the Pod schema: "Current cost in USD per hour") as a share of the
      catalog's list price for its GPUs; 1.1 (default): not the list price (the catalog's GpuType.price: "the
      rate actually billed for a pod is reported as `cost` on the pod itself", and "negotiated account discounts
      are not reflected"), above it; None: RunPod gives no cost, 0.0 while the pod runs (``cost`` is required
      in a Pod, so a response never lacks it). Read when the pod is created.
    - ``cost`` while PROVISIONING: 0.0 (a pod not yet on a machine; the document says 0.0 only of EXITED
      and TERMINATED, and not what a pod being placed costs): a client reads the cost once the pod runs.
    - ``clock``: the time log lines are stamped with (a test may freeze it).
    - ``log_streams_held``: while True, a new log stream waits before it reads the pod's log
      (``held_log_streams`` counts those waiting): a test can write lines while no stream is open.
    """

    def __init__(self, runner: PodRunner, *, api_key: str, catalog: Catalog | None = None,
                 contract: Contract | None = None, provision_delay: float = 0.0,
                 tick: float = 0.02, keepalive: float | None = None, resume: str = "after",
                 ts_digits: int = 0, stream_lifetime: float | None = 3.0,
                 datacenter_while_provisioning: bool = False, search_datacenters: bool = False,
                 ssh_public_keys: str = ""):
        self.runner = runner
        self.api_key = api_key
        self.catalog = catalog or default_catalog()
        self.contract = contract or Contract()
        self.provision_delay = provision_delay
        self.tick = tick
        self.keepalive = keepalive
        self.resume = resume
        self.ts_digits = ts_digits
        self.stream_lifetime = stream_lifetime
        self.datacenter_while_provisioning = datacenter_while_provisioning
        self.search_datacenters = search_datacenters
        self.no_capacity: set[str] = set()
        self.forbidden: set[str] = set()
        self.clock = time.time
        self.billed_rate: float | None = 1.1
        self.ssh_public_keys = ssh_public_keys
        #: Given to every pod as RUNPOD_API_URL when set: how a pod on a testbed host reaches this
        #: stand-in (a relay); RunPod's own pods reach https://api.runpod.io, the agent's default.
        self.pod_api_url: str | None = None
        self.pods: dict[str, PodState] = {}
        self.clusters: dict[str, ClusterState] = {}
        self.network_volumes: dict[str, dict] = {}  # id -> NetworkVolume (add_network_volume)
        #: The account's secrets: id -> Secret (RunPod's schema) with its write-only "value" kept beside it.
        self.secrets: dict[str, dict] = {}
        self.errors: list[str] = []
        self.requests: list[Recorded] = []
        # faults
        self.auth_failure: int | None = None
        self._rate_limited: list[str] = []           # Retry-After values, one per request
        self._failures: list[tuple[int, str, str]] = []
        self._create_faults: dict[tuple[str, int], tuple[int, str, str]] = {}
        self.drop_log_stream_after: int | None = None  # events; then the connection just closes
        self.log_streams_held = False
        self.held_log_streams = 0
        self._creates = {"pod": 0, "cluster": 0}
        self._cluster_seq = itertools.count(1)
        self._global_seq = itertools.count(10)
        self._log_seq = itertools.count(1)
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ life

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_address[1]}/v2"

    def start(self) -> "RunPodStandIn":
        standin = self

        class Handler(_Handler):
            api = standin

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.api = self
        self._server.daemon_threads = True
        serve = lambda: self._server.serve_forever(poll_interval=0.05)  # noqa: E731 - quick close
        for target, name in ((serve, "standin-http"), (self._drive, "standin-driver")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        """Stop every pod still running, then the server."""
        self._closing.set()
        for t in self._threads:
            if t.name == "standin-driver":  # first: it may be starting a pod right now
                t.join(60)
        with self._cond:
            self._cond.notify_all()
            handles = [p.handle for p in self.pods.values() if p.handle is not None]
            for p in self.pods.values():
                p.handle = None
        for h in handles:
            try:
                self.runner.stop(h)
            except Exception as exc:  # noqa: BLE001 - stop the rest anyway
                self._error(f"runner.stop on close: {exc!r}")
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for t in self._threads:
            t.join(10)

    def __enter__(self) -> "RunPodStandIn":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ faults

    def fail_create(self, nth: int = 1, status: int = 500, title: str = "Internal Server Error",
                    detail: str = "upstream failure", kind: str = "pod", made: bool = False) -> None:
        """The ``nth`` create (counted from now; ``kind`` pod or cluster) answers this error;
        with ``made``, after the pod or cluster was really made (a 5xx on the way back)."""
        self._create_faults[(kind, self._creates[kind] + nth)] = (status, title, detail, made)

    def rate_limit(self, k: int, retry_after: int | str = 1) -> None:
        """The next ``k`` requests answer 429 with this Retry-After (seconds or HTTP date)."""
        self._rate_limited += [str(retry_after)] * k

    def fail_requests(self, k: int, status: int = 503, title: str = "Service Unavailable",
                      detail: str = "upstream temporarily unavailable") -> None:
        """The next ``k`` requests answer this (5xx) error."""
        self._failures += [(status, title, detail)] * k

    def clear_faults(self) -> None:
        self._rate_limited.clear()
        self._failures.clear()
        self._create_faults.clear()
        self.auth_failure = self.drop_log_stream_after = None
        self.no_capacity.clear()
        self.forbidden.clear()

    def add_network_volume(self, name: str, data_center: str, size: int = 100) -> str:
        """A network volume in ``data_center``, as if made in RunPod's console; its id."""
        volume_id = _new_id()[:10]
        self.network_volumes[volume_id] = {"id": volume_id, "name": name, "size": size,
                                           "dataCenter": data_center, "type": "STANDARD"}
        return volume_id

    # ------------------------------------------------------------ inspection

    def pod(self, pod_id: str) -> PodState:
        return self.pods[pod_id]

    def _error(self, message: str) -> None:
        with self._cond:
            self.errors.append(message)

    def _injected(self) -> _Answer | None:
        """The next injected 429 or 5xx, if any."""
        with self._cond:
            if self._rate_limited:
                retry = self._rate_limited.pop(0)
                window = retry if retry.isdigit() else "60"
                return _Answer(429, "Too Many Requests", "rate limit exceeded for the minute window",
                               headers={"Retry-After": retry,
                                        "RateLimit": f'"minute";r=0;t={window}'})
            if self._failures:
                return _Answer(*self._failures.pop(0))
        return None

    # ------------------------------------------------------------ driver

    def _drive(self) -> None:
        """Move pods through their lifecycle and collect their output as log lines."""
        while not self._closing.is_set():
            try:
                self._drive_once()
            except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                self._error(f"driver: {exc!r}")
            self._closing.wait(self.tick)

    def _drive_once(self) -> None:
        now = time.time()
        with self._cond:
            to_start = [p for p in self.pods.values()
                        if p.status == "PROVISIONING" and p.wanted == "RUNNING"
                        and not p.starting and now - p.queued >= self.provision_delay]
            for p in to_start:
                p.status, p.starting = "STARTING", True
                self._system(p, "container starting")
            running = [p for p in self.pods.values() if p.handle is not None]
        for p in to_start:
            self._start(p)
        for p in running:
            self._observe(p)

    def _start(self, pod: PodState) -> None:
        cluster = self._cluster_info(pod)
        try:
            handle = self.runner.start(pod.id, self._pod_env(pod, cluster), pod.args or None,
                                       pod.image, cluster)
            address = self.runner.address(handle)
        except Exception as exc:  # noqa: BLE001 - the pod fails, the test sees why
            self._error(f"runner.start({pod.id}): {exc!r}")
            with self._cond:
                pod.starting = False
                if pod.status != "TERMINATED":
                    pod.status = "ERROR"
                    self._system(pod, f"container failed to start: {exc}")
                self._cond.notify_all()
            return
        with self._cond:
            pod.starting = False
            if pod.status == "TERMINATED" or pod.wanted != "RUNNING":
                stop = True
            else:
                stop = False
                pod.handle, pod.out_len, pod.partial = handle, 0, ""
                pod.public_ip = address or "127.0.0.1"
                if pod.global_networking:
                    pod.global_ip = address or f"{GLOBAL_PREFIX}.{next(self._global_seq)}.2"
        if stop:
            self.runner.stop(handle)

    def _observe(self, pod: PodState) -> None:
        handle = pod.handle
        if handle is None:
            return
        state, code = self.runner.status(handle)
        text = self.runner.output(handle)
        with self._cond:
            if pod.handle is not handle:
                return
            if state != "starting" and pod.status == "STARTING":
                pod.status, pod.started = "RUNNING", time.time()
                self._system(pod, "container running")
            self._collect(pod, text, final=state == "exited")
            if state == "exited":
                pod.handle, pod.exit_code = None, code
                pod.status = "EXITED"
                self._system(pod, f"container exited with code {code}")
            self._cond.notify_all()
        if state == "exited":  # what the command left behind dies with its container
            self.runner.stop(handle)

    def _collect(self, pod: PodState, text: str, final: bool) -> None:
        new = text[pod.out_len:]
        pod.out_len = len(text)
        chunk = pod.partial + new
        lines = chunk.split("\n")
        pod.partial = lines.pop()
        if final and pod.partial:
            lines.append(pod.partial)
            pod.partial = ""
        ts = self._stamp()  # one read of the container's output: one time
        for line in lines:
            self._log(pod, "container", line.rstrip("\r"), ts)

    def _stamp(self) -> str:
        return now_rfc3339(self.clock(), self.ts_digits)

    def _log(self, pod: PodState, source: str, line: str, ts: str | None = None) -> None:
        pod.logs.append(LogEntry(next(self._log_seq), ts or self._stamp(), source, line))

    def _system(self, pod: PodState, line: str) -> None:
        self._log(pod, "system", line)
        self._cond.notify_all()

    def _stop(self, pod: PodState, status: str) -> None:
        """Stop the pod's container (outside the lock: a runner may take a while)."""
        with self._cond:
            handle, pod.handle = pod.handle, None
            pod.status = status
            pod.wanted = status
            if handle is not None:
                self._system(pod, "container stopped" if status != "TERMINATED"
                             else "pod terminated")
            self._cond.notify_all()
        if handle is not None:
            self.runner.stop(handle)
            text = self.runner.output(handle)
            with self._cond:
                self._collect(pod, text, final=True)
                self._cond.notify_all()

    # ------------------------------------------------------------ environment

    def _cluster_info(self, pod: PodState) -> ClusterInfo | None:
        if pod.cluster_id is None:
            return None
        cluster = self.clusters.get(pod.cluster_id)
        if cluster is None:
            return None
        primary = self.pods[cluster.pod_ids[0]]
        return ClusterInfo(cluster.id, pod.rank, len(cluster.pod_ids), pod.overlay_ip, 24,
                           primary.overlay_ip, PRIMARY_PORT, cluster.compute["gpuCountPerPod"])

    def _pod_env(self, pod: PodState, cluster: ClusterInfo | None) -> dict[str, str]:
        """The environment RunPod sets inside a pod (runpod/docs: pods/templates/environment-
        variables, instant-clusters/configuration), over the pod's own env, its secret references
        substituted with the secrets' values as the pod boots."""
        with self._cond:
            held = {s["name"].lower(): s["value"] for s in self.secrets.values()}
        env = {key: self._substituted(value, held) for key, value in pod.env.items()}
        if pod.start_ssh and self.ssh_public_keys:
            env.setdefault("PUBLIC_KEY", self.ssh_public_keys)
        # Where a pod reaches this stand-in (RunPod's pods reach api.runpod.io): never the real API,
        # whatever runs in the pod; this machine's 127.0.0.1 unless a test gives a relay pods can reach.
        env["RUNPOD_API_URL"] = self.pod_api_url or self.url
        env.update({
            "RUNPOD_POD_ID": pod.id, "RUNPOD_DC_ID": pod.datacenter, "RUNPOD_API_KEY": pod.pod_key,
            "RUNPOD_POD_HOSTNAME": pod.id, "RUNPOD_GPU_COUNT": str(pod.gpu["count"]),
            "RUNPOD_CPU_COUNT": str(8 * pod.gpu["count"]),
        })
        if cluster is not None:
            gpus = cluster.gpus_per_pod
            env.update({
                "PRIMARY_ADDR": cluster.primary_ip, "MASTER_ADDR": cluster.primary_ip,
                "PRIMARY_PORT": str(cluster.primary_port), "MASTER_PORT": str(cluster.primary_port),
                "HOST_NODE_ADDR": f"{cluster.primary_ip}:{cluster.primary_port}",
                "NODE_ADDR": cluster.ip, "NODE_RANK": str(cluster.rank),
                "NUM_NODES": str(cluster.size), "NUM_TRAINERS": str(gpus),
                "WORLD_SIZE": str(cluster.size * gpus),
            })
        if "22/tcp" in pod.ports:
            env["RUNPOD_TCP_PORT_22"] = "22"  # both runners publish ports unchanged
        return env

    #: `{{ RUNPOD_SECRET_<name> }}` in a pod's env value (RunPod: "substituted with the secret's value when the
    #: pod or worker boots"; the spaces inside the braces are the document's, read here as optional).
    SECRET_REF = re.compile(r"\{\{\s*RUNPOD_SECRET_([a-zA-Z_][a-zA-Z0-9_.\-/]*)\s*\}\}")

    def _substituted(self, value: str, held: dict[str, str]) -> str:
        """An env value with each secret reference replaced by the secret's value. One that names no
        secret is left as written (the document does not say what RunPod does then: the least
        convenient reading, nothing fails and the job sees the reference)."""
        return self.SECRET_REF.sub(lambda m: held.get(m.group(1).lower(), m.group(0)), value)

    # ------------------------------------------------------------ JSON views

    def _pod_json(self, pod: PodState) -> dict:
        running = pod.status == "RUNNING"
        placed = pod.status != "PROVISIONING"
        proxy = direct = None
        if placed and pod.status != "TERMINATED":
            user = f"{pod.id}-{pod.ssh_user}"
            proxy = {"host": "ssh.runpod.io", "port": 22, "username": user,
                     "command": f"ssh {user}@ssh.runpod.io"}
        if running and "22/tcp" in pod.ports and pod.public_ip:
            direct = {"host": pod.public_ip, "port": 22, "username": "root",
                      "command": f"ssh root@{pod.public_ip} -p 22"}
        # RunPod: "enabled" is derived from whether the pod has an address yet
        gn: dict[str, Any] = {"enabled": False}
        if pod.global_ip and pod.status != "TERMINATED":
            gn = {"enabled": True, "ip": pod.global_ip, "internalDns": f"{pod.id}.runpod.internal"}
        runtime = None
        if running:
            ports = []
            for spec in pod.ports:
                number, _, kind = spec.partition("/")
                tcp = kind == "tcp"
                ports.append({"private": int(number), "public": int(number) if tcp else None,
                              "type": kind, "ip": pod.public_ip if tcp else None})
            runtime = {"uptime": int(time.time() - (pod.started or time.time())), "ports": ports}
        out = {
            "id": pod.id, "name": pod.name, "image": pod.image, "args": pod.args,
            "disk": pod.disk, "ports": list(pod.ports), "env": dict(pod.env),
            "registry": pod.registry, "status": pod.status,
            "actions": list(ACTIONS_BY_STATUS[pod.status]), "mounts": pod.mounts,
            "gpu": dict(pod.gpu), "cloud": pod.cloud,
            "dataCenterId": pod.datacenter if placed or self.datacenter_while_provisioning else None,
            "cudaVersion": "12.8", "ssh": {"proxy": proxy, "direct": direct}, "template": None,
            "cost": 0.0 if pod.status in ("PROVISIONING", "EXITED", "TERMINATED") else pod.price,
            "locked": False, "globalNetworking": gn, "runtime": runtime,
            "createdAt": now_rfc3339(pod.created),
            "startedAt": now_rfc3339(pod.started) if pod.started else None,
        }
        if pod.cluster_id is not None:
            out["cluster"] = {"id": pod.cluster_id, "rank": pod.rank, "ip": pod.overlay_ip}
        return out

    def _cluster_json(self, cluster: ClusterState) -> dict:
        pods = [self.pods[i] for i in cluster.pod_ids]
        by_status: dict[str, int] = {}
        for p in pods:
            by_status[p.status] = by_status.get(p.status, 0) + 1
        primary = pods[0]
        primary_json: dict[str, Any] = {"podId": primary.id, "status": primary.status}
        if primary.status == "RUNNING" and "22/tcp" in primary.ports and primary.public_ip:
            primary_json["sshEndpoint"] = f"{primary.public_ip}:22"
        out = {
            "id": cluster.id, "name": cluster.name, "type": cluster.type,
            "compute": dict(cluster.compute), "dataCenterId": cluster.datacenter,
            "pods": {"total": len(pods), "byStatus": by_status},
            "network": {"cidr": f"{OVERLAY_PREFIX}.{cluster.seq}.0/24", "vxlanId": cluster.seq,
                        "vxlanPort": 4789},
            "primary": primary_json, "createdAt": now_rfc3339(cluster.created),
        }
        # RunPod: "Derived from the member pods; omitted until at least one pod is placed."
        if not self.datacenter_while_provisioning and all(p.status == "PROVISIONING" for p in pods):
            del out["dataCenterId"]
        return out

    # ------------------------------------------------------------ routes

    def _billed(self, listed: float) -> float:
        """What a new pod costs per hour (its `cost` while it runs): billed_rate of the catalog's list price."""
        return 0.0 if self.billed_rate is None else round(listed * self.billed_rate, 4)

    def _find_pod(self, pod_id: str, *, include_terminated: bool = True) -> PodState:
        pod = self.pods.get(pod_id)
        if pod is None or (pod.status == "TERMINATED" and not include_terminated):
            raise _Answer(404, "Not Found", f"pod {pod_id} not found")
        return pod

    def _placement(self, gpu_id: str, count: int, cloud: str, dc_ids: list[str] | None,
                   global_networking: bool, product: str = "POD") -> tuple[dict, str]:
        """(GpuType, data center id) for a create, or the 400 (403) RunPod answers."""
        gpu = self.catalog.gpu(gpu_id)
        if gpu is None:
            raise _Answer(400, "Bad Request", f"gpu type {gpu_id!r} does not exist")
        ceiling = gpu["maxCount"][cloud.lower()]
        if count > ceiling:
            raise _Answer(400, "Bad Request", f"{gpu_id} allows at most {ceiling} GPUs per pod "
                          f"on {cloud} cloud, not {count}")
        # RunPod: global networking "Requires an NVIDIA GPU and a global-networking-enabled
        # data center (both enforced upstream)"; nothing about the cloud
        if global_networking and gpu["manufacturer"] != "NVIDIA":
            raise _Answer(400, "Bad Request", "global networking requires an NVIDIA GPU")
        if dc_ids:  # preferences: the first only, unless the stand-in is told to search them
            candidates = list(dc_ids) if self.search_datacenters else list(dc_ids[:1])
        else:  # "Omit or pass an empty array to let the scheduler choose"
            candidates = [d["id"] for d in self.catalog.datacenters]
        for dc_id in candidates:
            dc = self.catalog.datacenter(dc_id)
            if dc is None:
                continue
            if global_networking and not dc["globalNetwork"]:
                continue
            if dc_id in self.forbidden:
                if len(candidates) == 1:
                    raise _Answer(403, "Forbidden", "access denied")
                continue
            if dc_id in self.no_capacity:
                continue
            if self.catalog.level(gpu_id, dc_id, product) != "NONE":
                return gpu, dc_id
        where = ", ".join(candidates)
        gn = " with global networking" if global_networking else ""
        raise _Answer(400, "Bad Request", f"no capacity: no {count}x {gpu_id} available{gn} "
                      f"in {where}")

    def _volume_dcs(self, mounts: dict, dc_ids: list[str] | None) -> list[str] | None:
        """A network volume pins the placement to its data center (RunPod: "an existing
        NetworkVolume in the same data center as the pod")."""
        for mount in mounts.get("network") or []:
            volume = self.network_volumes.get(mount["volumeId"])
            if volume is None:
                raise _Answer(400, "Bad Request", f"network volume {mount['volumeId']} not found")
            if dc_ids and volume["dataCenter"] not in dc_ids:
                raise _Answer(400, "Bad Request", f"network volume {volume['id']} is in "
                              f"{volume['dataCenter']}, not in {', '.join(dc_ids)}")
            return [volume["dataCenter"]]
        return dc_ids

    def _create_fault(self, kind: str) -> tuple | None:
        """The injected answer of this create: raised now, or returned when it comes after
        the pod or cluster is made."""
        self._creates[kind] += 1
        fault = self._create_faults.pop((kind, self._creates[kind]), None)
        if fault is not None and not fault[3]:
            raise _Answer(*fault[:3])
        return fault and fault[:3]

    def create_pod(self, body: dict, query: dict) -> tuple[int, dict]:
        with self._cond:
            late = self._create_fault("pod")
            if ("gpu" in body) == ("cpu" in body):
                raise _Answer(400, "Bad Request", "exactly one of gpu or cpu must be set")
            if "cpu" in body:
                raise _Answer(400, "Bad Request", "CPU pods are not offered by this stand-in")
            mounts = body.get("mounts") or {}
            if "persistent" in mounts and "network" in mounts:
                raise _Answer(400, "Bad Request", "mounts: at most one of persistent or network")
            if "templateId" in body:
                raise _Answer(404, "Not Found", f"template {body['templateId']} not found")
            cloud = body.get("cloud", "SECURE")
            gpu_req = {"id": body["gpu"]["id"], "count": body["gpu"].get("count", 1)}
            gn = bool(body.get("globalNetworking", False))
            gpu, dc = self._placement(gpu_req["id"], gpu_req["count"], cloud,
                                      self._volume_dcs(mounts, body.get("dataCenterIds")), gn)
            pod = PodState(
                id=_new_id(), name=body["name"], image=body["image"], args=body.get("args", ""),
                env=dict(body.get("env") or {}), ports=list(body.get("ports") or []),
                disk=body.get("disk", 50), mounts=mounts, registry=body.get("registry"),
                gpu=gpu_req, cloud=cloud, datacenter=dc, global_networking=gn,
                start_ssh=bool(body.get("startSsh", False)),
                price=self._billed(gpu["price"][cloud.lower()] * gpu_req["count"]),
                created=time.time())
            self.pods[pod.id] = pod
            self._system(pod, "pod created")
            if late:
                raise _Answer(*late)
            return 201, self._pod_json(pod)

    def list_pods(self, body, query) -> tuple[int, dict]:
        include = query.get("includeClusterPods", ["false"])[0] == "true"
        with self._cond:
            pods = [self._pod_json(p) for p in self.pods.values() if p.status != "TERMINATED"
                    and (include or p.cluster_id is None)]
        return 200, {"pods": pods}

    def get_pod(self, body, query, pod_id: str) -> tuple[int, dict]:
        with self._cond:
            return 200, self._pod_json(self._find_pod(pod_id))

    def pod_action(self, body, query, pod_id: str) -> tuple[int, dict | None]:
        action = body["action"]
        with self._cond:
            pod = self._find_pod(pod_id, include_terminated=False)
            if pod.cluster_id is not None:
                raise _Answer(409, "Conflict", f"pod {pod_id} belongs to cluster "
                              f"{pod.cluster_id}: manage it through /v2/clusters/{pod.cluster_id}")
            if action not in ACTIONS_BY_STATUS[pod.status]:
                raise _Answer(409, "Conflict", f"cannot {action} a pod that is {pod.status} "
                              f"(allowed: {', '.join(ACTIONS_BY_STATUS[pod.status]) or 'none'})")
        if action == "terminate":
            self._stop(pod, "TERMINATED")
            return 204, None
        if action in ("stop", "restart"):
            self._stop(pod, "EXITED")
        if action in ("start", "restart"):
            with self._cond:
                pod.status, pod.wanted, pod.exit_code = "PROVISIONING", "RUNNING", None
                pod.queued = time.time()
        with self._cond:
            return 200, self._pod_json(pod)

    def delete_pod(self, body, query, pod_id: str) -> tuple[int, None]:
        with self._cond:
            pod = self._find_pod(pod_id, include_terminated=False)
            if pod.cluster_id is not None:
                raise _Answer(409, "Conflict", f"pod {pod_id} belongs to cluster "
                              f"{pod.cluster_id}: delete the cluster instead")
        self._stop(pod, "TERMINATED")
        return 204, None

    def pod_logs(self, body, query, pod_id: str, last_event_id: str | None = None):
        source = query.get("source", [None])[0]
        if source not in (None, "container", "system"):
            raise _Answer(422, "Unprocessable Entity", "Request validation failed.",
                          [f"source: {source!r} is not one of ['container', 'system']"])
        try:
            tail = int(query.get("tail", ["100"])[0])
        except ValueError:
            tail = -1
        if not 0 <= tail <= 5000:
            raise _Answer(422, "Unprocessable Entity", "Request validation failed.",
                          ["tail: must be an integer from 0 to 5000"])
        since = query.get("since", [None])[0]
        # Last-Event-ID "takes precedence over `since` and `tail`"; both are date-times
        cursor = last_event_id or since
        if cursor:
            try:
                when = parse_rfc3339(cursor)
            except ValueError as exc:
                what = "Last-Event-ID" if last_event_id else "since"
                raise _Answer(422, "Unprocessable Entity", "Request validation failed.",
                              [f"{what}: {exc}"]) from None
        with self._cond:
            self.held_log_streams += 1
            while self.log_streams_held and not self._closing.is_set():
                self._cond.wait(0.02)
            self.held_log_streams -= 1
            pod = self._find_pod(pod_id)
            entries = [e for e in pod.logs if source in (None, e.source)]
            if cursor:  # the document does not say whether that timestamp's lines come again
                after = (lambda e: parse_rfc3339(e.ts) > when) if self.resume == "after" else \
                    (lambda e: parse_rfc3339(e.ts) >= when)
                start = next((i for i, e in enumerate(pod.logs) if after(e)), len(pod.logs))
            else:
                keep = entries[-tail:] if tail else []
                start = pod.logs.index(keep[0]) if keep else len(pod.logs)
        return 200, _Stream(pod, source, start)

    def create_cluster(self, body: dict, query: dict) -> tuple[int, dict]:
        with self._cond:
            late = self._create_fault("cluster")
            compute = body["compute"]
            gpu, dc = self._placement(compute["gpuTypeId"], compute["gpuCountPerPod"], "SECURE",
                                      self._volume_dcs(body.get("mounts") or {},
                                                       body.get("dataCenterIds")), False, "CLUSTER")
            seq = next(self._cluster_seq)
            cluster = ClusterState(id=_new_id(), name=body["name"], type=body["type"],
                                   compute=dict(compute), datacenter=dc, seq=seq, pod_ids=[],
                                   created=time.time(), ports=list(body.get("ports") or []))
            for rank in range(compute["podCount"]):
                pod = PodState(
                    id=_new_id(), name=f"{body['name']}-{rank}", image=body["image"] if "image"
                    in body else "runpod/pytorch:latest", args=body.get("args", ""),
                    env=dict(body.get("env") or {}), ports=list(body.get("ports") or []),
                    disk=body.get("disk", 50), mounts=body.get("mounts") or {}, registry=None,
                    gpu={"id": compute["gpuTypeId"], "count": compute["gpuCountPerPod"]},
                    cloud="SECURE", datacenter=dc, global_networking=False,
                    start_ssh=bool(body.get("startSsh", False)),
                    price=self._billed(gpu["price"]["secure"] * compute["gpuCountPerPod"]),
                    created=time.time(), cluster_id=cluster.id, rank=rank,
                    overlay_ip=f"{OVERLAY_PREFIX}.{seq}.{10 + rank}")
                self.pods[pod.id] = pod
                cluster.pod_ids.append(pod.id)
                self._system(pod, f"cluster {cluster.id} member {rank} created")
            self.clusters[cluster.id] = cluster
            if late:
                raise _Answer(*late)
            return 201, self._cluster_json(cluster)

    def _find_cluster(self, cluster_id: str) -> ClusterState:
        cluster = self.clusters.get(cluster_id)
        if cluster is None:
            raise _Answer(404, "Not Found", f"cluster {cluster_id} not found")
        return cluster

    def list_clusters(self, body, query) -> tuple[int, dict]:
        with self._cond:
            return 200, {"clusters": [self._cluster_json(c) for c in self.clusters.values()]}

    def get_cluster(self, body, query, cluster_id: str) -> tuple[int, dict]:
        with self._cond:
            return 200, self._cluster_json(self._find_cluster(cluster_id))

    def cluster_pods(self, body, query, cluster_id: str) -> tuple[int, dict]:
        with self._cond:
            cluster = self._find_cluster(cluster_id)
            return 200, {"pods": [self._pod_json(self.pods[i]) for i in cluster.pod_ids]}

    def delete_cluster(self, body, query, cluster_id: str) -> tuple[int, None]:
        with self._cond:
            cluster = self._find_cluster(cluster_id)
            del self.clusters[cluster_id]
            pods = [self.pods[i] for i in cluster.pod_ids]
        for pod in pods:
            self._stop(pod, "TERMINATED")
        return 204, None

    def get_network_volume(self, body, query, volume_id: str) -> tuple[int, dict]:
        with self._cond:
            volume = self.network_volumes.get(volume_id)
            if volume is None:
                raise _Answer(404, "Not Found", f"network volume {volume_id} not found")
            return 200, dict(volume)

    # ------------------------------------------------------------ account secrets

    @staticmethod
    def _secret_json(secret: dict) -> dict:
        """A Secret as RunPod answers it: never its value."""
        return {k: v for k, v in secret.items() if k != "value"}

    def create_secret(self, body: dict, query) -> tuple[int, dict]:
        name = body["name"]
        if name.lower().startswith("runpod"):  # "the reserved prefix `RUNPOD` are rejected (case-insensitive)"
            raise _Answer(400, "Bad Request", f"secret name {name!r}: the prefix RUNPOD is reserved")
        with self._cond:
            if any(s["name"].lower() == name.lower() for s in self.secrets.values()):
                raise _Answer(409, "Conflict", f"a secret named {name} already exists")
            stamp = now_rfc3339(digits=0)
            secret = {"id": _new_id()[:12], "name": name, "description": body.get("description"),
                      "createdAt": stamp, "valueLastUpdatedAt": stamp, "value": body["value"]}
            self.secrets[secret["id"]] = secret
            return 201, self._secret_json(secret)

    def list_secrets(self, body, query) -> tuple[int, dict]:
        name = (query.get("name") or [None])[0]
        with self._cond:
            found = [self._secret_json(s) for s in self.secrets.values()
                     if name is None or s["name"].lower() == name.lower()]
        return 200, {"secrets": found}

    def delete_secret(self, body, query, secret_id: str) -> tuple[int, None]:
        with self._cond:
            if self.secrets.pop(secret_id, None) is None:
                raise _Answer(404, "Not Found", f"secret {secret_id} not found")
        return 204, None

    def list_datacenters(self, body, query) -> tuple[int, dict]:
        include = ",".join(query.get("include", [])).split(",")
        flag = query.get("globalNetwork", [None])[0]
        regions = [r for r in ",".join(query.get("regions", [])).split(",") if r]
        out = []
        for dc in self.catalog.datacenters:
            if flag is not None and dc["globalNetwork"] != (flag == "true"):
                continue
            if regions and dc["region"] not in regions:
                continue
            item = dict(dc)
            if "GPU_AVAILABILITY" in include:
                offered = [g for g in self.catalog.gpus
                           if (g["id"], dc["id"]) in self.catalog.stock]
                if offered:
                    item["gpuAvailability"] = [
                        {"id": g["id"], "name": g["name"],
                         "availability": self.catalog.level(g["id"], dc["id"])} for g in offered]
            out.append(item)
        return 200, {"dataCenters": out}

    def list_gpus(self, body, query) -> tuple[int, dict]:
        include = ",".join(query.get("include", [])).split(",")
        products = [p for p in ",".join(query.get("product", [])).split(",") if p]
        wants = "AVAILABILITY" in include
        if wants != bool(products):
            raise _Answer(400, "Bad Request", "product is required with include=AVAILABILITY, "
                          "and valid only with it")
        count = int(query.get("count", ["1"])[0])
        cloud = query.get("cloud", ["SECURE"])[0]
        rank = ["NONE", "LOW", "MEDIUM", "HIGH"]
        levels = lambda gpu_id, dc_id: max(  # noqa: E731 - the best of the products asked for
            (self.catalog.level(gpu_id, dc_id, product) for product in products), key=rank.index)
        out = []
        for gpu in self.catalog.gpus:
            item = dict(gpu)
            if wants:
                fits = count <= gpu["maxCount"][cloud.lower()]
                dcs = []
                for dc in self.catalog.datacenters:
                    level = levels(gpu["id"], dc["id"]) if fits else "NONE"
                    if level != "NONE":
                        dcs.append({"id": dc["id"], "name": dc["name"], "availability": level})
                item["availability"] = max((d["availability"] for d in dcs), key=rank.index,
                                           default="NONE")
                if dcs:
                    item["dataCenters"] = dcs
            out.append(item)
        return 200, {"gpus": out}

    ROUTES = [
        ("GET", "/v2/pods", "list_pods"), ("POST", "/v2/pods", "create_pod"),
        ("GET", "/v2/pods/{id}", "get_pod"), ("DELETE", "/v2/pods/{id}", "delete_pod"),
        ("POST", "/v2/pods/{id}/action", "pod_action"), ("GET", "/v2/pods/{id}/logs", "pod_logs"),
        ("GET", "/v2/clusters", "list_clusters"), ("POST", "/v2/clusters", "create_cluster"),
        ("GET", "/v2/clusters/{id}", "get_cluster"),
        ("DELETE", "/v2/clusters/{id}", "delete_cluster"),
        ("GET", "/v2/clusters/{id}/pods", "cluster_pods"),
        ("GET", "/v2/network-volumes/{id}", "get_network_volume"),
        ("GET", "/v2/catalog/datacenters", "list_datacenters"),
        ("GET", "/v2/catalog/gpus", "list_gpus"),
        ("GET", "/v2/account/secrets", "list_secrets"), ("POST", "/v2/account/secrets", "create_secret"),
        ("DELETE", "/v2/account/secrets/{id}", "delete_secret"),
    ]

    def route(self, method: str, path: str):
        """(template, handler name, path args) or None."""
        for m, template, name in self.ROUTES:
            pattern = "^" + re.sub(r"\{[^/]+\}", "([^/]+)", template) + "$"
            match = re.match(pattern, path)
            if match and m == method:
                return template, name, match.groups()
        return None


class _Server(ThreadingHTTPServer):
    api: RunPodStandIn

    def handle_error(self, request, client_address) -> None:
        """A crash in a handler is a stand-in bug: recorded for the test, not just printed."""
        import traceback

        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            return  # the client went away
        self.api._error(f"request handler crashed: {traceback.format_exc()}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: RunPodStandIn

    def log_message(self, *args) -> None:  # quiet: tests read standin.requests instead
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def _serve(self, method: str) -> None:
        api = self.api
        self._by = "?"  # whose key, once checked
        split = urlsplit(self.path)
        query = parse_qs(split.query, keep_blank_values=True)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        found = api.route(method, split.path)
        template = found[0] if found else None
        body: Any = None
        try:
            if found is None:
                raise _Answer(404, "Not Found", f"no route for {method} {split.path}")
            template, name, args = found
            self._by = self._check_auth(method, template, args)
            fault = api._injected()
            if fault is not None:
                raise fault
            wrong = api.contract.query_errors(method, template, query)
            if wrong:
                raise _Answer(422, "Unprocessable Entity", "Request validation failed.", wrong)
            ref = api.contract.request_ref(method, template)
            if ref is not None:
                body = self._body(raw, ref)
            handler = getattr(api, name)
            if name == "pod_logs":
                status, payload = handler(body, query, *args,
                                          last_event_id=self.headers.get("Last-Event-ID"))
            else:
                status, payload = handler(body, query, *args)
        except _Answer as answer:
            self._answer(method, split.path, template, answer.status, answer.problem(),
                         answer.headers, body)
            return
        except Exception as exc:  # noqa: BLE001 - a stand-in bug: loud, recorded
            api._error(f"{method} {split.path}: handler crashed: {exc!r}")
            self._answer(method, split.path, None, 500, {"title": "Internal Server Error",
                         "status": 500, "detail": f"stand-in crashed: {exc!r}"}, {}, body)
            return
        if isinstance(payload, _Stream):
            self._stream(method, split.path, template, payload)
        else:
            self._answer(method, split.path, template, status, payload, {}, body)

    #: What a pod's own key may do, in the least convenient reading of "limited in scope to only the
    #: pod": read, act on and delete that one pod; nothing else (403).
    POD_KEY_ROUTES = {("GET", "/v2/pods/{id}"), ("POST", "/v2/pods/{id}/action"), ("DELETE", "/v2/pods/{id}")}

    def _check_auth(self, method: str = "GET", template: str = "", args: tuple = ()) -> str:
        """Whose key the request carries ("user" or "pod:<id>"), or the 401/403 RunPod answers."""
        api = self.api
        if api.auth_failure == 403:
            raise _Answer(403, "Forbidden", "access denied")
        header = self.headers.get("Authorization")
        if api.auth_failure == 401 or header is None:
            raise _Answer(401, "Unauthorized", "missing bearer token" if header is None
                          else "invalid bearer token")
        if header == f"Bearer {api.api_key}":
            return "user"
        with api._cond:
            owner = next((p.id for p in api.pods.values() if header == f"Bearer {p.pod_key}"), None)
        if owner is None:
            raise _Answer(401, "Unauthorized", "invalid bearer token")
        if (method, template) not in self.POD_KEY_ROUTES or tuple(args[:1]) != (owner,):
            raise _Answer(403, "Forbidden", f"this key is scoped to pod {owner}")
        return f"pod:{owner}"

    def _body(self, raw: bytes, ref: str) -> Any:
        if not raw:
            raise _Answer(400, "Bad Request", "a JSON request body is required")
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if ctype != "application/json":
            raise _Answer(400, "Bad Request", f"Content-Type must be application/json, not {ctype!r}")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise _Answer(400, "Bad Request", f"malformed JSON body: {exc}") from None
        errors = self.api.contract.errors(ref, body)
        if errors:
            raise _Answer(422, "Unprocessable Entity", "Request validation failed.", errors)
        return body

    def _answer(self, method: str, path: str, template: str | None, status: int,
                payload: Any, headers: dict[str, str], request_body: Any) -> None:
        api = self.api
        ctype = "application/problem+json" if status >= 400 else "application/json"
        if template is not None:
            problems = self._check_response(method, template, status, ctype, payload)
            if problems:
                api._error(f"{method} {path} -> {status}: response breaks RunPod's contract: "
                           + "; ".join(problems))
                status, ctype, headers = 500, "application/problem+json", {}
                payload = {"title": "Internal Server Error", "status": 500,
                           "detail": "stand-in response broke the contract: " + "; ".join(problems)}
        with api._cond:
            api.requests.append(Recorded(method, path, status, request_body, getattr(self, "_by", "?")))
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if status != 204:
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if status != 204:
            self.wfile.write(data)

    def _check_response(self, method: str, template: str, status: int, ctype: str,
                        payload: Any) -> list[str]:
        contract = self.api.contract
        resp = contract.response(method, template, status)
        if resp is None:
            return [f"status {status} is not documented for {method} {template}"]
        content = resp.get("content")
        if not content:
            return [] if payload is None else [f"{status} must have no body"]
        if ctype not in content:
            return [f"{status} is documented as {sorted(content)}, not {ctype}"]
        if payload is None:
            return [f"{status} must have a body"]
        schema = content[ctype]["schema"]
        if "$ref" not in schema:  # the event stream: its events are checked one by one
            return []
        return contract.errors(schema["$ref"], payload, strict=True)

    def _stream(self, method: str, path: str, template: str, stream: _Stream) -> None:
        """Server-Sent Events (chunked) until the pod ends or the client goes away."""
        api, pod = self.api, stream.pod
        problems = self._check_response(method, template, 200, "text/event-stream", "stream")
        if problems:
            api._error(f"{method} {path}: {'; '.join(problems)}")
        with api._cond:
            api.requests.append(Recorded(method, path, 200, None))
        self.send_response(200)
        for k, v in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                     ("Connection", "keep-alive"), ("X-Accel-Buffering", "no"),
                     ("Transfer-Encoding", "chunked")):
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True
        index = stream.start
        with api._cond:
            drop_after, api.drop_log_stream_after = api.drop_log_stream_after, None
        sent = 0
        opened = quiet_since = time.monotonic()
        try:
            while True:
                with api._cond:
                    if index >= len(pod.logs) and not self._ended(pod):
                        api._cond.wait(min(0.25, api.keepalive or 0.25))
                    batch = pod.logs[index:]
                    index += len(batch)
                    done = self._ended(pod) and index >= len(pod.logs)
                    lifetime = api.stream_lifetime
                if lifetime is not None and time.monotonic() - opened >= lifetime:
                    done = True  # a clean end while the pod may well run on
                out = []
                for entry in batch:
                    if stream.source not in (None, entry.source):
                        continue
                    data = {"ts": entry.ts, "source": entry.source, "line": entry.line}
                    errors = self._check_event(data)
                    if errors:
                        api._error(f"{path}: log event breaks the contract: {errors}")
                    out.append(f"id: {entry.event_id}\ndata: {json.dumps(data)}\n\n")
                    sent += 1
                    if drop_after is not None and sent >= drop_after:
                        self._chunk("".join(out).encode())
                        return  # no final chunk: the client sees a broken stream
                if out:
                    quiet_since = time.monotonic()
                elif not done and api.keepalive and time.monotonic() - quiet_since >= api.keepalive:
                    out.append(": keep-alive\n\n")
                    quiet_since = time.monotonic()
                if out:
                    self._chunk("".join(out).encode())
                if done:
                    self._chunk(b"")
                    return
        except (BrokenPipeError, ConnectionResetError):
            return

    def _ended(self, pod: PodState) -> bool:
        return (pod.status in ENDED and pod.handle is None) or self.api._closing.is_set()

    def _check_event(self, data: dict) -> list[str]:
        """The documented SSE data payload: exactly source (a LogSource), line and ts."""
        errors = self.api.contract.errors("LogSource", data["source"])
        if set(data) != {"source", "line", "ts"}:
            errors.append(f"fields {sorted(data)}")
        try:
            _is_datetime(data["ts"])
        except ValueError as exc:
            errors.append(str(exc))
        return errors

    def _chunk(self, data: bytes) -> None:
        """One chunk of a chunked body; an empty one ends the body."""
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def b64_script_args(script: str) -> str:
    """``args`` that run ``script`` the way SkyPilot ships one through RunPod: base64 in a
    ``bash -c`` (so no quoting survives to trouble the API), decoded and run in the pod."""
    encoded = base64.b64encode(script.encode()).decode()
    return f"bash -c 'echo {encoded} | base64 --decode > init.sh; bash init.sh'"
