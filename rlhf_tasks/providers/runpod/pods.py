"""A task's pods and Instant Cluster on RunPod: creating them (the head, one candidate data
center after another; once RunPod has placed it, the workers in its data center; or one
Instant Cluster), showing their way to RUNNING, finding them by the names this provider
gives, their status lines, and terminating them, also when a launch fails before its job
(`Launching`). Nothing else of the account is touched."""

from __future__ import annotations

import time

from ... import state
from ...errors import StepFailed
from ...console import say
from ...agent.protocol import AgentError, wait_for
from ...plan import Plan
from .api import ENDED, RunPodAuthError, RunPodClient, RunPodError, RunPodNotFound
from .render import filled, is_cluster, pod_names
from . import vault


def find(client: RunPodClient, name: str) -> tuple[list[dict], list[dict]]:
    """This task's pods (by the names this provider gives) and its Instant Cluster (by name)."""
    pattern = pod_names(name)
    pods = [p for p in client.list_pods(f"{name}-") if pattern.match(p.get("name", ""))]
    clusters = [c for c in client.list_clusters() if c.get("name") == name]
    return pods, clusters


class Launching:
    """Around creating the pods: whatever fails (or Ctrl-C) terminates every pod this launch
    created (`undo`), and the failure names the step it was in (`step`, set as it goes)."""

    def __init__(self, client: RunPodClient, name: str, before: state.Before):
        self.client, self.name, self.before = client, name, before
        self.step = "creating the pods"

    def __enter__(self) -> Launching:
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        if exc is None:
            return False
        said = undo(self.client, self.name, self.before)
        if isinstance(exc, RunPodError):
            raise StepFailed(self.step, f"{exc}; {said}") from None
        if isinstance(exc, KeyboardInterrupt):
            waiting = getattr(exc, "waiting_for", None)  # see agent.protocol.wait_for
            raise StepFailed(self.step, f"interrupted (Ctrl-C); {said}"
                             + (f"; it was waiting for {waiting}" if waiting else "")) from None
        if isinstance(exc, StepFailed) and exc.step == self.step:
            raise StepFailed(self.step, f"{str(exc)[len(self.step) + 2:]}; {said}") from None
        if isinstance(exc, (StepFailed, AgentError)):
            raise StepFailed(self.step, f"{exc}; {said}") from None
        return False


def create(client: RunPodClient, plan: Plan, requests: dict, values: dict[str, str], datacenters: list[str],
           launching: Launching) -> list[dict]:
    """Put the secrets' `values` in RunPod's vault (one account secret each, which the requests
    reference), create the rendered requests, record the ids as they come, and wait until every
    pod runs: the pods, head first."""
    launching.step = "storing the task's secrets in RunPod's vault"
    held = vault.store(client, plan.name, values)
    if held:
        say(f"stored {len(held)} secret(s) in RunPod's vault, which the pods reference: {', '.join(sorted(held))}")
    if is_cluster(plan):
        launching.step = f"creating the Instant Cluster {plan.name}"
        cluster, asked = place(lambda dc: client.create_cluster(filled(requests["cluster"], {}, [dc], held)),
                               datacenters, f"Instant Cluster {plan.name}", launching.step)
        state.update(plan.name, cluster_id=cluster["id"])
        # RunPod: a cluster's dataCenterId is "omitted until at least one pod is placed"
        say(f"created Instant Cluster {plan.name} ({cluster['id']}) in {cluster.get('dataCenterId') or asked}")
        launching.step = f"starting the Instant Cluster {plan.name}"
        return wait_running(client, plan, cluster_id=cluster["id"])
    ids: list[str] = []
    head = requests["head"]
    launching.step = f"creating pod {head['name']}"
    made, asked = place(lambda dc: client.create_pod(filled(head, {}, [dc], held)), datacenters,
                        f"pod {head['name']}", launching.step)
    ids.append(made["id"])
    state.update(plan.name, cluster_id=made["id"], pods=ids)
    say(f"created pod {made['name']} ({made['id']}) in {made.get('dataCenterId') or asked}")
    if requests["workers"]:
        launching.step = f"waiting for RunPod to place pod {head['name']}"
        where = placed(client, plan, made)
    for worker in requests["workers"]:
        launching.step = f"creating pod {worker['name']}"
        body = filled(worker, {"HEAD_POD_ID": made["id"]}, [where], held)
        pod = client.create_pod(body)
        ids.append(pod["id"])
        state.update(plan.name, pods=ids)
        say(f"created pod {pod['name']} ({pod['id']})")
    launching.step = "starting the pods"
    return wait_running(client, plan, pod_ids=ids)


def _priced(pod: dict) -> bool:
    """Whether RunPod gives the pod's cost: a number above 0 (0.0 is a pod that no longer runs)."""
    cost = pod.get("cost")
    return isinstance(cost, (int, float)) and not isinstance(cost, bool) and cost > 0


def billed(members: list[dict], per_pod: float | None) -> tuple[float | None, str]:
    """The pods' price per hour as RunPod bills them, read once every pod runs: the sum of their `cost` ("Current
    cost in USD per hour (0.0 when EXITED or TERMINATED)", the Pod schema; the catalog's price is a list price,
    "the rate actually billed for a pod is reported as `cost` on the pod itself"). A pod whose cost is not given
    (absent, or 0.0 while it runs) counts at the catalog's price per pod (`per_pod`); with the words that say it."""
    given = [pod["cost"] for pod in members if _priced(pod)]
    missing = [pod["name"] for pod in members if not _priced(pod)]
    if missing and per_pod is None:
        return None, (f"RunPod gives no cost for {', '.join(missing)} and its catalog no price: the pods' "
                      f"price is not known")
    total = round(sum(given) + (per_pod or 0) * len(missing), 4)
    catalog = f"the catalog's list price: ${per_pod * len(members):.2f}/h" if per_pod else "no catalog price"
    if not missing:
        return total, (f"RunPod bills the {len(members)} pod(s) ${total:.2f}/h (the sum of their `cost`; {catalog}): "
                       f"the cap counts that")
    return total, (f"RunPod gives no cost for {', '.join(missing)}: counted at the catalog's ${per_pod:.2f}/h per "
                   f"pod, ${total:.2f}/h for the {len(members)} pod(s) ({catalog})")


def head_counts(members: list[dict], total: float | None) -> str | None:
    """Where the head, which reads only its own pod's `cost` (its key is scoped to its pod) and counts it for every
    node, counts other than the pods' sum: the words, else None."""
    head = members[0].get("cost")
    if not _priced(members[0]) or total is None or round(head * len(members), 4) == total:
        return None
    return (f"the head counts its own pod's cost for each of the {len(members)} pods, ${head * len(members):.2f}/h, "
            f"not their sum ${total:.2f}/h (its pod-scoped key reads only its pod)")


def place(create, datacenters: list[str], what: str, step: str) -> tuple[dict, str]:
    """`create(data center)` for one candidate after another, in order, until one is made:
    (what it made, the data center asked for). RunPod's `dataCenterIds` are "Preferred data
    centers", and its create "does not search for capacity"; its document says to "call this
    endpoint once per candidate in your order of preference until one returns 201": on to the
    next on 400 (no capacity, or a rule the request breaks) and 403 ("Your account cannot access
    the requested pool"); anything else (402, 422, retries run out) ends it."""
    refused = []
    for n, dc in enumerate(datacenters):
        try:
            return create(dc), dc
        except RunPodAuthError as exc:
            if exc.status != 403:
                raise
            why = f"the account cannot access the requested pool ({exc.status} {exc.title}: {exc.detail})"
        except RunPodError as exc:
            if exc.status != 400:
                raise
            why = f"{exc.status} {exc.title}: {exc.detail}"
        refused.append(f"{dc}: {why}")
        if n + 1 < len(datacenters):
            say(f"RunPod: {dc} refused {what} ({why}); trying {datacenters[n + 1]}")
    note = ""
    if len(refused) > 1 and all(": 400 " in r for r in refused):
        # RunPod: "if *every* candidate returns 400, read the last detail as a problem with the
        # request rather than as absent capacity"
        note = " (every one answered 400: RunPod reads that as a problem with the request, not capacity)"
    raise StepFailed(step, "no data center took it: " + "; ".join(refused) + note)


def placed(client: RunPodClient, plan: Plan, pod: dict) -> str:
    """The data center RunPod placed the head in, once it has: its `dataCenterId` is "string or
    null", "assigned by scheduler", and may be null while the pod is PROVISIONING. The workers go
    there (a null would send `dataCenterIds: [null]`, which RunPod's schema refuses)."""
    if pod.get("dataCenterId"):
        return pod["dataCenterId"]
    say(f"pod {pod['name']} ({pod['id']}) is {pod.get('status')}: waiting for RunPod to place it (its workers go "
        f"to its data center)")

    def check():
        now = client.get_pod(pod["id"])
        if now["status"] in ENDED:
            raise StepFailed(f"starting pod {pod['name']}", f"it is {now['status']} before it was placed")
        return bool(now.get("dataCenterId")), now.get("dataCenterId") or f"{now['status']}, no data center yet"

    where = wait_for(f"RunPod to place pod {pod['name']}", check, plan.wait.head_s, interval=0.3, max_interval=3.0,
                     report=say)
    say(f"pod {pod['name']} ({pod['id']}) is in {where}")
    return where


def members(client: RunPodClient, pod_ids: list[str] | None, cluster_id: str | None) -> list[dict]:
    """The pods, head (rank 0) first."""
    if cluster_id is None:
        return [client.get_pod(pod_id) for pod_id in pod_ids]
    pods = client.cluster_pods(cluster_id)
    ranks = [(pod.get("cluster") or {}).get("rank") for pod in pods]
    return [pod for _, pod in sorted(zip(ranks, pods), key=lambda item: (item[0] is None, item[0] or 0))]


def wait_running(client: RunPodClient, plan: Plan, pod_ids: list[str] | None = None,
                 cluster_id: str | None = None) -> list[dict]:
    """Show each pod's way PROVISIONING -> STARTING -> RUNNING; the pods once all run (the
    head's SSH endpoint known, for submit: client)."""
    shown: dict[str, str] = {}
    client_mode = plan.job.submit == "client"

    def check():
        pods = members(client, pod_ids, cluster_id)
        for pod in pods:
            status = pod["status"]
            if shown.get(pod["id"]) != status:
                extra = ""
                if status == "RUNNING":
                    net = pod.get("globalNetworking") or {}
                    member = pod.get("cluster") or {}
                    if net.get("internalDns"):
                        extra = f", {net['internalDns']} ({net.get('ip')})"
                    elif member.get("ip"):
                        extra = f", rank {member.get('rank')}, overlay {member['ip']}"
                say(f"pod {pod['name']} ({pod['id']}): {shown.get(pod['id'], 'created')} -> {status}{extra}")
                shown[pod["id"]] = status
            if status in ENDED:
                raise StepFailed(f"starting pod {pod['name']}", f"it is {status} before the job started")
        running = sum(1 for pod in pods if pod["status"] == "RUNNING")
        if cluster_id and len(pods) < plan.nodes:
            return False, f"{len(pods)}/{plan.nodes} cluster pods known"
        if running < len(pods):
            return False, f"{running}/{len(pods)} pods RUNNING"
        if client_mode and not (pods[0].get("ssh") or {}).get("direct"):
            return False, "the head pod's SSH endpoint is not published yet"
        return True, pods

    return wait_for(f"{plan.nodes} RunPod pods to run", check, plan.wait.head_s, interval=0.5, max_interval=3.0,
                    report=say)


def terminate(client: RunPodClient, name: str, timeout: float = 300) -> str:
    """Terminate this task's pods and delete its cluster; wait until they are gone; then delete its
    account secrets (a pod that still ran would lose them at its next boot)."""
    started = time.monotonic()
    pods, clusters = find(client, name)
    member_ids = []
    for cluster in clusters:
        member_ids += [p["id"] for p in client.cluster_pods(cluster["id"])]
        client.delete_cluster(cluster["id"])
    for pod in pods:
        if pod["status"] == "TERMINATED":
            continue
        try:
            client.pod_action(pod["id"], "terminate")
        except RunPodNotFound:
            pass
        except RunPodError as exc:
            if exc.status != 409:  # 409: it is already on its way out
                raise
    waiting = [p["id"] for p in pods] + member_ids

    def gone():
        left = []
        for pod_id in waiting:
            try:
                if client.get_pod(pod_id)["status"] != "TERMINATED":
                    left.append(pod_id)
            except RunPodNotFound:
                pass
        for cluster in clusters:
            try:
                client.get_cluster(cluster["id"])
                left.append(cluster["id"])
            except RunPodNotFound:
                pass
        return not left, f"still there: {', '.join(left)}"

    wait_for(f"RunPod to terminate {name}'s pods", gone, timeout, interval=0.5, max_interval=5.0, report=say)
    secrets = vault.forget(client, name)
    what = []
    if pods:
        what.append(f"terminated {len(pods)} pod(s) ({', '.join(p['id'] for p in pods)})")
    if clusters:
        what.append(f"deleted Instant Cluster {', '.join(c['id'] for c in clusters)} ({len(member_ids)} pods)")
    said = (" and ".join(what) or f"no RunPod pods or cluster named {name} were left") + \
        f" in {time.monotonic() - started:.1f}s"
    if secrets:
        said += f"; deleted {len(secrets)} account secret(s) from RunPod's vault ({', '.join(sorted(secrets))})"
    return said


def undo(client: RunPodClient, name: str, before: state.Before) -> str:
    """Terminate every pod (and cluster) this launch created; remove the token, record and
    staged files it wrote (an earlier launch's record is put back, never removed)."""
    try:
        said = terminate(client, name)
    except Exception as exc:  # noqa: BLE001 - say it; the user must look
        said = f"could not terminate its pods ({exc}): run `rlhf-tasks down {name}`"
    state.undo_launch(before)
    return said


def status(client: RunPodClient, name: str) -> str:
    """One line per cluster and pod of this task: id, status, data center, price, address."""
    pods, clusters = find(client, name)
    lines = [f"Instant Cluster {c['name']} ({c['id']}) in {c.get('dataCenterId')}: "
             + ", ".join(f"{n} {s}" for s, n in (c.get("pods") or {}).get("byStatus", {}).items())
             for c in clusters]
    for cluster in clusters:
        pods += client.cluster_pods(cluster["id"])
    for pod in pods:
        net = (pod.get("globalNetworking") or {}).get("internalDns") or (pod.get("cluster") or {}).get("ip") or ""
        lines.append(f"{pod['name']}\t{pod['id']}\t{pod['status']}\t{pod.get('dataCenterId')}\t"
                     f"${pod.get('cost') or 0:.2f}/h\t{net}".rstrip())
    secrets = sorted(s["name"] for s in vault.held(client, name))
    if secrets:
        lines.append(f"account secrets in RunPod's vault: {', '.join(secrets)}"
                     + ("" if pods or clusters else f" (no pod left: rlhf-tasks down {name} deletes them)"))
    return "\n".join(lines) or f"no RunPod pods or cluster named {name}"


def head_ssh(client: RunPodClient, name: str) -> dict:
    """The head pod's direct SSH endpoint (`ssh.direct`: host, port, username), for the
    dashboard's forward; StepFailed when it has none."""
    pods, clusters = find(client, name)
    for cluster in clusters:
        pods = [p for p in client.cluster_pods(cluster["id"]) if (p.get("cluster") or {}).get("rank") == 0]
    head = next((p for p in pods if p["name"] == f"{name}-head" or p.get("cluster")), None)
    if head is None:
        raise StepFailed(f"forwarding {name}'s dashboard", f"RunPod has no head pod of {name}")
    direct = (head.get("ssh") or {}).get("direct")
    if not direct:
        raise StepFailed(f"forwarding {name}'s dashboard", f"the head pod {head['id']} ({head['status']}) has no "
                         f"direct SSH endpoint: only a task with job.submit: client gets one (22/tcp, startSsh)")
    return direct
