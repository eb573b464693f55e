"""The commands on a cluster's life, by the name it was launched under here: `launch`, `status` (a
cluster's, every cluster's as `ps`, or a job's), `ps`, `down`, `forward`, `env`, `token`, `doctor`."""

from __future__ import annotations

import sys

from ..errors import BadInput, StepFailed
from .targets import ended_words, jobs_client, make_provider, no_such_job, ray_token, read_task


def cmd_launch(args) -> int:
    from ..launch import launch

    return launch(read_task(args.task), make_provider(args.provider, args), keep=args.keep, fresh=args.fresh)


def cmd_status(args) -> int:
    from .. import state

    if args.job is None:  # no name: every cluster launched from here, as `ps`
        if args.cluster and not args.address:
            record = state.load(args.cluster)
            if record is None:
                raise BadInput(f"--cluster: no cluster named {args.cluster} was launched from here "
                               f"(known: {', '.join(state.known()) or 'none'})")
            print(_cluster_status(args.cluster, record))
            return 0
        if args.address:
            raise BadInput("JOB: give the job's id (rlhf-tasks list --address ... lists them)")
        return cmd_ps(args)
    record = None if args.address or args.cluster else state.load(args.job)
    if record:  # a cluster's name: the cluster
        print(_cluster_status(args.job, record))
        return 0
    from ..jobs import dashboard_from_env

    if not (args.address or args.cluster or dashboard_from_env() or len(state.known()) == 1):
        # no cluster to ask of a job of that id: the name of a cluster never launched from here
        were = [f"{name} (ended)" if ended else name for name, ended in state.launched().items()]
        raise BadInput(f"NAME: no cluster named {args.job} was launched from here "
                       f"({'launched from here: ' + ', '.join(were) if were else 'none was'}); "
                       f"a job's id names its cluster with --cluster NAME")
    status = jobs_client(args).status(args.job)
    if status is None:
        raise BadInput(no_such_job(args))
    print(status)
    return 0


def _training_status(name: str, record: dict) -> list[str]:
    """The last step `launch` read of the training (runs/NAME/metrics.jsonl) and its W&B run."""
    from .. import state
    from ..progress import last_step, status_line

    lines = []
    step = last_step(state.run_dir(name))
    if step:
        lines.append(f"  training: {status_line(step)} (launch's following reads it; "
                     f"all steps: {state.run_dir(name) / 'metrics.jsonl'})")
    if record.get("wandb_url"):
        lines.append(f"  W&B run: {record['wandb_url']}")
    return lines


def _cluster_status(name: str, record: dict) -> str:
    """`status NAME`: what the provider says of its machines, what Ray says of its nodes
    (where its dashboard answers here), and its last job; or how it ended."""
    from ..agent.protocol import AgentError, alive_nodes
    from ..jobs import last_job

    provider = record.get("provider", "?")
    header = f"{name}: a cluster launched from here, on {provider}"
    if record.get("ended"):
        return f"{header}; {ended_words(name, record)}"
    said = make_provider(provider).status(name) if record.get("provider") else None
    lines = said.splitlines() if said else [header]  # a provider's own report names the cluster itself
    token = ray_token(name)
    dashboard = record.get("dashboard")
    if dashboard:
        try:
            nodes = alive_nodes(dashboard, token)
            lines.append(f"  Ray: {len(nodes)} node(s) alive (dashboard {dashboard})")
        except (OSError, ValueError, KeyError, AgentError) as exc:
            lines.append(f"  Ray: its dashboard {dashboard} does not answer here ({exc})")
    job = last_job(name, record, token)
    if job:
        seen = f" ({job['seen']})" if job.get("seen") else ""
        lines.append(f"  job {job['submission_id']}: {job['status']}{seen}")
    lines += _training_status(name, record)
    lines.append(f"  its jobs: rlhf-tasks list --cluster {name}; one job's status: rlhf-tasks status JOB "
                 f"--cluster {name}; stop it: rlhf-tasks down {name}")
    return "\n".join(lines)


def cmd_ps(args) -> int:
    """Every cluster launched from here and not ended, on every provider: its state as its provider
    reports it now (asked; unreachable said as such), its age and its cost so far, one line each."""
    import time

    from .. import state
    from ..agent.protocol.spend import hm

    names = state.known()
    if not names:
        print("no cluster launched from here is running (rlhf-tasks launch TASK.yaml starts one)")
        return 0
    rows = [("NAME", "PROVIDER", "NODES", "AGE", "COST", "STATE (as its provider reports it now)")]
    for name in names:
        record = state.load(name) or {}
        provider = record.get("provider") or "?"
        launched = record.get("launched")
        if launched is None:  # a record older than `launched`: its token was made at launch
            try:
                launched = (state.cluster_dir(name) / "token").stat().st_mtime
            except OSError:
                pass
        age = time.time() - launched if launched else None
        price = record.get("price_per_hour")
        cost = f"${price * age / 3600.0:.2f}" if price is not None and age is not None else "-"
        rows.append((name, provider, _nodes_words(name), hm(age) if age is not None else "?", cost,
                     _state_now(name, provider)))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5])
    return 0


def _nodes_words(name: str) -> str:
    """`ps`'s nodes column, from the plan staged for the cluster: `3`, or `3 (trainer 2, reward 1)` with groups."""
    from ..doctor import saved_plan

    plan = saved_plan(name)
    if plan is None:
        return "?"
    groups = ", ".join(f"{group.name} {group.nodes}" for group in plan.groups)
    return f"{plan.nodes} ({groups})" if groups else str(plan.nodes)


def _state_now(name: str, provider_name: str) -> str:
    """`ps`'s state column: the provider's own line, or why there is none."""
    from ..agent.protocol import AgentError

    try:
        provider = make_provider(provider_name)
        said = provider.state_line(name)
    except (OSError, ValueError, StepFailed, BadInput, AgentError) as exc:
        return f"unreachable: {exc}".replace("\n", " ")
    if said:
        return said.replace("\n", " ")
    where = provider.state_elsewhere
    return f"not asked here ({where.format(name=name)} says it)" if where else f"{provider_name} reports none"


def cmd_down(args) -> int:
    """Stop a cluster; say which job that stops, and keep the job's last known state in the record."""
    from .. import state
    from ..agent.protocol import TERMINAL_JOB_STATES
    from ..jobs import last_job

    name = args.target
    if name.endswith((".yaml", ".yml")):
        name = read_task(name).name
    record = state.load(name)
    provider_name = args.provider or (record or {}).get("provider")
    if provider_name is None:
        raise BadInput(f"down: no cluster named {name} is known here; pass --provider")
    if record and record.get("ended") and not args.provider:
        print(f"{name}: {ended_words(name, record)}")
        return 0
    job = last_job(name, record, ray_token(name)) if record and not record.get("ended") else None
    running = job is not None and job["status"] not in TERMINAL_JOB_STATES
    if running:
        said = f"was last seen {job['status']} (the dashboard did not answer)" if job.get("seen") else \
            f"is {job['status']}"
        print(f"{name}: job {job['submission_id']} {said}: stopping the cluster stops it", flush=True)
    print(f"stopping {name} on {provider_name} ...", flush=True)
    print(make_provider(provider_name).down(name))
    if job is not None:  # the record keeps how the job ended
        if running:
            print(f"stopped job {job['submission_id']} with the cluster (it was {job['status']})")
            job = {"submission_id": job["submission_id"], "status": "STOPPED",
                   "how": f"stopped by `rlhf-tasks down` while {job['status']}"}
        state.update(name, job={k: v for k, v in job.items() if k != "seen"})
    return 0


def cmd_forward(args) -> int:
    """The head's dashboard on this machine through the provider's tunnel, until Ctrl-C."""
    from .. import state

    record = state.load(args.name)
    provider_name = args.provider or (record or {}).get("provider")
    if provider_name is None:
        raise BadInput(f"NAME: no cluster named {args.name} was launched from here (known: "
                       f"{', '.join(state.known()) or 'none'}); pass --provider")
    if record and record.get("ended"):  # no dashboard to reach, whatever the provider's forward would say
        raise StepFailed(f"forwarding {args.name}'s dashboard", ended_words(args.name, record))
    return make_provider(provider_name).forward(args.name, args.port)


def cmd_env(args) -> int:
    """Shell lines that point Ray's own CLI (and rlhf-tasks) at a cluster launched from here."""
    import shlex

    from .. import state

    record = state.load(args.name)
    if record is None:
        raise BadInput(f"NAME: no cluster named {args.name} was launched from here (known: "
                       f"{', '.join(state.known()) or 'none'})")
    if record.get("ended"):
        raise StepFailed(f"setting up a shell for {args.name}", ended_words(args.name, record))
    if not record.get("dashboard"):
        raise StepFailed(f"setting up a shell for {args.name}", "its dashboard address is not known here; "
                         "export RAY_API_SERVER_ADDRESS yourself (e.g. a forwarded http://localhost:8265)")
    token = _cluster_token(args.name, record)
    # Ray's job CLI reads RAY_API_SERVER_ADDRESS before RAY_ADDRESS; `ray status` and `ray.init()`
    # read RAY_ADDRESS as the GCS's host:port.
    lines = [f"export RAY_API_SERVER_ADDRESS={shlex.quote(record['dashboard'])}"]
    if record.get("gcs"):
        lines.append(f"export RAY_ADDRESS={shlex.quote(record['gcs'])}")
    else:
        lines.append("unset RAY_ADDRESS")
    if token:
        lines += ["export RAY_AUTH_MODE=token", f"export RAY_AUTH_TOKEN={shlex.quote(token)}"]
    else:
        lines += ["export RAY_AUTH_MODE=disabled", "unset RAY_AUTH_TOKEN"]
    print("\n".join(lines))
    if not record.get("gcs"):
        print(f"# {args.name} on {record.get('provider', '?')}: Ray's job CLI (ray job list, logs, submit) works "
              f"through the dashboard; its GCS is not reachable from here, so RAY_ADDRESS is left unset: run "
              f"`ray status` and `ray.init()` on the head", file=sys.stderr)
    if sys.stdout.isatty():
        print(f"# use it as: eval \"$(rlhf-tasks env {args.name})\"", file=sys.stderr)
    return 0


def _cluster_token(name: str, record: dict) -> str | None:
    """The cluster's Ray token: the provider's own where it makes it (read fresh, kept here), else
    the one rlhf-tasks made."""
    from .. import state

    provider = make_provider(record["provider"]) if record.get("provider") else None
    if provider is None or not provider.makes_token:
        return state.token(name)
    token = provider.cluster_token(name)
    if token is None:
        raise StepFailed(f"reading the Ray token of {name}", f"{record['provider']} makes it, and has not yet (it "
                         f"does once the cluster exists): try again once `rlhf-tasks status {name}` shows its pods")
    return token


def _cluster_name(name: str) -> str:
    """A cluster's name as a task's: what the schema refuses is refused before any state is made for it."""
    import re

    from ..models import NAME_PATTERN

    if not re.fullmatch(NAME_PATTERN, name):
        raise BadInput(f"NAME: {name!r} is not a cluster's name: a task's name is lowercase letters, digits and "
                       f"dashes, 1 to 40 of them, starting and ending with a letter or digit")
    return name


def cmd_token(args) -> int:
    """For `dstack apply` / `sky launch` by hand: export RAY_AUTH_TOKEN=$(rlhf-tasks token NAME)."""
    from .. import state

    name = read_task(args.target).name if args.target.endswith((".yaml", ".yml")) else _cluster_name(args.target)
    record = state.load(name)
    if record and make_provider(record.get("provider", "")).makes_token:
        if args.new:
            raise BadInput(f"--new: {name} runs on {record['provider']}, which makes the cluster's Ray token itself")
        print(_cluster_token(name, record))
        return 0
    token = state.token(name)
    if token is None or args.new:
        token = state.new_token(name)
        print(f"made a new Ray token for {name} in {state.cluster_dir(name) / 'token'} (mode 0600)", file=sys.stderr)
    print(token)
    return 0


def cmd_doctor(args) -> int:
    from ..doctor import doctor

    return doctor(args.target, args.address, args.provider, args.timeout)
