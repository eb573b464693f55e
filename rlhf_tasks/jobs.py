"""Jobs client: submit, status, logs, stop and list through Ray's JobSubmissionClient,
with the cluster's token in the Authorization header. Ray is imported lazily."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Callable

from .agent.protocol import JobFollower, auth_headers, job_argv
from .errors import BadInput, StepFailed
from .plan import Plan


def working_dir_size(path: str, excludes: list[str]) -> int:
    """Bytes Ray would pack from `path`, using Ray's own traversal and exclude rules."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    root = Path(path).absolute()
    total = 0

    def add(p: Path):
        nonlocal total
        if p.is_file():
            total += p.stat().st_size

    _dir_travel(root, [_get_excludes(root, excludes)], add, include_gitignore=True)
    return total


def upload_limit() -> int:
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE

    return GCS_STORAGE_MAX_SIZE


def check_working_dir(path: str, excludes: list[str]) -> int:
    """Refuse, before any upload, a working_dir Ray would reject as too large."""
    if not Path(path).is_dir():
        raise BadInput(f"job.working_dir: {path} is not a directory")
    size, limit = working_dir_size(path, excludes), upload_limit()
    if size >= limit:
        raise BadInput(f"job.working_dir: {path} packs {size / 2**20:.0f} MiB after excludes, over Ray's upload "
                       f"limit of {limit / 2**20:.0f} MiB; add large files to job.excludes")
    return size


class Jobs:
    """One Ray cluster's Jobs API, reached at `address` (e.g. a forwarded localhost port)."""

    def __init__(self, address: str, token: str | None):
        from ray.job_submission import JobSubmissionClient

        self.address, self.token = address, token
        try:
            self.client = JobSubmissionClient(address, headers=auth_headers(token))
        except Exception as exc:  # ray raises ConnectionError or RuntimeError with its own text
            raise StepFailed("connecting to the Ray Jobs API", f"{address}: {exc}") from None

    def status(self, submission_id: str) -> str | None:
        try:
            return str(self.client.get_job_status(submission_id).value)
        except RuntimeError as exc:
            if "does not exist" in str(exc) or "404" in str(exc):
                return None
            raise

    def submit(self, plan: Plan, submission_id: str, head_addr: str, env: dict[str, str]) -> bool:
        """Submit the plan's job once: False when a job with this id is already there (a
        retry finds the first one). `env` decides W&B (WANDB_API_KEY given or not)."""
        if self.status(submission_id) is not None:
            return False
        argv, wandb = job_argv(plan.job.model_dump(), head_addr, head_addr, env)
        if wandb:
            print(wandb, flush=True)
        runtime_env = {}
        if plan.job.working_dir:
            check_working_dir(plan.job.working_dir, plan.job.excludes)
            runtime_env = {"working_dir": plan.job.working_dir, "excludes": plan.job.excludes}
        self.client.submit_job(entrypoint=shlex.join(argv), submission_id=submission_id, runtime_env=runtime_env)
        return True

    def logs(self, submission_id: str) -> str:
        return self.client.get_job_logs(submission_id)

    def stop(self, submission_id: str) -> bool:
        return self.client.stop_job(submission_id)

    def list(self) -> list:
        return self.client.list_jobs()

    def follow(self, submission_id: str, timeout_s: float | None = None, out=sys.stdout,
               final_status: Callable[[int], tuple[str, str] | None] = lambda shown: None,
               watch: Callable[[str], None] | None = None, hint_on_interrupt: bool = True) -> str:
        """Print the job's log as it grows until it ends; return the final status.

        When the dashboard goes away (a head that submitted the job exits as soon as it
        ends), `final_status(chars of the log shown so far)` may still know the outcome
        and the rest of the log, e.g. from the head agent's result line.
        Ctrl-C stops following, not the job: it says how to stop it and re-raises."""
        follower = JobFollower(self, submission_id, out)
        try:
            return follower.run(timeout_s, watch)
        except (OSError, RuntimeError) as exc:  # requests' ConnectionError is an OSError
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
