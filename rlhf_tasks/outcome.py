"""How a launched job ended and what is said of it, once: the Outcome (from the head agent's
result line or the dashboard), the summary, the verdict (the exit code, or the failed step
named), and a failure's forensics (every node's first error, and a bundle of their logs
where this machine has one or can make it)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .agent.protocol.bundle import OWN, RayLogs, gather, result_part, summary_lines, write_bundle
from .errors import StepFailed
from .plan import Plan
from .progress import Training
from .providers import Cluster


#: Who stops a job (Ray's status STOPPED), as the summary says it.
STOPPED_BY = "by `rlhf-tasks stop` or Ray's Jobs API"


@dataclass
class Outcome:
    """How the job ended, from the head agent's result line or the dashboard."""

    submission_id: str | None
    status: str | None                  # SUCCEEDED, FAILED, STOPPED; None: the job never ran
    error: str | None = None            # the head's own words, when it failed
    failed_step: str | None = None
    exit_code: int | None = None        # job.mode every_node: the command's exit code
    attempts: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    node_ids: set[str] = field(default_factory=set)
    last_line: str | None = None        # the job's own last line
    forensics: dict | None = None       # a failure's first error on each node and its bundle (agent.protocol.bundle)
    budget: dict | None = None          # the head stopped the run at a cap: its words, cost, last checkpoint
    spend: dict | None = None           # the training's spend record as the head ended (agent/budget.py)

    @classmethod
    def from_result(cls, result: dict, every_node: bool = False) -> Outcome:
        job = result.get("job") or {}
        code = job.get("exit_code", result.get("exit_code")) if every_node else None
        return cls(submission_id=job.get("submission_id"), status=job.get("status"), error=result.get("error"),
                   failed_step=result.get("failed_step"), exit_code=code, attempts=job.get("attempts") or [],
                   steps=result.get("steps") or [], node_ids=set(result.get("node_ids") or []),
                   last_line=job_said(result.get("job_log_tail") or ""), forensics=result.get("forensics"),
                   budget=result.get("budget") if (result.get("budget") or {}).get("capped") else None,
                   spend=result.get("spend") if isinstance(result.get("spend"), dict) else None)


#: Lines that are not the job's own: Ray's log records (Python's and its C++ core's, `[2026-11-28
#: 08:00:00,123 E 4242 4242] logging.cc:474: ...`), and the stack dump a SIGTERM makes Ray's core
#: print (`*** SIGTERM received at time=...`, `PC: @ 0x7f50... (unknown)`, `@ 0x7f50... (unknown)`).
NOT_THE_JOBS = re.compile(r"^(\(|\d{4}-\d\d-\d\d \d|\[\d{4}-\d\d-\d\d [\d:,.]+ [A-Z] \d+ \d+\]|"
                          r"\*\*\* \w+ received at time=|(PC: )?@\s+0x[0-9a-fA-F]+)")


def job_said(log: str) -> str | None:
    """The job's own last line: not Ray's log records, its signal dumps nor its worker-prefixed lines."""
    for line in reversed(log.splitlines()):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if line and not NOT_THE_JOBS.match(line):
            return line
    return None


def summarise(plan: Plan, outcome: Outcome, started: float, cluster: Cluster | None = None,
              training: Training | None = None) -> None:
    """What this run did: only the metrics rows its own nodes wrote (a resumed run's file
    also holds the rows of the runs before it, on other clusters), the restarts, and what the
    provider tells of its machines."""
    sid = outcome.submission_id or f"{plan.name}-{cluster.cluster_id if cluster else '?'}"
    how = outcome.status or ("not run" if not outcome.submission_id else "cut short, with no end state")
    lines = [f"job {sid}: {how} in {time.monotonic() - started:.0f}s wall time"
             + (f" (stopped before it finished, {STOPPED_BY})" if outcome.status == "STOPPED" else
                f" ({outcome.error})" if outcome.submission_id and not outcome.status and outcome.error else "")]
    if len(outcome.attempts) > 1:
        lines.append(f"attempts: {len(outcome.attempts)} (" + "; ".join(
            f"{a['submission_id']} {a['status'] or 'stopped'}" + (f": {a['cause']}" if a.get("cause") else "")
            for a in outcome.attempts) + ")")
    if outcome.budget:
        where = outcome.budget.get("checkpoint")
        lines.append(outcome.budget.get("words") or "stopped at the budget cap")
        lines.append(f"the last checkpoint: {where}" if where else
                     f"the last checkpoint: none yet{f' (in {plan.checkpoint_dir})' if plan.checkpoint_dir else ''}")
    if outcome.last_line:
        lines.append(f"the job's last line: {outcome.last_line}")
    if outcome.steps:
        lines.append("head steps: " + ", ".join(f"{s['step']} {s['seconds']:.0f}s" for s in outcome.steps))
    metrics_path = (plan.job.summary or {}).get("metrics")
    if metrics_path and Path(metrics_path).exists():
        rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
        ours = [row for row in rows if row.get("node_ids") and set(row["node_ids"]) <= outcome.node_ids]
        if ours:
            first, last = ours[0], ours[-1]
            nodes = {n for row in ours for n in row["node_ids"]}
            resumed = f", resumed after step {first['step'] - 1}" if first["step"] > 1 else ""
            lines.append(f"reward {first['mean_reward']:.2f} -> {last['mean_reward']:.2f} over steps "
                         f"{first['step']}..{last['step']}{resumed} (world size {last.get('world_size')}, "
                         f"{len(nodes)} nodes took part)")
        elif rows and outcome.node_ids and outcome.status == "SUCCEEDED":
            lines.append(f"trained nothing: the checkpoint was already at step {rows[-1]['step']} "
                         f"(raise job.args.steps to train further)")
        elif rows and outcome.node_ids:  # stopped or failed before its first row: not "nothing to train"
            lines.append(f"it wrote no metrics row before it ended {outcome.status or 'without running'} "
                         f"(the file's last row, step {rows[-1]['step']}, is an earlier run's)")
        lines.append(f"metrics: {metrics_path}")
    if training is not None:
        lines += training.summary_lines()
    if cluster is not None:
        lines += cluster.describe()
    if plan.checkpoint_dir:
        lines.append(f"checkpoints: {plan.checkpoint_dir}")
    if cluster is not None and cluster.logs_dir:
        lines.append(f"node logs: {cluster.logs_dir}")
    if outcome.forensics:
        lines += summary_lines(fetch_bundle(plan, cluster, outcome.forensics))
    print("\n== summary ==\n" + "\n".join("  " + line for line in lines), flush=True)


def fetch_bundle(plan: Plan, cluster: Cluster | None, found: dict) -> dict:
    """The head's failure bundle where this machine has it: its own path when the head's logs
    are here (local, Slurm's shared directory), else fetched through the dashboard while the
    head is still up, into the run's directory; else it is said to be on the head."""
    from . import state

    path = found.get("bundle")
    if not path or Path(path).exists() or found.get("where"):
        return found
    name = Path(path).name
    if cluster is not None and cluster.dashboard:
        try:
            data = RayLogs(cluster.dashboard, cluster.token).fetch_head(f"{OWN}/{name}")
            local = state.run_dir(plan.name) / name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
            local.chmod(0o600)
            return {**found, "bundle": str(local), "where": f"fetched from the head's {path}"}
        except (OSError, ValueError, KeyError):
            pass
    if cluster is not None and cluster.gather_here is not None:  # the run is over: the provider's own means
        made = cluster.gather_here(f"{plan.name} failed; the head's own bundle is {path} on the head machine")
        if made:
            return {**found, "bundle": made[0], "where": f"{made[1]}; the head's own is {path} on the head machine"}
    return {**found, "where": f"on the head node; `rlhf-tasks logs {plan.name} --bundle` makes one from here while "
            f"the cluster is up"}


def verdict(plan: Plan, outcome: Outcome, via_head_log: bool) -> int:
    """0 when the job succeeded; StepFailed naming the step otherwise."""
    where = "the head's log is above" if via_head_log else "its log is above"
    if plan.job.mode == "every_node":
        code = outcome.exit_code if outcome.exit_code is not None else 1
        if code != 0 or outcome.status != "SUCCEEDED":
            raise StepFailed("running the job", f"exit code {code}"
                             + (f" ({outcome.error})" if outcome.error else f" ({where})"))
        return 0
    if outcome.budget:  # whatever its driver did with the SIGTERM, the run did not finish
        raise StepFailed("the budget cap", f"{outcome.budget.get('words')}: the job was stopped before it finished; "
                         f"the cluster ended itself")
    if outcome.status == "SUCCEEDED":
        return 0
    if outcome.status is None:  # the head failed (e.g. preflight) or was stopped before the job ended
        step = outcome.failed_step or "running the task"
        error = (outcome.error or "the job did not run").replace(f"{step} failed: ", "", 1)
        raise StepFailed(step, f"{error} ({where})")
    if outcome.status == "STOPPED":
        raise StepFailed(f"running job {outcome.submission_id}", f"it was STOPPED before it finished ({STOPPED_BY})")
    raise StepFailed(f"running job {outcome.submission_id}", f"it ended {outcome.status or 'without running'} "
                     f"({where})")


def dashboard_bundle(cluster: Cluster, plan: Plan, secrets: dict[str, str], reason: str) -> dict | None:
    """Every node's logs gathered from here through the dashboard (where the head's own
    bundle stays on the head machine); None when nothing could be read."""
    from . import state

    scrub = {**secrets, **({"RAY_AUTH_TOKEN": cluster.token} if cluster.token else {})}
    try:
        gathered = gather(RayLogs(cluster.dashboard, cluster.token), scrub, reason)
        if not gathered["files"]:
            return None
        bundle = write_bundle(gathered, str(state.run_dir(plan.name)), plan.name)
    except (OSError, ValueError, KeyError):
        return None
    return {**result_part(gathered, bundle), "where": "gathered from here through the dashboard"}


def merge_forensics(head: dict | None, here: dict | None) -> dict | None:
    """The head's first errors (it saw the failure first, and knows preflight's verdict) with
    a bundle this machine has: the head's own when it is here, else the one gathered from here."""
    if not head or not head.get("gathered"):
        return here or head
    if here and not (head.get("bundle") and Path(head["bundle"]).exists()):
        return {**head, "bundle": here["bundle"], "where": f"{here['where']}; the head's own is {head.get('bundle')} "
                f"on the head machine"}
    return head
