"""launch: apply the provider's files, wait for the cluster, submit when the task says
`submit: client` (or find the head's submission), follow the job, and summarise."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .agent.protocol import (TERMINAL_JOB_STATES, AgentError, alive_nodes, auth_headers, cluster_check,
                             head_address, http_check, http_request, is_submission_of, next_submission_id,
                             parse_result, preflight_submission_id, submission_id, wait_for)
from .errors import HeadLost, StepFailed
from .plan import Plan
from .providers import Cluster, Provider
from .spec import Task


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] rlhf-tasks: {message}", flush=True)


def collect_secrets(task: Task) -> dict[str, str]:
    """Values of the task's secrets from this environment; missing ones are named, never shown."""
    values = {name: os.environ[name] for name in task.secrets if os.environ.get(name)}
    missing = [name for name in task.secrets if name not in values]
    if missing:
        say(f"not set in your environment, so not passed: {', '.join(missing)}")
    return values


class LogTail:
    """Echo new lines of the node agents' logs while we wait for the cluster."""

    def __init__(self, directory: str | None):
        self.directory = Path(directory) if directory else None
        self.offsets: dict[Path, int] = {}

    def pump(self) -> None:
        if not self.directory:
            return
        for path in sorted(self.directory.glob("node-*.log")):
            with open(path, "rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                chunk = handle.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            if complete:
                print(complete.decode("utf-8", "replace"), end="", flush=True)
                self.offsets[path] = self.offsets.get(path, 0) + len(complete)


def _watching(cluster: Cluster, tail: LogTail, check):
    """A wait_for check that also echoes node logs and notices a dead head."""
    def wrapped():
        tail.pump()
        for message in cluster.tend():
            say(message)
        if not cluster.head_alive():
            tail.pump()
            where = "its log is above" if cluster.logs_dir else "last lines:\n" + "\n".join(
                cluster.head_log().splitlines()[-20:])
            said = parse_result(cluster.head_log()) or {}
            if said.get("failed_step"):  # e.g. preflight: name the head's own failed step (not a lost head)
                error = (said.get("error") or "").replace(f"{said['failed_step']} failed: ", "", 1)
                raise StepFailed(said["failed_step"], f"{error} ({where})")
            raise HeadLost("bringing up the cluster", f"the head's process exited ({where})")
        return check()
    return wrapped


def wait_cluster(cluster: Cluster, plan: Plan, tail: LogTail) -> str:
    timeout = plan.wait.head_s + plan.wait.nodes_s
    wait_for(f"the Ray dashboard at {cluster.dashboard}",
             _watching(cluster, tail, lambda: http_check(cluster.dashboard + "/api/gcs_healthz")), timeout, report=say)
    check = cluster_check(cluster.dashboard, cluster.token, plan.nodes)
    return wait_for(f"{plan.nodes} nodes", _watching(cluster, tail, check), plan.wait.nodes_s, interval=0.5,
                    report=say)


def wait_preflight(cluster: Cluster, plan: Plan, tail: LogTail) -> None:
    """Until the head's preflight has passed (its Ray job ends SUCCEEDED), echo the head's
    log (the table, or the reasons). With `submit: client` the job is submitted after it;
    with `submit: head` the head's job is already submitted, behind a gate that opens now."""
    sid = preflight_submission_id(cluster.cluster_id)
    jobs_url = f"{cluster.dashboard}/api/jobs/"

    def check():
        try:
            status, body = http_request(jobs_url, headers=auth_headers(cluster.token))
        except OSError as exc:
            return False, str(exc)
        ours = [job for job in (json.loads(body) if status == 200 else [])
                if (job.get("submission_id") or "").startswith(sid)]
        state = ours[-1]["status"] if ours else "not submitted yet"
        return state in TERMINAL_JOB_STATES, state

    status = wait_for("the head's preflight", _watching(cluster, tail, check), plan.preflight.timeout_s + 120,
                      report=say)
    tail.pump()
    if status != "SUCCEEDED":
        raise StepFailed("preflight", f"it ended {status}: the head's log says why (the job's command did not run)")


def head_submission(dashboard: str, token: str | None, name: str):
    """A wait_for check: the id of the job the head agent submitted (see agent.protocol.submission_id)."""
    try:
        status, body = http_request(dashboard + "/api/jobs/", headers=auth_headers(token))
    except OSError as exc:
        return False, str(exc)
    ids = [job.get("submission_id") or "" for job in (json.loads(body) if status == 200 else [])]
    ours = [sid for sid in ids if is_submission_of(name, sid)]
    return (True, ours[-1]) if ours else (False, "not submitted yet")


def final_status_from_head(cluster: Cluster, shown: int, timeout_s: float = 60) -> tuple[str, str] | None:
    """The job's end state and the part of its log not shown yet, from the head agent's
    result line once the head has exited; None when it never said."""
    def check():
        if cluster.head_alive():
            return False, "the head is still running"
        return True, cluster.head_log()

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
        result = parse_result(cluster.head_log()) or {}
        if ((result.get("job") or {}).get("submission_id")) == sid or not cluster.head_alive():
            return True, result or None
        return False, "the head has not reported the job's end yet"
    try:
        return wait_for("the head's report on the job", check, timeout_s, interval=0.2, report=say)
    except AgentError:
        return None


def follow_attempts(jobs, cluster: Cluster, plan: Plan, sid: str, tail: LogTail) -> tuple[str, str]:
    """Follow a job through the restarts the head makes (`-r1`, `-r2`, ...): its final
    status and last submission id. The head has given up when its result line names the
    attempt that just ended, or when it is gone."""
    def tend(status):
        for message in cluster.tend():
            say(message)

    while True:
        try:
            status = jobs.follow(sid, plan.job.timeout_s, watch=tend, hint_on_interrupt=False,
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
            tail.pump()
            tend(status)
            if jobs.status(after) is not None:
                return True, after
            said = (parse_result(cluster.head_log()) or {}).get("job") or {}
            if said.get("submission_id") == following or not cluster.head_alive():
                return True, None
            return False, f"job {following} ended {status}; the head has not restarted it yet"
        say(f"job {sid} ended {status}; waiting to see whether the head restarts it")
        sid = wait_for(f"the head to restart job {sid}", restarted, plan.wait.nodes_s + 300, interval=0.5, report=say)
        if sid is None:
            return status, following
        say(f"following job {sid}, the head's restart of {following} (Ctrl-C stops following, not the job)")


def summarise(plan: Plan, submission_id: str, status: str, started: float, artifacts: str | None,
              node_ids: set[str] = frozenset(), head_result: dict | None = None) -> None:
    """What this run did: only the metrics rows its own nodes wrote (a resumed run's file
    also holds the rows of the runs before it, on other clusters), and the restarts."""
    lines = [f"job {submission_id}: {status} in {time.monotonic() - started:.0f}s wall time"]
    attempts = ((head_result or {}).get("job") or {}).get("attempts") or []
    if len(attempts) > 1:
        lines.append(f"attempts: {len(attempts)} (" + "; ".join(
            f"{a['submission_id']} {a['status'] or 'stopped'}" + (f": {a['cause']}" if a.get("cause") else "")
            for a in attempts) + ")")
    metrics_path = (plan.job.summary or {}).get("metrics")
    if metrics_path and Path(metrics_path).exists():
        rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
        ours = [row for row in rows if set(row.get("node_ids", [])) <= node_ids and row.get("node_ids")]
        if ours:
            first, last = ours[0], ours[-1]
            nodes = {n for row in ours for n in row["node_ids"]}
            resumed = f", resumed after step {first['step'] - 1}" if first["step"] > 1 else ""
            lines.append(f"reward {first['mean_reward']:.2f} -> {last['mean_reward']:.2f} over steps "
                         f"{first['step']}..{last['step']}{resumed} (world size {last.get('world_size')}, "
                         f"{len(nodes)} nodes took part)")
        elif rows:
            lines.append(f"trained nothing: the checkpoint was already at step {rows[-1]['step']} "
                         f"(raise job.args.steps to train further)")
        lines.append(f"metrics: {metrics_path}")
    if plan.checkpoint_dir:
        lines.append(f"checkpoints: {plan.checkpoint_dir}")
    if artifacts:
        lines.append(f"node logs: {artifacts}")
    print("\n== summary ==\n" + "\n".join("  " + line for line in lines), flush=True)


def follow_every_node(cluster: Cluster, plan: Plan, tail: LogTail, started: float) -> int:
    """job.mode every_node (no Ray, no dashboard): echo the node agents' output until the
    head's agent has ended; its result line holds the job's exit code."""
    say("every node runs the job's command (no Ray); following the node agents")
    wait_for("the head agent to finish", lambda: (tail.pump() or not cluster.head_alive(), "the job is running"),
             (plan.job.timeout_s or 7 * 86400) + plan.wait.head_s, interval=0.2, max_interval=1.0,
             progress_every=300, report=say)
    tail.pump()
    result = parse_result(cluster.head_log()) or {}
    job = result.get("job") or {}
    code = job.get("exit_code", result.get("exit_code", 1))
    summarise(plan, f"{plan.name}-{cluster.cluster_id}", job.get("status") or "FAILED", started, cluster.logs_dir)
    if code != 0:
        raise StepFailed("running the job", f"exit code {code}"
                         + (f" ({result['error']})" if result.get("error") else " (the head's log is above)"))
    return 0


def launch(task: Task, provider: Provider, keep: bool = False) -> int:
    """Launch the task, and relaunch it whole when its head is lost, as often as the
    provider says (`launch --retry N` on local): the new cluster resumes from the checkpoint."""
    relaunches = provider.relaunches()
    for attempt in range(relaunches + 1):
        try:
            return launch_once(task, provider, keep)
        except HeadLost as exc:
            if attempt == relaunches:
                raise
            say(f"the head is lost ({exc}); relaunching {task.name}, {attempt + 1} of {relaunches}: "
                f"it resumes from the checkpoint")
    raise AssertionError("unreachable")


def launch_once(task: Task, provider: Provider, keep: bool) -> int:
    from . import state
    from .jobs import Jobs

    started = time.monotonic()
    plan = provider.plan(task)
    if keep:
        plan = plan.replace(keep_cluster=True)
    secrets = collect_secrets(task)
    fresh = (state.load(task.name) or {"ended": True}).get("ended") is not None
    say(f"launching {task.name} on {provider.name}: {task.nodes} nodes; its files go to {state.run_dir(task.name)}")
    cluster = None
    job_started = interrupted = False
    try:
        cluster = provider.apply(plan, secrets)
        if cluster.finished is not None:  # the provider ran the job to its end itself (a managed job)
            return cluster.finished
        tail = LogTail(cluster.logs_dir)
        if plan.job.mode == "every_node":
            job_started = True
            return follow_every_node(cluster, plan, tail, started)
        have = wait_cluster(cluster, plan, tail)
        say(f"cluster up: {have} ({time.monotonic() - started:.0f}s)")
        node_ids = {n["node_id"] for n in alive_nodes(cluster.dashboard, cluster.token)}
        jobs = Jobs(cluster.dashboard, cluster.token)
        if plan.preflight.enabled:
            wait_preflight(cluster, plan, tail)
        if plan.job.submit == "client":
            sid = submission_id(plan.name, cluster.cluster_id)
            head = head_address(cluster.dashboard, cluster.token)
            if jobs.submit(plan, sid, head, {**os.environ, **secrets}):
                say(f"submitted job {sid}")
            else:
                say(f"job {sid} is already on this cluster")
        else:
            say("waiting for the head's job")
            sid = wait_for("the head to submit the job", _watching(cluster, tail, lambda: head_submission(
                cluster.dashboard, cluster.token, plan.name)), 600, report=say)
        job_started = True
        state.update(plan.name, job={"submission_id": sid, "status": "RUNNING"})
        tail.pump()
        say(f"following job {sid} (Ctrl-C stops following, not the job)")
        status, sid = follow_attempts(jobs, cluster, plan, sid, tail)
        state.update(plan.name, job={"submission_id": sid, "status": status})
        summarise(plan, sid, status, started, cluster.logs_dir, node_ids,
                  head_result(cluster, sid) if plan.job.submit == "head" else None)
        if keep:
            say(f"the cluster keeps running: `eval \"$(rlhf-tasks env {plan.name})\"` sets up this shell for Ray's own "
                f"CLI, `rlhf-tasks list --cluster {plan.name}` lists its jobs, `rlhf-tasks down {plan.name}` stops it")
        if status != "SUCCEEDED":
            raise StepFailed(f"running job {sid}", f"it ended {status} (its log is above)")
        return 0
    except KeyboardInterrupt:  # wherever it lands: while waiting for the cluster, the submission or the job
        interrupted = True
        print(file=sys.stderr)
        sid = ((state.load(task.name) or {}).get("job") or {}).get("submission_id")
        if not sid and cluster is not None and cluster.dashboard:  # the head may have submitted it already
            found, value = head_submission(cluster.dashboard, cluster.token, task.name)
            sid = value if found else None
        if sid:
            say(f"stopped following; job {sid} keeps running. Stop it with: rlhf-tasks stop {sid} --cluster {task.name}")
        say(f"the cluster keeps running; stop it with: rlhf-tasks down {task.name}")
        return 130
    except BaseException:
        if not job_started and not provider.stop_after_job:
            say(f"cleaning up what this launch created for {task.name}")
            provider.abandon(task.name, fresh)
        raise
    finally:
        if provider.stop_after_job and cluster is not None and not keep and not interrupted:
            say(f"stopping the {provider.name} cluster {task.name}")
            say(provider.down(task.name))
