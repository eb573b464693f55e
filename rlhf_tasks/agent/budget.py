"""The head's watch over what the run may cost and how long a kept cluster may idle, held by
the cluster itself so that it holds when the launcher is gone (a closed laptop):

- `placement.max_cost` (from the plan's price per hour) and `placement.max_duration`, for the
  training, not for one attempt: each head agent counts from its start and adds what the
  training's attempts before it spent (the spend record, below); at 80% it says so once; at the
  cap every running job's driver on the head gets SIGTERM, `placement.stop_grace` to checkpoint,
  then Ray stops what still runs and the head agent ends the cluster (its workers leave, each
  machine ends as its provider lets it: agent/ending.py), with an exit status the provider does
  not relaunch (the plan's budget.cap_exit);
- `placement.idle`: a cluster kept after its run (`launch --keep`, `submit: client`) ends
  after that long without a running job (a client's cluster sooner once its first job ended,
  unless kept).

The spend record: `.rlhf-tasks-spend.json` in the checkpoint directory, where a relaunched
attempt's head finds it (the provider's retry, a managed job's recovery: with shared or
persistent checkpoint storage), written by the head every SPEND_EVERY_S and at its end:
`{"version": 1, "training": ID, "attempts": {ATTEMPT: {"seconds", "cost", "price_per_hour",
"started", "ended"}}}`. The launcher's own record of the training (runs/NAME/spend.json, the
same shape) reaches the head as the plan's budget.spent; the two are merged by attempt.

Standard library only. The pure parts (what a cap allows, the words) are functions; the
thread only reads the clock and the Jobs API and signals the agent's main thread.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import threading
import time
import uuid
from typing import Callable, List, Optional

from .protocol import TERMINAL_JOB_STATES, AgentError, agents_own, log
from .protocol.spend import (SPEND_EVERY_S, SPEND_FILE, SPEND_VERSION, cap_seconds, cap_words, hm, merge,  # noqa: F401
                            read_spend, spent, totals, write_spend)

#: The warning's share of a cap.
WARN_AT = 0.8
#: A `submit: client` cluster not kept (no --keep) ends this long after its last job ended.
CLIENT_RUN_OVER_S = 60.0
#: How often the watch looks (the clock; the Jobs API for idleness and the grace).
TICK_S = 1.0
#: How long the head's job runner has to notice that a job stopped at a cap has ended.
RUNNER_NOTICES_S = 15.0
#: The signal the watch uses to end the agent's main thread (handled in __main__).
SIGNAL = signal.SIGUSR1

# ---------------------------------------------------------------- the training's spend record

class Spend(object):
    """This attempt's spend and the training's attempts before it (the plan's `spent`, from the launcher, and
    the spend record in the checkpoint directory): what the caps count against."""

    def __init__(self, budget: dict, checkpoint_dir: Optional[str], attempt: Optional[str] = None):
        self.training = budget.get("training")
        self.price = budget.get("price_per_hour")
        self.path = os.path.join(checkpoint_dir, SPEND_FILE) if checkpoint_dir and self.training else None
        self.attempt = attempt or "%s-%s" % (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), uuid.uuid4().hex[:8])
        self.started = time.time()
        before = merge(budget.get("spent") or {}, read_spend(self.path, self.training))
        before.pop(self.attempt, None)
        self.before = before
        self.seconds_before, self.cost_before, self.failed_before = totals(before)
        self.said_error = False

    def entry(self, seconds: float, ended: Optional[str] = None) -> dict:
        out = {"seconds": round(seconds, 1), "cost": spent(self.price, seconds), "price_per_hour": self.price,
               "started": round(self.started, 1)}
        if ended:
            out["ended"] = ended
        return out

    def record(self, seconds: float, ended: Optional[str] = None) -> dict:
        """The whole record: every attempt of the training, this one's spend so far among them."""
        attempts = dict(self.before)
        attempts[self.attempt] = self.entry(seconds, ended)
        return {"version": SPEND_VERSION, "training": self.training, "attempts": attempts}

    def write(self, seconds: float, ended: Optional[str] = None) -> dict:
        """Write the record where the next attempt reads it (once an error is said, quietly after)."""
        record = self.record(seconds, ended)
        if self.path:
            try:
                write_spend(self.path, record)
            except OSError as exc:
                if not self.said_error:
                    self.said_error = True
                    log("budget: cannot write the spend record %s (%s): a relaunched attempt will not know what "
                        "this one spent" % (self.path, exc))
        return record


def machine_price(budget: dict, nodes: int, env: Optional[dict] = None,
                  deadline_s: float = 10.0) -> "tuple[Optional[float], str]":
    """The cluster's price per hour as the provider bills this machine, read once it runs where the plan says
    (budget.machine_price: a rented machine's own record), times the nodes (every node is the same machine); or
    the plan's price_per_hour where the provider does not say it (a 429 or 5xx asked again for deadline_s; no
    answer, asked once). With the line for the head's log that says which."""
    from .ending import fill
    from .protocol import http_request

    rule, planned = budget["machine_price"], budget.get("price_per_hour")
    env = dict(os.environ) if env is None else env
    fallback = ("counting the plan's $%.2f/h" % planned) if planned is not None else "no price is counted"
    url = fill(rule["url"], env, rule.get("defaults") or {})
    token = env.get(rule["bearer_env"]) if rule.get("bearer_env") else None
    if url is None or (rule.get("bearer_env") and not token):
        needs = re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", rule["url"]) + [rule.get("bearer_env") or ""]
        unset = sorted(set(n for n in needs if n and not (env.get(n) or (rule.get("defaults") or {}).get(n))))
        return planned, "budget: cannot read %s (not set here: %s): %s" % (rule["what"], ", ".join(unset), fallback)
    headers = {"Authorization": "Bearer %s" % token} if token else {}
    deadline, why = time.monotonic() + deadline_s, ""
    while True:
        try:
            status, body = http_request(url, "GET", None, headers, timeout=10.0)
            if status < 400:
                answer = json.loads(body)
                value = answer.get(rule["field"]) if isinstance(answer, dict) else None
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    price = round(value * nodes, 4)
                    return price, "budget: counting %s, $%.4f/h, for each of the %d nodes: $%.2f/h%s" % (
                        rule["what"], value, nodes, price,
                        "" if planned is None else " (the plan's price, from the catalog: $%.2f/h)" % planned)
                return planned, "budget: %s is not given (%r): %s" % (rule["what"], value, fallback)
            why = "HTTP %d" % status
            if status < 500 and status != 429:
                break
        except (OSError, ValueError) as exc:  # no answer, or not JSON: asked once (the head waits for nothing)
            why = str(exc)
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    return planned, "budget: could not read %s (%s): %s" % (rule["what"], why, fallback)


def describe(budget: dict, nodes: int) -> Optional[str]:
    """The head's first line about the budget; None when nothing is capped or priced."""
    price, cap = budget.get("price_per_hour"), cap_seconds(budget)
    if price is None and cap is None:
        return None
    parts = ["$%.2f/h for the %d nodes" % (price, nodes) if price is not None else "no price per hour"]
    if cap is not None:
        parts.append("the job is stopped after %s (%s), with %.0fs to checkpoint after SIGTERM (placement.stop_grace)"
                     % (hm(cap), " and ".join(w for w, on in (("max_cost $%.2f" % (budget.get("max_cost") or 0),
                                                              budget.get("max_cost") is not None and bool(price)),
                                                             ("max_duration", bool(budget.get("max_duration_s"))))
                                                  if on), budget.get("stop_grace_s", 120.0)))
    return "budget: " + "; ".join(parts)


def newest_checkpoint(directory: Optional[str], patterns: Optional[List[str]] = None,
                      limit: int = 20000) -> Optional[str]:
    """The newest checkpoint under the checkpoint directory (bounded walk), where a stopped run's
    last checkpoint is; None when there is none yet. `patterns` are the recipe's checkpoint file
    names (the plan's checkpoint_files, shell patterns of paths relative to the directory, e.g.
    tiny-grpo's `step_*.pt`): only a path they match counts, never the metrics or the prepared data
    beside them. Without patterns (a recipe that knows none), the newest file; never what the agent
    keeps there (agents_own: the spend record, the models' cache)."""
    if not directory or not os.path.isdir(directory):
        return None
    newest, when, seen = None, -1.0, 0
    for root, dirs, files in os.walk(directory):
        if root == directory:
            dirs[:] = [d for d in dirs if not agents_own(d)]
            files = [f for f in files if not agents_own(f)]
        matched = []
        for name in (dirs + files) if patterns else files:
            path = os.path.join(root, name)
            seen += 1
            if patterns:
                if not any(_matches(os.path.relpath(path, directory), pattern) for pattern in patterns):
                    continue
                matched.append(name)
            try:
                mtime = os.path.getmtime(path)
            except OSError:
                continue
            if mtime > when:
                newest, when = path, mtime
            if seen >= limit:
                return newest
        dirs[:] = [d for d in dirs if d not in matched]  # a checkpoint directory is one checkpoint
    return newest


def _matches(relative: str, pattern: str) -> bool:
    """A relative path against a shell pattern, part by part (`*` never crosses a `/`)."""
    parts, wanted = relative.replace(os.sep, "/").split("/"), pattern.split("/")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))


def job_sessions(sid: str, proc: str = "/proc") -> List[int]:
    """The sessions of job `sid`'s entrypoint on this machine: Ray's job supervisor starts the
    entrypoint in a session of its own with RAY_JOB_CONFIG_JSON_ENV_VAR naming the submission
    (ray/dashboard/modules/job/job_supervisor.py), which its children inherit."""
    needle = ('"job_submission_id": %s' % json.dumps(sid)).encode()
    found = set()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "environ"), "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        for item in environ.split(b"\0"):
            if item.startswith(b"RAY_JOB_CONFIG_JSON_ENV_VAR=") and needle in item:
                try:
                    found.add(os.getsid(int(entry)))
                except OSError:
                    pass
    return sorted(s for s in found if s > 1 and s != os.getsid(0))


def own_job() -> Optional[str]:
    """The submission id of the Ray job this process runs in, if any (where an operator runs the
    head's job runner as a Ray job of its own): never one to stop at a cap; ending the runner ends it."""
    try:
        return json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", ""))["metadata"]["job_submission_id"]
    except (ValueError, KeyError, TypeError):
        return None


def term_driver(sid: str) -> List[int]:
    """SIGTERM to job `sid`'s entrypoint (its driver and what it started); the sessions signalled."""
    sessions = job_sessions(sid)
    for session in sessions:
        try:
            os.killpg(session, signal.SIGTERM)
        except OSError:
            pass
    return sessions


class Ending(AgentError):
    """The head ends the cluster on its own: at a cap (`code` 1, the run did not finish) or idle
    (`code` 0). Raised in the agent's main thread."""

    def __init__(self, step: str, message: str, code: int):
        AgentError.__init__(self, step, message, code)
        self.message = message


class Watch(threading.Thread):
    """The head's budget and idle watch (a daemon thread). `jobs()` lists the cluster's jobs
    (None when the dashboard is not up yet); `run_over` is set once the head's own run is over
    (its job ended, the cluster kept); `client` when jobs come from a client. When it ends the
    cluster it raises `Ending` in the main thread through SIGNAL (see `take`)."""

    def __init__(self, plan: dict, jobs: Callable[[], Optional[list]], kept: bool, client: bool,
                 clock: Callable[[], float] = time.monotonic):
        threading.Thread.__init__(self, name="rlhf-tasks-budget", daemon=True)
        self.budget = plan.get("budget") or {}
        self.nodes, self.checkpoints = plan["nodes"], plan.get("checkpoint_dir")
        self.checkpoint_files = plan.get("checkpoint_files") or []  # the recipe's own names for them
        self.jobs, self.kept, self.client, self.clock = jobs, kept, client, clock
        self.started = clock()
        self.spend = Spend(self.budget, self.checkpoints)
        self.final = None  # type: Optional[dict]  (the spend record as the attempt ended: settle)
        self.run_over = threading.Event()
        self.at_cap = threading.Event()  # set the moment a cap is reached: no restart from then on
        self.ending = None  # type: Optional[Ending]
        self.report = None  # type: Optional[dict]  (for the result line)
        self.handled = False
        self.warned = False
        self._closed = threading.Event()  # not `_stop`: that is Thread's own method (called after a fork)

    # ---------------------------------------------------------------- the main thread's side

    def take(self) -> Optional[Ending]:
        """In the main thread: the ending, once, when there is one (the signal handler and the
        job runner both ask; whoever asks first raises it)."""
        if self.ending is None or self.handled:
            return None
        self.handled = True
        return self.ending

    def capped(self) -> bool:
        return self.report is not None and self.report.get("capped", False)

    def close(self) -> None:
        self._closed.set()

    def seconds(self) -> float:
        return self.clock() - self.started

    def settle(self, ended: str) -> dict:
        """At the attempt's end (`done`, `failed`, `capped`, `stopped`): the spend record written a last time
        with how it ended, for the next attempt and the result line."""
        if self.final is None:
            self.final = self.spend.write(self.seconds(), ended)
        return self.final

    def retried_failure_left(self) -> bool:
        """Whether a failure of this attempt may still be relaunched by the provider (the plan's
        error_retries, counted over the training's failed attempts in the spend record)."""
        allowed = self.budget.get("error_retries")
        return allowed is None or self.spend.failed_before + 1 <= allowed

    # ---------------------------------------------------------------- the thread

    def run(self) -> None:
        line = describe(self.budget, self.nodes)
        if line:
            log(line)
        spend = self.spend
        before_s, before_cost = spend.seconds_before, spend.cost_before
        if spend.before:
            log("budget: the training %s spent %s over %s before this attempt (%d attempts, %d failed; its spend "
                "record: %s)" % (spend.training, "$%.2f" % before_cost if self.budget.get("price_per_hour") is not None
                                 else "cost unknown", hm(before_s), len(spend.before), spend.failed_before,
                                 spend.path or "the launcher's"))
        full = cap_seconds(self.budget)  # the training's whole allowance, for the 80% warning
        cap = cap_seconds(self.budget, before_s, before_cost)
        idle_since = self.clock()
        ran = False
        written = self.clock()
        spend.write(0.0)
        while not self._closed.wait(TICK_S if cap is None else max(0.01, min(TICK_S, cap - (
                self.clock() - self.started)))):  # the cap's moment itself, not the next tick after it
            seconds = self.clock() - self.started
            if self.clock() - written >= SPEND_EVERY_S:
                written = self.clock()
                spend.write(seconds)
            if cap is not None and not self.warned and seconds >= cap - (1.0 - WARN_AT) * full:
                self.warned = True
                cost = spent(self.budget.get("price_per_hour"), seconds)
                log("budget: 80%% of the cap reached (%s after %s): the job is stopped in about %s"
                    % ("$%.2f" % (cost + before_cost) if cost is not None else "cost unknown", hm(seconds + before_s),
                       hm(cap - seconds) if cap - seconds >= 120 else "%.0fs" % (cap - seconds)))
            if cap is not None and seconds >= cap:
                return self._cap(seconds)
            idle = self._idle_limit(ran)
            if idle is None and not self.client:
                idle_since = self.clock()  # the run is not over: it counts as busy
                continue
            running = self._running()
            if running is None:
                continue
            if running:
                idle_since, ran = self.clock(), ran or any(not j.startswith("preflight") for j in running)
                continue
            if self.client and not ran and self._ended_jobs():
                ran = True
            idle = self._idle_limit(ran)
            if idle is not None and self.clock() - idle_since >= idle:
                return self._end(Ending("the cluster's idle limit", "no job has run for %s (placement.idle)%s: "
                                        "the cluster ends itself" % (hm(idle) if idle >= 60 else "%.0fs" % idle, (
                                            "" if self.kept or not self.client else
                                            "; its client's job ended")), code=0), {"idle": True})

    def _idle_limit(self, ran: bool) -> Optional[float]:
        """How long the cluster may stay without a running job now; None: no limit."""
        idle = self.budget.get("idle_s", 3600.0)
        if self.client and not self.kept and ran:
            return min(idle, CLIENT_RUN_OVER_S) if idle else CLIENT_RUN_OVER_S
        if self.kept and (self.run_over.is_set() or self.client):
            return idle
        return None

    def _listed(self) -> Optional[list]:
        try:
            return self.jobs()
        except (OSError, ValueError, AgentError):
            return None

    def _running(self) -> Optional[List[str]]:
        """The submission ids of the jobs not ended yet; None when the Jobs API does not answer."""
        listed = self._listed()
        if listed is None:
            return None
        own = own_job()
        return [j.get("submission_id") or "" for j in listed
                if j.get("status") not in TERMINAL_JOB_STATES and j.get("submission_id") != own]

    def _ended_jobs(self) -> bool:
        listed = self._listed() or []
        return any(j.get("status") in TERMINAL_JOB_STATES and not (j.get("submission_id") or "").startswith(
            "preflight") for j in listed)

    def _cap(self, seconds: float) -> None:
        spend = self.spend
        cost = spent(self.budget.get("price_per_hour"), seconds)
        words = cap_words(self.budget, seconds + spend.seconds_before,
                          None if cost is None else cost + spend.cost_before, len(spend.before) + 1,
                          spend.seconds_before, spend.cost_before)
        grace = float(self.budget.get("stop_grace_s", 120.0))
        self.at_cap.set()
        log(words)
        running = self._running() or []
        stopped = list(running)
        for sid in running:
            sessions = term_driver(sid)
            log("job %s: SIGTERM to its driver (%s); it has %.0fs to checkpoint (placement.stop_grace)"
                % (sid, "session %s" % ", ".join(map(str, sessions)) if sessions else "not found on the head", grace))
        deadline = self.clock() + grace
        while running and self.clock() < deadline and not self._closed.wait(0.5):
            running = [sid for sid in (self._running() or []) if sid in running]
        for sid in running:
            log("job %s still runs after the grace: stopping it through Ray" % sid)
            try:
                self._stop_job(sid)
            except (OSError, AgentError):
                pass
        checkpoint = newest_checkpoint(self.checkpoints, self.checkpoint_files)
        log("the last checkpoint: %s" % (checkpoint or "none yet in %s" % self.checkpoints if self.checkpoints
                                          else "no checkpoint directory"))
        self.settle("capped")
        self._end(Ending("the budget cap", words, code=1),
                  {"capped": True, "words": words, "seconds": round(seconds + spend.seconds_before, 1),
                   "cost": None if cost is None else cost + spend.cost_before, "attempts": len(spend.before) + 1,
                   "checkpoint": checkpoint},
                  followed=bool(stopped))

    stop_job = None  # type: Optional[Callable[[str], object]]

    def _stop_job(self, sid: str) -> None:
        if self.stop_job is not None:
            self.stop_job(sid)

    def _end(self, ending: Ending, report: dict, followed: bool = False) -> None:
        """Hand the ending to the main thread: when the head's job runner follows a job that just
        ended (`followed`), it notices within a second or two and ends the run itself, with the
        job's last lines relayed; otherwise (or when it does not) the signal interrupts whatever
        the main thread waits for."""
        self.report, self.ending = report, ending
        deadline = self.clock() + (RUNNER_NOTICES_S if followed else 0.0)
        while not self.handled and self.clock() < deadline and not self._closed.wait(0.2):
            pass
        if not self.handled:
            os.kill(os.getpid(), SIGNAL)
