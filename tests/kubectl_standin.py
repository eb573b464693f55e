"""A stand-in `kubectl` for the fast tier's tests of the launcher's own code (its kubectl argv,
its messages, its reading of the operator's answers, which each test writes into the state
directory). What KubeRay and Kubernetes do is tested against the real ones (tests/kube/).

It plays the API server's client side over one state directory, `$KUBE_STANDIN_DIR`:

    crds/rayjobs.ray.io                  exists = KubeRay's CRDs are installed
    contexts.json                        optional: {"current": C, "contexts": {C: {"namespace": N|null}}}
    objects/<ns>/<kind>/<name>.json      what apply wrote (kind: rayjob, configmap, secret)
    status/<ns>/rayjob/<name>.json       a RayJob's .status (the controller's)
    pods/<ns>/<pod>.json                 Pod objects (the controller's)
    events/<ns>/<name>.json              Event objects (the operator's), listed by `get events --field-selector`
    logs/<ns>/<pod>/<container>.log      containers' output (the controller's)
    argv.jsonl                           one line per invocation: {"argv", "stdin"} (Secret values "<redacted>")
    hold-delete                          exists = `delete` waits until the test removes it (a slow API server)

Client-side `apply` refuses, as the API server does, an object too big for the
`last-applied-configuration` annotation it would carry (256 KiB).
It implements only the verbs and flags rlhf-tasks uses and exits 1 naming anything else, so the
product never leans on something this file silently ignores. Run as a program through the
`kubectl` shim that :func:`install` puts first on PATH; the rest are helpers for tests that play
the operator's answers by writing files.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import yaml

KINDS = {"rayjob": "rayjob", "rayjobs": "rayjob", "rayjobs.ray.io": "rayjob", "configmap": "configmap",
         "configmaps": "configmap", "cm": "configmap", "secret": "secret", "secrets": "secret", "pod": "pod",
         "pods": "pod", "crd": "crd", "crds": "crd", "customresourcedefinition": "crd",
         "customresourcedefinitions": "crd", "event": "event", "events": "event"}
PLURAL = {"rayjob": "rayjobs.ray.io", "configmap": "configmaps", "secret": "secrets", "pod": "pods",
          "crd": "customresourcedefinitions.apiextensions.k8s.io"}
REDACTED = "<redacted>"
#: Client-side `kubectl apply` keeps the whole object (compact JSON) in this annotation; the API server caps an
#: object's annotations at 256 KiB (ValidateAnnotations: keys and values together).
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
ANNOTATIONS_LIMIT = 256 * 1024


class Refused(Exception):
    """What real kubectl would refuse, or what this stand-in does not implement: exit 1."""


# ------------------------------------------------------------------ files


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def redacted(text: str | None) -> str | None:
    """stdin as recorded: every Secret's values replaced."""
    if not text:
        return text
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return text
    if not any(isinstance(d, dict) and d.get("kind") == "Secret" for d in docs):
        return text
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "Secret":
            for key in ("data", "stringData"):
                if isinstance(doc.get(key), dict):
                    doc[key] = {k: REDACTED for k in doc[key]}
    return "---\n".join(json.dumps(d) for d in docs)


# ------------------------------------------------------------------ the program


class Kubectl:
    def __init__(self, root: Path, argv: list[str], stdin: str | None):
        self.root, self.argv, self.stdin = root, argv, stdin
        self.context: str | None = None
        self.namespace: str | None = None
        self.out: list[str] = []

    def say(self, line: str) -> None:
        print(line, flush=True)

    def contexts(self) -> dict:
        return read_json(self.root / "contexts.json") or {"current": "standin", "contexts": {"standin": {}}}

    def ns(self) -> str:
        if self.namespace:
            return self.namespace
        config = self.contexts()
        return (config["contexts"].get(self.context or config["current"]) or {}).get("namespace") or "default"

    def run(self) -> int:
        args = list(self.argv)
        rest = []
        while args:  # global flags anywhere
            arg = args.pop(0)
            if arg == "--context":
                self.context = args.pop(0)
            elif arg.startswith("--context="):
                self.context = arg.split("=", 1)[1]
            elif arg in ("-n", "--namespace"):
                self.namespace = args.pop(0)
            elif arg.startswith("--namespace="):
                self.namespace = arg.split("=", 1)[1]
            else:
                rest.append(arg)
        if self.context is not None and self.context not in self.contexts()["contexts"]:
            raise Refused(f'error: context "{self.context}" does not exist')
        if not rest:
            raise Refused("the stand-in needs a verb")
        verb, words = rest[0], rest[1:]
        handler = {"config": self.config, "get": self.get, "apply": self.apply, "delete": self.delete,
                   "logs": self.logs, "port-forward": self.port_forward}.get(verb)
        if handler is None:
            raise Refused(f"the stand-in does not implement `kubectl {verb}`")
        return handler(words)

    @staticmethod
    def flags(words: list[str], known: dict[str, bool]) -> tuple[dict[str, object], list[str]]:
        """Parse flags (`known`: flag -> takes a value); anything else starting with `-` is refused."""
        found, positional = {}, []
        while words:
            word = words.pop(0)
            if word.startswith("-") and word != "-":
                name, eq, value = word.partition("=")
                if name not in known:
                    raise Refused(f"the stand-in does not implement the flag {name}")
                if known[name]:
                    found[name] = value if eq else words.pop(0)
                else:
                    found[name] = True
            else:
                positional.append(word)
        return found, positional

    # -- config view --minify -o json
    def config(self, words):
        flags, pos = self.flags(words, {"--minify": False, "-o": True, "--output": True})
        if pos != ["view"] or not flags.get("--minify") or flags.get("-o", flags.get("--output")) != "json":
            raise Refused(f"the stand-in implements only `config view --minify -o json`, not {words}")
        config = self.contexts()
        name = self.context or config["current"]
        self.say(json.dumps({"kind": "Config", "current-context": name, "contexts": [
            {"name": name, "context": {"cluster": "standin", **(config["contexts"].get(name) or {})}}]}))
        return 0

    def _path(self, kind: str, name: str, ns: str) -> Path:
        return self.root / "objects" / ns / kind / f"{name}.json"

    def _object(self, kind: str, name: str):
        if kind == "crd":
            return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                    "metadata": {"name": name}} if (self.root / "crds" / name).exists() else None
        if kind == "pod":
            return read_json(self.root / "pods" / self.ns() / f"{name}.json")
        found = read_json(self._path(kind, name, self.ns()))
        if found is not None and kind == "rayjob":
            status = read_json(self.root / "status" / self.ns() / "rayjob" / f"{name}.json")
            if status is not None:
                found["status"] = status
        return found

    # -- get KIND NAME -o json [--ignore-not-found]; get pods -l SEL -o json
    def get(self, words):
        flags, pos = self.flags(words, {"-o": True, "--output": True, "--ignore-not-found": False,
                                        "-l": True, "--selector": True, "--field-selector": True})
        if flags.get("-o", flags.get("--output")) != "json":
            raise Refused("the stand-in answers `get` only with -o json")
        if not pos or pos[0] not in KINDS:
            raise Refused(f"the stand-in does not know the resource type {pos[:1]}")
        kind = KINDS[pos[0]]
        if kind == "event":
            return self.events(pos, flags.get("--field-selector"))
        if "--field-selector" in flags:
            raise Refused("the stand-in selects by field only events")
        selector = flags.get("-l", flags.get("--selector"))
        if selector is not None:
            if kind != "pod" or len(pos) != 1:
                raise Refused("the stand-in lists only pods by label")
            wanted = dict(part.split("=", 1) for part in str(selector).split(","))
            items = []
            for path in sorted((self.root / "pods" / self.ns()).glob("*.json")):
                pod = read_json(path)
                labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
                if pod is not None and all(labels.get(k) == v for k, v in wanted.items()):
                    items.append(pod)
            self.say(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
            return 0
        if len(pos) != 2:
            raise Refused("the stand-in gets one object by name (or pods by -l)")
        found = self._object(kind, pos[1])
        if found is None:
            if flags.get("--ignore-not-found"):
                return 0
            raise Refused(f'Error from server (NotFound): {PLURAL[kind]} "{pos[1]}" not found')
        self.say(json.dumps(found))
        return 0

    # -- get events --field-selector involvedObject.kind=K,involvedObject.name=N -o json
    def events(self, pos, selector):
        if len(pos) != 1 or not selector:
            raise Refused("the stand-in lists events only with --field-selector")
        wanted = dict(part.split("=", 1) for part in str(selector).split(","))
        if set(wanted) - {"involvedObject.kind", "involvedObject.name"}:
            raise Refused(f"the stand-in selects events only by involvedObject.kind and .name, not {selector}")
        items = []
        for path in sorted((self.root / "events" / self.ns()).glob("*.json")):
            event = read_json(path) or {}
            involved = event.get("involvedObject") or {}
            if all(involved.get(key.split(".", 1)[1]) == value for key, value in wanted.items()):
                items.append(event)
        self.say(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        return 0

    # -- apply -f - [--server-side --force-conflicts --field-manager=M]
    def apply(self, words):
        flags, pos = self.flags(words, {"-f": True, "--filename": True, "--server-side": False,
                                        "--force-conflicts": False, "--field-manager": True})
        if pos or flags.get("-f", flags.get("--filename")) != "-":
            raise Refused("the stand-in applies only `-f -` (stdin)")
        if flags.get("--force-conflicts") and not flags.get("--server-side"):
            raise Refused("error: --force-conflicts only works with --server-side")
        docs = [d for d in yaml.safe_load_all(self.stdin or "") if d]
        if not docs:
            raise Refused("error: no objects passed to apply")
        for doc in docs:
            kind = KINDS.get(str(doc.get("kind", "")).lower())
            if kind not in ("rayjob", "configmap", "secret"):
                raise Refused(f"the stand-in does not apply kind {doc.get('kind')}")
            if kind == "rayjob" and not (self.root / "crds" / "rayjobs.ray.io").exists():
                raise Refused('error: resource mapping not found for name: "%s" namespace: "" from "STDIN": no '
                              'matches for kind "RayJob" in version "ray.io/v1"\nensure CRDs are installed first'
                              % doc["metadata"]["name"])
            meta = doc["metadata"]
            if meta.get("namespace") and self.namespace and meta["namespace"] != self.namespace:
                raise Refused(f'error: the namespace from the provided object "{meta["namespace"]}" does not match '
                              f'the namespace "{self.namespace}". You must pass \'--namespace={meta["namespace"]}\' '
                              f'to perform this operation.')
            if not flags.get("--server-side"):  # client-side apply keeps the object in an annotation; the server caps them
                kept = sum(len(k) + len(str(v)) for k, v in (meta.get("annotations") or {}).items())
                text = json.dumps(doc, separators=(",", ":"))  # as Go writes it: <, >, & as 6-byte escapes
                if kept + len(LAST_APPLIED) + len(text.encode()) + 5 * sum(map(text.count, "<>&")) > ANNOTATIONS_LIMIT:
                    raise Refused(f'The {doc["kind"]} "{meta["name"]}" is invalid: metadata.annotations: Too long: '
                                  f'must have at most {ANNOTATIONS_LIMIT} bytes')
            ns = meta.get("namespace") or self.ns()
            path = self._path(kind, meta["name"], ns)
            existed = path.exists()
            write_json(path, doc)
            how = "serverside-applied" if flags.get("--server-side") else "configured" if existed else "created"
            self.say(f"{kind}/{meta['name']} {how}" if kind != "rayjob" else f"rayjob.ray.io/{meta['name']} {how}")
        return 0

    # -- delete KIND/NAME... [--ignore-not-found]
    def delete(self, words):
        flags, pos = self.flags(words, {"--ignore-not-found": False})
        if not pos or any("/" not in p for p in pos):
            raise Refused("the stand-in deletes only KIND/NAME arguments")
        while (self.root / "hold-delete").exists():
            time.sleep(0.05)
        for item in pos:
            kind_word, name = item.split("/", 1)
            kind = KINDS.get(kind_word)
            if kind not in ("rayjob", "configmap", "secret"):
                raise Refused(f"the stand-in does not delete {kind_word}")
            path = self._path(kind, name, self.ns())
            if not path.exists():
                if flags.get("--ignore-not-found"):
                    continue
                raise Refused(f'Error from server (NotFound): {PLURAL[kind]} "{name}" not found')
            path.unlink()
            self.say(f'{PLURAL[kind].split(".")[0].rstrip("s")}{".ray.io" if kind == "rayjob" else ""} '
                     f'"{name}" deleted')
        return 0

    # -- logs [-f] POD -c CONTAINER
    def _container(self, pod: str, container: str):
        data = read_json(self.root / "pods" / self.ns() / f"{pod}.json")
        if data is None:
            return None, None
        status = data.get("status") or {}
        states = {c["name"]: c for c in (status.get("initContainerStatuses") or [])
                  + (status.get("containerStatuses") or [])}
        return data, states.get(container)

    def logs(self, words):
        flags, pos = self.flags(words, {"-f": False, "--follow": False, "-c": True, "--container": True})
        container = flags.get("-c", flags.get("--container"))
        if len(pos) != 1 or not container:
            raise Refused("the stand-in implements `logs [-f] POD -c CONTAINER`")
        pod = pos[0]
        data, status = self._container(pod, container)
        if data is None:
            raise Refused(f'Error from server (NotFound): pods "{pod}" not found')
        spec = data.get("spec") or {}
        names = [c["name"] for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])]
        if container not in names:
            raise Refused(f"error: container {container} is not valid for pod {pod}")
        state = (status or {}).get("state") or {}
        if "running" not in state and "terminated" not in state:
            reason = (state.get("waiting") or {}).get("reason") or "PodInitializing"
            raise Refused(f'Error from server (BadRequest): container "{container}" in pod "{pod}" is waiting to '
                          f'start: {reason}')
        path = self.root / "logs" / self.ns() / pod / f"{container}.log"
        offset = 0
        follow = flags.get("-f") or flags.get("--follow")
        while True:
            data, status = self._container(pod, container)
            ended = data is None or "terminated" in ((status or {}).get("state") or {})
            try:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
            except OSError:
                chunk = b""
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
                offset += len(chunk)
            if not follow or ended:
                return 0
            time.sleep(0.1)

    # -- port-forward pod/POD|svc/NAME LOCAL:REMOTE
    def port_forward(self, words):
        _, pos = self.flags(words, {})
        if len(pos) != 2 or "/" not in pos[0]:
            raise Refused("the stand-in implements `port-forward pod/POD|svc/NAME LOCAL:REMOTE`")
        kind, name = pos[0].split("/", 1)
        local, _, remote = pos[1].rpartition(":")
        pods = {p.stem: read_json(p) for p in (self.root / "pods" / self.ns()).glob("*.json")}
        if kind in ("svc", "service"):
            if not name.endswith("-head-svc"):
                raise Refused(f'Error from server (NotFound): services "{name}" not found')
            cluster = name[: -len("-head-svc")]
            heads = [p for p in pods.values() if p and p["metadata"]["labels"].get("ray.io/cluster") == cluster
                     and p["metadata"]["labels"].get("ray.io/node-type") == "head"]
            if not heads:
                raise Refused(f'Error from server (NotFound): services "{name}" not found')
            pod = heads[0]
        elif kind == "pod":
            pod = pods.get(name)
            if pod is None:
                raise Refused(f'Error from server (NotFound): pods "{name}" not found')
        else:
            raise Refused(f"the stand-in forwards only pod/ and svc/, not {kind}/")
        status = pod.get("status") or {}
        if status.get("phase") != "Running" or not status.get("podIP"):
            raise Refused(f"error: unable to forward port because pod is not running. Current status="
                          f"{status.get('phase')}")
        target = (status["podIP"], int(remote))
        server = socket.create_server(("127.0.0.1", int(local or remote)))
        self.say(f"Forwarding from 127.0.0.1:{int(local or remote)} -> {remote}")
        while True:
            client, _ = server.accept()
            threading.Thread(target=relay, args=(client, target), daemon=True).start()


def relay(client: socket.socket, target: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return

    def pump(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
    pump(client, upstream)


def main(argv: list[str]) -> int:
    root = Path(os.environ["KUBE_STANDIN_DIR"])
    stdin = sys.stdin.read() if ("-f" in argv and "-" in argv) or "--filename=-" in argv else None
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "argv.jsonl", "a") as out:
        out.write(json.dumps({"argv": ["kubectl", *argv], "stdin": redacted(stdin)}) + "\n")
    try:
        return Kubectl(root, argv, stdin).run()
    except Refused as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130


# ------------------------------------------------------------------ for tests


def install(directory: Path, env: dict | None = None) -> dict:
    """A `kubectl` shim in directory/bin that runs this stand-in over directory/kube (KubeRay's
    CRDs installed), and the environment that puts it first on PATH: env updated and returned."""
    bin_dir, root = directory / "bin", directory / "kube"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (root / "crds").mkdir(parents=True, exist_ok=True)
    (root / "crds" / "rayjobs.ray.io").write_text("")
    shim = bin_dir / "kubectl"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    shim.chmod(0o755)
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["KUBE_STANDIN_DIR"] = str(root)
    return env


def calls(root: Path) -> list[dict]:
    """Every invocation so far: {"argv", "stdin"}."""
    try:
        return [json.loads(line) for line in (root / "argv.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        return []


def pod(name: str, cluster: str, head: bool, phase: str = "Pending", containers=None, init=None,
        conditions=None, ip: str | None = None, group: str = "workers") -> dict:
    """A Pod as the controller writes it. `containers`/`init`: name -> state dict ({"running": {}},
    {"waiting": {"reason": R}}, {"terminated": {"exitCode": 0}}) or None (no status yet)."""
    containers = containers or {}
    init = init or {}

    def statuses(found):
        return [{"name": n, "ready": "running" in (s or {}), "restartCount": 0, "state": s} for n, s in found.items()
                if s is not None]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {
                "ray.io/cluster": cluster, "ray.io/node-type": "head" if head else "worker",
                "ray.io/group": "headgroup" if head else group}},
            "spec": {"containers": [{"name": n} for n in containers], "initContainers": [{"name": n} for n in init]},
            "status": {"phase": phase, "podIP": ip, "conditions": conditions or [],
                       "initContainerStatuses": statuses(init), "containerStatuses": statuses(containers)}}


def write_pod(root: Path, data: dict, ns: str = "default") -> None:
    write_json(root / "pods" / ns / f"{data['metadata']['name']}.json", data)


def write_status(root: Path, name: str, ns: str = "default", **status) -> None:
    write_json(root / "status" / ns / "rayjob" / f"{name}.json", status)


def write_event(root: Path, name: str, kind: str, involved: str, reason: str, message: str,
                ns: str = "default") -> None:
    write_json(root / "events" / ns / f"{name}.json", {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": ns},
        "involvedObject": {"kind": kind, "name": involved, "namespace": ns}, "reason": reason,
        "message": message, "type": "Warning"})


def append_log(root: Path, pod_name: str, container: str, text: str, ns: str = "default") -> None:
    path = root / "logs" / ns / pod_name / f"{container}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(text)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
