"""The head's watch over what the run may cost and how long a kept cluster may idle, held by
the cluster itself so that it holds when the launcher is gone (a closed laptop):

- `placement.max_cost` (from the plan's price per hour, counted from the head agent's start)
  and `placement.max_duration`: at 80% it says so once; at the cap every running job's driver
  on the head gets SIGTERM, `placement.stop_grace` to checkpoint, then Ray stops what still
  runs and the head agent ends the cluster (its workers leave, each machine ends as its
  provider lets it: agent/ending.py);
- `placement.idle`: a cluster kept after its run (`launch --keep`, `submit: client`) ends
  after that long without a running job (a client's cluster sooner once its first job ended,
  unless kept).

Standard library only. The pure parts (what a cap allows, the words) are functions; the
thread only reads the clock and the Jobs API and signals the agent's main thread.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Callable, List, Optional

from .protocol import TERMINAL_JOB_STATES, AgentError, log

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


def hm(seconds: float) -> str:
    """`1 h 05 m`, `0 h 02 m`: how the summary says a duration."""
    minutes = int(round(seconds / 60.0))
    return "%d h %02d m" % (minutes // 60, minutes % 60)


def spent(price_per_hour: Optional[float], seconds: float) -> Optional[float]:
    """US dollars after `seconds` at the price; None without a price."""
    return None if price_per_hour is None else price_per_hour * seconds / 3600.0


def cap_seconds(budget: dict) -> Optional[float]:
    """When the first cap is reached, in seconds from the head's start: max_duration, or the
    time max_cost buys at the price (a free cluster never reaches a cost cap); None: no cap."""
    caps = []
    if budget.get("max_duration_s"):
        caps.append(float(budget["max_duration_s"]))
    price, cost = budget.get("price_per_hour"), budget.get("max_cost")
    if cost is not None and price:
        caps.append(float(cost) / float(price) * 3600.0)
    return min(caps) if caps else None


def cap_words(budget: dict, seconds: float) -> str:
    """`stopped at the budget cap: $12.00 after 1 h 30 m` (or at max_duration), for the logs,
    the summary and `status`."""
    cost = spent(budget.get("price_per_hour"), seconds)
    money = "$%.2f" % cost if cost is not None else "cost unknown"
    if budget.get("max_cost") is not None and budget.get("price_per_hour") and \
            (not budget.get("max_duration_s") or cap_seconds(budget) < float(budget["max_duration_s"])):
        return "stopped at the budget cap: %s after %s (placement.max_cost $%.2f)" % (money, hm(seconds),
                                                                                   float(budget["max_cost"]))
    return "stopped at the budget cap: %s after %s (placement.max_duration %s)" % (
        money, hm(seconds), hm(float(budget["max_duration_s"])))


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


def newest_checkpoint(directory: Optional[str], limit: int = 20000) -> Optional[str]:
    """The newest entry under the checkpoint directory (bounded walk), where a stopped run's last
    checkpoint is; None when there is none."""
    if not directory or not os.path.isdir(directory):
        return None
    newest, when, seen = None, -1.0, 0
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            seen += 1
            try:
                mtime = os.path.getmtime(path)
            except OSError:
                continue
            if mtime > when:
                newest, when = path, mtime
            if seen >= limit:
                return newest
    return newest


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
        self.jobs, self.kept, self.client, self.clock = jobs, kept, client, clock
        self.started = clock()
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

    # ---------------------------------------------------------------- the thread

    def run(self) -> None:
        line = describe(self.budget, self.nodes)
        if line:
            log(line)
        cap = cap_seconds(self.budget)
        idle_since = self.clock()
        ran = False
        while not self._closed.wait(TICK_S if cap is None else max(0.01, min(TICK_S, cap - (
                self.clock() - self.started)))):  # the cap's moment itself, not the next tick after it
            seconds = self.clock() - self.started
            if cap is not None and not self.warned and seconds >= WARN_AT * cap:
                self.warned = True
                cost = spent(self.budget.get("price_per_hour"), seconds)
                log("budget: 80%% of the cap reached (%s after %s): the job is stopped in about %s"
                    % ("$%.2f" % cost if cost is not None else "cost unknown", hm(seconds),
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
        words = cap_words(self.budget, seconds)
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
        checkpoint = newest_checkpoint(self.checkpoints)
        log("the last checkpoint: %s" % (checkpoint or "none in %s" % self.checkpoints if self.checkpoints
                                          else "no checkpoint directory"))
        self._end(Ending("the budget cap", words, code=1),
                  {"capped": True, "words": words, "seconds": round(seconds, 1),
                   "cost": spent(self.budget.get("price_per_hour"), seconds), "checkpoint": checkpoint},
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
