"""The Jobs client of the CLI and the launcher: submit, status, logs, stop, list and follow
a Ray job through the dashboard's REST API, with the cluster's token. It is the agent's own
REST client (no Ray needed on this machine); Ray's SDK is imported only to submit a job with a
working_dir or a runtime_env, whose packing, upload and parsing are Ray's own code (workdir.py
and runtimeenv.py measure them first)."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Callable

from . import workdir
from .agent.protocol import (PREFLIGHT_PREFIX, TERMINAL_JOB_STATES, DashboardJobs, JobFollower, auth_headers,
                             http_request, is_submission_of, job_argv, job_runtime_env, next_submission_id,
                             preflight_parts)
from .errors import BadInput, StepFailed
from .plan import Plan


def dashboard_from_env() -> str | None:
    """The dashboard named by the environment, read as Ray's job CLI reads it:
    RAY_API_SERVER_ADDRESS first, then RAY_ADDRESS when that is a URL (`rlhf-tasks env` puts the
    GCS's host:port there, for `ray status` and `ray.init()`)."""
    import os

    ray_address = os.environ.get("RAY_ADDRESS") or ""
    return os.environ.get("RAY_API_SERVER_ADDRESS") or (ray_address if "://" in ray_address else None)


def working_dir_size(path: str, excludes: list[str]) -> int:
    """Bytes Ray would pack from `path` (workdir.measure: Ray's own traversal and exclude rules)."""
    return workdir.measure(path, excludes).size


def check_working_dir(path: str, excludes: list[str]) -> int:
    """Refuse, before any upload, a working_dir Ray would reject as too large (workdir.check)."""
    return workdir.check(path, excludes).size


class Jobs:
    """One Ray cluster's Jobs API, reached at `address` (e.g. a forwarded localhost port).
    A request that gets no answer fails as a named step, not as a traceback."""

    def __init__(self, address: str, token: str | None):
        self.address, self.token = address.rstrip("/"), token
        self.api = DashboardJobs(self.address, token)

    def _ask(self, what: str, call: Callable, *args):
        try:
            return call(*args)
        except OSError as exc:
            raise StepFailed(f"{what} through the Ray Jobs API at {self.address}", str(exc)) from None

    def status(self, submission_id: str) -> str | None:
        return self._ask(f"asking for job {submission_id}", self.api.status, submission_id)

    def logs(self, submission_id: str) -> str:
        return self._ask(f"reading job {submission_id}'s log", self.api.logs, submission_id)

    def stop(self, submission_id: str) -> bool:
        """Whether Ray stopped it (False: it had already ended)."""
        def stop():
            status, body = http_request(f"{self.address}/api/jobs/{submission_id}/stop", "POST", {},
                                        auth_headers(self.token))
            if status == 404:
                raise BadInput(f"JOB: no job {submission_id} on this cluster")
            if status >= 400:
                raise OSError(f"HTTP {status}: {body.decode('utf-8', 'replace')[:500]}")
            return bool(json.loads(body).get("stopped"))
        return self._ask(f"stopping job {submission_id}", stop)

    def list(self) -> list[dict]:
        """Every job on the cluster, as Ray's REST API gives them (dicts)."""
        return self._ask("listing jobs", self.api.jobs)

    def submit(self, plan: Plan, submission_id: str, head_addr: str, env: dict[str, str]) -> bool:
        """Submit the plan's job once: False when a job with this id is already there (a
        retry finds the first one). `env` decides W&B (WANDB_API_KEY given or not)."""
        if self.status(submission_id) is not None:
            return False
        argv, wandb = job_argv(plan.job.model_dump(), head_addr, head_addr, env)
        if wandb:
            print(wandb, flush=True)
        runtime_env = job_runtime_env(plan.job.model_dump())
        if plan.job.working_dir or runtime_env:
            if plan.job.working_dir:
                check_working_dir(plan.job.working_dir, plan.job.excludes)
            self.submit_with_runtime_env(submission_id, argv, {**runtime_env, **(
                {"working_dir": plan.job.working_dir} if plan.job.working_dir else {})})
        else:
            self._ask(f"submitting job {submission_id}", self.api.submit, submission_id, argv)
        return True

    def runs_of(self, sid: str) -> list[tuple[str, str]]:
        """The jobs of the chain `sid`, `sid-r1`, `sid-r2`, ... (next_submission_id) already on
        this cluster, with their status, up to the first free id (`submit --again` takes it)."""
        taken = []
        while (status := self.status(sid)) is not None:
            taken.append((sid, status))
            sid = next_submission_id(sid)
        return taken

    def submit_with_working_dir(self, submission_id: str, argv: list[str], working_dir: str,
                                excludes: list[str] = ()) -> None:
        """Pack and upload `working_dir` with the job: Ray's own SDK does that."""
        self.submit_with_runtime_env(submission_id, argv, {"working_dir": working_dir, "excludes": list(excludes)})

    def submit_with_runtime_env(self, submission_id: str, argv: list[str], runtime_env: dict) -> None:
        """Submit with a runtime_env Ray's own SDK packs, uploads (working_dir, py_modules) and parses
        (requirements files: RuntimeEnv)."""
        from ray.job_submission import JobSubmissionClient

        with_what = " with " + ", ".join(f"{key} {value}" if key == "working_dir" else key
                                         for key, value in runtime_env.items() if key != "excludes")
        try:
            client = JobSubmissionClient(self.address, headers=auth_headers(self.token))
            client.submit_job(entrypoint=shlex.join(argv), submission_id=submission_id, runtime_env=runtime_env)
        except (OSError, RuntimeError, ValueError, TypeError) as exc:
            # Ray's ConnectionError, its RuntimeError with the HTTP answer, or its parsing's refusal
            raise StepFailed(f"submitting job {submission_id}{with_what}", str(exc)) from None

    def follow(self, submission_id: str, timeout_s: float | None = None, out=sys.stdout,
               final_status: Callable[[int], tuple[str, str] | None] = lambda shown: None,
               watch: Callable[[str], None] | None = None, hint_on_interrupt: bool = True,
               after: str | None = None) -> str:
        """Print the job's log as it grows until it ends; return the final status.

        When the dashboard goes away (a head that submitted the job exits as soon as it
        ends), `final_status(chars of the log shown so far)` may still know the outcome
        and the rest of the log, e.g. from the head agent's result line.
        Ctrl-C stops following, not the job: it says how to stop it and re-raises. `after`: see
        JobFollower (a gated job's preflight part is not shown)."""
        follower = JobFollower(self.api, submission_id, out, after)
        try:
            return follower.run(timeout_s, watch)
        except OSError as exc:
            final = final_status(follower.shown)
            if final is None:
                raise StepFailed(f"following job {submission_id}", f"lost the Ray dashboard: {exc}") from None
            status, rest = final
            out.write(rest)
            out.flush()
            return status
        except KeyboardInterrupt:
            if hint_on_interrupt:  # the launcher says it itself, with the cluster's name
                print(f"\nstopped following; job {submission_id} keeps running. Stop it with: "
                      f"rlhf-tasks stop {submission_id} --address {self.address}", file=sys.stderr)
            raise


class PreflightShown:
    """A job's log as the launcher shows it: the line preflight's gate prints for the head
    (`RLHF_TASKS_PREFLIGHT {json}`, kilobytes of JSON) becomes its verdict, table and notes;
    the rest passes as it is. Complete lines only; `close()` writes a last partial line."""

    def __init__(self, out):
        self.out, self.pending = out, ""

    def write(self, text: str) -> None:
        text, self.pending = self.pending + text, ""
        cut = text.rfind("\n") + 1
        text, self.pending = text[:cut], text[cut:]
        shown = []
        for line in text.splitlines(keepends=True):
            at = line.find(PREFLIGHT_PREFIX)
            result = None
            if at >= 0:
                try:
                    result = json.loads(line[at + len(PREFLIGHT_PREFIX):])
                except ValueError:
                    pass
            if isinstance(result, dict):
                heading, table, said = preflight_parts(result)
                shown += [line[:at] + heading + "\n"] + [row + "\n" for row in table + said]
            else:
                shown.append(line)
        self.out.write("".join(shown))

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        if self.pending:
            self.out.write(self.pending)
            self.pending = ""
        self.out.flush()


def shown_command(entrypoint: str) -> str:
    """A job's command as `list` shows it: the trainer's, not the gate the head puts before it
    (`python3 .../agent/__main__.py gate FILE TIMEOUT [--preflight ...] -- CMD...`: CMD)."""
    try:
        words = shlex.split(entrypoint)
    except ValueError:
        return entrypoint
    if len(words) > 2 and words[1].endswith("/agent/__main__.py") and words[2] == "gate" and "--" in words:
        return shlex.join(words[words.index("--") + 1:])
    return entrypoint


def last_job(name: str, record: dict, token: str | None) -> dict | None:
    """Task `name`'s last job on a cluster launched from here: {"submission_id", "status"}, as
    its dashboard says now (one still running first), or, when the dashboard does not answer
    here, as the launcher last recorded it (with "seen": "last seen"); None when neither knows."""
    if record.get("dashboard"):
        try:
            jobs = [job for job in Jobs(record["dashboard"], token).list()
                    if is_submission_of(name, job.get("submission_id") or "")]
        except (StepFailed, ValueError):
            jobs = None
        if jobs:
            jobs.sort(key=lambda job: (job.get("status") not in TERMINAL_JOB_STATES, job.get("start_time") or 0))
            return {"submission_id": jobs[-1]["submission_id"], "status": jobs[-1].get("status")}
        if jobs is not None:
            return None
    job = record.get("job") or {}
    return {**job, "seen": "last seen"} if job.get("submission_id") and job.get("status") else None
