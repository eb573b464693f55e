"""The ConfigMap that carries the plan and the node agent to every pod: the plan as readable `data`,
the agent's package as one xz-compressed tar in `binaryData` (so the object stays below the 256 KiB
`kubectl apply -f` keeps of it in its last-applied annotation), and the `ray` stand-in an image without
Ray needs for KubeRay's wait-gcs-ready. And the shell lines that unpack the agent into the pod's
emptyDir at NODE_DIR and run it there, which the pods' containers and the RayJob's entrypoint share.
"""

from __future__ import annotations

import base64
import io
import json
import lzma
import shlex
import tarfile
from pathlib import Path

from ...errors import BadInput
from ...plan import Plan
from ..shipping import AGENT, LIB, NODE_DIR, NODE_ENTRY, module_files
from .options import KubeRayPlacement

#: The API server's cap on an object's annotations (keys and values), and the one where client-side
#: `kubectl apply -f` keeps the whole object.
ANNOTATIONS_LIMIT = 256 * 1024
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
#: Where the pods mount the ConfigMap (read-only): the plan, and lib/ as one archive that each pod
#: unpacks into NODE_DIR (an emptyDir: the agent runs from there as on every provider).
CONFIGMAP_DIR = "/opt/rlhf-tasks-configmap"
#: The ConfigMap's binaryData key of that archive.
LIB_ARCHIVE = "lib.tar.xz"
#: ConfigMap keys for an image without Ray: BASH_ENV appends the ConfigMap's directory to PATH in
#: KubeRay's `bash -c` lines, where `ray` (ray_standin.py) answers wait-gcs-ready's health check.
RAY_PATH_KEY, RAY_STANDIN_KEY = "ray-path.sh", "ray"
RAY_PATH_SH = (f'case ":$PATH:" in *":{CONFIGMAP_DIR}:"*) ;; *) PATH="$PATH:{CONFIGMAP_DIR}" ;; esac\n')


def pack(files: dict[str, str]) -> bytes:
    """Path -> text as an xz-compressed tar that is the same bytes for the same files (sorted members,
    fixed times, owners and modes; xz keeps no time): render stays pure, a re-apply changes nothing.
    xz, not gzip: the agent gzipped came within 1 KiB of the annotations' cap, xz takes a fifth less,
    and the pods' python3 unpacks either (tarfile.open detects it). xz's default preset, 6: 9 with its extreme
    flag packs 92 bytes less of 87 KB in 1.7 times as long, most of what `render` takes (benchmarks/RESULTS.md)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files):
            data = files[path].encode()
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(raw.getvalue(), preset=6)


def last_applied_size(obj: dict) -> int:
    """The bytes of annotations `kubectl apply -f` gives an object: its key and the object as compact
    JSON, which Go writes with `<`, `>`, `&` as 6-byte escapes."""
    text = json.dumps(obj, separators=(",", ":"))
    return len(LAST_APPLIED) + len(text.encode()) + 5 * sum(text.count(c) for c in "<>&")


def unpack_shell() -> str:
    """A shell command that unpacks the ConfigMap's archive into NODE_DIR with the image's python3
    (tarfile, the data filter where the Python has it)."""
    program = ("import sys, tarfile; t = tarfile.open(sys.argv[1]); "
               "t.extraction_filter = getattr(tarfile, \"data_filter\", None); t.extractall(sys.argv[2])")
    return shlex.join(["python3", "-c", program, f"{CONFIGMAP_DIR}/{LIB_ARCHIVE}", NODE_DIR])


def shipped(plan: Plan) -> dict[str, str]:
    """Path below NODE_DIR -> content: the agent's package (with what the recipe imports) under lib/."""
    return {f"{LIB}/{path}": text for path, text in module_files([AGENT, *plan.modules]).items()}


def plan_path(plan: Plan) -> str:
    return f"{CONFIGMAP_DIR}/{plan.name}.plan.json"


def configmap_document(plan: Plan, options: KubeRayPlacement) -> dict:
    configmap = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": metadata(plan, options, configmap_name(plan)),
                 "data": {f"{plan.name}.plan.json": plan.to_json(), RAY_PATH_KEY: RAY_PATH_SH,
                          RAY_STANDIN_KEY: (Path(__file__).parent / "ray_standin.py").read_text()},
                 "binaryData": {LIB_ARCHIVE: base64.b64encode(pack(shipped(plan))).decode()}}
    size = last_applied_size(configmap)
    if size > ANNOTATIONS_LIMIT:
        raise BadInput(f"--provider kuberay: the ConfigMap (plan and packed agent) would take {size} bytes of "
                       f"annotations once `kubectl apply -f` keeps it in {LAST_APPLIED}; the API server "
                       f"caps them at {ANNOTATIONS_LIMIT}")
    return configmap


def configmap_name(plan: Plan) -> str:
    return f"{plan.name}-rlhf-tasks"


def metadata(plan: Plan, options: KubeRayPlacement, name: str, labels: dict | None = None) -> dict:
    meta: dict = {"name": name}
    if options.namespace:
        meta["namespace"] = options.namespace
    meta["labels"] = {"app.kubernetes.io/managed-by": "rlhf-tasks", "rlhf-tasks/task": plan.name, **(labels or {})}
    return meta


def agent_shell(plan: Plan, *flags: str, unpack: bool = False) -> str:
    """A shell line that runs the agent (unpacked from the ConfigMap first, with `unpack`) with one
    of its attached roles."""
    agent = shlex.join(["python3", NODE_ENTRY, "--plan", plan_path(plan), *flags])
    line = f"export PYTHONPATH={NODE_DIR}/{LIB}${{PYTHONPATH:+:$PYTHONPATH}} && {agent}"
    return f"{unpack_shell()} && {line}" if unpack else line
