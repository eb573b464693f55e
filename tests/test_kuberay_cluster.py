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
from rlhf_tasks.agent.protocol.ports import free_port

pytestmark = pytest.mark.cluster


def tiny_grpo(ckpt: Path, steps: int = 150, save_every: int = 25) -> dict:
    return {"name": "tiny", "nodes": 3, "resources": {"cpus": 1}, "env": {"PYTHONUNBUFFERED": "1"},
            "preflight": "off", "ray": {"object_store_memory": "80MB"},
            "checkpoints": {"path": str(ckpt), "shared": {"kuberay": {"claim": "ckpt"}}},
            "wait": {"head": "3m", "nodes": "3m"},
            "job": {"recipe": "tiny-grpo", "working_dir": None, "timeout": "10m",
                    "args": {"steps": steps, "save_every": save_every, "prompts_per_step": 8, "group_size": 8,
                             "num_prompts": 200}}}


def shared_claim(cluster, ns: str, name: str, path: Path, mode: str = "ReadWriteMany") -> None:
    """A claim (ReadWriteMany unless `mode` says) bound to a hostPath volume every pod host sees (the test's
    tmp dir)."""
    path.mkdir(parents=True, exist_ok=True)
    pv = f"{ns}-{name}"
    cluster.cp.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [mode], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path)},
                  "claimRef": {"namespace": ns, "name": name}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
         "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}}]))
    tbmod.poll(lambda: json.loads(cluster.cp.kubectl("-n", ns, "get", "pvc", name, "-o", "json").stdout)
               ["status"].get("phase") == "Bound", 60, f"claim {name} bound")


def kubectl_json(cluster, ns: str, *args: str):
    out = cluster.cp.kubectl("-n", ns, "get", *args, "-o", "json", "--ignore-not-found")
    return json.loads(out.stdout) if out.stdout.strip() else None


def run_cli(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def cli_env(cluster, tmp_path: Path, **extra: str) -> dict:
    """The CLI's environment in a test: the cluster's kubeconfig, a home of the test's own, no token."""
    env = cluster.env(dict(os.environ, RLHF_TASKS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT),
                           PYTHONUNBUFFERED="1", **extra))
    env.pop("RAY_AUTH_TOKEN", None)
    return env


def launch_task(cluster, ns: str, tmp_path: Path, task: dict, env: dict | None = None,
                timeout: float = 600) -> tuple[subprocess.CompletedProcess, str]:
    """`launch` of `task` (written to the test's directory) in namespace `ns`: the finished process and
    what it said (kept in launch.out)."""
    path = tmp_path / f"{task['name']}.yaml"
    path.write_text(yaml.safe_dump(task))
    launch = run_cli(["launch", str(path), "--provider", "kuberay", "--namespace", ns],
                     env or cli_env(cluster, tmp_path), timeout=timeout)
    said = launch.stdout + launch.stderr
    (tmp_path / "launch.out").write_text(said)
    return launch, said


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_launch_refuses_a_claim_the_pods_cannot_all_mount_before_it_applies_anything(kube_cluster, ns, tmp_path):
    """checkpoints.shared.kuberay names a ReadWriteOnce claim (one Kubernetes node's) for 3 pods, then a claim that
    is not there: `check` cannot see either; `launch` reads the claim from the API server and refuses (exit 2),
    saying its access modes, and no RayJob is made."""
    cluster = kube_cluster
    shared_claim(cluster, ns, "ckpt", tmp_path / "ckpt", mode="ReadWriteOnce")
    launch, said = launch_task(cluster, ns, tmp_path, tiny_grpo(tmp_path / "ckpt"), timeout=180)
    assert launch.returncode == 2, said
    assert "checkpoints.shared.kuberay.claim: ckpt: its access modes are ReadWriteOnce" in said, said
    assert "use a ReadWriteMany claim" in said
    assert kubectl_json(cluster, ns, "rayjob", "tiny") is None
    task = tiny_grpo(tmp_path / "ckpt")
    task["checkpoints"]["shared"]["kuberay"]["claim"] = "not-there"
    launch, said = launch_task(cluster, ns, tmp_path, task, timeout=180)
    assert launch.returncode == 2, said
    assert f"checkpoints.shared.kuberay.claim: not-there: no such PersistentVolumeClaim in namespace {ns}" in said
    assert kubectl_json(cluster, ns, "rayjob", "tiny") is None


def test_launch_on_the_real_operator_with_a_late_and_a_lost_worker(kube_cluster, ns, tmp_path):
    """tiny-grpo through `launch --provider kuberay` and the real kubectl: one node is cordoned
    for 20 s, so a worker pod is scheduled late and the job's command starts only once it joined;
    a worker pod deleted mid-run is recreated by the operator and the job resumes from its
    checkpoint, every step once; SUCCEEDED; then `status`, and `down` leaves nothing of the run."""
    cluster = kube_cluster
    ckpt, steps = tmp_path / "ckpt", 500  # the loss lands near step 70 of a quiet run; 400 steps of margin
    shared_claim(cluster, ns, "ckpt", ckpt)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_grpo(ckpt, steps, save_every=25)))
    env = cli_env(cluster, tmp_path)
    late_node = cluster.runner.nodes and sorted(cluster.runner.nodes)[-1]
    cluster.cp.kubectl("cordon", late_node)
    cordoned = time.monotonic()
    out = open(tmp_path / "launch.out", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(path), "--provider", "kuberay",
                             "--namespace", ns], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        def pods():
            return (kubectl_json(cluster, ns, "pods") or {"items": []})["items"]
        def held_back():  # two pods bound, the third waits for room: its name
            listed = pods()
            waiting = [p["metadata"]["name"] for p in listed if not p["spec"].get("nodeName")]
            return len(listed) == 3 and len(waiting) == 1 and waiting[0]
        late = tbmod.poll(lambda: held_back() or cluster.check(), 180, "two pods bound and one pending")
        time.sleep(max(0.0, 20 - (time.monotonic() - cordoned)))  # the cordon is the test's condition: 20 s
        cluster.cp.kubectl("uncordon", late_node)
        tbmod.poll(lambda: (proc.poll() is None or (_ for _ in ()).throw(AssertionError(_read(out))))
                   and (cluster.check() or len(metrics(ckpt / "metrics.jsonl")) >= 20), 420, "step 20", 0.3)
        workers = [p for p in pods() if p["metadata"]["labels"].get("ray.io/node-type") == "worker"
                   and not p["metadata"].get("deletionTimestamp")]
        lost = workers[0]["metadata"]["name"]
        # a pod that goes at once (a preempted or failed machine), not after its 30 s of grace
        cluster.cp.kubectl("-n", ns, "delete", "pod", lost, "--grace-period=1", "--wait=false")
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
    # the late worker: scheduled only after the uncordon, and the job's command started once it was in
    lines = said.splitlines()
    unscheduled = next(i for i, line in enumerate(lines) if f"pod {late} (worker): Pending (not scheduled" in line)
    ready = next(i for i, line in enumerate(lines) if f"pod {late} (worker): Running (Ready)" in line)
    everyone = next(i for i, line in enumerate(lines) if "cluster ready: 3/3 nodes alive" in line)
    command = next(i for i, line in enumerate(lines) if "its command runs now" in line)
    assert unscheduled < ready < command and everyone < command
    status = run_cli(["status", "tiny"], env)
    assert status.returncode == 0 and "jobStatus SUCCEEDED" in status.stdout, status.stdout + status.stderr
    down = run_cli(["down", "tiny"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    left = cluster.cp.kubectl("-n", ns, "get", "rayjobs,rayclusters,pods,configmaps,secrets,services", "-o", "name")
    assert [x for x in left.stdout.split() if x != "configmap/kube-root-ca.crt"] == [], left.stdout


def _read(f) -> str:
    f.flush()
    return Path(f.name).read_text()


def failing_task(ckpt: Path) -> dict:
    """Two pods; the job's task on the worker raises, and the job fails."""
    return {"name": "fails", "nodes": 2, "resources": {"cpus": 1}, "preflight": "off",
            "ray": {"object_store_memory": "80MB"}, "secrets": ["FX_SECRET"],
            "checkpoints": {"path": str(ckpt)}, "wait": {"head": "3m", "nodes": "3m"},
            "job": {"recipe": "command", "working_dir": None, "timeout": "5m", "max_restarts": 0,
                    "args": {"entrypoint": f"python3 {ROOT / 'tests' / 'data' / 'fail_on_last_rank.py'}"}}}


def test_a_failing_job_then_status_token_env_forward_bundle_and_down(kube_cluster, ns, tmp_path):
    """A job whose task raises on the worker: `launch` exits 1 naming the worker and its first
    error; then, through the real kubectl: `status` shows the RayJob Failed, `token` is KubeRay's
    own (its Secret), `env` exports it, `forward` answers only once the dashboard does,
    `logs --bundle` through it holds every node's files and no secret, and `down` leaves nothing
    of the run in the namespace."""
    cluster = kube_cluster
    secret = "fx-secret-value-0123456789"
    env = cli_env(cluster, tmp_path, FX_SECRET=secret)
    launch, said = launch_task(cluster, ns, tmp_path, failing_task(tmp_path / "ckpt"), env)
    assert launch.returncode == 1, said[-5000:]
    assert "FAILED" in said and "RuntimeError: bad shard on rank 1" in said, said[-5000:]
    status = run_cli(["status", "fails"], env)
    assert status.returncode == 0 and "jobStatus FAILED" in status.stdout, status.stdout + status.stderr
    # the token is KubeRay's (Secret <cluster>, key auth_token), read through kubectl: never a new one
    rayjob = kubectl_json(cluster, ns, "rayjob", "fails")
    stored = kubectl_json(cluster, ns, "secret", rayjob["status"]["rayClusterName"])
    import base64
    kuberay_token = base64.b64decode(stored["data"]["auth_token"]).decode()
    token = run_cli(["token", "fails"], env)
    assert token.returncode == 0 and token.stdout.strip() == kuberay_token, token.stdout + token.stderr
    assert "made a new" not in token.stderr
    # forward: the address is said once the dashboard answered through it
    port = free_port()
    forward = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "forward", "fails", "--port", str(port)],
                               env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = forward.stdout.readline()
        assert f"is at http://127.0.0.1:{port}" in line, line
        shell = run_cli(["env", "fails"], env)
        assert shell.returncode == 0, shell.stderr
        assert f"export RAY_API_SERVER_ADDRESS=http://127.0.0.1:{port}" in shell.stdout
        assert f"export RAY_AUTH_TOKEN={kuberay_token}" in shell.stdout
        bundle = run_cli(["logs", "fails", "--bundle"], env, timeout=300)
        assert bundle.returncode == 0, bundle.stdout + bundle.stderr
        archive = next((tmp_path / "home" / "runs" / "fails").glob("*.tar.gz"))
        import tarfile
        with tarfile.open(archive) as tar:
            members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode(errors="replace")
                       for m in tar.getmembers() if m.isfile()}
        assert any(n.startswith("node0/") for n in members) and any(n.startswith("node1/") for n in members), \
            sorted(members)
        assert not any(secret in text or kuberay_token in text for text in members.values())
    finally:
        forward.terminate()
        forward.wait(15)
    down = run_cli(["down", "fails"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    left = cluster.cp.kubectl("-n", ns, "get", "rayjobs,rayclusters,pods,configmaps,secrets,services", "-o", "name")
    assert [x for x in left.stdout.split() if x != "configmap/kube-root-ca.crt"] == [], left.stdout


def test_a_queued_rayjob_of_an_image_without_ray_is_waited_for_then_runs_setup_before_kuberays_ray(
        kube_cluster, ns, tmp_path):
    """A Kueue queue named: the RayJob is created held (`suspend: true`, as Kueue's webhook makes
    it) and the real operator keeps it Suspended with no cluster. `launch` says it is queued and
    waits, deleting nothing; once admitted (what Kueue does: `suspend: false`) the operator makes
    the cluster and `launch` follows it to SUCCEEDED. Its image is the shipped GPU tasks' (NGC
    PyTorch: no `ray` until setup installs it): KubeRay's wait-gcs-ready runs `ray health-check` in
    every worker's image before setup, and its submitter `ray job submit`; the job still runs, with
    Ray as setup installed it, on both nodes."""
    from kube.cluster import INSTALLED_BIN, NO_RAY_IMAGE
    cluster = kube_cluster
    ray = Path(sys.executable).parent / "ray"
    task = {"name": "queued", "nodes": 2, "image": NO_RAY_IMAGE, "resources": {"cpus": 1}, "preflight": "off",
            "setup": [f"mkdir -p {INSTALLED_BIN} && ln -sf {ray} {INSTALLED_BIN}/ray"],  # as `pip install ray` would
            "ray": {"object_store_memory": "80MB"}, "wait": {"head": "3m", "nodes": "3m"},
            "placement": {"kuberay": {"queue": "team-a", "ray_version": cluster_ray_version()}},
            "job": {"recipe": "command", "working_dir": None, "timeout": "5m",
                    "args": {"entrypoint": "python3 -c \"import ray; ray.init(); "
                                           "print('admitted and ran on nodes', len(ray.nodes()))\""}}}
    path = tmp_path / "queued.yaml"
    path.write_text(yaml.safe_dump(task))
    env = cli_env(cluster, tmp_path)
    out = open(tmp_path / "launch.out", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(path), "--provider", "kuberay",
                             "--namespace", ns], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        tbmod.poll(lambda: "is queued in Kueue's queue team-a" in _read(out) or proc.poll() is not None, 120,
                   "the launcher to say the RayJob is queued")
        status = tbmod.poll(lambda: (kubectl_json(cluster, ns, "rayjob", "queued") or {}).get("status", {})
                            .get("jobDeploymentStatus") == "Suspended", 60, "the operator to hold it Suspended")
        # held past the operator's own wait (OPERATOR_S would have given up on a silent operator): still there
        assert status and proc.poll() is None, _read(out)[-3000:]
        assert not (kubectl_json(cluster, ns, "pods") or {"items": []})["items"]
        cluster.cp.kubectl("-n", ns, "patch", "rayjob", "queued", "--type", "merge", "-p", '{"spec":{"suspend":false}}')
        proc.wait(420)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    said = _read(out)
    assert proc.returncode == 0, said[-5000:]
    assert "admitted after" in said and "admitted and ran on nodes 2" in said and "SUCCEEDED in " in said, said[-5000:]
    assert "is the KubeRay operator running" not in said
    worker = next(p for p in kubectl_json(cluster, ns, "pods")["items"]
                  if p["metadata"]["labels"].get("ray.io/node-type") == "worker")
    waited = cluster.cp.kubectl("-n", ns, "logs", worker["metadata"]["name"], "-c", "wait-gcs-ready").stdout
    assert "GCS is ready" in waited, waited


def cluster_ray_version() -> str:
    from kube.cluster import RAY_VERSION
    return RAY_VERSION


def test_a_failed_setup_is_said_as_itself_before_the_operators_deadline(kube_cluster, ns, tmp_path):
    """A worker whose setup fails never becomes Ready; the operator would fail the RayJob only at
    `preRunningDeadlineSeconds` (wait.head + wait.nodes) as PreRunningDeadlineExceeded. `launch`
    reads the pod's own result line instead: it exits 1 long before that deadline, naming the pod,
    the step and its error, and deletes what it applied."""
    cluster = kube_cluster
    task = {"name": "bad-setup", "nodes": 2, "resources": {"cpus": 1}, "preflight": "off",
            "setup": ['if [ "$RLHF_TASKS_RANK" != 0 ]; then echo "the model cache is not mounted" >&2; exit 3; fi'],
            "ray": {"object_store_memory": "80MB"}, "wait": {"head": "2m", "nodes": "2m"},
            "job": {"recipe": "command", "working_dir": None, "timeout": "5m",
                    "args": {"entrypoint": "python3 -c \"print('never')\""}}}
    started = time.monotonic()
    launch, said = launch_task(cluster, ns, tmp_path, task)
    took = time.monotonic() - started
    assert launch.returncode == 1, said[-5000:]
    assert took < 200, f"{took:.0f}s: it waited for the operator's deadline (240 s)\n{said[-3000:]}"
    error = next(line for line in said.splitlines() if line.startswith("failed:"))
    assert "setup step 1" in error and "worker pod bad-setup-" in error and "the model cache is not mounted" in error, error
    assert "deleted rayjob bad-setup" in error
    assert "PreRunningDeadlineExceeded" not in said
    left = cluster.cp.kubectl("-n", ns, "get", "rayjobs,configmaps", "-o", "name")
    assert [x for x in left.stdout.split() if x != "configmap/kube-root-ca.crt"] == [], left.stdout


def test_with_a_ttl_of_0_the_failure_bundle_is_fetched_before_the_cluster_goes(kube_cluster, ns, tmp_path):
    """`ttl_after_finished: 0`: KubeRay deletes the cluster as soon as the job ends. The head's
    bundle of a failed job is still here after `launch`: fetched before the cluster went, with
    every node's files in it."""
    cluster = kube_cluster
    task = failing_task(tmp_path / "ckpt")
    task.update(name="gone-fast", secrets=[], placement={"kuberay": {"ttl_after_finished": 0}})
    launch, said = launch_task(cluster, ns, tmp_path, task)
    assert launch.returncode == 1 and "RuntimeError: bad shard on rank 1" in said, said[-5000:]
    bundles = list((tmp_path / "home" / "runs" / "gone-fast").glob("*.tar.gz"))
    assert bundles, said[-3000:]
    import tarfile
    with tarfile.open(bundles[0]) as tar:
        names = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name]
    assert any(n.startswith("node0/") for n in names) and any(n.startswith("node1/") for n in names), names
    assert str(bundles[0]) in said  # the summary names the bundle here, not one "on the head node"
    rayjob = kubectl_json(cluster, ns, "rayjob", "gone-fast")
    tbmod.poll(lambda: not (kubectl_json(cluster, ns, "pods", "-l", f"ray.io/cluster={rayjob['status']['rayClusterName']}")
                            or {"items": []})["items"], 120, "the operator to delete the cluster (TTL 0)")
    runner = cluster.cp.kubectl("-n", ns, "logs", "job/gone-fast").stdout  # the submitter's pod outlives the cluster
    assert "the bundle was read; the runner exits" in runner, runner[-2000:]  # not the whole hold


def test_every_shipped_tasks_rendered_file_is_what_the_api_server_takes(kube_cluster, ns, tmp_path):
    """What `render` prints for every shipped task that KubeRay can run, applied as its header says
    (`kubectl apply -f`, client-side, which keeps the whole object in an annotation) with the real
    API server's validation (`--dry-run=server`: KubeRay's CRD schema, the ConfigMap's limits)."""
    cluster = kube_cluster
    env = cluster.env(dict(os.environ, PYTHONPATH=str(ROOT)))
    applied = []
    for task in sorted((ROOT / "tasks").glob("*.yaml")):
        check = run_cli(["check", str(task), "--provider", "kuberay"], env)
        if check.returncode == 2 and "torchrun" in check.stderr:
            continue  # a recipe without Ray: refused, KubeRay always starts Ray
        out = tmp_path / f"{task.stem}.rayjob.yaml"
        rendered = run_cli(["render", str(task), "--provider", "kuberay", "-o", str(out)], env)
        assert rendered.returncode == 0, rendered.stderr
        said = cluster.cp.kubectl("-n", ns, "apply", "--dry-run=server", "-f", str(out), check=False)
        assert said.returncode == 0, f"{task.name}: {said.stdout}{said.stderr}"
        assert "rayjob.ray.io/" in said.stdout and "(server dry run)" in said.stdout, said.stdout
        applied.append(task.stem)
    assert len(applied) >= 6, applied
