"""doctor: check a running cluster on demand, through its dashboard address.

From here: the Ray token is accepted, the dashboard refuses requests without it, every
expected node is ALIVE with its CPUs and GPUs. Then on the cluster, as a Ray job (the same
preflight the head runs before a job, the agent's package uploaded as that job's
working_dir, so it works whatever the provider shipped): versions, interfaces, the
collective and every pair's bandwidth, plus each service's readiness check on its nodes,
the checkpoint directory written on every node and read on the others, free disk and
/dev/shm against the task's shm_size. Exit 0 when all pass, 1 otherwise, each failure
with what to do.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import providers, state
from .agent.protocol import (GROUP_LABEL, AgentError, alive_nodes, auth_headers, follow_preflight, group_counts,
                             http_request, preflight_argv, preflight_report)
from .errors import BadInput, StepFailed
from .models import size_bytes
from .plan import Plan
from .spec import load_task

DEFAULT_MIN_FREE = 2**30  # without a known model size: room for at least 1 GiB of checkpoint


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] doctor: {message}", flush=True)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass
class Target:
    name: str | None
    address: str
    token: str | None
    plan: Plan | None


def saved_plans(name: str) -> list[Plan]:
    """The plans launches and renders from here staged for cluster `name` (local: runs/NAME/plan.json;
    others: runs/NAME/PROVIDER/rlhf-tasks/NAME.PROVIDER.plan.json)."""
    run = state.run_dir(name)
    plans = []
    for path in [run / "plan.json", *sorted(run.glob(f"*/rlhf-tasks/{name}.*.plan.json"))]:
        try:
            plans.append(Plan.model_validate_json(path.read_text()))
        except (OSError, ValueError):
            continue
    return plans


def saved_plan(name: str) -> Plan | None:
    """The first of `saved_plans`, or None."""
    return next(iter(saved_plans(name)), None)


def resolve(target: str, address: str | None, provider_name: str | None) -> Target:
    """The cluster, its token and (when known) its plan, from a task file or a cluster name."""
    if target.endswith((".yaml", ".yml")):
        task = load_task(target)
        name = task.name
        record = state.load(name) or {}
        plan = providers.get(provider_name or record.get("provider") or "local").plan(task)
    else:
        name, record = target, state.load(target) or {}
        if not record and not address:
            raise BadInput(f"TASK|NAME: no cluster named {name} was launched from here (known: "
                           f"{', '.join(state.known()) or 'none'}); give a task file and --address")
        plan = saved_plan(name)
    if record.get("ended") and not address:
        raise StepFailed(f"checking {name}", f"the cluster ended at {record['ended']}")
    from .jobs import dashboard_from_env

    url = address or record.get("dashboard") or dashboard_from_env()
    if not url:
        raise BadInput("--address: no dashboard address known for this cluster (e.g. --address "
                       "http://localhost:8265 through your port forward)")
    return Target(name, url.rstrip("/"), os.environ.get("RAY_AUTH_TOKEN") or state.token(name), plan)


def access_checks(t: Target) -> list[Check]:
    """The token, the dashboard's refusal without it, and every expected node ALIVE."""
    checks = []
    jobs_url = f"{t.address}/api/jobs/"
    try:
        with_token, _ = http_request(jobs_url, headers=auth_headers(t.token), timeout=10)
    except OSError as exc:
        return [Check("dashboard reachable", False, str(exc),
                      "forward the head's dashboard port (dstack attach; ssh -L 8265:127.0.0.1:8265 HEAD) and pass "
                      "--address http://localhost:PORT")]
    auth_on = t.plan is None or t.plan.token_env is not None
    if with_token == 200:
        checks.append(Check("Ray token accepted", True, "the Jobs API answers with it" if t.token else
                            "the Jobs API answers without a token (auth is off)"))
    else:
        checks.append(Check("Ray token accepted", False, f"HTTP {with_token} with {'the' if t.token else 'no'} token",
                            f"export RAY_AUTH_TOKEN=$(rlhf-tasks token {t.name or 'NAME'}) (the cluster's own token)"))
    without, _ = http_request(jobs_url, timeout=10)
    if without in (401, 403):
        checks.append(Check("dashboard refuses requests without the token", True, f"HTTP {without} without it"))
    else:
        checks.append(Check("dashboard refuses requests without the token", False,
                            f"HTTP {without}: anyone who reaches this port can run code on the cluster (CVE-2023-48022)",
                            "keep ray.auth: token (the default) and relaunch" if not auth_on else
                            "the cluster does not enforce its token: relaunch it with this rlhf-tasks"))
    if with_token != 200:  # nothing more can be asked without the token
        return checks
    try:
        nodes = alive_nodes(t.address, t.token)
    except (OSError, AgentError) as exc:
        return checks + [Check("nodes ALIVE", False, str(exc), "see the head agent's log")]
    expected = t.plan.nodes if t.plan else len(nodes)
    per_node = [f"{n['node_ip']} ({_group_of(n)}{n.get('resources_total', {}).get('CPU', 0):g} CPU, "
                f"{n.get('resources_total', {}).get('GPU', 0):g} GPU)" for n in nodes]
    ok = len(nodes) >= expected
    checks.append(Check("nodes ALIVE", ok, f"{len(nodes)}/{expected}: " + ", ".join(per_node),
                        "" if ok else "a node left or never joined: read its agent's log (node logs) and relaunch"))
    if t.plan is not None and t.plan.groups:  # each group whole, by Ray's own labels and resources
        whole, counts = group_counts(nodes, [group.model_dump() for group in t.plan.groups])
        checks.append(Check("node groups", whole, counts, "" if whole else
                            "a group lacks nodes: read its nodes' agent logs (node logs) and relaunch"))
        checks.append(group_gpus_check(nodes, t.plan.groups))
    if t.plan is not None:
        for key, want in (("CPU", t.plan.ray.num_cpus), ("GPU", t.plan.ray.num_gpus)):
            short = [n["node_ip"] for n in nodes if want and n.get("resources_total", {}).get(key, 0) < want]
            if short:
                checks.append(Check(f"{key}s per node", False, f"{', '.join(short)} registered fewer than {want} {key}s",
                                    f"check the machines' {key}s against resources in the task"))
    return checks


def group_gpus_check(nodes: list[dict], groups: list) -> Check:
    """Each group's nodes give Ray the GPUs the plan says: a GPU group's its GPUs per node, a group whose GPUs
    the recipe serves outside Ray (ray_gpus 0) none, or a framework's placement group may fill them."""
    wrong = []
    for group in groups:
        want = group.gpus_per_node if group.ray_gpus is None else group.ray_gpus
        for node in [n for n in nodes if (n.get("labels") or {}).get(GROUP_LABEL) == group.name]:
            have = node.get("resources_total", {}).get("GPU", 0)
            if have != want if group.ray_gpus is not None else have < want:
                wrong.append(f"{node['node_ip']} (group {group.name}) registered {have:g} GPUs, not {want}"
                             + (" (the recipe serves them outside Ray)" if group.ray_gpus == 0 else ""))
    return Check("GPUs per group", not wrong, "; ".join(wrong) or "every group's nodes as the plan says",
                 "" if not wrong else "check the machines' GPUs against each group's resources, and the nodes' "
                 "ray start --num-gpus in their agent logs")


def _group_of(node: dict) -> str:
    """`reward, ` for a node Ray labels with its group (GROUP_LABEL); empty without."""
    group = (node.get("labels") or {}).get(GROUP_LABEL)
    return f"{group}, " if group else ""


def cluster_checks(t: Target, nodes: int, timeout: float) -> dict:
    """Preflight plus the doctor's checks, run on the cluster as a Ray job of their own."""
    from .jobs import Jobs

    plan = t.plan
    settings = {"min_bandwidth_bits": plan.preflight.min_bandwidth_bits if plan else 1e9,
                "torch": plan.preflight.torch if plan else True,
                "model": plan.preflight.model if plan else None,
                "weight_bytes": plan.preflight.weight_bytes if plan else None}
    extra = {"services": [s.model_dump(by_alias=True) for s in plan.services] if plan else [],
             "checkpoint_dir": plan.checkpoint_dir if plan else None,
             "shm_bytes": size_bytes(plan.resources.shm_size) if plan and plan.resources.shm_size else None,
             "min_free_bytes": (plan.preflight.weight_bytes if plan else None) or DEFAULT_MIN_FREE}
    jobs = Jobs(t.address, t.token)
    sid = f"doctor_{int(time.time())}_{os.getpid()}"
    upload = Path(tempfile.mkdtemp(prefix="rlhf-doctor-"))
    try:
        # The agent's package (rlhf_tasks/__init__.py is free of imports) as the job's working_dir: its
        # entry file runs by its path there, and Ray's workers import preflight's probe from it.
        shutil.copytree(Path(__file__).with_name("agent"), upload / "rlhf_tasks" / "agent",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(Path(__file__).with_name("__init__.py"), upload / "rlhf_tasks" / "__init__.py")
        argv = preflight_argv(settings, nodes, timeout=timeout, checks=extra)
        say(f"running the checks on the cluster as Ray job {sid} (deadline {timeout:.0f}s)")
        jobs.submit_with_working_dir(sid, argv, str(upload))
        return follow_preflight(jobs.api, sid, time.time() + timeout + 60, say)
    finally:
        shutil.rmtree(upload, ignore_errors=True)


def doctor(target: str, address: str | None, provider_name: str | None, timeout: float | None) -> int:
    t = resolve(target, address, provider_name)
    say(f"checking {t.name or t.address} at {t.address}"
        + ("" if t.plan else " (no task or plan known here: expectations come from the cluster itself)"))
    checks = access_checks(t)
    reachable = all(c.ok for c in checks if c.name in ("dashboard reachable", "Ray token accepted"))
    if reachable:
        nodes = t.plan.nodes if t.plan else len(alive_nodes(t.address, t.token))
        try:
            result = cluster_checks(t, nodes, timeout or (t.plan.preflight.timeout_s if t.plan else 120.0))
        except AgentError as exc:
            checks.append(Check("checks on the cluster", False, str(exc), "read the head's log"))
        else:
            preflight_report(result, say)
            failures = [f for f in result["failures"] if f["step"] != "doctor"]
            checks += [Check(f"preflight ({f['step']})", False, f["message"]) for f in failures]
            if not failures:
                checks.append(Check("preflight", True, f"versions, interfaces and the network across "
                                    f"{len(result['nodes'])} nodes (table above)"))
            checks += [Check(c["check"], c["ok"], c["detail"], c.get("fix") or "") for c in result["checks"]]
    failed = [c for c in checks if not c.ok]
    print("\n== doctor ==", flush=True)
    for check in checks:
        print(f"  {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}")
        if not check.ok and check.fix:
            print(f"       what to do: {check.fix}")
    print(f"  {len(checks) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0

