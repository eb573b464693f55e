"""The commands on one job through its cluster's dashboard (--address, or --cluster of a cluster launched
from here): `submit`, `logs` (and `logs NAME --bundle`, every node's logs), `stop`, `list`."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from ..errors import BadInput, StepFailed
from .targets import jobs_client, make_provider, no_such_job, ray_token, read_task


def cmd_submit(args) -> int:
    from .. import state
    from ..jobs import Jobs
    from ..agent.protocol import TERMINAL_JOB_STATES, head_address, next_submission_id, submission_id

    task = read_task(args.task)
    plan = make_provider(args.provider).plan(task)
    record = state.load(task.name) or {}
    cluster_key = record.get("cluster_id") or hashlib.sha256(args.address.encode()).hexdigest()[:8]
    sid = submission_id(task.name, cluster_key)
    token = ray_token(task.name)
    jobs = Jobs(args.address, token)
    where = f"--address {args.address}"
    if args.again:  # the next id of the chain; never beside a run of the same task (one checkpoint dir)
        runs = jobs.runs_of(sid)
        running = [(run, status) for run, status in runs if status not in TERMINAL_JOB_STATES]
        if running:
            run, status = running[-1]
            raise BadInput(f"--again: job {run} of {task.name} is still {status} on this cluster; follow it "
                           f"(rlhf-tasks logs {run} --follow {where}) or stop it first (rlhf-tasks stop {run} {where})")
        sid = next_submission_id(runs[-1][0]) if runs else sid
    if jobs.submit(plan, sid, head_address(args.address, token), dict(os.environ)):
        print(f"submitted {sid}")
    else:
        status = jobs.status(sid)
        if status in TERMINAL_JOB_STATES and not args.follow:
            print(f"{sid} is already on this cluster and ended {status}; its log: rlhf-tasks logs {sid} {where}; "
                  f"run it again (as the next submission id) with: rlhf-tasks submit {args.task} {where} --again")
            return 0
        print(f"{sid} is already on this cluster, {status}")
    if args.follow:
        status = jobs.follow(sid, plan.job.timeout_s)
        print(f"job {sid}: {status}")
        return 0 if status == "SUCCEEDED" else 1
    print(f"follow it with: rlhf-tasks logs {sid} --follow --address {args.address}")
    return 0


def cmd_logs(args) -> int:
    if args.bundle:
        return _bundle(args)
    from .. import state
    from ..jobs import PreflightShown

    if not args.address and not args.cluster and state.load(args.job) is not None:
        raise BadInput(no_such_job(args, asked=False))  # a cluster's name, said before any cluster is asked
    jobs = jobs_client(args)
    if jobs.status(args.job) is None:  # Ray answers an unknown id's log with nothing: say so instead
        raise BadInput(no_such_job(args))
    out = sys.stdout if args.raw else PreflightShown(sys.stdout)
    if args.follow:
        try:
            status = jobs.follow(args.job, out=out)
        finally:
            out.flush() if args.raw else out.close()
        print(f"job {args.job}: {status}", file=sys.stderr)
        return 0 if status == "SUCCEEDED" else 1
    out.write(jobs.logs(args.job))
    out.flush() if args.raw else out.close()
    return 0


def bundle_secret_names(name: str) -> list[str]:
    """The task's secrets, by its launch's record and every plan staged for it here, whichever
    provider: their values are scrubbed from a bundle."""
    from .. import state
    from ..doctor import saved_plans

    recorded = (state.load(name) or {}).get("secrets") or []
    return sorted({*recorded, *(secret for plan in saved_plans(name) for secret in plan.secrets)})


def _bundle(args) -> int:
    """`logs NAME --bundle`: every node's logs of a running cluster in one .tar.gz, through its dashboard."""
    from .. import state
    from ..agent.protocol.bundle import bundle_from, summary_lines

    args.cluster = args.cluster or args.job
    jobs = jobs_client(args)
    secrets = {n: os.environ[n] for n in bundle_secret_names(args.cluster) if os.environ.get(n)}
    if jobs.token:
        secrets["RAY_AUTH_TOKEN"] = jobs.token
    bundle, found = bundle_from(jobs.address, jobs.token, secrets, str(state.run_dir(args.cluster)),
                                args.cluster, "asked for with `rlhf-tasks logs --bundle`")
    if not found.get("nodes"):
        provider = (state.load(args.cluster) or {}).get("provider")
        kept = make_provider(provider).bundle_here(args.cluster, secrets) if provider else None
        if kept:
            if kept != bundle:
                Path(bundle).unlink(missing_ok=True)  # the empty one: the provider's holds every node's logs
            print(f"the dashboard at {jobs.address} reached no node; every node's logs as {provider} kept them here: "
                  f"{kept}")
            return 0
    print("\n".join(summary_lines(found)))
    if not found.get("nodes"):
        print(f"error: the bundle of {args.cluster} reached no node through {jobs.address}", file=sys.stderr)
        return 1
    return 0


def cmd_stop(args) -> int:
    from ..agent.protocol import TERMINAL_JOB_STATES, http_request, wait_for
    from ..console import say

    jobs = jobs_client(args)
    if not jobs.stop(args.job):
        status = jobs.status(args.job)
        print(f"{args.job}: already finished ({status})")
        if status in TERMINAL_JOB_STATES:
            _record_stopped(args, status, "it had ended before `rlhf-tasks stop`")
        return 0

    def stopped():
        try:
            status = jobs.status(args.job)
        except StepFailed:
            try:  # any answer, 401 included, is a dashboard that is still there
                http_request(f"{jobs.address}/api/gcs_healthz", timeout=5.0)
            except OSError:  # gone: a cluster ends itself once its job is over (unless kept)
                return True, None
            raise
        return status in TERMINAL_JOB_STATES, status
    status = wait_for(f"job {args.job} to stop", stopped, args.wait)
    print(f"{args.job}: {status or 'STOPPED'}")
    _record_stopped(args, status or "STOPPED", "stopped by `rlhf-tasks stop`")
    if status is None:
        say("Ray took the stop, and then the cluster's dashboard went: the cluster ended itself with its job")
    return 0


def _record_stopped(args, status: str, how: str) -> None:
    """The record of the cluster whose last job this is (--cluster's, or the one that names the
    job) keeps how it ended: the cluster may end itself with it, and `status`/`down` read the record."""
    from .. import state

    for name in [args.cluster] if args.cluster else state.known():
        record = state.load(name) or {}
        if not record.get("ended") and (record.get("job") or {}).get("submission_id") == args.job:
            state.update(name, job={"submission_id": args.job, "status": status, "how": how})
            return


def cmd_list(args) -> int:
    from ..jobs import shown_command

    for job in jobs_client(args).list():
        command = shown_command(job.get("entrypoint") or "")
        print(f"{job.get('submission_id') or job.get('job_id')}\t{job.get('status')}\t"
              f"{command if len(command) <= 100 else command[:99] + '…'}")
    return 0
