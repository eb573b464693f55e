"""KubeRay's day-one pod options (`placement.kuberay`) on the real control plane and the real
KubeRay operator (tests/kube/): the API server's PodSecurity admission, the kube-scheduler and
the operator decide, not us. Each task is rendered and applied by hand with the real kubectl,
as `render`'s header says, and followed through the RayJob's status."""
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


def apply(cluster, ns: str, tmp_path: Path, task: dict) -> None:
    """`rlhf-tasks render` then `kubectl apply -f` of what it wrote."""
    path = tmp_path / f"{task['name']}.yaml"
    path.write_text(yaml.safe_dump(task))
    rendered = tmp_path / f"{task['name']}.rayjob.yaml"
    out = run_cli(["render", str(path), "--provider", "kuberay", "-o", str(rendered)],
                  cluster.env(dict(os.environ, PYTHONPATH=str(ROOT))))
    assert out.returncode == 0, out.stderr
    cluster.cp.kubectl("-n", ns, "apply", "-f", str(rendered))


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


def test_a_restricted_namespace_admits_the_pods_only_with_security_context_restricted(kube_cluster, ns, tmp_path):
    """A namespace that enforces the restricted Pod Security Standard: the real API server's
    PodSecurity admission refuses the operator's pods of a task without `security_context`, and
    `launch` fails saying the API server's words (from the operator's FailedToCreateHeadPod event)
    and the option, with no pod made; with `security_context: restricted` every pod is admitted
    (the head, the worker with KubeRay's wait-gcs-ready, which copies the Ray container's
    securityContext, and our submitter pod) and the job SUCCEEDS. The node runner runs every
    container as root whatever runAsUser says: what is proven here is admission, not the user the
    processes run as."""
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

    task = small_task("restricted", "python3 -c \"print('admitted and ran')\"", security_context="restricted")
    launch, said = launch_task(cluster, ns, tmp_path, task, env, timeout=420)
    assert launch.returncode == 0, said[-4000:]
    assert "admitted and ran" in said and "SUCCEEDED in " in said
    admitted = {role(p): p for p in pods(cluster, ns)}
    assert set(admitted) == {"head", "worker", "submitter"}, sorted(admitted)
    for pod in admitted.values():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                    "capabilities": {"drop": ["ALL"]}}, container["name"]
    assert [c["name"] for c in admitted["worker"]["spec"]["initContainers"]] == ["wait-gcs-ready"]


def test_affinity_decides_where_the_scheduler_puts_the_pods(kube_cluster, ns, tmp_path):
    """nodeAffinity to two labelled nodes and a required podAntiAffinity between the Ray pods:
    the real kube-scheduler puts the head and the worker on the two labelled nodes, one each, and
    the submitter pod (which gets the nodeAffinity only) beside one of them, never on the third."""
    cluster = kube_cluster
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
        apply(cluster, ns, tmp_path, small_task("placed", "python3 -c \"print('placed and ran')\"",
                                                affinity=affinity))
        final = finished(cluster, ns, "placed")
    finally:
        for node in chosen:
            cluster.cp.kubectl("label", "node", node, f"{label}-", check=False)
    assert final["jobStatus"] == "SUCCEEDED", final
    where = {role(p): p["spec"].get("nodeName") for p in pods(cluster, ns)}
    assert set(where) == {"head", "worker", "submitter"}, where
    assert sorted([where["head"], where["worker"]]) == chosen, (where, nodes)
    assert where["submitter"] in chosen, (where, nodes)


def test_extra_volumes_are_mounted_in_the_ray_containers(kube_cluster, ns, tmp_path):
    """A claim (read-only, a model cache: a PersistentVolumeClaim bound to a hostPath volume) and a
    node's directory (hostPath, scratch): the job on the head reads the file in the claim, cannot
    write there, and writes to the scratch directory, which the node's directory then holds."""
    cluster = kube_cluster
    cache, scratch = tmp_path / "model-cache", tmp_path / "nvme"
    shared_claim(cluster, ns, "models", cache)
    (cache / "weights.txt").write_text("weights-0123\n")
    scratch.mkdir()
    script = tmp_path / "use_volumes.py"
    script.write_text(
        "import errno\n"
        "print('cache says', open('/models/weights.txt').read().strip())\n"
        "try:\n"
        "    open('/models/written', 'w')\n"
        "except OSError as exc:\n"
        "    print('cache is read-only:', exc.errno == errno.EROFS)\n"
        "open('/scratch/from-the-job.txt', 'w').write('scratch works')\n")
    volumes = [{"name": "model-cache", "claim": "models", "path": "/models", "read_only": True},
               {"name": "nvme", "host_path": str(scratch), "path": "/scratch"}]
    apply(cluster, ns, tmp_path, small_task("volumes", f"python3 {script}", volumes=volumes))
    final = finished(cluster, ns, "volumes")
    log = cluster.cp.kubectl("-n", ns, "logs", "job/volumes").stdout
    assert final["jobStatus"] == "SUCCEEDED", (final, log[-3000:])
    assert "cache says weights-0123" in log and "cache is read-only: True" in log, log[-3000:]
    assert (scratch / "from-the-job.txt").read_text() == "scratch works"
    assert not (cache / "written").exists()
    for pod in pods(cluster, ns):
        mounts = {m["mountPath"] for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])}
        assert ({"/models", "/scratch"} <= mounts) == (role(pod) != "submitter"), (role(pod), mounts)
