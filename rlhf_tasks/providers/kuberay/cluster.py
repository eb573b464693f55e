"""The handle over a RayJob `launch` applied (providers/base.Cluster), all through kubectl's JSON:
the pods' way up shown once per change (Pending with the scheduler's reason, init containers,
image pulls), each pod's containers' logs streamed into files the launcher follows, whether the
head's job runner still runs, and the summary's lines. The launcher follows; nothing here does.

The head's log (node-0.log) is the submitter's (`ray-job-submitter`, the pod of the Kubernetes
Job KubeRay makes in K8sJobMode, named after the RayJob): it runs `ray job submit` of the
entrypoint, the agent's job runner, and streams the runner's log: the runner's lines, the
job's own log it relays, and its result line. The head's Ray container
(node-0-ray.log: the agent's `--before-ray` lines: setup, prepare) and each worker's Ray
container (node-K.log) are followed beside it."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from ...agent.protocol import RESULT_PREFIX, parse_result, started_job
from ...errors import StepFailed
from ...plan import Plan
from ..base import Cluster, end_process
from .kubectl import Kubectl

SUBMITTER = "ray-job-submitter"
#: The Job controller's label on a Job's pods: KubeRay's submitter Job is named after the RayJob.
JOB_LABEL = "batch.kubernetes.io/job-name"
#: kubectl is asked at most this often while the launcher waits.
REFRESH_S = 2.0
#: How long the head's log may take to reach its file once its container has ended.
DRAIN_S = 30.0
FINISHED = ("Complete", "Failed", "ValidationFailed")
#: The agent's own log lines ("[12:00:00] node1: ...") and its result line, apart from a command's output.
AGENT_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+: |^" + RESULT_PREFIX)
#: How many lines of a failed pod's output its failure quotes.
OUTPUT_LINES = 3
#: The operator's events when the API server refuses a pod it creates (raycluster_controller.go).
POD_NOT_CREATED = ("FailedToCreateHeadPod", "FailedToCreateWorkerPod")
#: The API server's words when PodSecurity admission refuses a pod: no retry of the operator's can pass.
POD_SECURITY_REFUSAL = "violates PodSecurity"


def container_states(pod: dict) -> dict[str, dict]:
    """Container name -> its status (init containers too)."""
    status = pod.get("status") or {}
    return {c["name"]: c for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])}


def started(status: dict | None) -> bool:
    state = (status or {}).get("state") or {}
    return "running" in state or "terminated" in state


def terminated(status: dict | None) -> bool:
    return "terminated" in ((status or {}).get("state") or {})


def role(pod: dict) -> str:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if "ray.io/node-type" not in labels and JOB_LABEL in labels:
        return "submitter"
    return "head" if labels.get("ray.io/node-type") == "head" else "worker"


def ray_container(pod: dict) -> str | None:
    names = [c["name"] for c in (pod.get("spec") or {}).get("containers") or [] if c["name"] != SUBMITTER]
    return names[0] if names else None


def _state_words(name: str, status: dict, image: str | None) -> str | None:
    state = status.get("state") or {}
    if "waiting" in state:
        waiting = state["waiting"] or {}
        reason = waiting.get("reason") or "waiting"
        if reason == "PodInitializing":
            return None
        pull = f" (image {image})" if image and ("Image" in reason or reason == "ContainerCreating") else ""
        message = f": {waiting['message']}" if waiting.get("message") else ""
        return f"{name} {reason}{message}{pull}"
    if "terminated" in state:
        done = state["terminated"] or {}
        if done.get("exitCode") == 0:
            return None
        return f"{name} exited {done.get('exitCode')} ({done.get('reason') or 'Error'})"
    return None


def pod_words(pod: dict) -> str:
    """A pod's progress in one line: its phase and what holds it (the scheduler's reason, an
    init container, an image pull, a failed or restarted container), Ready or not."""
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    images = {c["name"]: c.get("image") for c in (pod.get("spec") or {}).get("initContainers", []) +
              (pod.get("spec") or {}).get("containers", [])}
    notes = []
    scheduled = conditions.get("PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        notes.append("not scheduled: " + ": ".join(x for x in (scheduled.get("reason"), scheduled.get("message")) if x))
    inits = (status.get("initContainerStatuses") or [])
    for init in inits:
        if "running" in (init.get("state") or {}):
            notes.append(f"init container {init['name']} running")
    for c in inits + (status.get("containerStatuses") or []):
        words = _state_words(c["name"], c, images.get(c["name"]))
        if words:
            notes.append(words)
        if c.get("restartCount"):
            notes.append(f"{c['name']} restarted {c['restartCount']}x")
    if phase == "Running":
        ready = conditions.get("Ready", {}).get("status") == "True"
        notes.append("Ready" if ready else "not Ready yet")
    return phase + (f" ({'; '.join(notes)})" if notes else "")


def rayjob_words(rayjob: dict | None, name: str) -> str:
    if rayjob is None:
        return f"RayJob {name}: gone"
    status = rayjob.get("status") or {}
    words = f"RayJob {name}: {status.get('jobDeploymentStatus') or 'New'}"
    if status.get("jobStatus"):
        words += f", job {status['jobStatus']}"
    why = ": ".join(x for x in (status.get("reason"), status.get("message")) if x)
    return words + (f" ({why})" if why else "")


class LogStream:
    """One container's log appended to a file by `kubectl logs -f` in a thread. When kubectl's
    stream ends before the container has, it is asked again and what was already written is
    skipped (kubectl prints a container's log from its beginning). `to_result`: the stream ends
    at the agent's result line (a Ray container's `--before-ray` role: what follows is KubeRay's
    `ray start`, which the launcher does not show), so that a big cluster's follow holds one
    kubectl per pod only while its pod comes up."""

    def __init__(self, kube: Kubectl, pod: str, container: str, path: Path, ended: Callable[[], bool],
                 to_result: bool = False):
        self.kube, self.pod, self.container, self.path, self.ended = kube, pod, container, path, ended
        self.to_result = to_result
        self.stop = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name=f"kubectl-logs-{pod}-{container}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        seen = 0
        while not self.stop.is_set():
            self.proc = subprocess.Popen(self.kube.argv("logs", "-f", self.pod, "-c", self.container),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            read = 0
            with open(self.path, "ab") as out:
                for line in self.proc.stdout:
                    read += len(line)
                    if read > seen:
                        out.write(line[max(0, len(line) - (read - seen)):])
                        out.flush()
                        seen = read
                    if self.to_result and RESULT_PREFIX.encode() in line:
                        self.proc.terminate()
                        self.proc.wait()
                        return
            self.proc.wait()
            if self.ended() or self.stop.wait(1.0):
                return

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        self.stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()


class PortForward:
    """`kubectl port-forward svc/<cluster>-head-svc LOCAL:8265`, started once the head pod runs
    and again whenever it exits, until closed."""

    def __init__(self, kube: Kubectl, service: str, local: int, remote: int, log: Path):
        self.kube, self.service, self.local, self.remote, self.log = kube, service, local, remote, log
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def argv(self) -> list[str]:
        return self.kube.argv("port-forward", f"svc/{self.service}", f"{self.local}:{self.remote}")

    def keep(self) -> list[str]:
        if self.proc is not None and self.proc.poll() is None:
            return []
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.starts += 1
        return [f"forwarding the head's dashboard: {' '.join(self.argv()[1:])}"] if self.starts == 1 else []

    def close(self) -> None:
        end_process(self.proc)


class Watch:
    """What kubectl says of one RayJob and its pods, asked at most every REFRESH_S; the log
    streams it starts as containers start; the lines that changed since last shown."""

    def __init__(self, kube: Kubectl, plan: Plan, cluster: str, logs: Path, undo: Callable[[], str],
                 forward: PortForward | None = None):
        self.kube, self.plan, self.name, self.cluster, self.logs = kube, plan, plan.name, cluster, logs
        self.undo, self.forward = undo, forward
        self.rayjob: dict | None = {}
        self.pods: dict[str, dict] = {}
        self.asked = 0.0
        self.shown: dict[str, str] = {}
        self.streams: dict[tuple[str, str], LogStream] = {}
        self.slots: dict[str, int] = {}  # worker pod -> its node-K.log
        self.exits: dict[tuple, str] = {}  # (pod, container, restarts, running now) -> the exited run's log
        self.head_seen = self.runner_seen = False
        self.ended_at: float | None = None
        self.error: str | None = None
        self.refused: str | None = None  # the API server's refusal of the operator's pods, once seen

    # ------------------------------------------------------------------ asking kubectl

    def refresh(self, force: bool = False) -> None:
        """Ask again (unless asked just now); when kubectl fails, the last answer stands and the
        failure is said once (a passing API hiccup is no reason to give up on the job)."""
        if not force and time.monotonic() - self.asked < REFRESH_S:
            return
        self.asked = time.monotonic()
        try:
            rayjob = self.kube.get("rayjob", self.name)
            pods = {p["metadata"]["name"]: p for p in self.kube.pods(f"ray.io/cluster={self.cluster}")
                    + self.kube.pods(f"{JOB_LABEL}={self.name}")}
        except (StepFailed, ValueError) as exc:
            self.error = f"kubectl did not answer: {exc}"
            return
        self.rayjob, self.pods, self.error = rayjob, pods, None
        for name, pod in sorted(self.pods.items()):
            self._follow(name, pod)
        if not self.pods and not self.runner_seen:
            self.refused = self.pods_refused()

    def pods_refused(self) -> str | None:
        """While the cluster has no pod: the operator's event saying the API server's PodSecurity
        admission refused one (the operator retries, but it never passes; the RayJob would only fail
        at preRunningDeadlineSeconds, saying nothing of why)."""
        try:
            events = self.kube.events("RayCluster", self.cluster)
        except (StepFailed, ValueError):
            return None
        return next((e.get("message") for e in events if e.get("reason") in POD_NOT_CREATED
                     and POD_SECURITY_REFUSAL in (e.get("message") or "")), None)

    def head(self) -> dict | None:
        heads = [p for p in self.pods.values() if role(p) == "head"]
        if heads:
            self.head_seen = True
        return heads[0] if heads else None

    def submitter(self) -> dict | None:
        pods = [p for p in self.pods.values() if role(p) == "submitter"]
        return pods[-1] if pods else None

    def _follow(self, name: str, pod: dict) -> None:
        """Start a log stream for each of the pod's containers that has started."""
        states = container_states(pod)
        if role(pod) == "submitter":
            files = {SUBMITTER: "node-0.log"}
        elif role(pod) == "head":
            files = {ray_container(pod): "node-0-ray.log"}
        else:
            if name not in self.slots:
                taken = {slot for pod_name, slot in self.slots.items() if pod_name in self.pods}
                self.slots[name] = min(set(range(1, self.plan.nodes)) - taken or {len(self.slots) + 1})
            files = {ray_container(pod): f"node-{self.slots[name]}.log"}
        for container, file in files.items():
            if container and (name, container) not in self.streams and started(states.get(container)):
                self.streams[(name, container)] = LogStream(self.kube, name, container, self.logs / file,
                                                            self._ended(name, container),
                                                            to_result=container != SUBMITTER)
                if container == SUBMITTER:
                    self.runner_seen = True

    def _ended(self, pod: str, container: str) -> Callable[[], bool]:
        def ended() -> bool:
            current = self.pods.get(pod)
            return current is None or terminated(container_states(current).get(container))
        return ended

    # ------------------------------------------------------------------ what the launcher asks

    def changes(self) -> list[str]:
        """Lines for what changed since last shown: the RayJob's status, each pod's progress."""
        self.refresh()
        self.failed_before_start()
        now = {"rayjob": rayjob_words(self.rayjob, self.name)}
        if self.error:
            now["error"] = self.error
        now.update({f"pod {n}": f"pod {n} ({role(p)}): {pod_words(p)}" for n, p in self.pods.items()})
        lines = [words for key, words in now.items() if self.shown.get(key) != words]
        lines += [f"{key} is gone" for key in self.shown if key not in now and key != "error"]
        self.shown = now
        if self.forward is not None and (self.head() or {}).get("status", {}).get("phase") == "Running":
            lines += self.forward.keep()
        return lines

    def failed_before_start(self) -> None:
        """The RayJob failed (or its head pod did, or a pod's agent) before the job runner started:
        delete what the launch applied and say why."""
        if self.runner_seen:
            return
        own = self.agent_failed()
        if own is not None:
            raise StepFailed("starting the cluster", f"{own}; {self.undo()}")
        if self.refused:
            hint = ("; placement.kuberay.security_context: restricted makes the pods pass it"
                    if '"restricted' in self.refused else "")
            raise StepFailed("starting the cluster", f"the API server refuses the operator's pods: {self.refused}"
                             f"{hint}; {self.undo()}")
        head = self.head()
        status = (self.rayjob or {}).get("status") or {}
        failed = status.get("jobDeploymentStatus") in ("Failed", "ValidationFailed")
        head_failed = head is not None and (head.get("status") or {}).get("phase") == "Failed"
        if failed or head_failed:
            why = rayjob_words(self.rayjob, self.name) if failed else \
                f"head pod {head['metadata']['name']}: {pod_words(head)}"
            raise StepFailed("starting the cluster", f"{why}, before the job runner started; {self.undo()}")

    def agent_failed(self) -> str | None:
        """The first pod whose agent ended with an error before KubeRay's `ray start` (its setup,
        the head's prepare, a worker's services), in words: its error and the output before it,
        from the log of the container's run that exited (`kubectl logs --previous` once it has
        restarted: a crash-looping container is mostly waiting, so its stream may never see it
        run). Such a pod never becomes Ready, and the operator would only say so at its
        pre-running deadline, as its own PreRunningDeadlineExceeded."""
        for pod_name, pod in sorted(self.pods.items()):
            container = ray_container(pod) if role(pod) != "submitter" else None
            status = container_states(pod).get(container) or {}
            now = ((status.get("state") or {}).get("terminated") or {}).get("exitCode")
            before = ((status.get("lastState") or {}).get("terminated") or {}).get("exitCode")
            if not now and not before:
                continue
            key = (pod_name, container, status.get("restartCount") or 0, bool(now))
            if key not in self.exits:  # each exited run is read once
                out = self.kube.run("logs", pod_name, "-c", container, *([] if now else ["--previous"]))
                self.exits[key] = out.stdout if out.returncode == 0 else ""
            text = self.exits[key]
            result = parse_result(text) or {}
            if result.get("exit_code"):
                said = [line for line in text.splitlines() if line.strip() and not AGENT_LINE.match(line)]
                output = f"; its output ended: {' | '.join(said[-OUTPUT_LINES:])}" if said else ""
                return (f"{role(pod)} pod {pod_name}: "
                        f"{result.get('error') or 'exit code %s' % result['exit_code']}{output}")
        return None

    def head_alive(self) -> bool:
        """Until the head's job runner has ended (its submitter, the head pod, or the RayJob) and
        its log has reached node-0.log."""
        self.refresh()
        self.failed_before_start()
        head, submitter = self.head(), self.submitter()
        status = (self.rayjob or {}).get("status") or {}
        ended = self.rayjob is None or status.get("jobDeploymentStatus") in FINISHED \
            or (head is None and self.head_seen) \
            or (head is not None and (head.get("status") or {}).get("phase") in ("Failed", "Succeeded")) \
            or (submitter is not None and terminated(container_states(submitter).get(SUBMITTER)))
        if not ended:
            self.ended_at = None
            return True
        self.ended_at = self.ended_at or time.monotonic()
        stream = self.streams.get(((submitter or {}).get("metadata", {}).get("name"), SUBMITTER))
        return stream is not None and stream.running and time.monotonic() - self.ended_at < DRAIN_S

    def describe(self) -> list[str]:
        self.refresh(force=True)
        if self.error:
            return [f"RayJob {self.name}: {self.error}"]
        lines = [rayjob_words(self.rayjob, self.name) + f" in namespace {self.kube.namespace} "
                 f"(context {self.kube.context})"]
        phases: dict[str, int] = {}
        for pod in self.pods.values():
            key = f"{role(pod)} {(pod.get('status') or {}).get('phase') or 'Pending'}"
            phases[key] = phases.get(key, 0) + 1
        lines.append(f"pods of {self.cluster}: " + (", ".join(f"{n} {k}" for k, n in sorted(phases.items()))
                                                   or "none left"))
        return lines

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
        if self.forward is not None:
            self.forward.close()


def handle(watch: Watch, token: str | None, dashboard: str | None) -> Cluster:
    """The launcher's handle over a watch."""
    return Cluster(name=watch.name, cluster_id=watch.cluster, token=token, head_alive=watch.head_alive,
                   dashboard=dashboard, node_logs=[str(watch.logs / f) for f in
                                                   ["node-0.log", "node-0-ray.log"] +
                                                   [f"node-{k}.log" for k in range(1, watch.plan.nodes)]],
                   describe=watch.describe, tend=watch.changes, close=watch.close)


def job_started(name: str, head_log: Path) -> bool:
    """Whether the job's command ran: the launcher recorded its submission, or the head said so."""
    from ... import state

    try:
        text = head_log.read_text(errors="replace")
    except OSError:
        text = ""
    return bool(((state.load(name) or {}).get("job") or {}).get("submission_id") or started_job(text))
