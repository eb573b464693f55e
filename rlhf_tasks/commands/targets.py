"""What the commands act on, as the user names it: a task file, a provider (with the values of
the `launch` options it declares), a cluster launched from here (its Ray token, how it ended), a job
through the cluster's dashboard (a Jobs client for --address or --cluster), and the words for an id
that names no job. Shared by the commands of cluster.py and job.py, so that each says a target alike."""

from __future__ import annotations

import os

from ..errors import BadInput, StepFailed


def read_task(path: str):
    """The task file, parsed and validated (spec.load_task)."""
    from ..spec import load_task

    return load_task(path)


def make_provider(name: str, args=None):
    """The provider, with the values of the `launch` options it declares."""
    from .. import providers

    cls = providers.provider_class(name)
    return cls(**{option.dest: getattr(args, option.dest, None) for option in cls.options})


def ray_token(name: str | None) -> str | None:
    """The Ray token to ask a cluster with: RAY_AUTH_TOKEN where it is set, else the one kept here for `name`."""
    from .. import state

    return os.environ.get("RAY_AUTH_TOKEN") or (state.token(name) if name else None)


def ended_words(name: str, record: dict) -> str:
    """What is known of a cluster that has ended: when, how its job ended, where its logs are."""
    from .. import state

    job = record.get("job") or {}
    how = ""
    if job.get("status"):
        from ..agent.protocol import TERMINAL_JOB_STATES

        how = f"; its job {job['submission_id']} " + (f"ended {job['status']}" if job["status"] in TERMINAL_JOB_STATES
                                                     else f"was last seen {job['status']}")
        how += f" ({job['how']})" if job.get("how") else ""
    capped = record.get("budget") or {}
    if capped.get("words"):  # the head ended it at placement.max_cost or max_duration
        how += f"; {capped['words']}; the last checkpoint: {capped.get('checkpoint') or 'none yet'}"
    logs = state.run_dir(name) / "nodes"
    where = f"; node logs: {logs}" if logs.is_dir() else ""
    return f"the cluster ended at {record['ended']}{how}{where} (launch it again to use it)"


def jobs_client(args):
    """A Jobs client for --address (or the cluster named by --cluster / the only known one)."""
    from .. import state
    from ..jobs import Jobs, dashboard_from_env

    name = args.cluster
    if name is None and not args.address and len(state.known()) == 1:
        name = state.known()[0]
    record = state.load(name) if name else None
    if name and not args.address:
        if record is None:
            raise BadInput(f"--cluster: no cluster named {name} was launched from here "
                           f"(known: {', '.join(state.known()) or 'none'})")
        if record.get("ended"):
            raise StepFailed(f"asking cluster {name}", ended_words(name, record))
    address = args.address or dashboard_from_env() or (record or {}).get("dashboard")
    if not address:
        raise BadInput("--address: no dashboard address given (e.g. --address http://localhost:8265 through "
                       "your port forward), and no single known cluster to use")
    return Jobs(address, ray_token(name))


def no_such_job(args, asked: bool = True) -> str:
    """`status`/`logs` of an id the cluster has no job of (`asked`: a cluster was asked); a cluster's
    name says how to ask for it, and its last recorded job."""
    from .. import state

    record = state.load(args.job)
    said = f"JOB: no job {args.job} on this cluster" if asked else f"JOB: {args.job} is not a job's id"
    if record is not None:
        sid = (record.get("job") or {}).get("submission_id")
        its = f"its job's logs with `rlhf-tasks logs {sid} --cluster {args.job}`, " if sid else ""
        said += (f"; {args.job} is a cluster's name: {its}its jobs with `rlhf-tasks list --cluster {args.job}`, "
                 f"one job's logs with `rlhf-tasks logs JOB --cluster {args.job}`, every node's logs with "
                 f"`rlhf-tasks logs {args.job} --bundle`")
    return said
