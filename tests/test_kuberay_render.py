"""KubeRay: every task renders a RayJob that KubeRay v1.7.0's own CRD schema accepts (with
unknown fields refused, as `kubectl apply --validate=strict` would), beside a ConfigMap that
carries the plan and the agent packed in one xz-compressed tar; the options are the provider's own and bad ones name their
field; no secret's value is ever rendered; and the agent's attached roles (prepare before
KubeRay's Ray, a node's services and environment before its `ray start`) do what the pods need."""

from __future__ import annotations

import base64
import copy
import functools
import io
import json
import lzma
import os
import re
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import jsonschema
import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.agent.attached import ray_env_lines
from rlhf_tasks.agent.contract import read_contract
from rlhf_tasks.errors import BadInput
from rlhf_tasks.providers.kuberay import CONFIGMAP_DIR, LIB_ARCHIVE, RAY_ENV_FILE, pack
from rlhf_tasks.providers.kuberay import configmap as kuberay_configmap
from rlhf_tasks.providers.kuberay.configmap import last_applied_size, shipped, unpack_shell
from rlhf_tasks.spec import load_task, parse_task

from conftest import ROOT

#: KubeRay v1.7.0's RayJob CRD schema (its openAPIV3Schema), as KubeRay publishes it.
RAYJOB_SCHEMA = ROOT / "tests" / "data" / "kuberay-rayjobs-v1.schema.json"
TASKS = sorted((ROOT / "tasks").glob("*.yaml"))
#: Tasks whose recipe runs without Ray (torchrun): KubeRay always starts Ray, so they are refused.
NO_RAY = {"openrlhf-dpo-llama3-8b.yaml"}
RAY_TASKS = [t for t in TASKS if t.name not in NO_RAY]
_CONFIGMAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def strict(schema):
    """The CRD's schema with unknown fields refused wherever it lists the fields (the API
    server prunes them silently; a rendered field it would drop is a bug here)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=1)
def spec_validator():
    schema = strict(json.loads(RAYJOB_SCHEMA.read_text()))["properties"]["spec"]
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def render(data_or_path) -> tuple[object, dict, dict, str]:
    provider = providers.get("kuberay")
    task = load_task(data_or_path) if isinstance(data_or_path, Path) else parse_task(data_or_path, "t.yaml")
    plan = provider.plan(task)
    (name, text), = provider.render(plan).items()
    assert name == f"{plan.name}.rayjob.yaml"
    configmap, rayjob = yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return plan, configmap, rayjob, text


def validate(rayjob: dict) -> None:
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    assert _DNS_NAME.match(rayjob["metadata"]["name"]) and len(rayjob["metadata"]["name"]) <= 47
    assert set(rayjob) == {"apiVersion", "kind", "metadata", "spec"}
    spec_validator().validate(rayjob["spec"])


@pytest.mark.parametrize("task_path", RAY_TASKS, ids=lambda p: p.stem)
def test_every_task_renders_a_rayjob_the_crd_schema_accepts(task_path):
    plan, configmap, rayjob, _ = render(task_path)
    validate(rayjob)
    spec = rayjob["spec"]
    cluster = spec["rayClusterSpec"]
    workers = cluster.get("workerGroupSpecs", [])
    assert sum(g["replicas"] for g in workers) + 1 == plan.nodes
    assert all(g["minReplicas"] == g["replicas"] == g["maxReplicas"] for g in workers)
    # K8sJobMode, its submitter in Ray's own image: the task's image may hold no Ray before setup
    assert spec["submissionMode"] == "K8sJobMode" and spec["backoffLimit"] == 0
    assert spec["submitterConfig"] == {"backoffLimit": 0}
    (submitter,) = spec["submitterPodTemplate"]["spec"]["containers"]
    assert submitter["name"] == "ray-job-submitter" and submitter["image"] == "rayproject/ray:2.60.0"
    assert "command" not in submitter  # KubeRay's own `ray job submit` line
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    assert spec["preRunningDeadlineSeconds"] >= plan.wait.head_s + plan.wait.nodes_s
    if plan.job.timeout_s:
        assert spec["activeDeadlineSeconds"] > plan.job.timeout_s
    assert (cluster.get("authOptions") == {"mode": "token"}) == bool(plan.token_env)
    # KubeRay v1.7.0 refuses a networkPolicy unless its alpha gate RayClusterNetworkPolicy is on (off by default)
    assert "networkPolicy" not in cluster
    assert cluster["rayVersion"] == "2.60.0"  # the Ray of rayproject/ray:2.60.0, the default image
    assert "python3 /opt/rlhf-tasks/lib/rlhf_tasks/agent/__main__.py" in spec["entrypoint"] and "--ray-started" in spec["entrypoint"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert "initContainers" not in head  # setup runs once per pod, in the Ray container (prepare too, on the head)
    for group in [cluster["headGroupSpec"], *workers]:
        (container,) = group["template"]["spec"]["containers"]
        assert "ray start" not in container["args"][0]  # KubeRay appends its own
        assert container["args"][0].endswith(f"--before-ray {RAY_ENV_FILE} && . {RAY_ENV_FILE} || exit")
        assert container["image"] == (plan.image or "rayproject/ray:2.60.0")
        assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] \
            >= plan.wait.head_s
        if plan.checkpoint_dir:
            assert {"name": "checkpoints", "mountPath": plan.checkpoint_dir} in container["volumeMounts"]
    # The ConfigMap carries the plan (readable) and lib/ as one xz-compressed tar, which every pod that runs
    # the agent before Ray unpacks into the emptyDir at /opt/rlhf-tasks.
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["name"] == f"{plan.name}-rlhf-tasks"
    assert set(configmap["data"]) == {f"{plan.name}.plan.json", "ray-path.sh", "ray"}
    assert set(configmap["binaryData"]) == {LIB_ARCHIVE}
    assert all(_CONFIGMAP_KEY.match(key) for key in [*configmap["data"], *configmap["binaryData"]])
    assert json.loads(configmap["data"][f"{plan.name}.plan.json"])["provider"] == "kuberay"
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(configmap["binaryData"][LIB_ARCHIVE]))) as tar:
        names = tar.getnames()
        assert names == sorted(names) and "lib/rlhf_tasks/agent/attached.py" in names
        assert tar.extractfile("lib/rlhf_tasks/agent/attached.py").read().decode() == \
            (ROOT / "rlhf_tasks" / "agent" / "attached.py").read_text()
    for group in [cluster["headGroupSpec"], *workers]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["rlhf-tasks"]["configMap"] == {"name": configmap["metadata"]["name"], "defaultMode": 0o555}
        assert volumes["rlhf-tasks-node"] == {"name": "rlhf-tasks-node", "emptyDir": {}}
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert {"name": "rlhf-tasks", "mountPath": CONFIGMAP_DIR, "readOnly": True} in container["volumeMounts"]
            assert {"name": "rlhf-tasks-node", "mountPath": "/opt/rlhf-tasks"} in container["volumeMounts"]
    unpack = f"{CONFIGMAP_DIR}/{LIB_ARCHIVE} /opt/rlhf-tasks && export PYTHONPATH=/opt/rlhf-tasks/lib"
    assert all(unpack in g["template"]["spec"]["containers"][0]["args"][0] for g in [cluster["headGroupSpec"], *workers])
    # `kubectl apply -f` (client-side) keeps the whole object as JSON in an annotation, which the API
    # server caps at 256 KiB: the packed agent keeps a clear margin below it.
    assert last_applied_size(configmap) < 128 * 1024


def test_the_agent_is_packed_the_same_every_time_and_the_pods_line_unpacks_it(tmp_path, monkeypatch):
    """Render stays pure (the same file for the same task), and the rendered unpack line, run with
    this machine's python3, puts back every shipped source byte for byte."""
    provider = providers.get("kuberay")
    plan = provider.plan(load_task(RAY_TASKS[0]))
    assert provider.render(plan) == provider.render(plan)
    files = shipped(plan)
    archive = pack(files)
    assert archive == pack(dict(reversed(list(files.items()))))
    assert lzma.decompress(archive) and archive.startswith(b"\xfd7zXZ")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert {(m.mtime, m.uid, m.gid, m.mode, m.uname, m.gname) for m in tar.getmembers()} == {(0, 0, 0, 0o644, "", "")}
    (tmp_path / "cm").mkdir()
    (tmp_path / "cm" / LIB_ARCHIVE).write_bytes(archive)
    line = unpack_shell().replace(f"{CONFIGMAP_DIR}/", f"{tmp_path}/cm/").replace(" /opt/rlhf-tasks", f" {tmp_path}/node")
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert {p.relative_to(tmp_path / "node").as_posix(): p.read_text()
            for p in (tmp_path / "node").rglob("*") if p.is_file()} == files
    # a ConfigMap that client-side apply could not annotate is refused at render, naming why
    monkeypatch.setattr(kuberay_configmap, "ANNOTATIONS_LIMIT", 64 * 1024)
    with pytest.raises(BadInput, match="kubectl apply -f.*last-applied-configuration.*65536"):
        provider.render(plan)


def test_network_policy_is_an_option_that_admits_the_operator():
    """Off by default (KubeRay's gate is alpha and off); on, KubeRay's DenyAllIngress plus a rule
    that lets the operator's namespace reach the head's dashboard, which it polls."""
    data = copy.deepcopy(FULL)
    data["placement"]["kuberay"].update(network_policy=True, operator_namespace="kuberay-system")
    _, _, rayjob, _ = render(data)
    validate(rayjob)
    assert rayjob["spec"]["rayClusterSpec"]["networkPolicy"] == {"mode": "DenyAllIngress", "head": {"ingressRules": [{
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}}],
        "ports": [{"port": 8265}]}]}}
    assert "networkPolicy" not in render(FULL)[2]["spec"]["rayClusterSpec"]


@pytest.mark.parametrize("name", ["7b-tiny", "0-day"])  # names are at most 40 characters already (spec.py)
def test_a_name_kuberay_refuses_is_refused_at_check(name):
    """A RayJob's name is a DNS-1035 label of at most 47 characters (KubeRay's validation)."""
    data = {"name": name, "nodes": 2, "job": {"recipe": "command", "args": {"entrypoint": "true"}}}
    with pytest.raises(BadInput, match=r"name: .*47 characters, starting with a letter"):
        render(data)
    render({**data, "name": "r-7b-tiny"})


def test_any_dashboard_port_is_the_heads_named_port():
    """KubeRay's submitter and the operator use the head's port named `dashboard`, so a moved
    dashboard is rendered there, not refused."""
    _, _, rayjob, _ = render({"name": "moved", "nodes": 2, "ray": {"dashboard_port": 8300},
                              "job": {"recipe": "command", "args": {"entrypoint": "true"}}})
    ports = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "dashboard", "containerPort": 8300} in ports


def test_the_strict_schema_refuses_what_kuberay_would_drop_or_reject():
    data = copy.deepcopy(FULL)
    data["placement"]["kuberay"]["network_policy"] = True
    _, _, rayjob, _ = render(data)
    validate(rayjob)
    for path, value in [(("spec", "submisionMode"), "SidecarMode"),
                        (("spec", "rayClusterSpec", "networkPolicy", "mode"), "AllowAll"),
                        (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "replica"), 2),
                        (("spec", "preRunningDeadlineSeconds"), 0)]:
        bad = copy.deepcopy(rayjob)
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)
    bad = copy.deepcopy(rayjob)
    del bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"]  # v1.7.0 requires it
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


FULL = {
    "name": "everything", "nodes": 4, "image": "verlai/verl:latest",
    "resources": {"gpus": "H100:8", "cpus": 64, "memory": "512GB", "shm_size": "128GB", "disk": "1TB"},
    "env": {"NCCL_DEBUG": "INFO"}, "secrets": ["WANDB_API_KEY", "HF_TOKEN"],
    "checkpoints": {"path": "/mnt/ckpt", "shared": {"kuberay": {"claim": "ckpt-pvc"}}},
    "services": [{"name": "judge", "where": "every_node", "command": "python3 -m judge", "ready": {"tcp": 9000},
                  "timeout": "10m"}],
    "placement": {"kuberay": {"namespace": "rl", "service_account": "trainer", "priority_class": "high",
                              "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                               "effect": "NoSchedule"}],
                              "queue": "team-a", "secret": "rl-secrets", "ray_version": "2.53.0"}},
    "job": {"recipe": "command", "args": {"entrypoint": "python3 train.py"}, "timeout": "2h", "max_restarts": 1},
}


def test_every_option_reaches_the_pods_and_passes_the_schema():
    plan, configmap, rayjob, _ = render(FULL)
    validate(rayjob)
    assert rayjob["metadata"]["namespace"] == configmap["metadata"]["namespace"] == "rl"
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.53.0"
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == 3
    for group in (cluster["headGroupSpec"], workers):
        pod = group["template"]["spec"]
        assert pod["serviceAccountName"] == "trainer" and pod["priorityClassName"] == "high"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt-pvc"}
        assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "128G"}  # Kubernetes' units
        (container,) = pod["containers"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        # requests = limits (Guaranteed QoS); the head leaves room for KubeRay's submitter (500m, 200Mi);
        # resources.disk is no ephemeral-storage unless asked for
        head = group is cluster["headGroupSpec"]
        assert container["resources"]["limits"] == (
            {"cpu": "63500m", "memory": f"{(512 * 10**9 - 200 * 2**20) // 2**20}Mi", "nvidia.com/gpu": "8"} if head
            else {"cpu": "64", "memory": "512G", "nvidia.com/gpu": "8"})
        assert container["resources"]["requests"] == container["resources"]["limits"]
        env = {e["name"]: e for e in container["env"]}
        assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}
        for name in ("WANDB_API_KEY", "HF_TOKEN"):
            assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": {"name": "rl-secrets", "key": name}}}
        assert env["RLHF_TASKS_RANK"]["value"] == ("0" if group is cluster["headGroupSpec"] else "1")
        assert env["RLHF_TASKS_WORKER_REPLICAS"]["value"] == "3"
    # A worker's startup covers its every-node services too; the head's, its setup.
    worker_probe = workers["template"]["spec"]["containers"][0]["startupProbe"]
    assert worker_probe["tcpSocket"] == {"port": 52365} and worker_probe["failureThreshold"] * 10 >= 1800 + 600
    assert rayjob["spec"]["activeDeadlineSeconds"] >= 2 * 7200
    assert plan.checkpoint_shared == {"claim": "ckpt-pvc"}
    assert providers.get("kuberay").shared_storage_warning(plan) is None


@pytest.mark.parametrize("scheduler,labels", [
    ("kueue", {"kueue.x-k8s.io/queue-name": "q1"}),
    ("volcano", {"volcano.sh/queue-name": "q1"}),  # nothing in KubeRay reads ray.io/scheduler-name
    ("yunikorn", {"ray.io/gang-scheduling-enabled": "true", "yunikorn.apache.org/app-id": "everything",
                  "yunikorn.apache.org/queue": "q1"}),
])
def test_a_named_queue_gives_its_schedulers_labels(scheduler, labels):
    data = copy.deepcopy(FULL)
    data["placement"]["kuberay"].update(scheduler=scheduler, queue="q1")
    _, _, rayjob, _ = render(data)
    own = {k: v for k, v in rayjob["metadata"]["labels"].items() if not k.startswith(("app.kubernetes", "rlhf-"))}
    assert own == labels
    data["placement"]["kuberay"].pop("queue")
    data["placement"]["kuberay"].pop("scheduler")
    assert "kueue.x-k8s.io/queue-name" not in render(data)[2]["metadata"]["labels"]


def test_amd_gpus_are_amd_resources():
    _, _, rayjob, _ = render(ROOT / "tasks" / "verl-ppo-gsm8k-mi300x.yaml")
    (container,) = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["amd.com/gpu"] == "8" and "nvidia.com/gpu" not in \
        container["resources"]["limits"]


def test_rendered_files_hold_no_secret_values(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("HF_TOKEN", "hf-secret-value")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-secret-value")
    for source in [*RAY_TASKS, FULL]:
        text = render(source)[3]
        assert not re.search("wandb-secret-value|hf-secret-value|ray-secret-value", text)
    assert "secretKeyRef" in render(FULL)[3]


@pytest.mark.parametrize("change,field", [
    ({"namspace": "rl"}, "placement.kuberay.namspace: unknown field (did you mean namespace?)"),
    ({"namespace": "RL_team"}, "placement.kuberay.namespace"),
    ({"queue": "a b"}, "placement.kuberay.queue"),
    ({"scheduler": "volcano"}, "placement.kuberay"),
    ({"scheduler": "slurm", "queue": "q"}, "placement.kuberay.scheduler"),
    ({"tolerations": [{"effect": "Sometimes"}]}, "placement.kuberay.tolerations[0].effect"),
    ({"node_selector": {"bad key!": "x"}}, "placement.kuberay.node_selector"),
    ({"ray_version": "2.46.0"}, "placement.kuberay.ray_version"),
    ({"ray_version": "latest"}, "placement.kuberay.ray_version"),
])
def test_bad_provider_options_name_their_field(change, field):
    data = {"name": "bad", "nodes": 2, "placement": {"kuberay": change},
            "job": {"recipe": "command", "args": {"entrypoint": "true"}}}
    with pytest.raises(BadInput, match=re.escape(field)):
        render(data)


def test_bad_input_is_exit_2_at_the_cli(tmp_path):
    task = tmp_path / "bad.yaml"
    task.write_text(yaml.safe_dump({"name": "bad", "nodes": 2, "placement": {"kuberay": {"secret": "No_Such"}},
                                    "job": {"recipe": "command", "args": {"entrypoint": "true"}}}))
    out = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "render", str(task), "--provider", "kuberay"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "placement.kuberay.secret" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "render", str(ROOT / "tasks" / sorted(NO_RAY)[0]),
                          "--provider", "kuberay"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "KubeRay always starts Ray" in out.stderr, out.stderr


@pytest.mark.parametrize("change,field", [
    ({"ray": {"dashboard_public": True}}, "ray.dashboard_public"),
    ({"checkpoints": {"path": "/c", "shared": {"kuberay": {"volume": "v"}}}}, "checkpoints.shared.kuberay"),
])
def test_what_kuberay_cannot_do_is_refused_naming_the_field(change, field):
    data = {"name": "bad", "nodes": 2, "job": {"recipe": "command", "args": {"entrypoint": "true"}}, **change}
    with pytest.raises(BadInput, match=re.escape(field)):
        render(data)


# --- the contract and the agent's attached roles ---------------------------------------------

def pod_env(rayjob: dict, head: bool, **operator) -> dict[str, str]:
    """A pod's plain environment as rendered (fieldRefs filled as the kubelet would), plus
    what KubeRay injects (`operator`)."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    group = cluster["headGroupSpec"] if head else cluster["workerGroupSpecs"][0]
    (container,) = group["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["RLHF_TASKS_POD_IP"] = "127.0.0.1"
    return {**env, **operator}


def test_the_contract_reads_rank_and_node_count_from_the_group():
    plan, _, rayjob, _ = render(ROOT / "tasks" / "tiny-grpo.yaml")
    contract = json.loads(plan.to_json())["contract"]
    head = read_contract(contract, pod_env(rayjob, True, RAY_CLUSTER_NAME="tiny-grpo-abcde"))
    assert (head.rank, head.nodes, head.head, head.node_addr, head.cluster_id) == \
        (0, 3, None, "127.0.0.1", "tiny-grpo-abcde")
    fqdn = "tiny-grpo-abcde-head-svc.default.svc.cluster.local"
    worker = read_contract(contract, pod_env(rayjob, False, FQ_RAY_IP=fqdn))
    assert (worker.rank, worker.nodes, worker.head) == (1, 3, fqdn)


def test_ray_env_lines_hold_only_what_the_agent_adds_and_never_the_token():
    base = {"PATH": "/bin", "RAY_AUTH_TOKEN": "tok", "WANDB_API_KEY": "w"}
    env = {**base, "NCCL_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/opt/x y", "RAY_AUTH_TOKEN": "other"}
    text = ray_env_lines(env, base)
    assert text == "export NCCL_SOCKET_IFNAME=eth0\nexport PYTHONPATH='/opt/x y'\n"
    assert ray_env_lines(base, base) == ""


def agent_plan(tmp_path: Path, **extra) -> tuple[Path, dict]:
    data = {"name": "attached", "nodes": 2, "checkpoints": {"path": str(tmp_path / "ckpt")},
            "prepare": [f"echo prepared > {tmp_path}/prepared.txt"],
            "setup": [f"echo set-up >> {tmp_path}/setup.txt"],
            "job": {"recipe": "command", "args": {"entrypoint": "true"}}, **extra}
    plan, _, rayjob, _ = render(data)
    path = tmp_path / "attached.plan.json"
    path.write_text(plan.to_json())
    return path, rayjob


@pytest.fixture(autouse=True)
def _no_agent_left(tmp_path):
    """What an agent run with --before-ray leaves running for the pod (a process of its own, forked
    with the same command line) ends with the test: it names the test's plan, in its tmp_path."""
    yield
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rlhf_tasks.agent" in argv and any(str(tmp_path).encode() in a for a in argv):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_agent(plan: Path, env: dict, *flags: str) -> subprocess.CompletedProcess:
    env = {**env, "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.agent", "--plan", str(plan), *flags], env=env,
                          capture_output=True, text=True, timeout=120)


def test_before_ray_on_the_head_runs_setup_and_prepare_once_and_a_worker_no_prepare(tmp_path):
    plan, rayjob = agent_plan(tmp_path)
    out = run_agent(plan, pod_env(rayjob, True, RAY_AUTH_TOKEN="t"), "--before-ray", str(tmp_path / "ray.env"),
                    "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "prepared.txt").read_text() == "prepared\n"
    assert (tmp_path / "setup.txt").read_text() == "set-up\n"
    (tmp_path / "prepared.txt").unlink()
    worker = run_agent(plan, pod_env(rayjob, False, FQ_RAY_IP="127.0.0.1", RAY_AUTH_TOKEN="t"), "--before-ray",
                       str(tmp_path / "ray.env"), "--state-dir", str(tmp_path / "state"))
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert not (tmp_path / "prepared.txt").exists()


def test_before_ray_leaves_a_workers_ready_services_running_and_writes_rays_environment(tmp_path):
    service = {"name": "echo", "where": "every_node", "ready": {"tcp": 18923}, "timeout": "1m",
               "command": f"exec {sys.executable} -m http.server 18923 --bind 127.0.0.1"}
    plan, rayjob = agent_plan(tmp_path, services=[service])
    env_file = tmp_path / "ray.env"
    env = pod_env(rayjob, False, FQ_RAY_IP="127.0.0.1", RAY_AUTH_TOKEN="the-token-value")
    out = run_agent(plan, env, "--before-ray", str(env_file), "--state-dir", str(tmp_path / "state"))
    pgid_files = list((tmp_path / "state").glob("*service-echo.pgid"))
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "service echo ready" in out.stdout
        (pgid_file,) = pgid_files
        os.kill(int(pgid_file.read_text()), 0)  # still running after the agent exited
        text = env_file.read_text()
        assert oct(env_file.stat().st_mode & 0o777) == "0o600"
        assert "export RLHF_TASKS_NODE_RANK=1" in text and "export RLHF_TASKS_NUM_NODES=2" in text
        assert "export RAY_AUTH_MODE=token" in text and "the-token-value" not in text
        assert (tmp_path / "setup.txt").read_text() == "set-up\n"
        # What the pod's shell does next: source it (KubeRay's `ray start` would then see it).
        shown = subprocess.run(["bash", "-c", f". {env_file} && echo $RLHF_TASKS_HEAD_ADDR"], capture_output=True,
                               text=True, env={"PATH": os.environ["PATH"]})
        assert shown.stdout.strip() == "127.0.0.1"
    finally:
        for pgid_file in pgid_files:
            try:
                os.killpg(int(pgid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass


def test_before_ray_on_the_head_starts_no_service(tmp_path):
    service = {"name": "echo", "where": "every_node", "ready": {"tcp": 18924}, "timeout": "1m",
               "command": "exit 1"}
    plan, rayjob = agent_plan(tmp_path, services=[service])
    env = pod_env(rayjob, True, RAY_AUTH_TOKEN="t")
    out = run_agent(plan, env, "--before-ray", str(tmp_path / "ray.env"), "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "export RLHF_TASKS_NODE_RANK=0" in (tmp_path / "ray.env").read_text()
    assert "starting service" not in out.stdout  # the head's services are the job runner's


def test_the_header_is_right_for_the_namespace_and_never_puts_secret_values_on_a_command_line():
    text = render(FULL)[3]
    header = text.split("apiVersion", 1)[0]
    assert "kubectl apply -n rl -f <this file>" in header and "kubectl get rayjob -n rl everything" in header
    assert "kubectl logs -n rl -f" in header
    # FULL names a Secret of the user's: nothing to create, and nothing about --from-literal
    assert "your Secret rl-secrets" in header and "create" not in header and "--from-literal" not in header
    data = copy.deepcopy(FULL)
    data["placement"]["kuberay"].pop("secret")
    header = render(data)[3].split("apiVersion", 1)[0]
    assert "kubectl create secret generic -n rl everything-secrets --from-env-file=FILE" in header
    assert "--from-literal" not in header and "$WANDB_API_KEY" not in header


def test_ttl_after_finished_may_be_zero_as_kuberay_allows():
    data = copy.deepcopy(FULL)
    data["placement"]["kuberay"]["ttl_after_finished"] = 0
    _, _, rayjob, _ = render(data)
    validate(rayjob)
    assert rayjob["spec"]["ttlSecondsAfterFinished"] == 0


def test_disk_is_ephemeral_storage_only_when_asked():
    data = copy.deepcopy(FULL)
    data["placement"]["kuberay"]["ephemeral_storage"] = True
    cluster = render(data)[2]["spec"]["rayClusterSpec"]
    for group in (cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]):
        assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["ephemeral-storage"] == "1T"


def test_check_says_what_an_image_must_hold_and_what_kuberay_cannot_select():
    provider = providers.get("kuberay")
    notes = "\n".join(provider.notes(provider.plan(load_task(ROOT / "tasks" / "openrlhf-ppo-llama3-8b.yaml"))))
    assert "image nvcr.io/nvidia/pytorch:26.03-py3: it must hold bash and python3" in notes
    assert "`ray health-check`" in notes and "placement.kuberay.ray_version" in notes
    assert "by the time KubeRay's `ray start` runs: in the image, or installed by setup" in notes
    assert "request 8 GPUs of any type" in notes and "nvidia.com/gpu.product" in notes
    data = copy.deepcopy(FULL)  # a product selected and the Ray named: neither note
    plan = provider.plan(parse_task(data, "t.yaml"))
    assert not [n for n in provider.notes(plan) if "any type" in n or "ray_version" in n]


# --- job.working_dir: nothing travels with `submit: head` (issue 29, item 10) ---------------------

WORKING_DIR_TASK = {"name": "wd", "nodes": 2, "job": {"recipe": "command", "args": {"entrypoint": "python3 train.py"}}}


@pytest.mark.parametrize("command", ["check", "render", "launch"])
def test_a_working_dir_the_task_names_is_refused_with_submit_head(tmp_path, command):
    """KubeRay's submitter runs on the cluster: a working_dir of this machine would never reach the
    job. Refused before anything (exit 2, nothing written, kubectl never asked), naming the field,
    why, and what to do."""
    data = copy.deepcopy(WORKING_DIR_TASK)
    data["job"]["working_dir"] = "."
    task = tmp_path / "wd.yaml"
    task.write_text(yaml.safe_dump(data))
    out_dir = tmp_path / "out"
    argv = [command, str(task), "--provider", "kuberay"] + (["-o", str(out_dir) + os.sep] if command == "render" else [])
    env = dict(os.environ, RLHF_TASKS_HOME=str(tmp_path / "home"), PATH=str(tmp_path / "no-kubectl"))
    out = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *argv], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr
    assert "job.working_dir: . would not reach the job" in err, err
    assert "KubeRay's submitter runs on the cluster and nothing is uploaded from this machine" in err
    assert "put the code in the image (or on a volume" in err and "job.submit: client" in err
    assert "kubectl" not in err.split("job.working_dir", 1)[0]  # refused for the task, before kubectl is looked for
    assert not out_dir.exists() and not (tmp_path / "home").exists() and out.stdout == ""


def test_the_default_working_dir_is_none_on_kuberay_and_the_header_and_check_say_so(tmp_path):
    plan, configmap, rayjob, text = render(copy.deepcopy(WORKING_DIR_TASK))
    assert plan.job.working_dir is None
    assert json.loads(configmap["data"]["wd.plan.json"])["job"]["working_dir"] is None
    header = text.split("apiVersion", 1)[0]
    line = ("# job.working_dir: none: the job runs in the head container's working directory (the image's); "
            "nothing is uploaded from this machine.")
    assert header.count(line) == 1, header
    validate(rayjob)
    task = tmp_path / "wd.yaml"
    task.write_text(yaml.safe_dump(WORKING_DIR_TASK))
    out = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "check", str(task), "--provider", "kuberay"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("working_dir none: the job runs in the head container's working directory") == 1
    # working_dir: null says the same and is no refusal: nothing is asked to travel
    data = copy.deepcopy(WORKING_DIR_TASK)
    data["job"]["working_dir"] = None
    assert render(data)[0].job.working_dir is None


def test_with_submit_client_the_working_dir_is_uploaded_from_here_as_before(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    for given in ({}, {"working_dir": "."}):
        data = copy.deepcopy(WORKING_DIR_TASK)
        data["job"].update(submit="client", **given)
        plan, _, rayjob, text = render(data)
        assert plan.job.working_dir == str(tmp_path)  # the current directory's: a task given as data
        assert "job.working_dir: none" not in text
        validate(rayjob)


# --- the day-one pod options (issue 29, item 12) ---------------------------------------------

OPTIONS = {
    "image_pull_secrets": ["registry-creds"],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                     {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["h100"]}]}]}},
                 "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                     "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                        "labelSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}}]}},
    "topology_spread": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                         "whenUnsatisfiable": "ScheduleAnyway",
                         "labelSelector": {"matchLabels": {"rlhf-tasks/task": "everything"}}}],
    "pod_labels": {"team": "rl", "example.com/cost-center": "a-17"},
    "pod_annotations": {"example.com/owner": "rl team <rl@example.com>"},
    "security_context": "restricted", "run_as_user": 1001,
    "volumes": [{"name": "model-cache", "claim": "models", "path": "/models", "read_only": True}],
    "kueue_priority_class": "high-priority",
    "rdma_resource": {"rdma/ib": 1},
}


def with_options(**options) -> dict:
    data = copy.deepcopy(FULL)
    data["placement"]["kuberay"].update(copy.deepcopy(options))
    return data


def pods(rayjob: dict) -> dict[str, dict]:
    """The pod templates by role: head, workers, submitter."""
    spec = rayjob["spec"]
    return {"head": spec["rayClusterSpec"]["headGroupSpec"]["template"],
            "workers": spec["rayClusterSpec"]["workerGroupSpecs"][0]["template"],
            "submitter": spec["submitterPodTemplate"]}


def test_the_pod_options_reach_every_pod_where_they_belong():
    """Pull secrets, labels, annotations and the pods' securityContext on every pod (the submitter's
    too); the affinity and topology spread on the Ray pods (the submitter gets the nodeAffinity);
    volumes and the RDMA resource in the Ray containers only; Kueue's priority class on the RayJob."""
    _, _, rayjob, _ = render(with_options(**OPTIONS))
    validate(rayjob)
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high-priority"
    for role, template in pods(rayjob).items():
        pod, meta = template["spec"], template["metadata"]
        assert pod["imagePullSecrets"] == [{"name": "registry-creds"}], role
        assert meta["labels"] == {"rlhf-tasks/task": "everything", "team": "rl", "example.com/cost-center": "a-17"}
        assert meta["annotations"] == {"example.com/owner": "rl team <rl@example.com>"}
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1001, "runAsGroup": 1001,
                                          "fsGroup": 1001, "seccompProfile": {"type": "RuntimeDefault"}}
        (container,) = pod["containers"]
        # KubeRay copies the Ray container's securityContext into wait-gcs-ready (common/pod.go)
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        if role == "submitter":
            assert pod["affinity"] == {"nodeAffinity": OPTIONS["affinity"]["nodeAffinity"]}
            assert "topologySpreadConstraints" not in pod and "model-cache" not in volumes and not mounts
            assert "rdma/ib" not in container["resources"]["limits"]
            continue
        assert pod["affinity"] == OPTIONS["affinity"]
        assert pod["topologySpreadConstraints"] == OPTIONS["topology_spread"]
        assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}
        assert mounts["model-cache"] == {"name": "model-cache", "mountPath": "/models", "readOnly": True}
        assert container["resources"]["limits"]["rdma/ib"] == container["resources"]["requests"]["rdma/ib"] == "1"
    # none of it without the options
    _, _, plain, _ = render(FULL)
    for template in pods(plain).values():
        assert not {"imagePullSecrets", "securityContext", "affinity", "topologySpreadConstraints"} & \
            set(template["spec"]) and "annotations" not in template["metadata"]
        assert "securityContext" not in template["spec"]["containers"][0]
    assert "kueue.x-k8s.io/priority-class" not in plain["metadata"]["labels"]


def test_a_free_form_security_context_and_infiniband_on_the_node():
    """{pod, container} as given; ib_host_device mounts the node's /dev/infiniband in the Ray
    containers and adds IPC_LOCK there (never to the submitter); a host_path volume is a hostPath."""
    _, _, rayjob, _ = render(with_options(
        security_context={"pod": {"fsGroup": 2000}, "container": {"readOnlyRootFilesystem": False}},
        ib_host_device=True, volumes=[{"name": "nvme", "host_path": "/mnt/nvme", "path": "/scratch"}]))
    validate(rayjob)
    for role, template in pods(rayjob).items():
        pod = template["spec"]
        (container,) = pod["containers"]
        assert pod["securityContext"] == {"fsGroup": 2000}
        if role == "submitter":
            assert container["securityContext"] == {"readOnlyRootFilesystem": False}
            continue
        assert container["securityContext"] == {"readOnlyRootFilesystem": False, "capabilities": {"add": ["IPC_LOCK"]}}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["infiniband"]["hostPath"] == {"path": "/dev/infiniband", "type": "Directory"}
        assert volumes["nvme"] == {"name": "nvme", "hostPath": {"path": "/mnt/nvme"}}
        assert {"name": "infiniband", "mountPath": "/dev/infiniband"} in container["volumeMounts"]
        assert {"name": "nvme", "mountPath": "/scratch"} in container["volumeMounts"]
    _, _, ipc, _ = render(with_options(ipc_lock=True, rdma_resource="rdma/hca_shared_devices_a"))
    (container,) = pods(ipc)["workers"]["spec"]["containers"]
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert container["resources"]["requests"]["rdma/hca_shared_devices_a"] == "1"


def test_the_infiniband_note_says_only_what_is_still_missing():
    provider = providers.get("kuberay")

    def note(**options):
        data = with_options(**options)
        data["network"] = "infiniband"
        notes = [n for n in provider.notes(provider.plan(parse_task(data, "t.yaml"))) if n.startswith("network:")]
        return notes[0] if notes else None

    bare = note()
    assert "rdma_resource" in bare and "ib_host_device" in bare and "IPC_LOCK" in bare
    only_ipc = note(rdma_resource={"rdma/ib": 1})
    assert "IPC_LOCK" in only_ipc and "RDMA device" not in only_ipc
    only_device = note(ipc_lock=True)
    assert "RDMA device" in only_device and "IPC_LOCK" not in only_device
    assert note(rdma_resource={"rdma/ib": 1}, ipc_lock=True) is None
    assert note(ib_host_device=True) is None


@pytest.mark.parametrize("change,field", [
    ({"image_pull_secrets": ["Bad_Name"]}, "placement.kuberay.image_pull_secrets"),
    ({"affinity": {"nodeAffinty": {}}}, "placement.kuberay.affinity"),
    ({"affinity": {"nodeAffinity": "pool=h100"}}, "placement.kuberay.affinity"),
    ({"affinity": ["nodeAffinity"]}, "placement.kuberay.affinity"),
    ({"topology_spread": [{"maxSkew": 1, "topologyKey": "zone"}]}, "placement.kuberay.topology_spread[0].whenUnsatisfiable"),
    ({"topology_spread": [{"maxSkew": 0, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]},
     "placement.kuberay.topology_spread[0].maxSkew"),
    ({"pod_labels": {"bad key!": "x"}}, "placement.kuberay.pod_labels"),
    ({"pod_labels": {"team": "not a value"}}, "placement.kuberay.pod_labels"),
    ({"pod_labels": {"ray.io/node-type": "head"}}, "placement.kuberay.pod_labels"),
    ({"pod_labels": {"kueue.x-k8s.io/queue-name": "other"}}, "placement.kuberay.pod_labels"),
    ({"pod_labels": {"rlhf-tasks/task": "other"}}, "placement.kuberay.pod_labels"),
    ({"pod_annotations": {"ray.io/overwrite-container-cmd": "true"}}, "placement.kuberay.pod_annotations"),
    ({"security_context": "baseline"}, "placement.kuberay.security_context"),
    ({"security_context": {"pod": {"allowPrivilegeEscalation": False}}}, "placement.kuberay.security_context"),
    ({"run_as_user": 1000}, "placement.kuberay.run_as_user: the user of security_context"),
    ({"security_context": "restricted", "run_as_user": 0}, "placement.kuberay.run_as_user"),
    ({"security_context": "restricted", "ipc_lock": True}, "placement.kuberay.ipc_lock: security_context restricted"),
    ({"security_context": "restricted", "volumes": [{"name": "n", "host_path": "/mnt", "path": "/n"}]},
     "placement.kuberay.volumes: security_context restricted allows no hostPath volume (n)"),
    ({"volumes": [{"name": "m", "claim": "c", "host_path": "/mnt", "path": "/m"}]}, "placement.kuberay.volumes[0]"),
    ({"volumes": [{"name": "m", "path": "/m"}]}, "placement.kuberay.volumes[0]"),
    ({"volumes": [{"name": "m", "claim": "c", "path": "models"}]}, "placement.kuberay.volumes[0].path"),
    ({"volumes": [{"name": "shm", "claim": "c", "path": "/m"}]}, "placement.kuberay.volumes"),
    ({"volumes": [{"name": "a", "claim": "c", "path": "/m"}, {"name": "b", "claim": "d", "path": "/m/x"}]},
     "placement.kuberay.volumes"),
    ({"volumes": [{"name": "m", "claim": "c", "path": "/dev/shm"}]}, "placement.kuberay.volumes[0].path: /dev/shm"),
    ({"volumes": [{"name": "m", "claim": "c", "path": "/opt/rlhf-tasks-configmap"}]}, "placement.kuberay.volumes[0].path"),
    ({"volumes": [{"name": "m", "claim": "c", "path": "/opt/rlhf-tasks/lib"}]}, "placement.kuberay.volumes[0].path"),
    ({"volumes": [{"name": "m", "claim": "c", "path": "/mnt"}]}, "placement.kuberay.volumes[0].path: /mnt holds"),
    ({"kueue_priority_class": "high"}, "placement.kuberay.kueue_priority_class: Kueue's priority class needs a queue"),
    ({"kueue_priority_class": "high", "scheduler": "volcano", "queue": "q"},
     "placement.kuberay.kueue_priority_class: Kueue's priority class needs a queue with scheduler kueue (scheduler is volcano"),
    ({"kueue_priority_class": "High!", "queue": "q"}, "placement.kuberay.kueue_priority_class"),
    ({"rdma_resource": {"rdma/ib": 0}}, "placement.kuberay.rdma_resource"),
    ({"rdma_resource": "ib"}, "placement.kuberay.rdma_resource"),
])
def test_bad_pod_options_name_their_field(change, field):
    data = {"name": "bad", "nodes": 2, "placement": {"kuberay": change}, "checkpoints": {"path": "/mnt/ckpt"},
            "job": {"recipe": "command", "args": {"entrypoint": "true"}}}
    with pytest.raises(BadInput, match=re.escape(field)):
        render(data)


def test_a_bad_pod_option_is_exit_2_at_the_cli(tmp_path):
    task = tmp_path / "bad.yaml"
    task.write_text(yaml.safe_dump({"name": "bad", "nodes": 2, "placement": {"kuberay": {
        "volumes": [{"name": "m", "claim": "c", "path": "/dev/shm"}]}},
        "job": {"recipe": "command", "args": {"entrypoint": "true"}}}))
    out = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "render", str(task), "--provider", "kuberay"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "placement.kuberay.volumes[0].path" in out.stderr, out.stderr


def test_readmes_kuberay_example_renders_with_its_options():
    """docs/kuberay.md's task-file example is a task that renders a RayJob the schema accepts,
    with the options it shows where they belong and nothing left for `check` to say about InfiniBand."""
    section = (ROOT / "docs" / "kuberay.md").read_text().split("\n## An example task file\n", 1)[1].split("\n## ", 1)[0]
    example = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    plan, _, rayjob, _ = render(example)
    validate(rayjob)
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high-priority"
    assert rayjob["spec"]["preRunningDeadlineSeconds"] == 30 * 60
    for role, template in pods(rayjob).items():
        assert template["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}], role
        assert template["metadata"]["labels"]["team"] == "rl", role
    (head,) = pods(rayjob)["head"]["spec"]["containers"]
    assert head["resources"]["limits"]["rdma/ib"] == "1"
    assert head["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in head["volumeMounts"]
    provider = providers.get("kuberay")
    assert not [n for n in provider.notes(plan) if n.startswith("network:")]


def test_active_deadline_is_the_budget_cap_plus_the_bring_up_and_stop_grace_never_the_attempts_beyond_it():
    """`max_duration: 48h` with `job.timeout: 24h` and two restarts made a 72.9 h deadline: KubeRay's
    backstop then held the cluster 24 h past the cap the head enforces. It is the cap (max_duration,
    or max_cost at the task's price), counted from the head agent's start, which is within
    preRunningDeadlineSeconds of the RayJob's, plus stop_grace; the attempts' sum where that is shorter."""
    base = {"name": "capped", "nodes": 2, "resources": {"gpus": "H100:8"},
            "job": {"recipe": "command", "args": {"entrypoint": "python3 train.py"}, "timeout": "24h",
                    "max_restarts": 2}}
    plan, _, rayjob, _ = render({**base, "placement": {"max_duration": "48h", "stop_grace": "5m"}})
    spec = rayjob["spec"]
    assert spec["activeDeadlineSeconds"] == spec["preRunningDeadlineSeconds"] + 48 * 3600 + 300
    # a cost cap at the task's price: $200 at $10/h is 20 h
    _, _, rayjob, _ = render({**base, "placement": {"max_cost": 200, "price_per_hour": 10, "stop_grace": "2m"}})
    assert rayjob["spec"]["activeDeadlineSeconds"] == rayjob["spec"]["preRunningDeadlineSeconds"] + 20 * 3600 + 120
    # a cap beyond every attempt allowed: the attempts bound it, as before
    _, _, long, _ = render({**base, "placement": {"max_duration": "30d"}})
    _, _, uncapped, _ = render(base)
    assert long["spec"]["activeDeadlineSeconds"] == uncapped["spec"]["activeDeadlineSeconds"] < 30 * 24 * 3600
    # no job.timeout but a cap: the cap still bounds the RayJob
    nolimit = {**base, "job": {"recipe": "command", "args": {"entrypoint": "python3 train.py"}}}
    _, _, rayjob, _ = render({**nolimit, "placement": {"max_duration": "2h"}})
    assert rayjob["spec"]["activeDeadlineSeconds"] == rayjob["spec"]["preRunningDeadlineSeconds"] + 2 * 3600 + 120
