"""The job runner on the head: submitting the job (the REST API, or `ray job submit
--working-dir --runtime-env-json` through Ray's CLI when it has a working_dir or a runtime_env), the gate a job submitted early
waits behind, the attempt loop (follow one attempt; on a failure, a stall or a lost node,
stop it, wait for every node and resubmit), and the restart policy as a pure function.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections import namedtuple
from typing import Callable, List, Optional, Tuple

from .protocol import (GROUP_ADDR, JOB_STARTS, PREFLIGHT_GRACE_S, PREFLIGHT_COMMAND, PREFLIGHT_PREFIX,
                       TERMINAL_JOB_STATES, AgentError, DashboardJobs, JobFollower, agents_own, alive_nodes,
                       cluster_check, fill_group_addrs, group_addrs, group_counts, job_argv, job_runtime_env, log,
                       submission_id, wait_for)
from .raynode import Node, agent_entry

#: A failure this soon after submission, twice the same way, with no new checkpoint, is a bug.
FAST_FAILURE_S = 120.0


#: Ray 2.60's health-check defaults (ray_config_def.h): period, timeout (ms), misses.
RAY_HEALTH_CHECK_DEFAULTS = {"RAY_health_check_period_ms": 3000, "RAY_health_check_timeout_ms": 10000,
                             "RAY_health_check_failure_threshold": 5}


def silence_bound(env: dict, stall_s: Optional[float] = None) -> Tuple[float, str]:
    """How long Ray's GCS takes at most to declare a silent node dead, with the head's
    environment `env` (see raynode.health_check_env), and that said in a line for the log."""
    values = {}
    for key, default in RAY_HEALTH_CHECK_DEFAULTS.items():
        try:
            values[key] = float(env.get(key) or default)
        except ValueError:
            values[key] = float(default)
    period, timeout = values["RAY_health_check_period_ms"] / 1000.0, values["RAY_health_check_timeout_ms"] / 1000.0
    misses = values["RAY_health_check_failure_threshold"]
    bound = misses * (period + timeout)
    text = ("a node that goes silent is declared dead within %.0fs (Ray's health checks on the head: every %.1fs, "
            "timeout %.1fs, %g misses; wait.node_silence sets them), then the job restarts on the nodes there are"
            % (bound, period, timeout, misses))
    if stall_s:
        text += "; a job whose log stops growing for %.0fs restarts too (job.stall_timeout)" % stall_s
    return bound, text


class Restart(Exception):
    """The running job must be stopped and submitted again: why, and whether it looks like a
    bug in the job (the same `fingerprint` twice) rather than a fault of the cluster."""

    def __init__(self, reason: str, bug: bool = False, fingerprint: Optional[str] = None):
        Exception.__init__(self, reason)
        self.reason, self.bug, self.fingerprint = reason, bug, fingerprint


def checkpoint_mark(directory: Optional[str], limit: int = 20000) -> Optional[float]:
    """The newest modification time under the checkpoint directory: changes when a new
    checkpoint is written (bounded walk: a huge tree is not scanned to its end). The spend
    record the head rewrites there every few seconds and the models' cache (agents_own) are no
    checkpoint: neither they nor the directory itself, whose time their writes move, count."""
    if not directory or not os.path.isdir(directory):
        return None
    newest, seen = 0.0, 0
    for root, dirs, files in os.walk(directory):
        if root == directory:
            dirs[:] = [d for d in dirs if not agents_own(d)]
            files = [f for f in files if not agents_own(f)]
        for name in dirs + files:
            seen += 1
            try:
                newest = max(newest, os.path.getmtime(os.path.join(root, name)))
            except OSError:
                pass
            if seen >= limit:
                return newest
    return newest


#: What the restart policy decided: restart or give up (`restart`), why (`reason`: the
#: restart's reason, or the message the job fails with), and the fingerprint this attempt
#: leaves for the next one to compare with (None unless it failed fast).
Verdict = namedtuple("Verdict", "restart reason fingerprint")


def restart_policy(previous: List[dict], cause: Optional[Restart], seconds: float, mark_before: Optional[float],
                   mark_after: Optional[float], max_restarts: int, sid: str) -> Verdict:
    """Whether to restart the job after attempt `len(previous)` (0-based) ended: `previous`
    are the attempts before it (each with the `fingerprint` its verdict left), `cause` why
    this one must be restarted (None: it must not, e.g. it SUCCEEDED), `seconds` how long it
    ran, `mark_before`/`mark_after` the checkpoint mark around it (see checkpoint_mark).

    No restart when there is no cause or no restart left; none either when it failed the
    same way as the attempt before, fast, with no new checkpoint between: a bug in the job,
    not a fault of the cluster. Anything else (a slow failure, a new checkpoint, a lost
    node, a stall) is restarted."""
    if cause is None:
        return Verdict(False, None, None)
    last = "%s (job %s)" % (cause.reason, sid)
    if len(previous) >= max_restarts:
        return Verdict(False, "%s; no restarts left (job.max_restarts is %d)" % (cause.reason, max_restarts), None)
    if cause.bug and previous and previous[-1].get("fingerprint") == cause.fingerprint \
            and seconds < FAST_FAILURE_S and mark_after == mark_before:
        return Verdict(False, "it failed the same way twice in a row within %.0fs, with no new checkpoint between: "
                       "a bug, not a fault, so it is not restarted (last: %s)" % (FAST_FAILURE_S, last), None)
    return Verdict(True, last, cause.fingerprint if seconds < FAST_FAILURE_S else None)


class Gate(object):
    """A file on the head that a job submitted early waits behind (`python3 ENTRY gate FILE ...`,
    its entrypoint's wrapper): the job's supervisor and driver start while the nodes are
    still joining, and its command runs the moment the head writes "go" (every node ALIVE,
    preflight passed), or never, when the head writes "stop: why". With `preflight`, the
    gate runs preflight's checks itself first (the job's log starts with them, up to their
    result line, which the head reads): one Ray job and its supervisor fewer while the
    nodes join."""

    def __init__(self, path: str, preflight: Optional[List[str]] = None, sid: Optional[str] = None):
        self.path, self.preflight, self.sid = path, preflight, sid  # sid: the gated job's submission id
        self.opened = False
        self.result = path + ".preflight"  # preflight's result, written by the gate beside its file
        for stale in (path, self.result):
            if os.path.exists(stale):
                os.remove(stale)

    def wrap(self, argv: List[str], timeout_s: float) -> List[str]:
        """The job's command behind this gate: this agent's entry file by its path (the job runs in
        its working_dir, which Ray also puts first on PYTHONPATH: `-m` could find another agent there)."""
        checks = ["--preflight"] + self.preflight[self.preflight.index(PREFLIGHT_COMMAND) + 1:] if self.preflight else []
        return ["python3", agent_entry(), "gate", self.path, "%.0f" % timeout_s] + checks + ["--"] + argv

    def open(self, addrs: Optional[dict] = None) -> None:
        """The command may start; `addrs`: the groups' addresses it fills `{group_addr:NAME}` with."""
        self._write("go\n" + (json.dumps(addrs) + "\n" if addrs else ""))
        self.opened = True

    def close(self, why: str) -> None:
        self._write("stop: %s\n" % why)

    def _write(self, word: str) -> None:
        with open(self.path + ".tmp", "w") as handle:
            handle.write(word)
        os.replace(self.path + ".tmp", self.path)


GATE_USAGE = "usage: python3 LIB/rlhf_tasks/agent/__main__.py gate FILE TIMEOUT_S [--preflight PREFLIGHT_ARGS...] -- CMD..."


def gate_main(argv: List[str]) -> int:
    """`python3 ENTRY gate FILE TIMEOUT_S [--preflight ARGS...] -- CMD...`: run preflight
    (its module's main, here: this process is the job's first Ray driver) when asked, then
    wait for the head's word in FILE, then become CMD (exec: the job's process is the
    command's), or exit 1 saying why not."""
    ours = argv[:argv.index("--")] if "--" in argv else []
    command = argv[len(ours) + 1:]
    if len(ours) < 2 or not command or ours[2:3] not in ([], ["--preflight"]):
        print(GATE_USAGE, file=sys.stderr)
        return 2
    path, timeout_s = ours[0], float(ours[1])
    deadline = time.monotonic() + timeout_s
    print("rlhf-tasks: the job's gate is waiting for %sthe head's word (up to %.0fs)"
          % ("preflight, then " if ours[2:] else "", timeout_s), flush=True)
    if ours[2:] and not gated_preflight(ours[3:], path + ".preflight"):
        return 1
    checked = time.monotonic()
    while True:
        try:
            with open(path) as handle:
                word = handle.read()
        except FileNotFoundError:
            word = ""
        if word.startswith("go"):
            addrs = json.loads(word.split("\n", 1)[1].strip() or "{}")
            if addrs and any(GROUP_ADDR.search(arg) for arg in command):
                print("rlhf-tasks: the groups' addresses in the job's command: %s"
                      % ", ".join("%s=%s" % item for item in sorted(addrs.items())), flush=True)
            try:
                command = fill_group_addrs(command, addrs)
            except AgentError as exc:
                print("rlhf-tasks: the job's command was not started: %s" % exc, flush=True)
                return 1
            if ours[2:]:
                print("rlhf-tasks: the head's word came %.2fs after preflight's result" % (time.monotonic() - checked),
                      flush=True)
            try:
                os.execvp(command[0], command)
            except OSError as exc:
                print("rlhf-tasks: cannot run %s: %s" % (command[0], exc), file=sys.stderr, flush=True)
                return 127
        if word.startswith("stop"):
            print("rlhf-tasks: the job's command was not started: %s" % word[5:].strip(), flush=True)
            return 1
        if time.monotonic() > deadline:
            print("rlhf-tasks: the job's command was not started: the head gave no word within %.0fs" % timeout_s,
                  flush=True)
            return 1
        time.sleep(0.02)  # a local file: the command starts the moment the head says go


def gated_preflight(args: List[str], result_file: Optional[str] = None) -> bool:
    """Preflight's checks in this process, its result line in the job's log (and in `result_file`,
    where the head agent reads it at once); whether they passed."""
    from . import preflight

    code = preflight.main(args, result_file)
    preflight.disconnect()  # before the command's driver connects
    if code != 0:
        print("rlhf-tasks: preflight failed (its result above says why): the job's command was not started",
              flush=True)
    return code == 0


class JobRunner(object):
    """Submits and follows the job on the head, restarting it by restart_policy. `finish()`
    runs when the job is over, before the runner returns or fails (the head's result line
    and, with keep_cluster, supervising the cluster)."""

    def __init__(self, node: Node, jobs: DashboardJobs, finish: Callable[[], None], watch=None):
        self.node, self.plan, self.info, self.jobs, self.finish = node, node.plan, node.info, jobs, finish
        self.watch = watch  # budget.Watch: at a cap the job is not restarted
        self.job = {}  # type: dict  (submission_id, status, attempts; for the result line)
        self.follower = None  # type: Optional[JobFollower]
        self.expected = {}  # type: dict  (node id -> address: the nodes the running attempt started with)
        self.node_ids = []  # type: List[str]

    def submit_gated(self, preflight: Optional[List[str]] = None) -> Optional[Gate]:
        """Submit the job's first attempt now, behind a gate (see Gate) that runs `preflight`
        (its command line) first; None when this cluster already has it (an agent that
        restarted follows it instead)."""
        sid = submission_id(self.plan["name"], self.node.cluster_key(), 0)
        if self.jobs.status(sid) is not None:
            return None
        gate = Gate(os.path.join(self.node.state_dir, "%s.gate" % sid), preflight, sid)
        plan = self.plan  # the longest the head may take to say: its services, the nodes, preflight
        limit = sum(s["timeout"] for s in plan["services"]) + \
            plan["wait"]["nodes_s"] + (plan["preflight"]["timeout_s"] + PREFLIGHT_GRACE_S
                                       if plan["preflight"]["enabled"] else 0) + 60
        self.submit(sid, gate.wrap, limit)
        return gate

    def open(self, gate: Gate) -> None:
        """The job's command starts now (once: the head opens the gate as soon as preflight passed)."""
        if not gate.opened:
            log(JOB_STARTS % gate.sid + " (it was submitted while the nodes joined)")
            gate.open(self.group_addrs())

    def submit_and_follow(self, gate: Optional[Gate]) -> int:
        """Open the gate of the job's first attempt (or submit it) and follow it; when it
        fails, stalls or loses a node, stop it, wait until every node is back, and resubmit
        it (it resumes from the latest checkpoint), as restart_policy says."""
        node, job = self.node, self.plan["job"]
        key = self.node.cluster_key()
        alive = alive_nodes(node.dashboard, node.token)
        self.expected = dict((n["node_id"], n["node_ip"]) for n in alive)
        self.node_ids = sorted(self.expected)  # the launcher's summary: which metrics are this run's
        log(silence_bound(node.env, job.get("stall_timeout_s"))[1])
        max_restarts = job.get("max_restarts", 0)
        attempts = []  # type: List[dict]
        self.job = {"submission_id": None, "status": None, "attempts": attempts}
        attempt = 0
        while True:
            sid = submission_id(self.plan["name"], key, attempt)
            self.job["submission_id"] = sid
            mark = checkpoint_mark(self.plan.get("checkpoint_dir"))
            status, cause, seconds = self.run_attempt(sid, attempt, can_restart=attempt < max_restarts,
                                                      gate=gate if attempt == 0 else None)
            self.job["status"] = status
            attempts.append({"submission_id": sid, "status": status, "cause": cause and cause.reason,
                             "seconds": round(seconds, 1)})
            if self.watch is not None and self.watch.at_cap.is_set():
                self.at_cap(sid)
            if cause is None:
                break
            verdict = restart_policy(attempts[:-1], cause, seconds, mark, checkpoint_mark(self.plan.get("checkpoint_dir")),
                                     max_restarts, sid)
            if not verdict.restart:
                self.stop_job(sid)
                self.finish()
                raise AgentError("running job %s" % sid, verdict.reason)
            attempts[-1]["fingerprint"] = verdict.fingerprint
            attempt += 1
            log("restarting the job, attempt %d of %d: %s" % (attempt, max_restarts, verdict.reason))
            with node.step("restart %d" % attempt):
                self.stop_job(sid)
                self.wait_for_every_node()
        self.finish()
        if status != "SUCCEEDED":
            raise AgentError("running job %s" % sid, "it ended %s" % status)
        return 0

    def at_cap(self, sid: str) -> None:
        """The job ended at a cap (its driver got SIGTERM): no restart. Once the watch's grace is
        over and it has said where the last checkpoint is, the run ends with its words."""
        watch = self.watch
        watch.handled = True  # this thread ends the run, not the watch's signal
        watch.join()
        self.job["status"] = self.jobs.status(sid) or self.job.get("status")
        self.job["attempts"][-1]["status"] = self.job["status"]
        self.finish()
        raise watch.ending

    def run_attempt(self, sid: str, attempt: int, can_restart: bool = True,
                    gate: Optional[Gate] = None) -> Tuple[Optional[str], Optional[Restart], float]:
        """Start (submit once, or open its gate) and follow one attempt: its final status
        (None when it was interrupted), why it must be restarted (None when it must not), and
        how long it ran. With no restart left, a failure is reported at once."""
        node, job, jobs = self.node, self.plan["job"], self.jobs
        with node.step("submit" if attempt == 0 else "resubmit %d" % attempt):
            if gate is not None:
                self.open(gate)
            elif jobs.status(sid) is not None:
                log((JOB_STARTS % sid if attempt == 0 else "job %s" % sid)
                    + " (it was already submitted to this cluster; following it)")
            else:
                self.submit(sid)
        log("following job %s" % sid)
        self.follower = follower = JobFollower(jobs, sid, after=PREFLIGHT_PREFIX if gate and gate.preflight else None)
        started = checked = time.monotonic()

        def watch(status):
            nonlocal checked
            if not node.ray.alive():
                raise AgentError("running job %s" % sid, "the Ray head exited while the job was %s" % status)
            now = time.monotonic()
            stall = job.get("stall_timeout_s")
            if stall and now - follower.last_growth > stall:
                raise Restart("its log has not grown for %.0fs (job.stall_timeout)" % stall)
            if now - checked >= 2.0:
                checked = now
                missing = self.missing_nodes()
                if missing:
                    raise Restart("node %s left the cluster" % ", ".join(missing))

        try:
            with node.step("job" if attempt == 0 else "job attempt %d" % attempt):
                status = follower.run(job.get("timeout_s"), watch)
        except Restart as restart:
            return None, restart, time.monotonic() - started
        seconds = time.monotonic() - started
        log("job %s %s after %.1fs" % (sid, status, seconds))
        if self.watch is not None and self.watch.at_cap.is_set():
            return status, None, seconds  # stopped at a cap: nothing to restart
        if status != "FAILED":  # SUCCEEDED, or STOPPED by someone: nothing to restart
            return status, None, seconds
        missing = self.lost_after_failure() if can_restart else self.missing_nodes(True)
        if missing:
            return status, Restart("node %s left the cluster and the job FAILED" % ", ".join(missing)), seconds
        last_line = ([line for line in follower.log_text.splitlines() if line.strip()] or [""])[-1]
        return status, Restart("the job FAILED", bug=True, fingerprint=last_line[-300:]), seconds

    def missing_nodes(self, replaced: bool = False) -> List[str]:
        """Addresses of the nodes the attempt started with that are not ALIVE now, by Ray's
        node id (a replacement is another node, whatever its address); with `replaced`, also
        addresses ALIVE twice: a new machine joined before Ray noticed the old one's death."""
        try:
            nodes = alive_nodes(self.node.dashboard, self.node.token)
        except OSError:
            return []
        ids, alive = set(n["node_id"] for n in nodes), [n["node_ip"] for n in nodes]
        missing = sorted(ip for node_id, ip in self.expected.items() if node_id not in ids)
        twice = sorted({ip for ip in alive if alive.count(ip) > 1}) if replaced else []
        return missing + [ip for ip in twice if ip not in missing]

    def lost_after_failure(self) -> List[str]:
        """After a failure, the nodes that were lost, if any: Ray marks a dead node only after
        its health checks fail, so poll for that a little (`wait.node_loss`) before blaming
        the job itself."""
        grace_s = self.plan["wait"].get("node_loss_s", 40.0)
        try:
            return wait_for("Ray to notice a lost node", lambda: (lambda m: (bool(m), m))(self.missing_nodes(True)),
                            grace_s, interval=0.5, max_interval=1.0, progress_every=grace_s + 1)
        except AgentError:
            return []

    def stop_job(self, sid: str) -> None:
        jobs = self.jobs
        if jobs.status(sid) in TERMINAL_JOB_STATES:
            return
        log("stopping job %s" % sid)
        jobs.stop(sid)
        wait_for("job %s to stop" % sid, lambda: (lambda s: (s in TERMINAL_JOB_STATES, s))(jobs.status(sid)), 120)

    def wait_for_every_node(self) -> None:
        """As many nodes ALIVE as the task asks for, with their CPUs and GPUs, and no more (a
        lost node's stale entry gone). Counted, not matched by address: a replacement machine
        (a new pod, a new VM) usually comes back with another address."""
        plan, before = self.plan, self.expected
        nodes, ray = plan["nodes"], plan["ray"]
        check = cluster_check(self.node.dashboard, self.node.token, nodes, (ray.get("num_cpus") or 0) * nodes,
                              (ray.get("num_gpus") or 0) * nodes, exact=True)
        groups = plan.get("groups")

        def progress():
            done, have = check()
            if groups:  # and each group whole again, named where it is short: from the nodes check() read
                grouped, words = group_counts(check.alive, groups)
                done, have = done and grouped, "%s (%s)" % (have, words)
            if done:
                return True, have
            try:
                ids = set(n["node_id"] for n in alive_nodes(self.node.dashboard, self.node.token))
            except OSError:
                return False, have
            gone = sorted(ip for node_id, ip in before.items() if node_id not in ids)
            return False, "%s%s" % (have, "; gone: %s (any machine may take their place)" % ", ".join(gone)
                                    if gone else "")
        have = wait_for("%d nodes to be ALIVE again" % nodes, self.node.ray_alive(progress), plan["wait"]["nodes_s"],
                        interval=0.5, max_interval=2.0)

        def listed():
            try:
                return True, alive_nodes(self.node.dashboard, self.node.token)
            except OSError as exc:
                return False, str(exc)
        alive = wait_for("Ray's list of nodes", listed, 60, interval=0.5)
        self.expected = dict((n["node_id"], n["node_ip"]) for n in alive)
        new = sorted(ip for node_id, ip in self.expected.items() if node_id not in before)
        self.node_ids = sorted(set(self.node_ids) | set(self.expected))
        log("cluster ready again: %s%s" % (have, "; new: %s" % ", ".join(new) if new else ""))

    def group_addrs(self) -> Optional[dict]:
        """The groups' addresses for `{group_addr:NAME}` (protocol.group_addrs), read now, when every group is in;
        None for a task without groups."""
        groups = self.plan.get("groups")
        return group_addrs(alive_nodes(self.node.dashboard, self.node.token), groups) if groups else None

    def submit(self, sid: str, wrap: Optional[Callable[[List[str], float], List[str]]] = None,
               wait_s: float = 0.0) -> None:
        """Submit the job's entrypoint, or (`wrap`) the entrypoint behind a gate it may wait
        at for up to `wait_s` seconds."""
        job = self.plan["job"]
        # behind a gate, submitted while the nodes join, the gate fills the groups' addresses when it opens
        argv, wandb = job_argv(job, self.info.head, self.info.node_addr, self.node.env,
                               None if wrap else self.group_addrs())
        if wandb:
            log(wandb)
        entrypoint = " ".join(shlex.quote(a) for a in argv)
        gated = " (its command waits until every node is ALIVE%s)" % (
            " and preflight passed" if self.plan["preflight"]["enabled"] else "") if wrap else ""
        argv = wrap(argv, wait_s) if wrap else argv
        cmd = submit_command(job, self.node.dashboard, sid, argv)
        if cmd is None:
            log("submitting job %s%s: %s" % (sid, gated, entrypoint))
            return self.jobs.submit(sid, argv)
        runtime_env = sorted(job.get("runtime_env") or {})
        log("submitting job %s%s%s%s: %s" % (
            sid, " with working_dir %s" % job["working_dir"] if job.get("working_dir") else "",
            " with runtime_env %s" % ", ".join(runtime_env) if runtime_env else "", gated, entrypoint))

        def send():
            out = subprocess.run(cmd, env=self.node.env, capture_output=True, text=True)
            if out.returncode == 0:
                return None
            why = out.stderr.strip()[-2000:] or out.stdout.strip()[-2000:]
            if "No available agent" in why:  # Ray's own words: the head's job agent is not up yet, try again
                return True, why.splitlines()[-1]
            return False, why
        self.jobs.submit_with(sid, send)


def submit_command(job: dict, dashboard: str, sid: str, argv: List[str]) -> Optional[List[str]]:
    """The `ray job submit` the head runs for a job with a working_dir or a runtime_env (packing,
    uploading and parsing them is Ray's own code: its CLI reads --runtime-env-json as
    ray/dashboard/modules/dashboard_sdk.py: parse_runtime_env_args, --working-dir over it); None for a
    job with neither, submitted through the REST API."""
    runtime_env = job_runtime_env(job)
    if not job.get("working_dir") and not runtime_env:
        return None
    return (["ray", "job", "submit", "--address", dashboard, "--submission-id", sid, "--no-wait"]
            + (["--working-dir", job["working_dir"]] if job.get("working_dir") else [])
            + (["--runtime-env-json", json.dumps(runtime_env)] if runtime_env else []) + ["--"] + argv)
