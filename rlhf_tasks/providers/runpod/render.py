"""What is pure of the RunPod provider: its contracts and network presets, the task's
checks, and the rendered files: `NAME.start.sh` (the agent and the plan in heredocs, then
the agent) and the create requests of RunPod's REST API v2 (`NAME.runpod.json`), whose env
references the task's secrets in RunPod's vault (`{{ RUNPOD_SECRET_rlhf-tasks.NAME.VARIABLE }}`,
vault.py), never their values; `launch` fills the head pod's id and the data center (`filled`)."""

from __future__ import annotations

import base64
import gzip
import lzma
import json
import os
import re
import shlex
from typing import Any

from pydantic import Field

from ...errors import BadInput
from ...gpu_spec import gpu_memory_words
from ...models import StrictModel, size_bytes
from ...agent.protocol import RESULT_PREFIX
from ...plan import Contract, MachinePrice, Plan, SelfEnd, env, template
from ...spec import Task
from ..base import Sharing
from ..shipping import NODE_DIR, WRITTEN_BY, plan_file, agent_command, heredoc, node_path, shared_entry, shipped_files
from . import vault

NAME = "runpod"
#: RunPod GPU type ids for the short names a task writes (`resources.gpus: H100:8`); a name
#: not here is sent as written, and `launch` checks it against RunPod's catalog.
GPU_TYPES = {
    "h100": "NVIDIA H100 80GB HBM3", "h100sxm": "NVIDIA H100 80GB HBM3", "h100pcie": "NVIDIA H100 PCIe",
    "h100nvl": "NVIDIA H100 NVL", "h200": "NVIDIA H200", "b200": "NVIDIA B200",
    "a100": "NVIDIA A100-SXM4-80GB", "a10080gb": "NVIDIA A100-SXM4-80GB", "a10080g": "NVIDIA A100-SXM4-80GB", "a100sxm": "NVIDIA A100-SXM4-80GB",
    "a100pcie": "NVIDIA A100 80GB PCIe", "l40s": "NVIDIA L40S", "l40": "NVIDIA L40", "a40": "NVIDIA A40",
    "rtx4090": "NVIDIA GeForce RTX 4090", "rtxa6000": "NVIDIA RTX A6000", "a6000": "NVIDIA RTX A6000",
    "mi300x": "AMD Instinct MI300X OAM",
}
#: Global Networking and Instant Clusters need a GPU on every pod: a task without one gets this.
DEFAULT_GPU = "NVIDIA A40"
#: A task without an image gets RunPod's PyTorch image (python3; the recipe's setup installs Ray where missing).
DEFAULT_IMAGE = "runpod/pytorch:1.0.2-cu1281-torch280-ubuntu2404"
MAX_ARGS = 120 * 1024              # one argument of `bash -c` stays below Linux's 128 KiB per argument
GLOBAL_LINK = "100 Mbit/s"         # between Global Networking pods (RunPod's docs)

#: The guide's contract: RAY_WORKER unset/0 on the head, > 0 on workers; workers know
#: HEAD_POD_ID; every pod resolves `<podId>.runpod.internal`. The head has no HEAD_POD_ID and
#: uses its own address. The node count defaults to the plan's (EXPECTED_WORKERS is optional).
POD_CONTRACT = Contract(
    rank=env("RAY_WORKER", default="0"),
    nodes=env("EXPECTED_WORKERS", plus=1),
    head=template("{HEAD_POD_ID}.runpod.internal"),
    node_addr=template("{RUNPOD_POD_ID}.runpod.internal"),
    cluster_id=env("RUNPOD_POD_ID"),
)
#: How a pod ends itself once its agent is done: RunPod puts RUNPOD_POD_ID and a key scoped to that pod
#: (RUNPOD_API_KEY, "used to make RunPod API calls to the specific pod. It's limited in scope to only the
#: pod": runpod/docs, pods/references/environment-variables) in every pod; the user's own key never goes
#: into a pod. RUNPOD_API_URL moves the API, as for the launcher (the tests' stand-in sets it in its pods).
#: Instant Clusters have none: their pods "cannot be modified or deleted via the pod endpoints".
SELF_END = SelfEnd(method="POST", url="{RUNPOD_API_URL}/pods/{RUNPOD_POD_ID}/action",
                   defaults={"RUNPOD_API_URL": "https://api.runpod.io/v2"}, json_body={"action": "terminate"},
                   bearer_env="RUNPOD_API_KEY", what="terminate this pod (RunPod's pod-scoped key)")
#: What RunPod bills a pod: its `cost`, "Current cost in USD per hour (0.0 when EXITED or TERMINATED)" (the Pod
#: schema; the catalog's GpuType.price is a list price: "the rate actually billed for a pod is reported as `cost`
#: on the pod itself", and negotiated discounts are not in it). The head reads its own pod's with the pod-scoped
#: key once it runs (the pods are created from one request: the same GPU type, count, cloud and data center) and
#: counts it for every node; where RunPod gives none, the catalog's price the plan carries.
MACHINE_PRICE = MachinePrice(url="{RUNPOD_API_URL}/pods/{RUNPOD_POD_ID}",
                             defaults={"RUNPOD_API_URL": "https://api.runpod.io/v2"}, bearer_env="RUNPOD_API_KEY",
                             field="cost", what="RunPod's `cost` of this pod")
#: What RunPod sets on every node of an Instant Cluster.
CLUSTER_CONTRACT = Contract(
    rank=env("NODE_RANK"),
    nodes=env("NUM_NODES"),
    head=env("PRIMARY_ADDR"),
    node_addr=env("NODE_ADDR"),
    cluster_id=env("RUNPOD_POD_ID"),
    gpus_per_node=env("NUM_TRAINERS"),
)
#: `{iface}` is the interface that holds the node's address, found on the node: the pod's
#: Global Networking interface, or an Instant Cluster's overlay (ens1 today, eth1 on older ones).
#: The rest is the OpenRLHF-M guide's list (github.com/the-laughing-monkey/OpenRLHF-M,
#: docs/RunPodding_Multinode.md at 75e1d42, "Set these on both the head and worker nodes"), with one
#: change: its `NCCL_NET_SOCKET_FAMILY=IPv4` is no variable of NCCL's, which reads NCCL_SOCKET_FAMILY and
#: takes only AF_INET or AF_INET6 (src/misc/socket.cc, ncclEnvSocketFamily; `IPv4` leaves the family
#: free), so it is NCCL_SOCKET_FAMILY=AF_INET here. FORCE_MODEL_INIT_TO_CUDA is the guide's as it stands.
GLOBAL_PRESET = {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}", "NCCL_IB_DISABLE": "1",
                 "NCCL_SOCKET_FAMILY": "AF_INET", "NCCL_LAUNCH_MODE": "GROUP", "NCCL_SOCKET_NTHREADS": "1",
                 "NCCL_NSOCKS_PERTHREAD": "1", "FORCE_MODEL_INIT_TO_CUDA": "1"}
CLUSTER_PRESET = {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}"}


#: Which storage RunPod's pods share (RunPod's storage docs and its REST API v2, /work/shared/runpod/openapi-v2.json).
SHARING = (
    Sharing("network_volume", "pods (Global Networking) or an Instant Cluster", "yes",
            "a network volume is \"Shareable: Yes (across Pods)\" (docs.runpod.io/pods/storage/types) and lives in "
            "one data center, where `launch` creates the pods (catalog.py); a pod mounts at most one "
            "(REST API v2 Mounts.network, maxItems 1)"),
)


class RunPodShared(StrictModel):
    """`checkpoints.shared.runpod`: a network volume every pod mounts at checkpoints.path."""

    network_volume: str = Field(description="id of a RunPod network volume; it lives in one data center, "
                                "where the pods then go")


def is_cluster(plan_or_task) -> bool:
    return plan_or_task.network == "runpod-cluster"


def gpu_request(resources, chosen: str | None = None) -> tuple[str, int]:
    """(RunPod GPU type id, GPUs per pod) for the task's `resources.gpus`: the type `launch` chose from RunPod's
    catalog where given; for GPUs given by memory alone, before that, words saying so (see memory_note)."""
    if not resources.gpus:
        return DEFAULT_GPU, 1
    name = resources.gpu_name
    if chosen or (resources.gpu_memory and not name):
        return chosen or f"a GPU type of {gpu_memory_words(resources.gpu_memory)}", resources.gpus_per_node
    key = re.sub(r"[^a-z0-9]", "", (name or "").lower())
    return GPU_TYPES.get(key, name), resources.gpus_per_node


def pod_names(name: str) -> re.Pattern:
    """The names this provider gives a task's pods, and nothing else of the account."""
    return re.compile(rf"^{re.escape(name)}-(head|worker-\d+)$")


def start_args(script: str) -> str:
    """The pod's `args`: the start script, compressed, in one `bash -c` word (quotes do not
    survive RunPod's splitting, base64 has none). Two stages: the script xz-compressed (a fifth
    smaller than gzip: the demo's no longer fits a pod's args with gzip) and unpacked by the
    python3 the node agent needs anyway (an image need not have `xz`), in a short first stage
    that gzip and base64 carry."""
    packed = base64.b64encode(lzma.compress(script.encode(), preset=9 | lzma.PRESET_EXTREME)).decode()
    first = ('python3 -c "import base64, lzma, sys; sys.stdout.buffer.write(lzma.decompress(base64.b64decode('
             'sys.stdin.read())))" > /tmp/rlhf-tasks-start.sh <<\'RLHF_TASKS_START\'\n' + packed +
             "\nRLHF_TASKS_START\nexec bash /tmp/rlhf-tasks-start.sh\n")
    encoded = base64.b64encode(gzip.compress(first.encode(), mtime=0)).decode()
    return (f"bash -c 'echo {encoded} | base64 -d | gzip -dc > /tmp/rlhf-tasks-unpack.sh; "
            f"exec bash /tmp/rlhf-tasks-unpack.sh'")


def _shipped(path: str, text: str) -> str:
    """A shipped file written where it goes on the node (its directory made first)."""
    return f"mkdir -p {shlex.quote(os.path.dirname(path))}\n" + "\n".join(heredoc(shlex.quote(path), text)) + "\n"


def cross_node_traffic(plan: Plan) -> str:
    """What the recipe sends between nodes, in words (for the 100 Mbit/s warning)."""
    argv = plan.job.entrypoint

    def flag(*names: str) -> str | None:
        for index, arg in enumerate(argv[:-1]):
            if arg in names:
                return argv[index + 1]
        return None

    engines = flag("--vllm_num_engines", "--vllm.num_engines")
    if engines and engines != "0":
        backend = flag("--vllm_sync_backend", "--vllm.sync_backend") or "nccl"
        return (f"the recipe moves weights across pods: after every training step the actor sends its weights to "
                f"{engines} vLLM engines spread over the {plan.nodes} pods ({backend} weight sync)")
    if any(arg.startswith("trainer.nnodes=") and arg != "trainer.nnodes=1" for arg in argv):
        return ("the recipe moves weights across pods: verl shards the model over the pods (FSDP), so parameters "
                "and gradients cross the link on every step")
    return "training across pods sends its gradients over it"


#: The portable placement fields RunPod cannot use: said by `check` and ignored (base.Provider.ignores). Its REST
#: API v2 has no bid and no price bound (CreatePodRequest and CreateClusterRequest: no price field), and creates
#: on-demand pods only.
IGNORES = {
    "spot": "RunPod's v2 API creates on-demand pods only: the launcher shows the catalog's on-demand (secure) "
            "price, and the head counts what RunPod bills its pod",
    "retry": "the RunPod provider does not relaunch lost pods; the head restarts the job (job.max_restarts) while "
             "its pod lives",
    "price_per_hour": "RunPod's own price is counted: each pod's billed `cost` once it runs, the catalog's list price "
                      "where RunPod gives none (the launcher shows the catalog's and asks before it creates "
                      "anything); RunPod's v2 API takes no price bound or bid for a pod",
    "fleets": "RunPod has no fleets",
    "backends": "RunPod is one backend",
}

#: Recipes whose roles move the model's weights between nodes at every step (an actor's to vLLM engines,
#: verl's FSDP shards): over Global Networking's link, the step waits on it.
WEIGHT_SYNC_RECIPES = ("openrlhf-ppo", "openrlhf-m-grpo", "verl-ppo", "search-r1")
GLOBAL_LINK_BITS = 100e6


def shm_warning(plan: Plan) -> str | None:
    """resources.shm_size is not applied: RunPod's create request (REST v2 `CreatePodRequest`, its
    `ContainerConfig`: ../shared/runpod/openapi-v2.json) has no field for /dev/shm."""
    if not plan.resources.shm_size:
        return None
    return (f"resources.shm_size {plan.resources.shm_size} is not applied: RunPod's create request (REST API v2 "
            f"CreatePodRequest) has no size for /dev/shm, so a pod's /dev/shm is what RunPod's machine for the "
            f"GPU type gives it; NCCL and vLLM on one pod need it large (check `df -h /dev/shm` on a pod)")


def weight_sync_warning(plan: Plan) -> str | None:
    """Pods with Global Networking and a recipe that syncs weights across them: what the 100 Mbit/s link
    costs each step, from the model's size where its name says it (plan.py model_weights)."""
    if is_cluster(plan) or plan.nodes < 2 or plan.job.recipe not in WEIGHT_SYNC_RECIPES:
        return None
    model, weight_bytes = plan.preflight.model, plan.preflight.weight_bytes
    if weight_bytes:
        seconds = weight_bytes * 8 / GLOBAL_LINK_BITS
        took = f"{seconds / 60:.0f} m" if seconds < 3600 else f"{seconds / 3600:.1f} h"
        cost = (f"one bf16 copy of {model}'s weights ({weight_bytes / 1e9:.0f} GB) takes about {took} at that "
                f"rate, at every weight sync")
    else:
        cost = f"each GB of weights takes {8e9 / GLOBAL_LINK_BITS:.0f} s at that rate ({model or 'the model'}: " \
               f"its name says no size)"
    return (f"network: {plan.network}: Global Networking links the {plan.nodes} pods at {GLOBAL_LINK} (RunPod's "
            f"docs), and {cross_node_traffic(plan)}: {cost}; network: runpod-cluster (an Instant Cluster, "
            f"1.6-3.2 Tbit/s between nodes) moves it in seconds")


def check(task: Task) -> None:
    """The provider's own checks of a task (BadInput naming the field)."""
    shared_entry(RunPodShared, task.checkpoints.shared.get(NAME), NAME)
    if task.network == "infiniband":
        raise BadInput("network: infiniband: RunPod pods have no InfiniBand between them; use runpod-cluster "
                       "(an Instant Cluster, 1.6-3.2 Tbit/s between nodes) or runpod-global (pods, 100 Mbit/s)")
    if is_cluster(task) and task.nodes < 2:  # RunPod v2: ClusterCompute.podCount "minimum": 2
        raise BadInput(f"nodes: an Instant Cluster has at least 2 nodes, not {task.nodes}; use "
                       f"network: runpod-global for a single pod")
    if is_cluster(task) and task.nodes > 250:  # RunPod v2: ClusterCompute.podCount "maximum": 250
        raise BadInput(f"nodes: an Instant Cluster has at most 250 nodes, not {task.nodes}")
    if is_cluster(task) and task.groups:  # RunPod v2: CreateClusterRequest.compute is one gpuTypeId, gpuCountPerPod
        kinds = {gpu_request(group.resources)[:2] for group in task.groups}
        if len(kinds) > 1:
            index = next(i for i, group in enumerate(task.groups)
                         if gpu_request(group.resources)[:2] != gpu_request(task.groups[0].resources)[:2])
            raise BadInput(f"groups[{index}].resources.gpus: an Instant Cluster is one GPU type and count on every "
                           f"node (its create request's compute: one gpuTypeId and gpuCountPerPod), and group "
                           f"{task.groups[index].name} differs from {task.groups[0].name}; use network: "
                           f"runpod-global (pods per group, each its own GPU type)")
    if "RUNPOD_API_KEY" in task.secrets:
        raise BadInput("secrets: RUNPOD_API_KEY: your RunPod API key is never written into a pod (RunPod gives "
                       "each pod a key of its own, scoped to that pod, as RUNPOD_API_KEY); remove it")


#: Files of a working_dir that hold credentials by convention: never shipped in a pod's start command, which
#: anyone who can read the account's pods reads (a task's secrets go through RunPod's vault instead).
CREDENTIAL_FILES = re.compile(r"^(\.env(\..*)?|\.netrc|\.pgpass|id_(rsa|dsa|ecdsa|ed25519)|.*\.(pem|key|p12|pfx))$")


def pack(path: str, excludes: list[str]) -> bytes:
    """job.working_dir as a tar.gz of what Ray would upload from it (its excludes, .gitignore and
    .rayignore, virtualenvs left out: workdir.py), the same bytes for the same files. BadInput when
    it holds a credentials file (CREDENTIAL_FILES)."""
    import io
    import tarfile

    from ... import workdir

    files: list = []
    workdir.measure(path, excludes, files)
    root = os.path.abspath(path)
    credentials = sorted(os.path.relpath(str(f), root) for f in files if CREDENTIAL_FILES.match(f.name))
    if credentials:
        raise BadInput(f"job.working_dir: {path} holds {', '.join(credentials)}, which would be shipped in the pods' "
                       f"start command, readable by whoever can read the pods of your RunPod account; leave "
                       f"{'it' if len(credentials) == 1 else 'them'} out with job.excludes (and pass the values as "
                       f"secrets:, which go through RunPod's vault)")
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for file in sorted(files):
            info = tar.gettarinfo(str(file), os.path.relpath(str(file), root))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(file, "rb") as handle:
                tar.addfile(info, handle)
    return buffer.getvalue()


def shipped_lines(archive: bytes | None) -> list[str]:
    """Start-script lines that unpack job.working_dir where the agent runs (the pod's directory for it)."""
    if archive is None:
        return ["# job.working_dir: none shipped (the task names none): the job runs in this empty directory"]
    encoded = base64.b64encode(archive).decode()
    return [f"# job.working_dir, shipped: {len(archive)} bytes (tar.gz), unpacked where the agent runs",
            f"base64 -d > {NODE_DIR}/workdir.tar.gz <<'RLHF_TASKS_WORKDIR'",
            *(encoded[i:i + 76] for i in range(0, len(encoded), 76)), "RLHF_TASKS_WORKDIR",
            f"python3 -m tarfile -e {NODE_DIR}/workdir.tar.gz . && rm -f {NODE_DIR}/workdir.tar.gz && "
            'say "job.working_dir unpacked in $PWD"']


def start_script(plan: Plan, archive: bytes | None = None) -> str:
    """What every pod runs: it writes the agent and the plan under /opt/rlhf-tasks and
    starts the agent (which runs the setup commands), then keeps the pod up, so that a
    container restart never runs the job twice. `archive`: job.working_dir (pack), unpacked
    in the directory the agent runs in, which the head submits the job with."""
    cluster = is_cluster(plan)
    preset = " ".join(f"{k}={v}" for k, v in plan.network_env.items())
    lines = [
        "#!/usr/bin/env bash",
        f"# rlhf-tasks: one node of {plan.name} ({plan.nodes} nodes) on RunPod. Rendered by rlhf-tasks; it names",
        "# secrets only (safe to commit). It carries the node agent and the plan: the image needs python3 and",
        "# Ray, nothing else (the task's setup runs first on every node).",
    ]
    if cluster:
        lines += [
            "# Instant Cluster: RunPod sets NODE_RANK, NUM_NODES, PRIMARY_ADDR, NODE_ADDR and NUM_TRAINERS on",
            "# every node; give every node:",
        ]
    else:
        lines += [
            "# Pods with Global Networking (the OpenRLHF-M guide's variables), every pod:",
            "#   RAY_WORKER        unset or 0 on the head; on each worker its own rank, 1 to N-1 (the create",
            "#                     requests give worker-k RAY_WORKER=k)",
            "#   HEAD_POD_ID       on the workers: the head pod's id (they reach it as <id>.runpod.internal)",
            f"#   EXPECTED_WORKERS  optional: how many workers the head waits for ({plan.nodes - 1} in this plan)",
        ]
    lines += [
        f"#   RAY_AUTH_TOKEN    the cluster's Ray token: rlhf-tasks token {plan.name}",
        "#   WANDB_API_KEY     optional: W&B logging when set",
        "#   DEBUG_RAY=1       optional: Ray's legacy debugger (`ray debug` on the head)",
        f"# Network preset {plan.network}: {preset or 'none'}",
        "#   ({iface}: the interface that holds this node's address, found on the node; the task's env",
        "#   overrides any of them).",
    ]
    if not cluster and plan.nodes > 1:
        lines.append(f"# Global Networking links the pods at {GLOBAL_LINK}.")
    lines += [
        "# As a pod's start command (RunPod's args replace the image's CMD), see the args of",
        f"# {plan.name}.runpod.json; or copy this file to each pod and run: bash start.sh",
        "set -u",
        'say() { echo "[$(date +%H:%M:%S)] start.sh: $*"; }',
        "",
    ]
    script = "\n".join(lines) + "\n"
    for local, text in shipped_files(plan).items():
        script += _shipped(node_path(local), text)
    plan_path = f"{NODE_DIR}/{plan_file(plan)}"
    # The agent runs the setup commands itself (no --skip-setup): its result line covers them.
    agent = agent_command(plan).replace(" --skip-setup", "")
    keep = (f'say "the pod stays up (and billed) until it is terminated: rlhf-tasks down {plan.name}, '
            f'or RunPod\'s console"')
    script += "\n".join([
        "",
        f"plan={shlex.quote(plan_path)}",
        'if [ "${DEBUG_RAY:-0}" = 1 ]; then',
        "  python3 -c 'import json, sys; p = json.load(open(sys.argv[1])); p[\"ray\"][\"debug\"] = \"legacy\"; "
        "json.dump(p, open(sys.argv[1], \"w\"), indent=2)' \"$plan\" && say \"DEBUG_RAY=1: Ray's legacy debugger is on\"",
        "fi",
        "# SSH (submit: client): RunPod puts the account's keys in PUBLIC_KEY when the pod has startSsh,",
        "# and the image's own start command, which would start sshd, is replaced by this script.",
        'if [ -n "${PUBLIC_KEY:-}" ]; then',
        '  mkdir -p ~/.ssh && chmod 700 ~/.ssh && printf "%s\\n" "$PUBLIC_KEY" >> ~/.ssh/authorized_keys',
        "  chmod 600 ~/.ssh/authorized_keys",
        "  sshd=$(command -v sshd || echo /usr/sbin/sshd)",
        '  if [ ! -x "$sshd" ] && command -v apt-get >/dev/null; then',
        '    say "installing openssh-server (the image has no sshd)"',
        "    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server; } >/dev/null 2>&1",
        "  fi",
        '  if [ -x "$sshd" ]; then',
        '    ssh-keygen -A >/dev/null 2>&1; mkdir -p /run/sshd; "$sshd" && say "sshd started" || say "sshd failed to start"',
        "  else",
        '    say "no sshd in the image: no SSH access"',
        "  fi",
        "fi",
        "export PYTHONUNBUFFERED=1",
        f"mkdir -p {NODE_DIR}/workdir && cd {NODE_DIR}/workdir",
        "if ! command -v python3 >/dev/null 2>&1; then",
        '  say "python3 is not in the image"',
        "  echo '" + RESULT_PREFIX + json.dumps({"error": "python3 is not in the image", "exit_code": 2,
                                                 "failed_step": "starting the node agent"}) + "'",
        f"  {keep}",
        "  exec sleep infinity",
        "fi",
        *shipped_lines(archive),
        agent,
        'say "the node agent exited with code $?"',
        keep,
        "exec sleep infinity",
        "",
    ])
    return script


def disk_gb(size: str) -> int:
    """RunPod's `disk`: a whole number of GB, at least 1 (BaseContainerConfig.disk in its OpenAPI document), rounded
    up so that a pod has at least what the task asks; GB as 10^9 bytes, which is also at least 2^30-byte GB's."""
    return max(1, -(-size_bytes(size) // 10**9))


def disk_note(plan: Plan) -> str | None:
    """What `check` says when RunPod's whole GB is more than the task's disk."""
    disk = plan.resources.disk
    if not disk or disk_gb(disk) * 10**9 == size_bytes(disk):
        return None
    return (f"resources.disk {disk}: RunPod's disk is a whole number of GB (10^9 bytes), so it asks {disk_gb(disk)}GB, "
            f"rounded up")


def secret_names(plan: Plan) -> list[str]:
    """The variables that go through RunPod's vault: the task's secrets and the Ray token's."""
    return plan.secrets + ([plan.token_env] if plan.token_env else [])


def memory_note(plan: Plan) -> str | None:
    """What the requests say for GPUs given by memory alone, where RunPod takes one GPU type per pod."""
    res = plan.resources
    if not res.gpu_memory or res.gpu_name:
        return None
    return (f"resources.gpus {res.gpus} names no GPU type, and a pod has one (CreateGpuConfig.id): `launch` picks "
            f"the cheapest of RunPod's GPU types of that memory (GET /v2/catalog/gpus, each type's `memory`) that "
            f"fits, and says which; by hand, put its id in gpu.id.")


def bodies(plan: Plan, args: str, gpu: str | None = None, gpus: dict[str, str] | None = None) -> dict:
    """The create requests, each secret a reference to its account secret (vault.py); `gpu`: the GPU type
    `launch` chose from the catalog; `gpus`: with node groups, each group's (by name). With groups, the pods
    of each group in the task's order, one Global Networking group (an Instant Cluster is one GPU type: check)."""
    gpu_id, count = gpu_request(plan.groups[0].machine if plan.groups else plan.resources, gpu)
    client = plan.job.submit == "client"
    secrets = {name: vault.reference(plan.name, name) for name in secret_names(plan)}
    image = plan.groups[0].image if plan.groups and is_cluster(plan) else plan.image
    container: dict[str, Any] = {"image": image or DEFAULT_IMAGE, "args": args}
    if plan.resources.disk:
        container["disk"] = disk_gb(plan.resources.disk)
    if client:  # the head's sshd, for the dashboard's SSH forward
        container["ports"] = ["22/tcp"]
    where: dict[str, Any] = {"dataCenterIds": list(plan.placement.regions)} if plan.placement.regions else {}
    shared = shared_entry(RunPodShared, plan.checkpoint_shared, NAME)
    mounts = {"mounts": {"network": [{"volumeId": shared.network_volume, "path": plan.checkpoint_dir}]}} \
        if shared and plan.checkpoint_dir else {}
    if is_cluster(plan):
        body = {"name": plan.name, "type": "TRAINING",
                "compute": {"gpuTypeId": gpu_id, "gpuCountPerPod": count, "podCount": plan.nodes},
                **container, "env": secrets, **where, **mounts, **({"startSsh": True} if client else {})}
        return {"cluster": body}

    def pod(role: str, rank: int, group=None) -> dict:
        contract = {"RAY_WORKER": str(rank), "EXPECTED_WORKERS": str(plan.nodes - 1)}
        if rank:
            contract["HEAD_POD_ID"] = "${HEAD_POD_ID}"
        box, gpu_of = dict(container), {"id": gpu_id, "count": count}
        if group is not None:  # the group's GPU type and count, image and disk (a pod is one GPU type)
            g_id, g_count = gpu_request(group.machine, (gpus or {}).get(group.name))
            gpu_of = {"id": g_id, "count": g_count}
            box["image"] = group.image or DEFAULT_IMAGE
            disk = group.machine.disk
            box.pop("disk", None)
            if disk:
                box["disk"] = disk_gb(disk)
        body = {"name": f"{plan.name}-{role}", **box, "gpu": gpu_of,
                "cloud": "SECURE", "env": {**contract, **secrets}, **where, **mounts}
        if plan.nodes > 1:
            body["globalNetworking"] = True
        if rank == 0 and client:
            body["startSsh"] = True
        elif rank:
            body.pop("ports", None)
        return body

    if plan.groups:  # each pod's RAY_WORKER its rank in its group's range (first_rank on): the agent's group_of
        ranks = [(rank, group) for group in plan.groups
                 for rank in range(group.first_rank, group.first_rank + group.nodes)]
        return {"head": pod("head", 0, ranks[0][1]),
                "workers": [pod(f"worker-{k}", k, group) for k, group in ranks[1:]]}
    return {"head": pod("head", 0), "workers": [pod(f"worker-{k}", k) for k in range(1, plan.nodes)]}


#: A rendered env value that references an account secret.
SECRET_REFERENCE = re.compile(r"\{\{ RUNPOD_SECRET_(\S+) \}\}")


def filled(body: dict, values: dict[str, str], datacenters: list[str], held: set[str] | frozenset = frozenset()) -> dict:
    """A rendered request with its `${NAME}` env values filled (HEAD_POD_ID: never a secret), its
    references kept to the account secrets `held` (a secret not set here is left out, as the
    launcher says), and its data centers chosen."""
    out = json.loads(json.dumps(body))
    env = {}
    for key, value in out.get("env", {}).items():
        match = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", value)
        secret = SECRET_REFERENCE.fullmatch(value)
        if secret is not None:
            if secret.group(1) in held:
                env[key] = value
        elif match is None:
            env[key] = value
        elif values.get(match.group(1)):
            env[key] = values[match.group(1)]
    out["env"] = env
    out["dataCenterIds"] = list(datacenters)
    return out


def too_big_to_ship(working_dir: str, archive: bytes, args: int) -> str:
    """Why job.working_dir cannot be shipped in a pod's start command, and what to do."""
    return (f"job.working_dir: {working_dir} packs {len(archive) // 1024 + 1} KiB (tar.gz), too much for a pod's start "
            f"command, which carries it beside the node agent ({args // 1024} KiB in all, at most {MAX_ARGS // 1024} "
            f"KiB): with job.submit: head nothing else of this machine reaches a pod. Leave out what the job does not "
            f"need (job.excludes, .rayignore), or set job.submit: client (launch then uploads job.working_dir to the "
            f"job through the head's ssh forward), or put the code in the image or on a network volume "
            f"(checkpoints.shared.runpod) and leave job.working_dir out")


def render(plan: Plan, archive: bytes | None = None, gpu: str | None = None,
           gpus: dict[str, str] | None = None) -> dict[str, str]:
    """File name -> content: the create requests and the start script they carry (with
    job.working_dir's `archive`, when the task ships one; with the GPU type `launch` chose, `gpu`)."""
    script = start_script(plan, archive)
    args = start_args(script)
    if len(args) > MAX_ARGS:
        if archive is not None and len(start_args(start_script(plan))) <= MAX_ARGS:
            raise BadInput(too_big_to_ship(plan.job.working_dir, archive, len(args)))
        raise BadInput(f"the start script is too large for a pod's args ({len(args) // 1024} KiB compressed, "
                       f"at most {MAX_ARGS // 1024} KiB): it carries the agent and job.args' shipped modules")
    if is_cluster(plan):
        what = ("POST https://api.runpod.io/v2/clusters. rlhf-tasks launch sets dataCenterIds to one data "
                "center at a time, of those whose Instant Cluster stock has the GPU type, until one takes it.")
    else:
        what = ("POST https://api.runpod.io/v2/pods, the head first, then the workers. rlhf-tasks launch fills "
                "HEAD_POD_ID (the head pod's id) and sets dataCenterIds to one data center at a time, of those "
                "whose catalog entry has Global Networking and the GPU type in stock, until one takes the head; "
                "the workers go to the head's, once RunPod has placed it.")
    notes = [f"{WRITTEN_BY}: the create requests for RunPod's REST API v2: {what} args runs {plan.name}.start.sh "
             "(xz and gzip, base64)."]
    names = secret_names(plan)
    if names:
        made = ", ".join(f"{vault.secret_name(plan.name, name)} (" + (
            f"rlhf-tasks token {plan.name}" if name == plan.token_env else f"your {name}") + ")" for name in names)
        notes.append(
            "Secrets are references to RunPod account secrets, substituted when a pod boots; no value is in a "
            "request. rlhf-tasks launch creates them from your environment and deletes them at rlhf-tasks down "
            f"{plan.name} (and when the launcher sees the cluster end). By hand, before the requests: create "
            f"{made} in RunPod's console (Secrets) or with POST https://api.runpod.io/v2/account/secrets "
            "{\"name\": ..., \"value\": ...}; delete them (DELETE /v2/account/secrets/{id}) once the pods are "
            "terminated.")
    if plan.groups:
        bare = [group.name for group in plan.groups if not group.machine.gpus]
        if bare:
            notes.append(f"groups {', '.join(bare)} have no resources.gpus: each of their pods gets 1x {DEFAULT_GPU} "
                         f"(RunPod pods with Global Networking need an NVIDIA GPU: CreatePodRequest.globalNetworking).")
    elif not plan.resources.gpus:
        why = "an Instant Cluster's pods have GPUs" if is_cluster(plan) else \
            "RunPod pods with Global Networking need an NVIDIA GPU"
        notes.append(f"resources.gpus is not set: every pod gets 1x {DEFAULT_GPU} ({why}); set resources.gpus "
                     f"to choose.")
    ignored = [f"resources.{key}" for key in ("shm_size", "memory") if getattr(plan.resources, key)]
    if ignored:
        notes.append(f"{' and '.join(ignored)} not applied: RunPod sizes a pod's memory and /dev/shm by its "
                     f"GPU type.")
    if disk_note(plan):
        notes.append(disk_note(plan) + ".")
    if memory_note(plan) and not gpu:
        notes.append(memory_note(plan))
    document = {"note": " ".join(notes), **bodies(plan, args, gpu, gpus)}
    return {f"{plan.name}.runpod.json": json.dumps(document, indent=2) + "\n", f"{plan.name}.start.sh": script}
