"""Following a launched job, the same way for every provider, until it ends:

- through the head's log, where this machine can read it (local, Slurm, RunPod, managed
  SkyPilot): the head agent brings the cluster up, runs preflight, submits the job,
  restarts it, and relays its log; its result line ends the job;
- through the dashboard otherwise (dstack and SkyPilot, through their port forwards), and
  for `submit: client`, where the launcher submits the job itself.

Every line of the job's log reaches the user once, and no result line does. What the
following found is an Outcome (outcome.py); launch.py decides what becomes of the cluster."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

from .agent.protocol import (PREFLIGHT_PREFIX, RESULT_PREFIX, TERMINAL_JOB_STATES, AgentError, DashboardJobs,
                             alive_nodes, attempt_of, cluster_check, head_address, http_check, is_submission_of,
                             next_submission_id, parse_preflight, parse_result, preflight_submission_id, started_job,
                             submission_id, wait_for)
from .console import say
from .errors import HeadLost, StepFailed
from .outcome import Outcome, dashboard_bundle, merge_forensics
from .plan import Plan
from .providers import Cluster


#: How long following the head's log may take beyond the job's own limits (start-up, preflight).
FOLLOW_SLACK_S = 600.0
#: Without a job timeout, the follower still ends some day.
NO_TIMEOUT_S = 7 * 86400.0
#: How long the head's agent may take to exit after its result line (it has stopped Ray by then).
HEAD_EXIT_S = 30.0


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
