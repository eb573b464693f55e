"""The KubeRay provider on a real Kubernetes control plane with the real KubeRay operator
(tests/kube/): `launch --provider kuberay` applies with the real kubectl, the API server
validates, the operator builds the cluster and its pods, and the pods run on namespace hosts.
Nothing here plays KubeRay."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import testbed as tbmod
from conftest import ROOT

pytestmark = pytest.mark.cluster


def tiny_grpo(ckpt: Path, steps: int = 150, save_every: int = 25) -> dict:
    return {"name": "tiny", "nodes": 3, "resources": {"cpus": 1}, "env": {"PYTHONUNBUFFERED": "1"},
            "preflight": "off", "ray": {"object_store_memory": "80MB"},
            "checkpoints": {"path": str(ckpt), "shared": {"kuberay": {"claim": "ckpt"}}},
            "wait": {"head": "3m", "nodes": "3m"},
            "job": {"recipe": "tiny-grpo", "working_dir": None, "timeout": "10m",
                    "args": {"steps": steps, "save_every": save_every, "prompts_per_step": 8, "group_size": 8,
                             "num_prompts": 200}}}


def shared_claim(cluster, ns: str, name: str, path: Path) -> None:
    """A ReadWriteMany claim bound to a hostPath volume every pod host sees (the test's tmp dir)."""
    path.mkdir(parents=True, exist_ok=True)
    pv = f"{ns}-{name}"
    cluster.cp.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path)},
                  "claimRef": {"namespace": ns, "name": name}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}}]))
    tbmod.poll(lambda: json.loads(cluster.cp.kubectl("-n", ns, "get", "pvc", name, "-o", "json").stdout)
               ["status"].get("phase") == "Bound", 60, f"claim {name} bound")


def kubectl_json(cluster, ns: str, *args: str):
    out = cluster.cp.kubectl("-n", ns, "get", *args, "-o", "json", "--ignore-not-found")
    return json.loads(out.stdout) if out.stdout.strip() else None


def run_cli(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_launch_on_the_real_operator_with_a_late_and_a_lost_worker(kube_cluster, tmp_path):
    """tiny-grpo through `launch --provider kuberay` and the real kubectl: one node is cordoned
    for 20 s, so a worker pod is scheduled late and the job's command starts only once it joined;
    a worker pod deleted mid-run is recreated by the operator and the job resumes from its
    checkpoint, every step once; SUCCEEDED; then `status`, and `down` leaves nothing of the run."""
    cluster = kube_cluster
    ns = cluster.namespace("launch")
    ckpt, steps = tmp_path / "ckpt", 1500
    shared_claim(cluster, ns, "ckpt", ckpt)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_grpo(ckpt, steps, save_every=25)))
    env = cluster.env(dict(os.environ, RLHF_TASKS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT),
                           PYTHONUNBUFFERED="1"))
    env.pop("RAY_AUTH_TOKEN", None)
    late_node = cluster.runner.nodes and sorted(cluster.runner.nodes)[-1]
    cluster.cp.kubectl("cordon", late_node)
    cordoned = time.monotonic()
    out = open(tmp_path / "launch.out", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(path), "--provider", "kuberay",
                             "--namespace", ns], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        def pods():
            return (kubectl_json(cluster, ns, "pods") or {"items": []})["items"]
        def held_back():  # two pods bound, the third waits for room
            listed = pods()
            return len(listed) == 3 and len([p for p in listed if p["spec"].get("nodeName")]) == 2
        tbmod.poll(lambda: held_back() or cluster.check(), 180, "two pods bound and one pending")
        time.sleep(max(0.0, 20 - (time.monotonic() - cordoned)))  # the cordon is the test's condition: 20 s
        cluster.cp.kubectl("uncordon", late_node)
        tbmod.poll(lambda: (proc.poll() is None or (_ for _ in ()).throw(AssertionError(_read(out))))
                   and (cluster.check() or len(metrics(ckpt / "metrics.jsonl")) >= 20), 420, "step 20", 0.3)
        workers = [p for p in pods() if p["metadata"]["labels"].get("ray.io/node-type") == "worker"
                   and not p["metadata"].get("deletionTimestamp")]
        lost = workers[0]["metadata"]["name"]
        cluster.cp.kubectl("-n", ns, "delete", "pod", lost, "--wait=false")
        proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        cluster.cp.kubectl("uncordon", late_node, check=False)
    said = _read(out)
    assert proc.returncode == 0, said[-6000:]
    assert "== summary ==" in said and "SUCCEEDED in " in said and "RLHF_TASKS_RESULT" not in said
    final = tbmod.poll(lambda: (r := kubectl_json(cluster, ns, "rayjob", "tiny")) and
                       r.get("status", {}).get("jobDeploymentStatus") in ("Complete", "Failed") and r["status"],
                       30, "the RayJob's final status")
    assert final["jobDeploymentStatus"] == "Complete" and final["jobStatus"] == "SUCCEEDED", final
    rows = metrics(ckpt / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no step lost, none counted twice
    assert [r for r in rows if r.get("resumed_from", 0) >= 10]
    assert "restarting the job, attempt 1" in said
    # the late worker: the head's runner waited with 2 of 3 nodes, and the command started once all 3 were in
    lines = said.splitlines()
    waited = next(i for i, line in enumerate(lines) if "waiting for 3 nodes to join" in line and "2/3 nodes" in line)
    ready = next(i for i, line in enumerate(lines) if "cluster ready: 3/3 nodes alive" in line)
    command = next(i for i, line in enumerate(lines) if "its command runs now" in line)
    assert waited < ready < command
    status = run_cli(["status", "tiny"], env)
    assert status.returncode == 0 and "jobStatus SUCCEEDED" in status.stdout, status.stdout + status.stderr
    down = run_cli(["down", "tiny"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    left = cluster.cp.kubectl("-n", ns, "get", "rayjobs,rayclusters,pods,configmaps,secrets,services", "-o", "name")
    assert [x for x in left.stdout.split() if x != "configmap/kube-root-ca.crt"] == [], left.stdout


def _read(f) -> str:
    f.flush()
    return Path(f.name).read_text()
