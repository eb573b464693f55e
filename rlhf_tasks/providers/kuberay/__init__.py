"""KubeRay: a RayJob that `kubectl apply -f` runs (`render.py`, pure: its options in `options.py`, the
ConfigMap with the plan and the agent in `configmap.py`, the pod templates in `pods.py`, the RayJob in
`rayjob.py`), and `launch`, `status`, `down`, `forward` through the user's own kubectl (`kubectl.py`;
the handle the launcher follows is `cluster.py`'s).

`launch` pins the kubeconfig context and namespace (`--context`, `--namespace`, else the
kubeconfig's), checks that KubeRay's CRDs are there, refuses a RayJob of the same name that
already exists, and applies: first, unless `placement.kuberay.secret` names a Secret of the
user's, the Secret `<name>-secrets` made from the launcher's environment (server-side apply, the
values on kubectl's stdin only), then exactly what `render` prints (`kubectl apply -f -`). It
waits for the operator to name the RayJob's cluster, then hands the launcher the pods' logs and
progress. What fails before the job runner starts (and, unless --keep, a launch whose job never
ran) deletes what the launch applied; Ctrl-C before the job's command starts is the launcher's
`down` (a second Ctrl-C leaves it all as it is, or once the RayJob is deleted only stops the wait for
the pods; the handle's close() deletes nothing after a Ctrl-C). KubeRay deletes the cluster itself `ttl_after_finished` after the job
(`shutdownAfterJobFinishes`); `down` deletes the RayJob, the ConfigMap and the Secret it made.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

from ... import state
from ...agent.protocol import AgentError, wait_for
from ...agent.protocol.ports import free_port
from ...console import say
from ...errors import BadInput, StepFailed
from ...plan import Plan
from ...spec import Task
from ..base import Cluster, Option, hold_forward, start_tunnel, write_files
from ..shipping import shared_entry
from . import cluster as watching
from .kubectl import Kubectl, apply_secret, require_crds, resolve, secret_object
from .configmap import ANNOTATIONS_LIMIT, CONFIGMAP_DIR, LIB_ARCHIVE, configmap_name, pack
from .options import SHARED_MODE, KubeRayPlacement, KubeRayShared, Toleration, _dns, kuberay_placement
from .pods import (AGENT_PORT, DASHBOARD_PORT, GPU_RESOURCE, POD_IP_ENV, PROBE_PERIOD_S, RANK_ENV, RAY_ENV_FILE,
                   WORKERS_ENV)
from .rayjob import WORKER_GROUP
from .render import KubeRayRender

#: How long the operator may take to give a new RayJob its cluster's name (a queued RayJob waits longer).
OPERATOR_S = 120.0
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: How often a queued RayJob's wait is said.
QUEUE_PROGRESS_S = 30.0


class Undo:
    """Deletes what one launch applied, once (its failure before the job, or a job that never
    ran); what it did, in words. The record of the cluster is marked ended."""

    def __init__(self, kube: Kubectl, name: str, objects: list):
        self.kube, self.name, self.objects = kube, name, [tuple(o) for o in objects]
        self.done: str | None = None

    def __call__(self) -> str:
        if self.done is None:
            try:
                self.kube.delete(self.objects)
                self.done = "deleted " + ", ".join(f"{kind} {n}" for kind, n in self.objects)
                state.end(self.name)
            except StepFailed as exc:
                self.done = f"could not delete what it applied ({exc}); rlhf-tasks down {self.name}"
        return self.done


class KubeRayProvider(KubeRayRender):
    makes_token = True  # KubeRay's own (authOptions: token): Secret <cluster>, key auth_token
    # `down` deletes the RayJob first (KubeRay then removes the cluster), then waits for the pods to go.
    down_again = ("Ctrl-C again, before its RayJob is deleted, leaves it all running; after, it only stops "
                  "waiting for the pods to go")
    options = (Option("--context", "the kubeconfig context to launch in (default: its current one)",
                      {"metavar": "CONTEXT"}),
               Option("--namespace", "the namespace (default: placement.kuberay.namespace, else the context's)",
                      {"metavar": "NAMESPACE"}))

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._kube: Kubectl | None = None
        self._undo: dict[str, Any] = {}

    def plan(self, task: Task) -> Plan:
        """The plan, with `--namespace` as the rendered objects' namespace."""
        plan = super().plan(task)
        chosen = self.chosen.get("namespace")
        if not chosen:
            return plan
        try:
            _dns(chosen)
        except ValueError as exc:
            raise BadInput(f"--namespace: {exc}") from None
        named = plan.placement.kuberay.get("namespace")
        if named not in (None, chosen):
            raise BadInput(f"--namespace: {chosen} is not the task's placement.kuberay.namespace ({named})")
        options = {**plan.placement.kuberay, "namespace": chosen}
        return plan.replace(placement=plan.placement.model_copy(update={"kuberay": options}))

    # ------------------------------------------------------------------ launch

    def ready(self, plan: Plan) -> None:
        """kubectl, the context, and KubeRay's CRDs in it; BadInput (nothing launched) otherwise."""
        self._kube = resolve(self.chosen.get("context"), kuberay_placement(plan.placement).namespace)
        require_crds(self._kube)
        self.require_shared_claim(self._kube, plan)

    def require_shared_claim(self, kube: Kubectl, plan: Plan) -> None:
        """checkpoints.shared.kuberay's claim as the API server has it: there, and ReadWriteMany when several pods
        mount it (a ReadWriteOnce claim mounts on one node, and a pod on another waits for it, ContainerCreating,
        until the RayJob's deadline); BadInput otherwise, before anything is applied. `check` cannot see it."""
        shared = shared_entry(KubeRayShared, plan.checkpoint_shared, self.name)
        if not shared:
            return
        where = f"checkpoints.shared.kuberay.claim: {shared.claim}"
        claim = kube.get("persistentvolumeclaim", shared.claim)
        if claim is None:
            raise BadInput(f"{where}: no such PersistentVolumeClaim in namespace {kube.namespace} ({kube.where}); "
                           f"create it first ({SHARED_MODE} for several pods), or name another")
        modes = (claim.get("status") or {}).get("accessModes") or (claim.get("spec") or {}).get("accessModes") or []
        if plan.nodes > 1 and SHARED_MODE not in modes:
            raise BadInput(f"{where}: its access modes are {', '.join(modes) or 'none'} (kubectl get pvc "
                           f"{shared.claim} -n {kube.namespace}), so the {plan.nodes} pods cannot all mount it "
                           f"read-write: ReadWriteOnce is one Kubernetes node's, ReadWriteOncePod one pod's, "
                           f"ReadOnlyMany read-only; use a {SHARED_MODE} claim (a StorageClass on NFS, CephFS, EFS, "
                           f"Filestore...)")

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        if self._kube is None:
            self.ready(plan)
        kube, name = self._kube, plan.name
        options = kuberay_placement(plan.placement)
        found = kube.get("rayjob", name)
        if found is not None:
            raise BadInput(f"name: {watching.rayjob_words(found, name)} already exists in namespace {kube.namespace}; "
                           f"`rlhf-tasks down {name}` (or kubectl delete rayjob {name}) first")
        secret = None if options.secret else f"{name}-secrets"
        files = self.render(plan)
        directory = state.run_dir(name) / self.name
        write_files(directory, {**files, "plan.json": plan.to_json()})  # plan.json: what `logs --bundle` scrubs
        objects = [("rayjob", name), ("configmap", configmap_name(plan))] + \
            ([("secret", secret)] if secret and plan.secrets else [])
        state.save(name, {"provider": self.name, "context": kube.context, "namespace": kube.namespace,
                          "objects": objects, "cluster_id": None, "dashboard": None,
                          "dashboard_port": plan.ray.dashboard_port, "directory": str(directory)})
        undo = self._undo[name] = Undo(kube, name, objects)  # a failure from here on: the launcher's abandon()
        if secret and plan.secrets:
            for line in apply_secret(kube, secret, secret_object(secret, name, secrets)).splitlines():
                say(f"kubectl: {line}")
        out = kube.must("kubectl apply", "apply", "-f", "-", stdin=files[f"{name}.rayjob.yaml"])
        for line in out.strip().splitlines():
            say(f"kubectl: {line}")
        try:
            cluster = self._cluster_name(kube, name)
        except AgentError as exc:
            raise StepFailed("waiting for the KubeRay operator", str(exc)) from None
        state.update(name, cluster_id=cluster)
        return self._handle(kube, plan, cluster, undo)

    def refuses_missing_secrets(self, plan: Plan, missing: list[str]) -> str | None:
        """Every pod reads the task's secrets from one Secret; the one `launch` makes needs them all."""
        if kuberay_placement(plan.placement).secret:
            return None  # a Secret of the user's: its keys are the user's to have
        return (f"every pod reads the task's secrets from Secret {plan.name}-secrets, which launch makes from your "
                f"environment, and a pod whose key is missing does not start (or name a Secret of yours in "
                f"placement.kuberay.secret)")

    def _cluster_name(self, kube: Kubectl, name: str) -> str:
        """The RayCluster's name once the operator has given it (`status.rayClusterName`). A RayJob
        that a queue holds (Kueue suspends it: `Suspended`, no cluster) is waited for as long as it
        is queued, with its queue and how long: it is admitted when the queue has room, and its
        cluster gets a name of its own then."""
        queued = {"since": None, "said": 0.0}

        def named():
            rayjob = kube.get("rayjob", name)
            status = (rayjob or {}).get("status") or {}
            if rayjob is None:
                raise StepFailed("waiting for the KubeRay operator", f"RayJob {name} is gone")
            if status.get("jobDeploymentStatus") in ("Failed", "ValidationFailed"):
                raise StepFailed("waiting for the KubeRay operator", watching.rayjob_words(rayjob, name))
            if (rayjob.get("spec") or {}).get("suspend") or status.get("jobDeploymentStatus") in (
                    "Suspended", "Suspending"):
                if queued["since"] is None:
                    queued["since"] = time.monotonic()
                    queue = ((rayjob.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL)
                    say(f"RayJob {name} is queued" + (f" in Kueue's queue {queue}" if queue else "")
                        + ": it starts once the queue admits it (Ctrl-C stops waiting and deletes it)")
                waited = time.monotonic() - queued["since"]
                if waited - queued["said"] >= QUEUE_PROGRESS_S:
                    queued["said"] = waited
                    say(f"RayJob {name}: queued for {waited:.0f}s")
                return False, f"queued for {waited:.0f}s"
            if not status.get("rayClusterName"):
                if queued["since"] is not None:
                    return False, "admitted; the operator names its cluster next"
                if time.monotonic() - started > OPERATOR_S:
                    raise StepFailed("waiting for the KubeRay operator", f"RayJob {name} has no status after "
                                     f"{OPERATOR_S:.0f}s: is the KubeRay operator running, and watching namespace "
                                     f"{kube.namespace}?")
                if time.monotonic() >= progress["next"]:
                    progress["next"] += QUEUE_PROGRESS_S / 3
                    say(f"waiting for the KubeRay operator to take RayJob {name}: "
                        f"{time.monotonic() - started:.0f}s of {OPERATOR_S:.0f}s (no status yet)")
                return False, "RayJob has no status yet"
            return True, status["rayClusterName"]
        started = time.monotonic()
        progress = {"next": started + QUEUE_PROGRESS_S / 3}
        # no deadline of its own: the operator's silence has OPERATOR_S (above), a queue takes what it takes
        cluster = wait_for(f"the KubeRay operator to take RayJob {name}", named, float("inf"), interval=0.3,
                           max_interval=2.0, progress_every=float("inf"), report=say)
        if queued["since"] is not None:
            say(f"RayJob {name} admitted after {time.monotonic() - queued['since']:.0f}s in the queue")
        say(f"RayJob {name} in namespace {kube.namespace} (context {kube.context}): cluster {cluster}")
        return cluster

    def _handle(self, kube: Kubectl, plan: Plan, cluster: str, undo) -> Cluster:
        logs = state.run_dir(plan.name) / "nodes"
        logs.mkdir(parents=True, exist_ok=True)
        for old in logs.glob("node-*.log"):
            old.unlink()
        # The head's dashboard through a forward: `submit: client` submits through it, and for
        # `submit: head` a failed job's bundle is fetched through it before KubeRay deletes the cluster.
        local = free_port()
        forward = watching.PortForward(kube, f"{cluster}-head-svc", local, plan.ray.dashboard_port,
                                       state.run_dir(plan.name) / self.name / "port-forward.log")
        dashboard = f"http://127.0.0.1:{local}"
        if plan.job.submit == "client":
            state.update(plan.name, dashboard=f"http://127.0.0.1:{plan.ray.dashboard_port}")
        watch = watching.Watch(kube, plan, cluster, logs, undo, forward)
        made = watching.handle(watch, None, dashboard)
        if plan.token_env:
            tend = made.tend

            def tend_and_token() -> list[str]:  # the operator's token Secret exists once the cluster does
                lines = tend()
                if made.token is None and watch.head() is not None:
                    try:
                        made.token = self._token(kube, plan.name, cluster)
                    except StepFailed:
                        pass  # asked again at the next wait
                return lines
            made.tend = tend_and_token
        keep = plan.keep_cluster

        def close() -> None:
            watch.close()
            if made.interrupted:  # Ctrl-C: the launcher's cancel ran `down`, or a second Ctrl-C left it all
                return
            if not keep and not undo.done and not watching.job_started(plan.name, logs / "node-0.log") and \
                    not (state.load(plan.name) or {}).get("ended"):
                say(f"the job of {plan.name} never ran: {undo()}")
        made.close = close
        return made

    def cluster_token(self, name: str) -> str | None:
        kube, record = self._target(name)
        cluster = record.get("cluster_id") or (((kube.get("rayjob", name) or {}).get("status") or {})
                                               .get("rayClusterName"))
        return self._token(kube, name, cluster) if cluster else None

    def _token(self, kube: Kubectl, name: str, cluster: str) -> str | None:
        """The Ray token KubeRay made (Secret <cluster>, key auth_token), kept here with mode 0600
        for the launcher, `env`, `submit`; None while the operator has not made it."""
        secret = kube.get("secret", cluster)
        value = ((secret or {}).get("data") or {}).get("auth_token")
        if not value:
            return None
        token = base64.b64decode(value).decode()
        directory = state.cluster_dir(name)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory / "token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token)
        return token

    def abandon(self, before: state.Before) -> list[str]:
        """A launch that failed before its job: delete what it applied, then its local files."""
        undo = self._undo.get(before.name)
        said = [undo()] if undo is not None and not undo.done else []
        return said + super().abandon(before)

    # ------------------------------------------------------------------ status, down, forward

    def _target(self, name: str) -> tuple[Kubectl, dict]:
        """kubectl pinned where `launch` put cluster `name` (else the kubeconfig's current context)."""
        record = state.load(name) or {}
        if record.get("provider") == self.name:
            return resolve(record.get("context"), record.get("namespace")), record
        return resolve(self.chosen.get("context"), self.chosen.get("namespace")), {}

    def status(self, name: str) -> str:
        kube, record = self._target(name)
        rayjob = kube.get("rayjob", name)
        if rayjob is None:  # deleted: the pods of its cluster may still be going
            status = {}
            lines = [f"RayJob {name}: not found in namespace {kube.namespace} (context {kube.context})"]
        else:
            status = rayjob.get("status") or {}
            lines = [f"RayJob {name} in namespace {kube.namespace} (context {kube.context}): jobDeploymentStatus "
                     f"{status.get('jobDeploymentStatus') or '-'}, jobStatus {status.get('jobStatus') or '-'}"
                     + (f" ({': '.join(x for x in (status.get('reason'), status.get('message')) if x)})"
                        if status.get("reason") or status.get("message") else "")]
        cluster = status.get("rayClusterName") or record.get("cluster_id")
        pods = sorted(kube.pods(f"ray.io/cluster={cluster}") if cluster else [],
                      key=lambda p: (watching.role(p) != "head", p["metadata"]["name"]))
        if cluster and (rayjob is not None or pods):
            lines.append(f"cluster {cluster}: {len(pods)} pod(s)")
            lines += [f"  pod {p['metadata']['name']} ({watching.role(p)}): {watching.pod_words(p)}" for p in pods]
        return "\n".join(lines)

    def down(self, name: str) -> str:
        kube, record = self._target(name)
        objects = [tuple(o) for o in record.get("objects") or [("rayjob", name), ("configmap", f"{name}-rlhf-tasks")]]
        cluster = record.get("cluster_id") or (((kube.get("rayjob", name) or {}).get("status") or {})
                                               .get("rayClusterName"))
        said = kube.delete(objects)
        gone = ""
        if cluster:
            def pods_gone():  # the cluster's, and the submitter Job's (named after the RayJob)
                pods = kube.pods(f"ray.io/cluster={cluster}") + kube.pods(f"{watching.JOB_LABEL}={name}")
                return not pods, f"{len(pods)} pod(s) left"
            try:
                wait_for(f"the pods of {cluster} to go", pods_gone, 120, interval=0.3, max_interval=2.0, report=say)
                gone = f"; the pods of {cluster} are gone"
            except AgentError as exc:
                gone = f"; {exc}"
            except KeyboardInterrupt:  # deleted already: KubeRay removes the cluster whether we wait or not
                gone = (f"; stopped waiting for the pods of {cluster} to go (Ctrl-C): KubeRay removes them "
                        f"(`rlhf-tasks status {name}` shows what is left)")
        state.end(name)
        left = "" if record else f" (the Secret {name}-secrets, if you made it, is left)"
        return (f"{name}: deleted " + ", ".join(f"{k} {n}" for k, n in objects)
                + f" in namespace {kube.namespace} (context {kube.context}){gone}{left}"
                + (f"\n{said}" if said else ""))

    def forward(self, name: str, port: int | None = None) -> int:
        """`kubectl port-forward svc/<cluster>-head-svc PORT:<dashboard>` until Ctrl-C. The address is
        said and recorded only once the head's dashboard answered through it."""
        kube, record = self._target(name)
        rayjob = kube.get("rayjob", name)
        cluster = ((rayjob or {}).get("status") or {}).get("rayClusterName") or record.get("cluster_id")
        if not cluster:
            raise BadInput(f"NAME: no RayJob {name} with a cluster in namespace {kube.namespace} "
                           f"(context {kube.context})")
        remote = record.get("dashboard_port") or DASHBOARD_PORT
        local = port or remote
        tunnel, said = start_tunnel(kube.argv("port-forward", f"svc/{cluster}-head-svc", f"{local}:{remote}"))
        return hold_forward(name, tunnel, "kubectl port-forward", f"http://127.0.0.1:{local}", timeout=30,
                            said=said, recorded=bool(record), ready=lambda: self._token(kube, name, cluster),
                            then=f"eval \"$(rlhf-tasks env {name})\", rlhf-tasks submit TASK --provider kuberay "
                                 f"--address http://127.0.0.1:{local}")


__all__ = ["AGENT_PORT", "ANNOTATIONS_LIMIT", "CONFIGMAP_DIR", "GPU_RESOURCE", "LIB_ARCHIVE", "POD_IP_ENV",
           "PROBE_PERIOD_S", "RANK_ENV", "RAY_ENV_FILE", "DASHBOARD_PORT", "WORKER_GROUP", "WORKERS_ENV",
           "KubeRayPlacement", "KubeRayProvider", "KubeRayShared", "Toleration", "kuberay_placement", "pack"]
