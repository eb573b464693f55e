"""launch: the one follower. A provider's `apply` brings the cluster up and hands back a
handle (providers/base.Cluster); this module follows the job on it the same way for every
provider and summarises it once:

- through the head's log, where this machine can read it (local, Slurm, RunPod, managed
  SkyPilot): the head agent brings the cluster up, runs preflight, submits the job,
  restarts it, and relays its log; its result line ends the job;
- through the dashboard otherwise (dstack and SkyPilot, through their port forwards), and
  for `submit: client`, where the launcher submits the job itself.

Every line of the job's log reaches the user once, and no result line does."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .agent.protocol import (PREFLIGHT_PREFIX, RESULT_PREFIX, TERMINAL_JOB_STATES, AgentError, DashboardJobs,
                             alive_nodes, attempt_of, cluster_check, head_address, http_check, is_submission_of,
                             next_submission_id, parse_preflight, parse_result, preflight_submission_id, started_job,
                             submission_id, wait_for)
from .agent.protocol.bundle import OWN, RayLogs, gather, result_part, summary_lines, write_bundle
from .console import say
from .errors import BadInput, HeadLost, StepFailed
from .plan import Plan
from .progress import Training
from .providers import Cluster, Provider
from .spec import Task

#: How long following the head's log may take beyond the job's own limits (start-up, preflight).
FOLLOW_SLACK_S = 600.0
#: Without a job timeout, the follower still ends some day.
NO_TIMEOUT_S = 7 * 86400.0
#: How long the head's agent may take to exit after its result line (it has stopped Ray by then).
HEAD_EXIT_S = 30.0
#: Who stops a job (Ray's status STOPPED), as the summary says it.
STOPPED_BY = "by `rlhf-tasks stop` or Ray's Jobs API"


def collect_secrets(task: Task, provider: Provider, plan: Plan) -> dict[str, str]:
    """Values of the task's secrets from this environment; missing ones are named once, never
    shown, before anything starts: bad input where the provider cannot launch without them."""
    values = {name: os.environ[name] for name in task.secrets if os.environ.get(name)}
    missing = [name for name in task.secrets if name not in values]
    if missing:
        refusal = provider.refuses_missing_secrets(plan, missing)
        if refusal:
            raise BadInput(f"secrets: {', '.join(missing)} not set in your environment; {refusal}: export "
                           f"{'it' if len(missing) == 1 else 'them'}, or take {'it' if len(missing) == 1 else 'them'} "
                           f"out of the task's secrets")
        say(f"not set in your environment, so not passed: {', '.join(missing)}")
    return values


class LogTail:
    """Echo the complete lines that the node agents' logs gain, each line once, and of a line
    not ended yet the redraws of a bar that are done (metrics.redrawn). A result line
    is never shown (the summary says it), and a log ends at its result line: what its agent
    prints after it (keeping the cluster up) is not this launch's business. What the head's
    log (the first) says on the way, the job's start and the head's result, is kept here, so
    that nobody reads a long log again from its beginning."""

    def __init__(self, paths: list[str] = (), text: Callable[[], str] | None = None, out=None):
        self.paths = [Path(p) for p in paths]
        self.text = text  # a log that is only a whole text (e.g. `dstack apply`'s), when there are no paths
        self.offsets: dict[object, int] = {}
        self.ended: set[object] = set()
        self.out = out or sys.stdout
        self.head = self.paths[0] if self.paths else "text"
        self.head_started: str | None = None  # the job whose command the head let run (agent.protocol.JOB_STARTS)
        self.head_result: dict | None = None  # the head agent's result line

    def pump(self) -> None:
        for path in self.paths:
            if path in self.ended:
                continue
            try:
                with open(path, "rb") as handle:
                    handle.seek(self.offsets.get(path, 0))
                    chunk = handle.read()
            except FileNotFoundError:
                continue
            self._show(path, chunk)
        if self.text is not None and "text" not in self.ended:
            data = self.text().encode("utf-8", "replace")
            self._show("text", data[self.offsets.get("text", 0):])

    def _show(self, key: object, chunk: bytes) -> None:
        from .recipes.metrics import redrawn

        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offsets[key] = self.offsets.get(key, 0) + len(complete)
        shown = []
        for line in complete.decode("utf-8", "replace").splitlines(keepends=True):
            if key == self.head and self.head_started is None:
                self.head_started = started_job(line)
            if RESULT_PREFIX in line:
                if key == self.head:
                    self.head_result = parse_result(line)
                self.ended.add(key)
                break
            shown.append(line)
        else:  # of the line not ended yet, a bar's redraws that are done (a nested bar's newest ends no line)
            rest = chunk[len(complete):].decode("utf-8", "surrogateescape")
            drawn = rest[:redrawn(rest)].encode("utf-8", "surrogateescape")
            if drawn:
                self.offsets[key] += len(drawn)
                shown.append(drawn.decode("utf-8", "replace"))
        if shown:
            self.out.write("".join(shown))
            self.out.flush()


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


# ------------------------------------------------------------------ through the head's log


def follow_head_log(cluster: Cluster, plan: Plan, tail: LogTail,
                    on_start: Callable[[str], None] = lambda sid: None) -> Outcome:
    """Echo the node agents' logs (`tail`: the head's first) until the head agent's result line:
    the job's end (or the head's failure, which the line names). A head gone without its line
    is a lost head.
    `on_start(id)` once the head says the job's command runs (agent.protocol.JOB_STARTS)."""
    started = []
    began = time.monotonic()
    attempts = plan.job.max_restarts + 1 if plan.job.submit == "head" else 1
    budget = plan.wait.head_s + plan.wait.nodes_s + plan.preflight.timeout_s + FOLLOW_SLACK_S + \
        attempts * (plan.job.timeout_s or NO_TIMEOUT_S)

    def ended():
        tail.pump()
        tick = getattr(tail.out, "tick", None)
        if tick:
            tick()
        for message in cluster.tend():
            say(message)
        if not started and tail.head_started:
            started.append(tail.head_started)
            on_start(tail.head_started)
        result = tail.head_result
        if result is None and not cluster.head_alive():
            tail.pump()
            result = tail.head_result
            if result is None:
                told = "; ".join(cluster.describe())
                if word := cluster.job_ended():  # the provider ended the job (and the head with it)
                    raise StepFailed("running the job", f"{word} (its log is above)")
                raise HeadLost("running the task", "the head's node agent ended without reporting the job's end "
                               + (f"({told}; its log is above)" if told else "(its log is above)"))
        return result is not None, result or "the head is running" + cost_so_far(plan, time.monotonic() - began)

    result = wait_for("the job to end (the head's log is above)", ended, budget, interval=0.2, max_interval=1.0,
                      progress_every=600, report=say)
    if result.get("exit_code") is not None and not result.get("bundle_held_s"):
        # the head ends with its line: let the provider see it end (one holding its bundle waits for us)
        try:
            wait_for("the head's node agent to exit", lambda: (not cluster.head_alive(), "it is still running"),
                     HEAD_EXIT_S, interval=0.2, max_interval=1.0, progress_every=HEAD_EXIT_S + 1, report=say)
        except AgentError:
            pass  # the summary says what the provider knows by now
    tail.pump()
    return Outcome.from_result(result, every_node=plan.job.mode == "every_node")


def cost_so_far(plan: Plan, seconds: float) -> str:
    """`; about $1.20 so far of placement.max_cost $10.00`: for the progress line while following
    (counted from here, as the head counts from its own start)."""
    price, cap = plan.budget.price_per_hour, plan.budget.max_cost
    if price is None:
        return ""
    return f"; about ${price * seconds / 3600:.2f} so far" + (f" of placement.max_cost ${cap:.2f}" if cap else "")


# ------------------------------------------------------------------ through the dashboard


class HeadEnded(Exception):
    """The head ended while the launcher was still waiting to follow its job through the dashboard, and its
    result line says how the job ended (a job of a second or two: the head submitted it, saw it end, and left
    before the dashboard was seen): that line is the outcome, not a lost head."""

    def __init__(self, result: dict):
        super().__init__("the head reported the job's end")
        self.result = result


def _watching(cluster: Cluster, tail: LogTail, check):
    """A wait_for check that also echoes node logs and notices a head that is done: one that said how the job
    ended (its result line) is HeadEnded, one that failed a step of its own StepFailed, one gone without a word
    HeadLost."""
    def ended(said: dict) -> bool:
        return bool((said.get("job") or {}).get("status") or said.get("failed_step"))

    def wrapped():
        tail.pump()
        for message in cluster.tend():
            say(message)
        said = tail.head_result or {}  # its last word, which can come well before its provider calls it gone (dstack)
        if not ended(said) and cluster.head_alive():
            return check()
        if not ended(said):
            tail.pump()
            said = parse_result(cluster.read_head_log()) or {}
        if (said.get("job") or {}).get("status"):  # it ran the job to its end: its line says how that ended
            raise HeadEnded(said)
        where = "its log is above" if cluster.node_logs else \
            "last lines:\n" + "\n".join(cluster.read_head_log().splitlines()[-20:])
        if said.get("failed_step"):  # e.g. preflight: name the head's own failed step (not a lost head)
            error = (said.get("error") or "").replace(f"{said['failed_step']} failed: ", "", 1)
            raise StepFailed(said["failed_step"], f"{error} ({where})")
        if word := cluster.job_ended():  # the provider ended the job (and the head with it)
            raise StepFailed("running the job", f"{word} ({where})")
        raise HeadLost("bringing up the cluster", f"the head's process exited ({where})")
    return wrapped


def wait_cluster(cluster: Cluster, plan: Plan, tail: LogTail) -> str:
    timeout = plan.wait.head_s + plan.wait.nodes_s
    wait_for(f"the Ray dashboard at {cluster.dashboard}",
             _watching(cluster, tail, lambda: http_check(cluster.dashboard + "/api/gcs_healthz")), timeout, report=say)
    check = cluster_check(cluster.dashboard, cluster.token, plan.nodes)
    return wait_for(f"{plan.nodes} nodes", _watching(cluster, tail, check), plan.wait.nodes_s, interval=0.5,
                    report=say)


def wait_preflight(cluster: Cluster, plan: Plan, tail: LogTail, gated: str | None = None) -> None:
    """Until the head's preflight has passed, echo the head's log (the table, or the reasons).
    With `submit: head` the gate of the head's job `gated` runs it (that job's log carries
    its result line) and opens once the head saw it pass; with `submit: client` it is the
    head's Ray job `preflight_<cluster>`, and the job is submitted after it."""
    api = DashboardJobs(cluster.dashboard, cluster.token)
    sid = preflight_submission_id(cluster.cluster_id)

    def check():
        try:
            if gated:
                result = parse_preflight(api.logs(gated))
                if result is not None:
                    return True, "SUCCEEDED" if result["passed"] else "FAILED"
                state = api.status(gated)
                return state in TERMINAL_JOB_STATES, f"job {gated} {state}"
            jobs = api.jobs()
        except OSError as exc:
            return False, str(exc)
        ours = [job for job in jobs if (job.get("submission_id") or "").startswith(sid)]
        state = ours[-1]["status"] if ours else "not submitted yet"
        return state in TERMINAL_JOB_STATES, state

    status = wait_for("the head's preflight", _watching(cluster, tail, check), plan.preflight.timeout_s + 120,
                      report=say)
    tail.pump()
    if status != "SUCCEEDED":
        raise StepFailed("preflight", f"it ended {status}: the head's log says why (the job's command did not run)")


def gated_preflight(plan: Plan, sid: str) -> bool:
    """Whether job `sid`'s gate runs preflight: the head's first attempt, when preflight is on."""
    return plan.job.submit == "head" and plan.preflight.enabled and attempt_of(sid) == 0


def head_submission(dashboard: str, token: str | None, name: str):
    """A wait_for check: the id of the job the head agent submitted (see agent.protocol.submission_id)."""
    try:
        jobs = DashboardJobs(dashboard, token).jobs()
    except OSError as exc:
        return False, str(exc)
    ids = [job.get("submission_id") or "" for job in jobs]
    ours = [sid for sid in ids if is_submission_of(name, sid)]
    return (True, ours[-1]) if ours else (False, "not submitted yet")


def final_status_from_head(cluster: Cluster, shown: int, timeout_s: float = 60) -> tuple[str, str] | None:
    """The job's end state and the part of its log not shown yet, from the head agent's
    result line once it is written (its process may end well after: dstack's run) or the head
    has exited; None when it never said."""
    def check():
        log = cluster.read_head_log()
        if ((parse_result(log) or {}).get("job") or {}).get("status") or not cluster.head_alive():
            return True, log
        return False, "the head is still running"

    try:
        result = parse_result(wait_for("the head agent to finish", check, timeout_s, interval=0.2, report=say))
    except AgentError:
        return None
    job = (result or {}).get("job") or {}
    if not job.get("status"):
        return None
    total, tail = result.get("job_log_chars", 0), result.get("job_log_tail", "")
    missing = total - shown
    if missing <= 0:
        return job["status"], ""
    if missing <= len(tail):
        return job["status"], tail[len(tail) - missing:]
    return job["status"], f"[... {missing - len(tail)} characters of the job's log are only in the head's log]\n" + tail


def head_result(cluster: Cluster, sid: str, timeout_s: float = 30) -> dict | None:
    """The head agent's result line about job `sid` (its attempts and their causes), once it
    has printed it; None when it does not within the deadline (a provider whose head log
    does not reach us)."""
    def check():
        result = parse_result(cluster.read_head_log()) or {}
        if ((result.get("job") or {}).get("submission_id")) == sid or not cluster.head_alive():
            return True, result or None
        return False, "the head has not reported the job's end yet"
    try:
        return wait_for("the head's report on the job", check, timeout_s, interval=0.2, report=say)
    except AgentError:
        return None


#: The head agent's exit codes when a signal ended it (SIGINT, SIGTERM): stopped from outside, not by its own verdict.
SIGNALLED = (130, 143)
#: The head agent's word when it restarts the job (agent/jobrunner.py): why.
RESTARTING = re.compile(r"restarting the job, attempt \d+ of \d+: (.*)")


def follow_attempts(jobs, cluster: Cluster, plan: Plan, sid: str, tail: LogTail) -> tuple[str, str]:
    """Follow a job through the restarts the head makes (`-r1`, `-r2`, ...): its final
    status and last submission id. The head has given up when its result line names the
    attempt that just ended, or when it is gone."""
    def tend(status):
        tick = getattr(tail.out, "tick", None)
        if tick:
            tick()
        for message in cluster.tend():
            say(message)

    # The head's first job starts with preflight's run in its gate, which the head's log reports.
    after = PREFLIGHT_PREFIX if gated_preflight(plan, sid) else None
    while True:
        try:
            status = jobs.follow(sid, plan.job.timeout_s, out=tail.out, watch=tend, hint_on_interrupt=False, after=after,
                                 final_status=lambda shown: final_status_from_head(cluster, shown))
        except StepFailed as exc:
            if not cluster.head_alive():
                raise HeadLost(f"following job {sid}", f"the head is gone ({exc})") from None
            raise
        if status == "SUCCEEDED" or plan.job.submit != "head" or not plan.job.max_restarts:
            return status, sid
        following = sid
        after = next_submission_id(sid)

        def restarted():
            tend(status)
            try:
                if jobs.status(after) is not None:
                    return True, after
            except StepFailed as exc:  # the dashboard is gone: with the head (its run ended), or for a moment
                if cluster.head_alive():
                    return False, f"job {following} ended {status}; the dashboard does not answer ({exc})"
            said = (parse_result(cluster.read_head_log()) or {}).get("job") or {}
            if said.get("submission_id") == following or not cluster.head_alive():
                return True, None
            return False, f"job {following} ended {status}; the head has not restarted it yet"
        say(f"job {sid} ended {status}; waiting to see whether the head restarts it")
        sid, after = wait_for(f"the head to restart job {sid}", restarted, plan.wait.nodes_s + 300, interval=0.5,
                              report=say), None
        if sid is None:
            result = parse_result(cluster.read_head_log()) or {}
            if result.get("exit_code") in SIGNALLED or (not result and not cluster.head_alive()):
                return None, following  # the head was ended from outside while it waited for its nodes
            return status, following
        say(f"following job {sid}, the head's restart of {following} (Ctrl-C stops following, not the job)")


def start_through_dashboard(cluster: Cluster, plan: Plan, tail: LogTail,
                            secrets: dict[str, str]) -> tuple[str, set[str]]:
    """Wait for the cluster through its dashboard, then submit the job (`submit: client`) or
    find the head's submission: its id, and the nodes it runs on."""
    from .jobs import Jobs

    have = wait_cluster(cluster, plan, tail)
    say(f"cluster up: {have}")
    node_ids = {n["node_id"] for n in alive_nodes(cluster.dashboard, cluster.token)}
    if plan.job.submit == "client":
        if plan.preflight.enabled:
            wait_preflight(cluster, plan, tail)
        sid = submission_id(plan.name, cluster.cluster_id)
        head = head_address(cluster.dashboard, cluster.token)
        if Jobs(cluster.dashboard, cluster.token).submit(plan, sid, head, {**os.environ, **secrets}):
            say(f"submitted job {sid}")
        else:
            say(f"job {sid} is already on this cluster")
    else:
        say("waiting for the head's job")
        sid = wait_for("the head to submit the job", _watching(cluster, tail, lambda: head_submission(
            cluster.dashboard, cluster.token, plan.name)), 600, report=say)
        if gated_preflight(plan, sid):
            wait_preflight(cluster, plan, tail, gated=sid)
    return sid, node_ids


def follow_dashboard(cluster: Cluster, plan: Plan, tail: LogTail, sid: str, node_ids: set[str],
                     secrets: dict[str, str] | None = None) -> Outcome:
    """Follow job `sid`'s log through the dashboard, through the head's restarts. When it
    failed, every node's logs are gathered from here at once, while the cluster is still up."""
    from . import state
    from .jobs import Jobs

    state.update(plan.name, job={"submission_id": sid, "status": "RUNNING"})
    tail.pump()
    say(f"following job {sid} (Ctrl-C stops following, not the job)")
    status, sid = follow_attempts(Jobs(cluster.dashboard, cluster.token), cluster, plan, sid, tail)
    here = dashboard_bundle(cluster, plan, secrets or {}, f"job {sid} ended {status or 'with its head'}") \
        if status != "SUCCEEDED" else None
    said = head_result(cluster, sid) if plan.job.submit == "head" else None
    outcome = Outcome.from_result(said) if said else Outcome(sid, status)
    outcome.submission_id, outcome.status, outcome.node_ids = sid, status, node_ids
    if status is None:  # the head was ended (its run, by the provider) while it waited to restart the job
        try:  # its process too, so that the provider can say why (dstack: once `dstack apply` has ended)
            wait_for("the head's process to end", lambda: (not cluster.head_alive(), "it is still running"),
                     2 * HEAD_EXIT_S, interval=0.5, max_interval=1.0, progress_every=2 * HEAD_EXIT_S + 1, report=say)
        except AgentError:
            pass  # the summary says what the provider knows by now
        causes = RESTARTING.findall(cluster.read_head_log())
        outcome.error = "the head was ended while it waited for its nodes to restart the job" + (
            f" after: {causes[-1].strip()}" if causes else "") + \
            "; the provider's word on its nodes is in the summary"
    outcome.forensics = merge_forensics(outcome.forensics, here)
    return outcome


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


# ------------------------------------------------------------------ the summary


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


# ------------------------------------------------------------------ launch


def refuse_spent(plan: Plan) -> None:
    """BadInput, before anything is rented, when the training's attempts so far (the launcher's record) reached
    a cap already: a launch without --fresh continues the training, and its head would end at once."""
    from .agent.protocol import spend as bmod

    seconds, cost, _ = bmod.totals(plan.budget.spent)
    left = bmod.cap_seconds(plan.budget.model_dump(), seconds, cost)
    if not plan.budget.spent or left is None or left > 0:
        return
    from . import state

    which = "placement.max_cost" if plan.budget.max_cost is not None and plan.budget.price_per_hour and \
        cost >= plan.budget.max_cost else "placement.max_duration"
    raise BadInput(f"{which}: the training {plan.budget.training} spent ${cost:.2f} over {bmod.hm(seconds)} in "
                   f"{len(plan.budget.spent)} attempts already ({state.spend_path(plan.name)}), which reaches "
                   f"{which} ({f'${plan.budget.max_cost:.2f}' if which.endswith('cost') else bmod.hm(plan.budget.max_duration_s or 0)}): "
                   f"a launch without --fresh continues that training and its budget. Raise {which}, or start a new "
                   f"training with `rlhf-tasks launch --fresh`; nothing was launched")


def keep_spend(plan: Plan, spend: dict | None) -> None:
    """The head's word on the training's spend (its result line) merged into the launcher's record."""
    if not spend or spend.get("training") != plan.budget.training:
        return
    from . import state
    from .agent.protocol import spend as bmod

    record = state.training(plan.name)
    if record.get("training") != plan.budget.training:
        record = {"version": 1, "training": plan.budget.training, "attempts": {}}
    record["attempts"] = bmod.merge(record.get("attempts") or {}, plan.budget.spent, spend.get("attempts") or {})
    state.keep_training(plan.name, record)


def refuse_live_cluster(name: str, provider: Provider) -> None:
    """One live cluster per name: a launch on another provider under the name of a cluster that
    still lives would overwrite its record (and its token), leaving it running, billed and out of
    reach of `env`, `status` and `down`. Refused before anything is created or written; the same
    provider's own relaunch rules stand (local refuses a running cluster, RunPod pods of the name)."""
    from . import providers, state

    record = state.load(name)
    if not record or record.get("ended") or record.get("provider") in (None, provider.name):
        return
    other = record["provider"]
    try:
        live = providers.provider_class(other).live(record)
    except BadInput:  # a provider not installed here: take the record's word
        live = True
    if not live:
        return
    from .jobs import last_job

    job = last_job(name, record, state.token(name)) or {}  # its dashboard's word where it answers here
    what = (f"its job {job['submission_id']} " + (f"was last seen {job['status']}" if job.get("seen") else
                                                  f"is {job['status']}")) if job.get("submission_id") else \
        "no job of it seen yet"
    raise BadInput(f"name: a cluster named {name} is live on {other} ({what}); launching it on {provider.name} "
                   f"would replace its record and leave it running out of reach. Stop it first with "
                   f"`rlhf-tasks down {name}` (or rename this task); nothing was launched")


def launch(task: Task, provider: Provider, keep: bool = False, fresh: bool = False) -> int:
    """Launch the task, and relaunch it whole when its head is lost, as often as the
    provider says (`launch --retry N` on local): the new cluster resumes from the checkpoint
    (with `fresh`, from the fresh run's: the old ones are moved aside once, by this launch's stamp),
    and the training's steps are read on as one (rlhf_tasks.progress)."""
    refuse_live_cluster(task.name, provider)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) if fresh else None
    relaunches = provider.relaunches()
    wandb_env = wandb_run(task, fresh)
    training = None
    try:
        for attempt in range(relaunches + 1):
            try:
                return launch_once(task, provider, keep, stamp, training, wandb_env)
            except HeadLost as exc:
                training = getattr(exc, "training", None) or training
                if attempt == relaunches:
                    raise
                say(f"the head is lost ({exc}); relaunching {task.name}, {attempt + 1} of {relaunches}: "
                    f"it resumes from the checkpoint")
        raise AssertionError("unreachable")
    finally:
        if training is not None:
            training.close()


def wandb_run(task: Task, fresh: bool = False) -> dict[str, str]:
    """W&B's run id and resume mode for this launch (WANDB_RUN_ID, WANDB_RESUME=allow, which wandb.init
    reads whatever framework calls it): the id kept in runs/NAME/wandb-run-id, so that the job's
    restarts, a relaunch and a later launch of the name continue one W&B run; `launch --fresh`
    makes a new id. Nothing where the task logs nothing to W&B (no WANDB_API_KEY secret). Writes
    nothing: `keep_wandb_run` does, once the launch goes ahead."""
    import secrets as random

    if "WANDB_API_KEY" not in task.secrets:
        return {}
    run_id = None if fresh else kept_wandb_run(task.name)
    if not run_id:
        run_id = f"{task.name}-{random.token_hex(4)}"
    return {"WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow"}


def kept_wandb_run(name: str) -> str | None:
    from . import state

    try:
        run_id = (state.run_dir(name) / "wandb-run-id").read_text().strip()
    except OSError:
        return None
    return run_id if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id) else None


def keep_wandb_run(name: str, env: dict[str, str]) -> None:
    """Keep the W&B run id this launch uses for the next one of the name, and say which it is."""
    from . import state

    run_id = env.get("WANDB_RUN_ID")
    if not run_id:
        return
    if kept_wandb_run(name) == run_id:
        say(f"W&B: continuing run id {run_id} (launch --fresh starts a new one)")
        return
    path = state.run_dir(name) / "wandb-run-id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    say(f"W&B: a new run id {run_id}; this name's restarts and next launches continue it")


def training_view(task: Task, plan: Plan, started: float) -> Training:
    """What follows the training in the job's log (rlhf_tasks.progress): the recipe's reader of
    its framework's metric lines; its steps go to runs/NAME/metrics.jsonl."""
    from . import state

    try:
        reader = task.job.metrics_reader()
    except Exception:  # noqa: BLE001 - no progress line rather than no run
        reader = None
    return Training(reader, sys.stdout, state.run_dir(task.name), plan.budget.price_per_hour, started, say=say,
                    on_wandb=lambda url: state.update(task.name, wandb_url=url))


def cancel(name: str, provider: Provider, made: bool, head_log: Callable[[], str] = lambda: "",
           waiting: str | None = None) -> int:
    """Ctrl-C before the job's command started cancels the launch. The head would start the
    job on its own (behind its gate, once every node is in) with nobody following, and
    neither its gate nor, on every provider, its dashboard can be reached from here; `down`
    can: it stops the cluster, and the job never runs. (`made`: this launch got as far as
    making a cluster; `head_log`: the head's log, to tell whether the job started meanwhile;
    `waiting`: what the launcher was waiting for when Ctrl-C came, see agent.protocol.wait_for.)"""
    if waiting:
        say(f"interrupted while waiting for {waiting}")
    if not made:
        say(f"interrupted before a cluster was made for {name}: nothing runs")
        return 130
    again = f"the cluster may still be running, and its head start the job: stop it with: rlhf-tasks down {name}"
    say(f"interrupted before the job's command started: stopping the cluster {name}, so that the job does not run "
        f"({provider.down_again})")
    try:
        say(provider.down(name))
    except KeyboardInterrupt:
        say(f"interrupted again: {again}{left_running(provider, name)}")
        return 130
    except (StepFailed, BadInput, AgentError) as exc:
        say(f"could not stop it ({exc}): {again}{left_running(provider, name)}")
        return 130
    sid = started_job(head_log())
    say(f"job {sid} had just started; it stopped with the cluster" if sid else
        f"the job of {name} did not run; launch it again to run it")
    return 130


def left_running(provider: Provider, name: str) -> str:
    """What the provider says is still there of cluster `name` (its machines), as lines to
    append to a message; "" when it says nothing or cannot be asked."""
    try:
        said = provider.status(name)
    except (StepFailed, BadInput, AgentError, OSError, KeyboardInterrupt):
        return ""
    return "; what is left of it:\n  " + "\n  ".join(said.splitlines()) if said else ""


def ask_ray_runtime_env(task: Task, plan) -> None:
    """job.runtime_env as Ray's own parsing judges it, before anything is rented (as `check` asks it):
    a refusal here costs nothing, the head's `ray job submit` would refuse it once the cluster is up."""
    from .runtimeenv import ask_ray

    try:
        ask_ray(plan.job.runtime_env, plan.job.working_dir, plan.job.excludes)
    except BadInput as exc:
        raise BadInput(f"{task.source}: {exc}") from None


def launch_once(task: Task, provider: Provider, keep: bool, fresh: str | None = None,
                training: Training | None = None, wandb_env: dict[str, str] | None = None) -> int:
    from . import state

    started = time.monotonic()
    plan = provider.plan(task)
    if keep:
        plan = plan.replace(keep_cluster=True)
    if fresh:
        if not plan.checkpoint_dir:
            raise BadInput("--fresh: the task has no checkpoint directory to start over from (checkpoints.path)")
        plan = plan.replace(fresh=fresh)
    if wandb_env:
        plan = plan.replace(env={**wandb_env, **plan.env})  # the task's own env wins
    trained = state.training(task.name, fresh)
    plan = plan.replace(budget=plan.budget.model_copy(update={"training": trained["training"],
                                                              "spent": trained["attempts"]}))
    refuse_spent(plan)
    ask_ray_runtime_env(task, plan)
    provider.ready(plan)  # bad input found here (a missing CLI) leaves nothing written or removed
    secrets = collect_secrets(task, provider, plan)
    if wandb_env and secrets.get("WANDB_API_KEY"):
        keep_wandb_run(task.name, wandb_env)
    before = provider.before_launch(task.name)
    say(f"launching {task.name} on {provider.name}: {task.nodes} nodes; its files go to {state.run_dir(task.name)}")
    state.keep_training(task.name, trained)  # the training this launch belongs to, for the next one of the name
    if plan.fresh:
        say(f"--fresh: the run starts over; the head moves the old checkpoints aside before prepare, nothing deleted: "
            f"{plan.checkpoint_dir} -> {plan.checkpoint_dir}.old-{plan.fresh} (its log says where they went)")
    cluster = None
    job_started = interrupted = command_started = False
    try:
        cluster = provider.apply(plan, secrets)
        if cluster.price_per_hour is not None:  # the provider's own price (RunPod's catalog, dstack's plan)
            plan = plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": cluster.price_per_hour}))
        if plan.budget.price_per_hour is not None and "price_per_hour" not in (state.load(plan.name) or {}):
            state.update(plan.name, price_per_hour=plan.budget.price_per_hour)  # `ps` counts the cost so far
        state.update(plan.name, secrets=plan.secrets)  # their names (never values): `logs --bundle` scrubs them
        training = training or training_view(task, plan, started)
        tail = LogTail(cluster.node_logs, None if cluster.node_logs else cluster.head_log, out=training)
        via_head_log = plan.job.submit == "head" and bool(cluster.node_logs or plan.job.mode == "every_node")
        if via_head_log:  # the head runs the job: from here on the cluster is the user's, to `down`
            job_started = True
            say("every node runs the job's command (no Ray); following the node agents' logs" if plan.job.mode ==
                "every_node" else "following the head's log (Ctrl-C before the job's command starts cancels the "
                "launch and stops the cluster; after, it stops following, not the job)")

            def record_start(sid: str) -> None:  # what `down` knows where the dashboard does not answer
                if plan.job.mode != "every_node":  # every_node runs no Ray job to name
                    state.update(plan.name, job={"submission_id": sid, "status": "RUNNING"})

            outcome = follow_head_log(cluster, plan, tail, on_start=record_start)
        else:
            try:
                sid, node_ids = start_through_dashboard(cluster, plan, tail, secrets)
                job_started = command_started = True
                outcome = follow_dashboard(cluster, plan, tail, sid, node_ids, secrets)
            except HeadEnded as ended:  # the job was over before it could be followed: the head's line says how
                job_started = command_started = True
                tail.pump()
                outcome = Outcome.from_result(ended.result)
                say(f"the head ended before its job could be followed here; its result line says job "
                    f"{outcome.submission_id} ended {outcome.status}")
        if outcome.status is not None or not (state.load(plan.name) or {}).get("job"):  # not over `down`'s word
            state.update(plan.name, job={"submission_id": outcome.submission_id, "status": outcome.status})
        if outcome.budget:  # `status NAME` says it too
            state.update(plan.name, budget={k: outcome.budget.get(k) for k in ("words", "checkpoint")})
        keep_spend(plan, outcome.spend)
        training.close()
        summarise(plan, outcome, started, cluster, training)
        if keep and not outcome.budget:
            idle = plan.budget.idle_s
            say(f"the cluster keeps running: `eval \"$(rlhf-tasks env {plan.name})\"` sets up this shell for Ray's own "
                f"CLI, `rlhf-tasks list --cluster {plan.name}` lists its jobs, `rlhf-tasks down {plan.name}` stops it"
                + (f"; it ends itself after {idle:.0f}s without a running job (placement.idle)" if idle else ""))
        return verdict(plan, outcome, via_head_log)
    except KeyboardInterrupt as exc:  # wherever it lands: while bringing the cluster up, submitting, or following
        interrupted = True
        if training is not None:
            training.close()
        if cluster is not None:  # what becomes of the cluster is decided here, not by its close()
            cluster.interrupted = True
        print(file=sys.stderr)
        said = started_job(cluster.read_head_log()) if cluster is not None else None
        if command_started or said:
            sid = ((state.load(task.name) or {}).get("job") or {}).get("submission_id") or said
            if not sid and cluster is not None and cluster.dashboard:
                found, value = head_submission(cluster.dashboard, cluster.token, task.name)
                sid = value if found else None
            if plan.job.mode == "every_node":  # no Ray job to stop: the command runs on every node
                say("stopped following; the job's command keeps running on every node")
            elif sid:
                say(f"stopped following; job {sid} keeps running. Stop it with: rlhf-tasks stop {sid} "
                    f"--cluster {task.name}" + (f" (with `rlhf-tasks forward {task.name}` running in another shell: "
                                                f"the launch's own forward of the dashboard has ended)"
                                                if provider.forward_after_launch else ""))
            say(f"the cluster keeps running; stop it with: rlhf-tasks down {task.name}" if keep or
                plan.job.submit == "client" else
                f"the cluster ends itself when the job ends (or now: rlhf-tasks down {task.name})")
            return 130
        made = cluster is not None or state.before_launch(task.name, before.staged).record != before.record
        return cancel(task.name, provider, made, cluster.read_head_log if cluster is not None else lambda: "",
                      getattr(exc, "waiting_for", None))
    except BaseException as exc:
        if isinstance(exc, HeadLost) and training is not None:
            exc.training = training  # the relaunch goes on reading the same training
        if not job_started and not provider.stop_after_job:
            undone = provider.abandon(before)
            if undone:
                say(f"cleaned up what this launch created for {task.name}: {'; '.join(undone)}")
        raise
    finally:
        if training is not None and not isinstance(sys.exc_info()[1], HeadLost):
            training.close()
        if cluster is not None:
            cluster.close()
        if provider.stop_after_job and cluster is not None and not keep and not interrupted:
            say(f"stopping the {provider.name} cluster {task.name}")
            say(provider.down(task.name))
