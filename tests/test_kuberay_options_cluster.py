"""KubeRay's day-one pod options (`placement.kuberay`) on the real control plane and the real
KubeRay operator (tests/kube/): the API server's PodSecurity admission, the kube-scheduler and
the operator decide, not us. A task is launched, or rendered and applied by hand with the real
kubectl as `render`'s header says (which this file proves too) and followed through the RayJob's
status."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

import testbed as tbmod
from conftest import ROOT
from test_kuberay_cluster import cli_env, kubectl_json, launch_task, run_cli, shared_claim

pytestmark = pytest.mark.cluster

#: What the API server's PodSecurity admission says when it refuses a pod.
PSA_REFUSAL = 'violates PodSecurity "restricted:latest"'


def small_task(name: str, entrypoint: str, nodes: int = 2, **kuberay) -> dict:
    """A command job on 1-CPU pods (the head leaves half of its node to KubeRay's submitter)."""
    return {"name": name, "nodes": nodes, "resources": {"cpus": 1}, "preflight": "off",
            "ray": {"object_store_memory": "80MB"}, "wait": {"head": "3m", "nodes": "3m"},
            "placement": {"kuberay": kuberay},
            "job": {"recipe": "command", "working_dir": None, "timeout": "5m", "args": {"entrypoint": entrypoint}}}


def render(cluster, tmp_path: Path, task: dict) -> Path:
    """`rlhf-tasks render` of `task`: the file it wrote, to apply by hand."""
    path = tmp_path / f"{task['name']}.yaml"
    path.write_text(yaml.safe_dump(task))
    rendered = tmp_path / f"{task['name']}.rayjob.yaml"
    out = run_cli(["render", str(path), "--provider", "kuberay", "-o", str(rendered)],
                  cluster.env(dict(os.environ, PYTHONPATH=str(ROOT))))
    assert out.returncode == 0, out.stderr
    return rendered


def finished(cluster, ns: str, name: str, timeout: float = 300) -> dict:
    """The RayJob's status once the operator says it is Complete or Failed."""
    return tbmod.poll(lambda: (cluster.check() or True) and (r := kubectl_json(cluster, ns, "rayjob", name))
                      and r.get("status", {}).get("jobDeploymentStatus") in ("Complete", "Failed") and r["status"],
                      timeout, f"RayJob {name} to finish")


def pods(cluster, ns: str) -> list[dict]:
    return (kubectl_json(cluster, ns, "pods") or {"items": []})["items"]


def role(pod: dict) -> str:
    """head, worker or submitter (the pod of KubeRay's submitter Job)."""
    labels = pod["metadata"].get("labels", {})
    return labels.get("ray.io/node-type") or ("submitter" if "job-name" in labels else "?")


def test_a_restricted_namespace_admits_only_restricted_pods_which_affinity_places(kube_cluster, ns, tmp_path):
    """A namespace that enforces the restricted Pod Security Standard: the real API server's
    PodSecurity admission refuses the operator's pods of a task without `security_context`, and
    `launch` fails saying the API server's words (from the operator's FailedToCreateHeadPod event)
    and the option, with no pod made; with `security_context: restricted` every pod is admitted
    (the head, the worker with KubeRay's wait-gcs-ready, which copies the Ray container's
    securityContext, and our submitter pod) and the job SUCCEEDS. The node runner runs every
    container as root whatever runAsUser says: what is proven here is admission, not the user the
    processes run as. The admitted task also has `affinity` (independent of admission): nodeAffinity
    to two labelled nodes and a required podAntiAffinity between the Ray pods, so the real
    kube-scheduler puts the head and the worker on the two labelled nodes, one each, and the
    submitter pod (which gets the nodeAffinity only) beside one of them, never on the third."""
    cluster = kube_cluster
    cluster.cp.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    env = cli_env(cluster, tmp_path)
    task = small_task("open", "python3 -c \"print('should not run')\"")
    launch, said = launch_task(cluster, ns, tmp_path, task, env, timeout=300)
    assert launch.returncode == 1, said[-4000:]
    assert "the API server refuses the operator's pods" in said and PSA_REFUSAL in said, said[-4000:]
    assert "allowPrivilegeEscalation != false" in said and "runAsNonRoot != true" in said, said[-4000:]
    assert "placement.kuberay.security_context: restricted makes the pods pass it" in said
    assert pods(cluster, ns) == [] and kubectl_json(cluster, ns, "rayjob", "open") is None  # launch cleaned up

    nodes = sorted(n["metadata"]["name"] for n in json.loads(cluster.cp.kubectl("get", "nodes", "-o", "json").stdout)
                   ["items"])
    chosen, label = nodes[-2:], "rlhf-tasks-test/pool"
    affinity = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": label, "operator": "In", "values": [ns]}]}]}},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}]}}
    for node in chosen:
        cluster.cp.kubectl("label", "node", node, f"{label}={ns}", "--overwrite")
    try:
        task = small_task("restricted", "python3 -c \"print('admitted and ran')\"", security_context="restricted",
                          affinity=affinity)
        launch, said = launch_task(cluster, ns, tmp_path, task, env, timeout=420)
        admitted = {role(p): p for p in pods(cluster, ns)}
    finally:
        for node in chosen:
            cluster.cp.kubectl("label", "node", node, f"{label}-", check=False)
    assert launch.returncode == 0, said[-4000:]
    assert "admitted and ran" in said and "SUCCEEDED in " in said
    assert set(admitted) == {"head", "worker", "submitter"}, sorted(admitted)
    for pod in admitted.values():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                    "capabilities": {"drop": ["ALL"]}}, container["name"]
    assert [c["name"] for c in admitted["worker"]["spec"]["initContainers"]] == ["wait-gcs-ready"]
    where = {name: pod["spec"].get("nodeName") for name, pod in admitted.items()}
    assert sorted([where["head"], where["worker"]]) == chosen, (where, nodes)
    assert where["submitter"] in chosen, (where, nodes)


def test_render_and_kubectl_apply_by_hand_runs_the_job_with_its_secret_and_extra_volumes(kube_cluster, ns, tmp_path):
    """What `render` prints, applied by hand as its header says (the Secret from a file of NAME=value
    lines first), runs: the RayJob completes and the job's lines are in the submitter's log, the
    Secret's value among them. Its `volumes`: a claim (read-only, a model cache: a
    PersistentVolumeClaim bound to a hostPath volume) and a node's directory (hostPath, scratch),
    mounted in the Ray containers, not the submitter's: the job on the head reads the file in the
    claim, cannot write there, and writes to the scratch directory, which the node's directory then
    holds. Its two nodes are two node groups (issue 46), KubeRay's own heterogeneous form: a worker group per
    group, each pod with its group's Ray label and custom resource (as Ray's own node list says in the job),
    the reward group's setup and service on its pod only."""
    cluster = kube_cluster
    cache, scratch = tmp_path / "model-cache", tmp_path / "nvme"
    shared_claim(cluster, ns, "models", cache)
    (cache / "weights.txt").write_text("weights-0123\n")
    scratch.mkdir()
    script = tmp_path / "use_volumes.py"
    script.write_text(
        "import errno, os\n"
        "print('job says', len(os.environ['HELLO_SECRET']))\n"
        "print('cache says', open('/models/weights.txt').read().strip())\n"
        "try:\n"
        "    open('/models/written', 'w')\n"
        "except OSError as exc:\n"
        "    print('cache is read-only:', exc.errno == errno.EROFS)\n"
        "open('/scratch/from-the-job.txt', 'w').write('scratch works')\n"
        "import ray, time\n"
        "ray.init()\n"
        "groups = {n['Labels'].get('rlhf-tasks/group'): n for n in ray.nodes() if n['Alive']}\n"
        "print('groups', sorted(groups), groups['reward']['Resources'].get('reward'),\n"
        "      'reward' in groups['trainer']['Resources'])\n"
        "on = ray.remote(num_cpus=0, resources={'reward': 1})(lambda: ray.get_runtime_context().get_node_id())\n"
        "print('reward task on its group:', ray.get(on.remote()) == groups['reward']['NodeID'])\n")
    volumes = [{"name": "model-cache", "claim": "models", "path": "/models", "read_only": True},
               {"name": "nvme", "host_path": str(scratch), "path": "/scratch"}]
    task = dict(small_task("by-hand", f"python3 {script}", volumes=volumes), secrets=["HELLO_SECRET"])
    del task["nodes"], task["resources"]
    task["groups"] = [{"name": "trainer", "nodes": 1, "resources": {"cpus": 1}},
                      {"name": "reward", "nodes": 1, "resources": {"cpus": 1},
                       "setup": ["echo {group} $RLHF_TASKS_NODE_RANK >> /scratch/setup.txt"],
                       "services": [{"name": "rm", "command": "echo {group} $RLHF_TASKS_GROUP >> /scratch/service.txt; "
                                                              "exec sleep 600"}]}]
    rendered = render(cluster, tmp_path, task)
    create = next(line for line in rendered.read_text().splitlines() if "kubectl create secret generic" in line)
    assert "--from-env-file=FILE" in create
    (tmp_path / "secrets.env").write_text("HELLO_SECRET=seven-7\n")
    cluster.cp.kubectl("-n", ns, "create", "secret", "generic", "by-hand-secrets",
                       f"--from-env-file={tmp_path / 'secrets.env'}")
    cluster.cp.kubectl("-n", ns, "apply", "-f", str(rendered))
    final = finished(cluster, ns, "by-hand")
    log = cluster.cp.kubectl("-n", ns, "logs", "job/by-hand").stdout  # as the header says to follow it
    assert final["jobStatus"] == "SUCCEEDED", (final, log[-3000:])
    assert "job says 7" in log, log[-3000:]  # len("seven-7"): the value reached the job from the Secret
    assert "cache says weights-0123" in log and "cache is read-only: True" in log, log[-3000:]
    assert (scratch / "from-the-job.txt").read_text() == "scratch works"
    assert "groups ['reward', 'trainer'] 1.0 False" in log and "reward task on its group: True" in log, log[-3000:]
    assert (scratch / "setup.txt").read_text().split() == ["reward", "1"]
    assert (scratch / "service.txt").read_text().split() == ["reward", "reward"]
    assert not (cache / "written").exists()
    for pod in pods(cluster, ns):
        mounts = {m["mountPath"] for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])}
        assert ({"/models", "/scratch"} <= mounts) == (role(pod) != "submitter"), (role(pod), mounts)
        group = {"head": "trainer", "worker": "reward"}.get(role(pod))
        assert pod["metadata"]["labels"].get("rlhf-tasks/group") == group, (role(pod), pod["metadata"]["labels"])
