"""`launch`, `status`, `down` on KubeRay through kubectl, against the stand-in kubectl
(tests/kubectl_standin.py). The fast tests play the operator's answers themselves by writing the
stand-in's status, pod and log files (the remote boundary), one step after another as kubectl is
asked; the product's own code (the CLI, the launcher, the provider, kubectl's argv) runs as a
user's would. What KubeRay itself does is tested against the real operator and API server:
tests/test_kuberay_cluster.py."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from kubectl_standin import append_log, calls, install, pod, write_event, write_pod, write_status
from rlhf_tasks import providers
from rlhf_tasks.agent.protocol import JOB_STARTS, result_line
from rlhf_tasks.cli import main
from rlhf_tasks.errors import StepFailed
from rlhf_tasks.agent.protocol.ports import free_port
from rlhf_tasks.providers.kuberay import cluster as kuberay_cluster
from rlhf_tasks.spec import load_task

SECRET_VALUE = "wandb-value-42"
CLUSTER = "kr-abcde"
HEAD, WORKER = f"{CLUSTER}-head-x1y2z", f"{CLUSTER}-workers-worker-q9w8e"
SUBMITTER = "kr-7fz2k"  # the pod of KubeRay's submitter Job, named after the RayJob


def submitter_pod(state: dict, phase: str = "Running") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": SUBMITTER, "namespace": "default", "labels": {"batch.kubernetes.io/job-name": "kr"}},
            "spec": {"containers": [{"name": "ray-job-submitter"}]},
            "status": {"phase": phase, "containerStatuses": [{"name": "ray-job-submitter", "restartCount": 0,
                                                              "ready": "running" in state, "state": state}]}}
UNSCHEDULABLE = "0/1 nodes are available: 1 Insufficient cpu."


@pytest.fixture
def kube(tmp_path, monkeypatch, rlhf_home):
    """The stand-in kubectl first on PATH, over an empty cluster with KubeRay's CRDs; kubectl
    asked often (the tests' operator moves on as it is asked)."""
    env = install(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("KUBE_STANDIN_DIR", env["KUBE_STANDIN_DIR"])
    monkeypatch.setenv("WANDB_API_KEY", SECRET_VALUE)
    monkeypatch.setattr(kuberay_cluster, "REFRESH_S", 0.1)
    return Path(env["KUBE_STANDIN_DIR"])


def task_file(tmp_path: Path, **extra) -> str:
    data = {"name": "kr", "nodes": 2, "secrets": ["WANDB_API_KEY"], "preflight": "off",
            "job": {"recipe": "command", "args": {"entrypoint": "python3 train.py"}}, **extra}
    path = tmp_path / "kr.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def asked(root: Path, *words: str) -> int:
    """How often kubectl was run with all of `words`."""
    return sum(all(w in c["argv"] for w in words) for c in calls(root))


class Operator(threading.Thread):
    """Plays KubeRay and the kubelets by writing the stand-in's files: each step once its
    condition on what was asked holds."""

    def __init__(self, root: Path, steps):
        super().__init__(daemon=True)
        self.root, self.steps, self.error = root, steps, None
        self.stop = threading.Event()

    def run(self):
        try:
            for condition, action in self.steps:
                while not condition(self.root):
                    if self.stop.wait(0.05):
                        return
                action(self.root)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            self.error = exc

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join(5)
        assert self.error is None, self.error


def applied(root: Path) -> bool:
    return (root / "objects" / "default" / "rayjob" / "kr.json").exists()


def pods_asked(n: int):
    return lambda root: asked(root, "get", "pods") >= n


def initializing(root: Path) -> None:
    write_status(root, "kr", jobDeploymentStatus="Initializing", rayClusterName=CLUSTER, jobId="kr-j1")
    write_pod(root, pod(HEAD, CLUSTER, True, containers={"ray-head": None},
                        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": UNSCHEDULABLE}]))
    write_pod(root, pod(WORKER, CLUSTER, False, init={"wait-gcs-ready": {"waiting": {"reason": "PodInitializing"}}},
                        containers={"ray-worker": {"waiting": {"reason": "PodInitializing"}}}))


def preparing(root: Path) -> None:
    append_log(root, HEAD, "ray-head", "[10:00:00] node0: prepare: making the data\n")
    write_pod(root, pod(HEAD, CLUSTER, True, "Running", containers={"ray-head": {"running": {}}},
                        ip="10.0.0.1", conditions=[{"type": "PodScheduled", "status": "True"}]))


def running(root: Path) -> None:
    append_log(root, HEAD, "ray-head", "[10:00:05] node0: the environment for Ray is in /tmp/x; Ray starts next\n"
               + result_line({"exit_code": 0, "rank": 0}) + "\n" + "Ray runtime started.\n")
    append_log(root, SUBMITTER, "ray-job-submitter", "[10:00:09] node0: kuberay node 0 of 2\n"
               + "[10:00:12] node0: " + JOB_STARTS % "kr-kr-abcde" + "\njob says hello\n")
    append_log(root, WORKER, "ray-worker", "[10:00:06] node1: Ray starts next\n"
               + result_line({"exit_code": 0, "rank": 1}) + "\n")
    write_status(root, "kr", jobDeploymentStatus="Running", jobStatus="RUNNING", rayClusterName=CLUSTER, jobId="kr-j1")
    write_pod(root, pod(HEAD, CLUSTER, True, "Running", containers={"ray-head": {"running": {}}}, ip="10.0.0.1",
                        conditions=[{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]))
    write_pod(root, submitter_pod({"running": {}}))
    write_pod(root, pod(WORKER, CLUSTER, False, "Running", init={"wait-gcs-ready": {"terminated": {"exitCode": 0}}},
                        containers={"ray-worker": {"running": {}}}, ip="10.0.0.2",
                        conditions=[{"type": "Ready", "status": "True"}]))


def finished(root: Path) -> None:
    result = {"exit_code": 0, "rank": 0, "steps": [{"step": "job", "seconds": 2.0}], "node_ids": [],
              "job": {"submission_id": "kr-kr-abcde", "status": "SUCCEEDED"}, "job_log_tail": "job says hello\n"}
    append_log(root, SUBMITTER, "ray-job-submitter", result_line(result) + "\n")
    write_pod(root, submitter_pod({"terminated": {"exitCode": 0, "reason": "Completed"}}, "Succeeded"))
    write_status(root, "kr", jobDeploymentStatus="Complete", jobStatus="SUCCEEDED", rayClusterName=CLUSTER,
                 jobId="kr-j1")


def the_plan_rendered(path: str, env: dict[str, str] | None = None) -> str:
    """What render prints; `env`: with what a launch adds (its W&B run id, issue 38)."""
    provider = providers.get("kuberay")
    plan = provider.plan(load_task(path))
    plan = plan.replace(env={**env, **plan.env}) if env else plan
    return provider.render(plan)["kr.rayjob.yaml"]


# ------------------------------------------------------------------ launch


def test_launch_applies_the_secret_then_what_render_prints_and_follows_the_job_to_its_summary(
        kube, tmp_path, capsys):
    path = task_file(tmp_path)
    steps = [(applied, initializing), (pods_asked(2), preparing), (pods_asked(4), running),
             (pods_asked(6), finished)]
    with Operator(kube, steps):
        code = main(["launch", path, "--provider", "kuberay"])
    out = capsys.readouterr()
    said = out.out + out.err
    assert code == 0, said
    # The exact argv, in order: the context, KubeRay's CRDs, no RayJob of that name yet, the
    # Secret (server-side: no annotation keeps its values), then exactly what render prints.
    argvs = [c["argv"] for c in calls(kube)]
    k = ["kubectl", "--context", "standin"]
    assert argvs[:5] == [
        ["kubectl", "config", "view", "--minify", "-o", "json"],
        k + ["get", "crd", "rayjobs.ray.io", "-o", "json"],
        k + ["-n", "default", "get", "rayjob", "kr", "-o", "json", "--ignore-not-found"],
        k + ["-n", "default", "apply", "--server-side", "--force-conflicts", "--field-manager=rlhf-tasks", "-f", "-"],
        k + ["-n", "default", "apply", "-f", "-"]]
    records = calls(kube)
    run_id = (tmp_path / "home" / "runs" / "kr" / "wandb-run-id").read_text().strip()
    assert records[4]["stdin"] == the_plan_rendered(path, {"WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow"})
    secret = json.loads(records[3]["stdin"])
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "kr-secrets"
    assert secret["data"] == {"WANDB_API_KEY": "<redacted>"}
    # The value reached the Secret (the kubelet's to inject) and nothing else: not argv, not the output.
    stored = json.loads((kube / "objects" / "default" / "secret" / "kr-secrets.json").read_text())
    assert base64.b64decode(stored["data"]["WANDB_API_KEY"]).decode() == SECRET_VALUE  # the value, base64 as kept
    assert SECRET_VALUE not in (kube / "argv.jsonl").read_text() and SECRET_VALUE not in said
    # The pods' way up, each change once; the job's log once; the summary.
    assert said.count(UNSCHEDULABLE) == 1
    assert "prepare: making the data" in said
    assert out.out.splitlines().count("job says hello") == 1 and "RLHF_TASKS_RESULT" not in out.out
    assert "RayJob kr: Running, job RUNNING" in said
    assert "== summary ==" in out.out and "job kr-kr-abcde: SUCCEEDED" in out.out
    assert "RayJob kr: Complete, job SUCCEEDED in namespace default (context standin)" in out.out
    # Logs followed with kubectl logs -f, the head's from the submitter.
    assert ["kubectl", "--context", "standin", "-n", "default", "logs", "-f", SUBMITTER, "-c", "ray-job-submitter"] \
        in argvs
    # The job ran: what was applied stays until `down` (KubeRay deletes the cluster after its TTL).
    assert applied(kube)
    record = json.loads((tmp_path / "home" / "clusters" / "kr" / "cluster.json").read_text())
    assert record["cluster_id"] == CLUSTER and record["objects"] == [["rayjob", "kr"], ["configmap", "kr-rlhf-tasks"],
                                                                      ["secret", "kr-secrets"]]
    assert record["job"] == {"submission_id": "kr-kr-abcde", "status": "SUCCEEDED"}


def test_a_head_pod_that_fails_before_the_job_runner_starts_deletes_what_the_launch_applied(kube, tmp_path, capsys):
    def prepare_fails(root):
        append_log(root, HEAD, "ray-head", "prepare: no space left on device\n")
        write_pod(root, pod(HEAD, CLUSTER, True, "Failed",
                            containers={"ray-head": {"terminated": {"exitCode": 1, "reason": "Error"}}}))

    with Operator(kube, [(applied, initializing), (pods_asked(2), prepare_fails)]):
        code = main(["launch", task_file(tmp_path), "--provider", "kuberay"])
    said = "".join(capsys.readouterr())
    assert code == 1, said
    assert "failed: starting the cluster: head pod " in said and "ray-head exited 1 (Error)" in said
    assert "deleted rayjob kr, configmap kr-rlhf-tasks, secret kr-secrets" in said
    assert ["kubectl", "--context", "standin", "-n", "default", "delete", "rayjob/kr", "configmap/kr-rlhf-tasks",
            "secret/kr-secrets", "--ignore-not-found"] in [c["argv"] for c in calls(kube)]
    assert not any((kube / "objects").rglob("*.json"))
    assert said.count("deleted rayjob kr") == 1


def test_a_rayjob_the_operator_refuses_deletes_what_the_launch_applied(kube, tmp_path, capsys):
    def refused(root):
        write_status(root, "kr", jobDeploymentStatus="ValidationFailed", reason="ValidationFailed",
                     message="The RayJob spec is invalid")

    with Operator(kube, [(applied, refused)]):
        code = main(["launch", task_file(tmp_path), "--provider", "kuberay"])
    said = "".join(capsys.readouterr())
    assert code == 1 and "RayJob kr: ValidationFailed (ValidationFailed: The RayJob spec is invalid)" in said
    assert "cleaned up what this launch created for kr: deleted rayjob kr" in said
    assert not any((kube / "objects").rglob("*.json"))
    assert not (tmp_path / "home" / "clusters" / "kr").exists()  # no record of a cluster that never was


PSA_REFUSAL = ('Failed to create head Pod default/kr-abcde-head-x1y2z, pods "kr-abcde-head-x1y2z" is forbidden: '
               'violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false (container "ray-head" '
               'must set securityContext.allowPrivilegeEscalation=false)')


def test_pods_the_api_server_refuses_fail_the_launch_saying_why(kube, tmp_path, capsys):
    """A namespace that enforces the restricted Pod Security Standard refuses the operator's pods
    (its FailedToCreateHeadPod event holds the API server's words): launch fails at once, saying
    them and the option that makes the pods pass, instead of waiting for preRunningDeadlineSeconds."""
    def refused(root):
        write_status(root, "kr", jobDeploymentStatus="Initializing", rayClusterName=CLUSTER, jobId="kr-j1")
        write_event(root, "kr-abcde.1", "RayCluster", CLUSTER, "FailedToCreateHeadPod", PSA_REFUSAL)
        write_event(root, "other.1", "RayCluster", "someone-else", "FailedToCreateHeadPod", "not ours")

    with Operator(kube, [(applied, refused)]):
        code = main(["launch", task_file(tmp_path), "--provider", "kuberay"])
    said = "".join(capsys.readouterr())
    assert code == 1, said
    assert "failed: starting the cluster: the API server refuses the operator's pods: " + PSA_REFUSAL in said
    assert "placement.kuberay.security_context: restricted makes the pods pass it" in said
    assert "not ours" not in said
    assert "deleted rayjob kr, configmap kr-rlhf-tasks, secret kr-secrets" in said
    assert ["kubectl", "--context", "standin", "-n", "default", "get", "events", "--field-selector",
            f"involvedObject.kind=RayCluster,involvedObject.name={CLUSTER}", "-o", "json"] in \
        [c["argv"] for c in calls(kube)]


def test_launch_checks_kubectl_and_kuberays_crds_before_anything(kube, tmp_path, capsys, monkeypatch):
    path = task_file(tmp_path)
    (kube / "crds" / "rayjobs.ray.io").unlink()
    assert main(["launch", path, "--provider", "kuberay"]) == 2
    err = capsys.readouterr().err
    assert "KubeRay's CRDs are not installed in context standin" in err and "helm install kuberay-operator" in err
    assert [c["argv"][-5:] for c in calls(kube)][-1] == ["get", "crd", "rayjobs.ray.io", "-o", "json"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["launch", path, "--provider", "kuberay"]) == 2
    assert "the `kubectl` command is not on PATH" in capsys.readouterr().err
    assert not (kube / "objects").exists() and not (tmp_path / "home").exists()
    assert not any("apply" in c["argv"] for c in calls(kube))


def test_launch_refuses_missing_secrets_and_a_rayjob_that_exists(kube, tmp_path, capsys, monkeypatch):
    path = task_file(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY")
    assert main(["launch", path, "--provider", "kuberay"]) == 2
    assert "secrets: WANDB_API_KEY not set in your environment" in capsys.readouterr().err
    monkeypatch.setenv("WANDB_API_KEY", SECRET_VALUE)
    (kube / "objects" / "default" / "rayjob").mkdir(parents=True)
    (kube / "objects" / "default" / "rayjob" / "kr.json").write_text(json.dumps({"metadata": {"name": "kr"}}))
    write_status(kube, "kr", jobDeploymentStatus="Running", jobStatus="RUNNING")
    assert main(["launch", path, "--provider", "kuberay"]) == 2
    assert "RayJob kr: Running, job RUNNING already exists in namespace default" in capsys.readouterr().err
    assert not any("apply" in c["argv"] for c in calls(kube))


def test_context_and_namespace_reach_every_kubectl_call(kube, tmp_path, capsys):
    (kube / "contexts.json").write_text(json.dumps({"current": "a", "contexts": {"a": {}, "prod": {"namespace": "ml"}}}))
    with Operator(kube, [(lambda r: (r / "objects" / "team" / "rayjob" / "kr.json").exists(),
                          lambda r: write_status(r, "kr", "team", jobDeploymentStatus="ValidationFailed"))]):
        assert main(["launch", task_file(tmp_path), "--provider", "kuberay", "--context", "prod",
                     "--namespace", "team"]) == 1
    argvs = [c["argv"] for c in calls(kube)]
    assert argvs[0] == ["kubectl", "--context", "prod", "config", "view", "--minify", "-o", "json"]
    assert argvs[1] == ["kubectl", "--context", "prod", "get", "crd", "rayjobs.ray.io", "-o", "json"]
    assert all(argv[1:5] == ["--context", "prod", "-n", "team"] for argv in argvs[2:])
    assert ["kubectl", "--context", "prod", "-n", "team", "apply", "-f", "-"] in argvs
    assert ["kubectl", "--context", "prod", "-n", "team", "delete", "rayjob/kr", "configmap/kr-rlhf-tasks",
            "secret/kr-secrets", "--ignore-not-found"] in argvs
    # --namespace is the rendered objects' namespace: what was applied is what render prints with it.
    assert "  namespace: team\n" in calls(kube)[4]["stdin"]
    capsys.readouterr()
    assert main(["launch", task_file(tmp_path), "--provider", "kuberay", "--namespace", "Bad_NS"]) == 2
    assert "--namespace: 'Bad_NS' is not a DNS label" in capsys.readouterr().err


def test_ctrl_c_while_the_pods_are_pending_deletes_what_the_launch_applied(kube, tmp_path):
    """Ctrl-C before the job's command starts cancels the launch: `down`, which deletes the
    objects and waits until the operator has removed the pods."""
    import signal

    def pods_go(root):
        for path in (root / "pods" / "default").glob("*.json"):
            path.unlink()

    env = dict(os.environ, RLHF_TASKS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    gone = lambda root: not applied(root) and asked(root, "delete") > 0  # noqa: E731
    with Operator(kube, [(applied, initializing), (gone, pods_go)]):
        proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", task_file(tmp_path), "--provider",
                                 "kuberay"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if UNSCHEDULABLE in line:
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=120)
    said = "".join(seen) + rest
    assert proc.returncode == 130, said
    assert "interrupted before the job's command started: stopping the cluster kr" in said
    assert "kr: deleted rayjob kr, configmap kr-rlhf-tasks, secret kr-secrets" in said
    assert f"the pods of {CLUSTER} are gone" in said
    assert not any((kube / "objects").rglob("*.json")) and not any((kube / "pods").rglob("*.json"))


def launch_process(kube: Path, tmp_path: Path) -> subprocess.Popen:
    env = dict(os.environ, RLHF_TASKS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", task_file(tmp_path), "--provider",
                             "kuberay"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class Output:
    """The launcher's output, read as it comes (a thread), so that a test can wait for a line and
    still have every line after it."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.reader = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self.reader.start()

    def until(self, text: str, deadline_s: float = 60) -> None:
        wait_until(lambda: any(text in line for line in list(self.lines)) or not self.reader.is_alive(),
                   f"the launch to say {text!r}", deadline_s)
        assert any(text in line for line in self.lines), f"the launch ended without {text!r}:\n{self.text()}"

    def text(self) -> str:
        return "".join(self.lines)

    def end(self, timeout: float = 120) -> str:
        self.proc.wait(timeout)
        self.reader.join(10)
        return self.text()


def wait_until(condition, what: str, deadline_s: float = 60) -> None:
    import time

    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"not within {deadline_s:.0f}s: {what}"
        time.sleep(0.05)


def pods_asked_after_delete(root: Path) -> bool:
    """kubectl delete has returned (down asks for the pods only after it) and down waits for the pods."""
    argvs = [c["argv"] for c in calls(root)]
    deletes = [i for i, argv in enumerate(argvs) if "delete" in argv]
    return bool(deletes) and any("get" in argv and "pods" in argv for argv in argvs[deletes[0]:])


def test_a_second_ctrl_c_after_the_rayjob_is_deleted_only_stops_waiting_for_the_pods(kube, tmp_path):
    """The first Ctrl-C is `down`: it deletes the RayJob (KubeRay then removes the cluster) and waits
    for the pods. A second one there stops the wait: what the launcher says matches what happened
    (deleted, the pods going), and nothing is deleted a second time."""
    import signal

    with Operator(kube, [(applied, initializing)]):  # the pods never go: the operator is slow
        proc = launch_process(kube, tmp_path)
        out = Output(proc)
        out.until(UNSCHEDULABLE)
        proc.send_signal(signal.SIGINT)
        out.until("interrupted before the job's command started")
        wait_until(lambda: pods_asked_after_delete(kube), "down to delete the RayJob and wait for the pods")
        proc.send_signal(signal.SIGINT)
        said = out.end()
    assert proc.returncode == 130, said
    assert ("stopping the cluster kr, so that the job does not run (Ctrl-C again, before its RayJob is deleted, "
            "leaves it all running; after, it only stops waiting for the pods to go)") in said
    assert "kr: deleted rayjob kr, configmap kr-rlhf-tasks, secret kr-secrets" in said
    assert f"stopped waiting for the pods of {CLUSTER} to go (Ctrl-C): KubeRay removes them" in said
    assert "the job of kr did not run" in said
    assert "interrupted again" not in said and "never ran" not in said and "leaves it running" not in said
    assert asked(kube, "delete") == 1  # once: nothing deleted after the second Ctrl-C
    assert any((kube / "pods").rglob("*.json"))  # the pods are KubeRay's to remove


def test_a_second_ctrl_c_before_the_rayjob_is_deleted_leaves_it_all_as_it_says(kube, tmp_path):
    """A second Ctrl-C while `kubectl delete` is still on its way (a slow API server) leaves the
    RayJob and all it made, says so with what is left, and nothing deletes it afterwards."""
    import signal

    (kube / "hold-delete").write_text("")
    with Operator(kube, [(applied, initializing)]):
        proc = launch_process(kube, tmp_path)
        out = Output(proc)
        out.until(UNSCHEDULABLE)
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: asked(kube, "delete") == 1, "down to ask kubectl to delete the RayJob")
        proc.send_signal(signal.SIGINT)
        out.until("interrupted again")
        (kube / "hold-delete").unlink()  # the API server answers again: a late delete would now go through
        said = out.end()
    assert proc.returncode == 130, said
    assert "interrupted again: the cluster may still be running, and its head start the job: stop it with: " \
           "rlhf-tasks down kr" in said
    assert "RayJob kr in namespace default (context standin): jobDeploymentStatus Initializing" in said
    assert "deleted rayjob" not in said and "never ran" not in said
    assert applied(kube) and asked(kube, "delete") == 1  # the one kubectl delete, stopped with the launcher


# ------------------------------------------------------------------ the real kubectl, no cluster


@pytest.fixture(scope="module")
def real_kubectl(tmp_path_factory) -> Path:
    """The real kubectl (Kubernetes' own, as `make kube` built it into its cache: never built here,
    so the fast tier stays fast, though a build under way, as `make test` starts one, is waited
    for), alone in a bin directory: no cluster is started, kubectl only reads
    a kubeconfig and dials a closed port. Skipped locally (failed in CI) when it was not built."""
    from conftest import need
    from kube.controlplane import built

    found = built(wait_for_a_build_under_way=True)
    need(found is not None, "the real kubectl: run `make kube` first (tests/kube/build.sh, with Go)")
    bin_dir = tmp_path_factory.mktemp("kubectl-bin")
    (bin_dir / "kubectl").symlink_to(found / "bin" / "kubectl")
    return bin_dir


def launch_with(real_kubectl: Path, tmp_path: Path, kubeconfig: str, *flags: str) -> subprocess.CompletedProcess:
    config = tmp_path / "kubeconfig"
    config.write_text(kubeconfig)
    env = dict(os.environ, KUBECONFIG=str(config), RLHF_TASKS_HOME=str(tmp_path / "home"),
               PATH=f"{real_kubectl}{os.pathsep}{os.environ['PATH']}", WANDB_API_KEY=SECRET_VALUE)
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "launch", task_file(tmp_path), "--provider",
                           "kuberay", *flags], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_an_unconfigured_kubectl_is_said_as_such_not_blamed_on_a_context_flag(real_kubectl, tmp_path):
    out = launch_with(real_kubectl, tmp_path, "")
    assert out.returncode == 2, out.stderr
    assert "kubectl has no current context" in out.stderr, out.stderr
    assert "kubectl config use-context NAME" in out.stderr and "or pass --context NAME" in out.stderr
    assert "--context:" not in out.stderr and "cannot use" not in out.stderr
    assert not (tmp_path / "home").exists()
    # a --context the user did give is the one named
    out = launch_with(real_kubectl, tmp_path, "", "--context", "prod")
    assert out.returncode == 2 and "--context: kubectl cannot use --context prod" in out.stderr, out.stderr
    assert "cannot locate context prod" in out.stderr


def test_an_unreachable_api_server_is_said_once_naming_the_context_and_server(real_kubectl, tmp_path):
    port = free_port()  # a loopback port nothing listens on
    server = f"https://127.0.0.1:{port}"
    out = launch_with(real_kubectl, tmp_path, yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": server}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "me"}}],
        "users": [{"name": "me", "user": {"token": "not-a-real-token"}}]}))
    assert out.returncode == 2, out.stderr
    err = out.stderr
    assert err.count(f"127.0.0.1:{port}") == 2, err  # the API server named once by us, once in kubectl's line
    assert err.count("was refused") == 1 and "memcache.go" not in err, err
    assert f"kubectl cannot reach the API server of context lab (API server {server})" in err
    assert "nothing was launched" in err and "not-a-real-token" not in err
    assert not (tmp_path / "home").exists()


def test_client_gos_repeated_log_lines_are_said_once():
    from rlhf_tasks.providers.kuberay.kubectl import said

    klog = ('E1126 13:42:35.351026   10998 memcache.go:381] "Couldn\'t get current server API group list" '
            'err="dial tcp 127.0.0.1:1: connect: connection refused"')
    only_log = subprocess.CompletedProcess([], 1, "", "\n".join([klog] * 5))
    assert said(only_log) == ('"Couldn\'t get current server API group list" '
                              'err="dial tcp 127.0.0.1:1: connect: connection refused"')
    both = subprocess.CompletedProcess([], 1, "", "\n".join([klog] * 5 + ["The connection ... was refused"]))
    assert said(both) == "The connection ... was refused"


# ------------------------------------------------------------------ status, down


def launched_record(kube: Path, rlhf_home: Path) -> None:
    """What a launch of `kr` left: its record here, its objects and pods there."""
    from rlhf_tasks import state

    state.save("kr", {"provider": "kuberay", "context": "standin", "namespace": "default", "cluster_id": CLUSTER,
                      "objects": [["rayjob", "kr"], ["configmap", "kr-rlhf-tasks"], ["secret", "kr-secrets"]]})
    for kind, name in (("rayjob", "kr"), ("configmap", "kr-rlhf-tasks"), ("secret", "kr-secrets")):
        path = kube / "objects" / "default" / kind / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": kind, "metadata": {"name": name}}))


def test_status_says_the_rayjobs_two_states_and_each_pods_phase(kube, rlhf_home, capsys):
    launched_record(kube, rlhf_home)
    write_status(kube, "kr", jobDeploymentStatus="Running", jobStatus="RUNNING", rayClusterName=CLUSTER)
    running(kube)
    write_pod(kube, pod(f"{CLUSTER}-workers-worker-zzzzz", CLUSTER, False, "Pending",
                        containers={"ray-worker": {"waiting": {"reason": "ImagePullBackOff",
                                                               "message": "Back-off pulling image"}}}))
    assert main(["status", "kr"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("RayJob kr in namespace default (context standin): jobDeploymentStatus Running, "
                      "jobStatus RUNNING")
    assert out[1] == f"cluster {CLUSTER}: 3 pod(s)"
    assert out[2].startswith(f"  pod {HEAD} (head): Running")
    assert out[3].startswith(f"  pod {WORKER} (worker): Running")
    assert out[4] == (f"  pod {CLUSTER}-workers-worker-zzzzz (worker): Pending (ray-worker ImagePullBackOff: "
                      f"Back-off pulling image)")
    argvs = [c["argv"] for c in calls(kube)]
    assert ["kubectl", "--context", "standin", "-n", "default", "get", "rayjob", "kr", "-o", "json",
            "--ignore-not-found"] in argvs
    assert ["kubectl", "--context", "standin", "-n", "default", "get", "pods", "-l", f"ray.io/cluster={CLUSTER}",
            "-o", "json"] in argvs


def test_down_deletes_the_rayjob_configmap_and_secret_and_waits_for_the_pods(kube, rlhf_home, capsys):
    launched_record(kube, rlhf_home)
    running(kube)

    def kubelet_stops_pods(root):
        for path in (root / "pods" / "default").glob("*.json"):
            path.unlink()

    with Operator(kube, [(lambda r: not (r / "objects" / "default" / "rayjob" / "kr.json").exists(),
                          kubelet_stops_pods)]):
        assert main(["down", "kr"]) == 0
    out = capsys.readouterr().out
    assert ["kubectl", "--context", "standin", "-n", "default", "delete", "rayjob/kr", "configmap/kr-rlhf-tasks",
            "secret/kr-secrets", "--ignore-not-found"] in [c["argv"] for c in calls(kube)]
    assert not any((kube / "objects").rglob("*.json"))
    assert f"the pods of {CLUSTER} are gone" in out
    record = json.loads((rlhf_home / "clusters" / "kr" / "cluster.json").read_text())
    assert record["ended"]


def test_forward_that_fails_says_why_and_records_nothing(kube, rlhf_home):
    """kubectl port-forward to a head pod that is not there: the forward fails with kubectl's
    words, and no dashboard address is recorded (the real forward: tests/test_kuberay_cluster.py)."""
    launched_record(kube, rlhf_home)
    write_status(kube, "kr", jobDeploymentStatus="Running", rayClusterName=CLUSTER)
    with pytest.raises(StepFailed, match=r"forwarding the dashboard of kr: kubectl port-forward exited with code 1: Error from server \(NotFound\)"):
        providers.get("kuberay").forward("kr", free_port())
    record = json.loads((rlhf_home / "clusters" / "kr" / "cluster.json").read_text())
    assert not record.get("dashboard")


def test_a_pods_progress_names_what_holds_it():
    spec_image = {"spec": {"containers": [{"name": "ray-worker", "image": "verlai/verl:ngc"}], "initContainers": []}}

    def words(phase, containers, conditions=()):
        data = pod("p", CLUSTER, False, phase, containers=containers, conditions=list(conditions))
        data["spec"] = spec_image["spec"]
        return kuberay_cluster.pod_words(data)

    assert words("Pending", {"ray-worker": {"waiting": {"reason": "ContainerCreating"}}}) == \
        "Pending (ray-worker ContainerCreating (image verlai/verl:ngc))"
    assert words("Pending", {"ray-worker": {"waiting": {"reason": "ErrImagePull", "message": "manifest unknown"}}}) \
        == "Pending (ray-worker ErrImagePull: manifest unknown (image verlai/verl:ngc))"
    assert words("Pending", {"ray-worker": {"waiting": {"reason": "CreateContainerConfigError", "message":
                                                        "secret \"kr-secrets\" not found"}}}) == \
        'Pending (ray-worker CreateContainerConfigError: secret "kr-secrets" not found)'
    assert words("Pending", {}, [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                  "message": UNSCHEDULABLE}]) == f"Pending (not scheduled: Unschedulable: {UNSCHEDULABLE})"
    crashed = pod("p", CLUSTER, False, "Running", containers={"ray-worker": {"running": {}}},
                  conditions=[{"type": "Ready", "status": "False"}])
    crashed["status"]["containerStatuses"][0]["restartCount"] = 3
    assert kuberay_cluster.pod_words(crashed) == "Running (ray-worker restarted 3x; not Ready yet)"


def test_the_standins_port_forward_relays_to_the_head_pods_ip(kube):
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    remote = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"hello " + conn.recv(100))
    threading.Thread(target=echo, daemon=True).start()
    running(kube)
    with open(kube / "pods" / "default" / f"{HEAD}.json") as handle:
        data = json.load(handle)
    data["status"]["podIP"] = "127.0.0.1"  # the head pod's address, as the kubelet reports it
    write_pod(kube, data)
    local = free_port()
    proc = subprocess.Popen(["kubectl", "port-forward", f"svc/{CLUSTER}-head-svc", f"{local}:{remote}"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"Forwarding from 127.0.0.1:{local} -> {remote}"
        with socket.create_connection(("127.0.0.1", local), timeout=10) as sock:
            sock.sendall(b"there")
            assert sock.recv(100) == b"hello there"
    finally:
        proc.terminate()
        proc.wait(10)
        server.close()


def test_the_standin_refuses_what_it_does_not_implement(kube):
    out = subprocess.run(["kubectl", "get", "rayjob", "kr", "-o", "yaml"], capture_output=True, text=True)
    assert out.returncode == 1 and "-o json" in out.stderr
    out = subprocess.run(["kubectl", "rollout", "status"], capture_output=True, text=True)
    assert out.returncode == 1 and "kubectl rollout" in out.stderr
    out = subprocess.run(["kubectl", "delete", "rayjob/kr", "--wait=false"], capture_output=True, text=True)
    assert out.returncode == 1 and "--wait" in out.stderr
    # what the API server refuses of a client-side apply: an object over the 256 KiB its annotation may hold
    big = yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big"},
                          "data": {"x": "y" * 256 * 1024}})
    out = subprocess.run(["kubectl", "apply", "-f", "-"], input=big, capture_output=True, text=True)
    assert out.returncode == 1 and "metadata.annotations: Too long" in out.stderr
    assert not (kube / "objects" / "default" / "configmap" / "big.json").exists()
    out = subprocess.run(["kubectl", "apply", "--server-side", "-f", "-"], input=big, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
