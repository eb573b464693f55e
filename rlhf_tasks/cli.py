"""rlhf-tasks command line. Thin: parses arguments, calls the layers, maps errors to
exit codes (0 ok, 2 bad input with nothing launched or written, 1 a failed step).
Imports nothing heavy (ray, torch, provider SDKs) at start-up."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from .errors import BadInput, StepFailed


def _task(path: str):
    from .spec import load_task

    return load_task(path)


def _provider(name: str, args=None):
    """The provider, with the values of the `launch` options it declares."""
    from . import providers

    cls = providers.provider_class(name)
    return cls(**{option.dest: getattr(args, option.dest, None) for option in cls.options})


def _fitting_provider(task) -> tuple[str, list[str], dict[str, str]]:
    """For `check` without --provider: the providers whose own checks pass (local first),
    and why the others refuse; bad input when none can run the task."""
    from . import providers

    fits, refusals = [], {}
    for name in ["local"] + [n for n in providers.names() if n != "local"]:
        try:
            _provider(name).fits(task)
            fits.append(name)
        except BadInput as exc:
            refusals[name] = str(exc)
    if not fits:
        raise BadInput("no provider can run this task:\n" + "\n".join(f"  {n}: {why}" for n, why in refusals.items()))
    return fits[0], fits, refusals


def _json_provider(task, fits: list[str]) -> str:
    """Whose plan `check --json` prints without --provider (a plan is one provider's, the text speaks
    for all): local's, launch's and render's default, where local can run the task; else the one
    provider that can and that the task names (placement.<provider>, checkpoints.shared.<provider>)."""
    from .spec import PROVIDER_PLACEMENT

    if "local" in fits:
        return "local"
    named = {n for n in PROVIDER_PLACEMENT if getattr(task.placement, n)} | set(task.checkpoints.shared)
    named = [n for n in fits if n in named]
    if len(named) == 1:
        return named[0]
    raise BadInput(f"--json: the plan is one provider's: give --provider ({', '.join(fits)} can run it"
                   + (f"; the task names {', '.join(named)}" if named else "") + ")")


def cmd_check(args) -> int:
    task = _task(args.task)
    name, fits, refusals = (args.provider, [args.provider], {}) if args.provider else _fitting_provider(task)
    if args.json and not args.provider:
        name = _json_provider(task, fits)
    provider = _provider(name)
    plan = provider.plan(task)
    if args.provider:
        _warn_shared_storage(provider, plan)
    _warn_wandb(task)
    _warn_working_dir_moved(task, plan)
    framework = _asked(task, lambda: task.job.ask_framework(plan.job.entrypoint + plan.job.wandb_args)
                       + _ask_ray_runtime_env(plan))
    if args.provider:
        asked = framework + _asked(task, lambda: provider.ask_own_code(plan))
        if args.json:
            print(plan.to_json(), end="")
            return 0
    elif args.json:
        print(plan.to_json(), end="")
        return 0
    res = task.resources
    print(f"{args.task}: ok")
    print(f"  cluster   {task.nodes} node(s) x {res.gpus or 'no GPU'}"
          + (f", {res.cpus} CPU(s) each" if res.cpus else "") + (f" on {name}" if args.provider else ""))
    if args.provider:
        print("\n".join(_plan_lines(provider, plan, task) + [f"  asked     {line}" for line in asked]))
        cost = _cost_line(provider, plan)
        if cost:
            print(cost)
        return 0
    # No provider chosen: speak for none in particular. Each provider's own plan, asked of its own
    # code (a provider whose code refuses the render cannot run it); the lines that differ between
    # them said per group; their warnings counted, not given as the user's.
    plans, warned, asked = {}, {}, {}
    for other in fits:
        each = provider if other == name else _provider(other)
        try:
            plans[other] = (each, plan if other == name else each.plan(task))
            asked[other] = each.ask_own_code(plans[other][1])
        except BadInput as exc:
            plans.pop(other, None)
            refusals[other] = str(exc)
            continue
        notes = each.notes(plans[other][1])
        if notes:
            warned[other] = len(notes)
    if not plans:
        raise BadInput(f"{task.source}: no provider can run this task:\n"
                       + "\n".join(f"  {n}: {why}" for n, why in refusals.items()))
    print(f"  providers {', '.join(plans)} can run it" + "".join(
        f"\n            not {n}: {why.split(': ', 1)[-1]}" for n, why in refusals.items()))
    if warned:
        print(f"            with warnings on {', '.join(f'{n} ({count})' for n, count in warned.items())}: "
              f"rlhf-tasks check {args.task} --provider NAME says them")
    for line in _merged({other: _plan_lines(each, each_plan, task) + [f"  asked {line}" for line in asked[other]]
                         for other, (each, each_plan) in plans.items()}):
        print(line)
    for line in framework:
        print(f"  asked     {line}")
    cost = _cost_line(provider, plan, neutral=True)
    if cost:
        print(cost)
    return 0


def _ask_ray_runtime_env(plan) -> list[str]:
    """Ray's own parsing of job.runtime_env (runtimeenv.ask_ray; Ray imported only for a task that has one)."""
    from .runtimeenv import ask_ray

    return ask_ray(plan.job.runtime_env, plan.job.working_dir, plan.job.excludes)


def _asked(task, ask) -> list[str]:
    """What a framework's or provider's own code says (`ask()`), its refusal named by the task file."""
    try:
        return ask()
    except BadInput as exc:
        raise BadInput(f"{task.source}: {exc}") from None


def _merged(lines: dict[str, list[str]]) -> list[str]:
    """Each provider's `check` lines as one list: a line every provider says alike, once; a line
    that differs, once per group of providers that say it alike (`checkpoints on local: ...`)."""
    keyed: dict[tuple, dict[str, str]] = {}
    for name, own in lines.items():
        seen: dict[str, int] = {}
        for line in own:
            label, _, rest = line.strip().partition(" ")
            seen[label] = seen.get(label, -1) + 1
            keyed.setdefault((label, seen[label]), {})[name] = rest.strip()
    out = []
    for (label, _), said in keyed.items():
        groups: dict[str, list[str]] = {}
        for name, rest in said.items():
            groups.setdefault(rest, []).append(name)
        if len(groups) == 1 and len(said) == len(lines):
            out.append(f"  {label.ljust(9)} {next(iter(groups))}")
            continue
        out += [f"  {label} on {', '.join(names)}: {rest}" for rest, names in groups.items()]
    return out


def _plan_lines(provider, plan, task) -> list[str]:
    """What `check` says of a provider's plan: services, prepare, the job, checkpoints, working_dir."""
    import shlex

    lines = []
    for service in plan.services:
        ready = service.ready
        probe = ("no readiness check" if ready is None else f"{ready.method} {ready.http}"
                 if hasattr(ready, "http") else f"tcp {ready.tcp}")
        lines.append(f"  service   {service.name} on {service.where} ({probe})")
    for command in plan.prepare:
        lines.append(f"  prepare   {command}  (rank 0)")
    lines.append(f"  job       {plan.job.recipe}, submitted from {plan.job.submit}")
    if plan.open_files:
        whose = "job.open_files" if task.job.open_files is not None else f"the {plan.job.recipe} recipe's"
        lines.append(f"  open_files {plan.open_files} ({whose}): every node's agent raises its soft limit to it "
                     "before Ray starts, and stops where the node's hard limit is lower")
    lines.append(f"  entrypoint {shlex.join(plan.job.entrypoint)}")
    if plan.checkpoint_dir:
        lines.append(f"  checkpoints {plan.checkpoint_dir} (resume: {task.checkpoints.resume})")
    hub = provider.hub_words(plan)
    if hub and not hub[1]:  # a warning is said with the others
        lines.append(f"  models    {hub[0]}")
    if provider.upload is not None:
        from .workdir import human

        upload = provider.upload
        left = f"; left out: {', '.join(p.lstrip('/') for p in upload.left_out)}" if upload.left_out else ""
        lines.append(f"  working_dir {upload.path} packs {human(upload.size)} (measured with {upload.how}{left}): "
                     f"{provider.upload_words(plan)}")
    elif words := provider.working_dir_words(plan):
        lines.append(f"  working_dir {words}")
    return lines


def _hm(seconds: float) -> str:
    """`1 h 05 m`: as the head agent's budget lines say a duration."""
    minutes = int(round(seconds / 60.0))
    return f"{minutes // 60} h {minutes % 60:02d} m"


def _span(seconds: float) -> str:
    """`30s`, `2 m`, `1 h 30 m`: a grace or a cap, as `check` says it."""
    if seconds < 60 or (seconds < 3600 and seconds % 60):
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f} m" if seconds < 3600 else _hm(seconds)


def _cost_line(provider, plan, neutral: bool = False) -> str | None:
    """`check`'s cost line: the price per hour where it is known (the task's placement.price_per_hour,
    or where the provider takes it from), and the most the run may cost: up to the first cap
    (placement.max_cost at the price, placement.max_duration), then placement.stop_grace, as the head
    agent enforces them (agent/budget.py), counted from its start. None on a machine that bills
    nothing (local) with neither a price nor a cap."""
    budget = plan.budget
    price = budget.price_per_hour
    caps = ([budget.max_duration_s] if budget.max_duration_s else []) + (  # as agent/budget.py's cap_seconds
        [budget.max_cost / price * 3600.0] if budget.max_cost is not None and price else [])
    cap = min(caps) if caps else None
    source = None if neutral else provider.price_source
    if price is None and cap is None and not neutral and not provider.bills:
        return None
    bound = None if neutral or not price else provider.price_bound
    heard = f"; {bound} ${price / plan.nodes:.2f}/h per node" if bound else ""
    launch_price = None if neutral else provider.launch_price
    counted = (f"; the head counts {source} where it prices the offers" if source else
               f"; the head counts {launch_price} where it prices them, else this price" if launch_price else
               "; the head counts this price, not the provider's") if bound else ""
    words = [f"${price:.2f}/h for the cluster (placement.price_per_hour{heard}{counted})" if price is not None else
             f"the price per hour comes from {source}" if source else
             "price per hour not given (placement.price_per_hour)"]
    grace = f"the cluster ends within placement.stop_grace {_span(budget.stop_grace_s)} after it"
    by_cost = budget.max_cost is not None and (price or source) and (
        budget.max_duration_s is None or price is None or cap < budget.max_duration_s)
    if by_cost:
        most = f"at most about ${budget.max_cost + price * budget.stop_grace_s / 3600:.2f}: " if price else ""
        after = f", after {_hm(cap)}" if price else ", at its price"
        words.append(f"{most}the head stops the job at ${budget.max_cost:.2f} (placement.max_cost{after}) and {grace}, "
                     f"counted from the head agent's start, over every attempt of the training")
    elif budget.max_duration_s:
        most = (f"at most about ${price * (budget.max_duration_s + budget.stop_grace_s) / 3600:.2f}: "
                if price is not None else "")
        words.append(f"{most}the head stops the job after {_hm(budget.max_duration_s)} (placement.max_duration) and "
                     f"{grace}, counted from the head agent's start, over every attempt of the training")
    else:
        words.append("no cap (placement.max_cost, placement.max_duration): nothing ends the bill but the job's end")
    retries = None if neutral else provider.retries(plan)
    if retries is not None:
        words.append(_retry_words(provider, plan, retries, cap is not None or by_cost))
    return "  cost      " + "; ".join(words)


def _retry_words(provider, plan, retries, capped: bool) -> str:
    """What `check` says of the provider's own relaunches: what it relaunches after, and how the caps hold
    across them (each attempt's head adds the spend record of the attempts before it)."""
    from .agent.protocol.spend import SPEND_FILE

    said = f"{provider.name} relaunches the run after {retries.on} ({retries.cites})"
    if not capped:
        return said + ": with no cap, each attempt bills until its job ends"
    if not provider.spend_kept(plan):  # refused by retry_rules where a cap is given; said for a plan built anyway
        return said + f": each attempt's head counts from $0 (no spend record every attempt sees)"
    return (said + f": one cap for the training, whatever restarts it: each attempt's head adds what the attempts "
            f"before it spent ({plan.checkpoint_dir}/{SPEND_FILE}) and ends at the cap with exit status "
            f"{retries.cap_exit}, which {provider.name} does not relaunch; beyond the cap, each attempt bills its "
            f"start before its head agent counts (provisioning, setup)")


def _warn_wandb(task) -> None:
    """A task that names a W&B project logs nothing without WANDB_API_KEY: said now, not after the run."""
    from .plan import wandb_options

    told = wandb_options(task)
    named = [f"{where}.wandb.project" for where, options in (("placement", task.placement.wandb),
                                                              ("job", task.job.wandb)) if options and options.project]
    args = getattr(task.job, "args", None)
    if getattr(args, "wandb_project", None):  # OpenRLHF's
        named.append("job.args.wandb_project")
    if "project_name" in getattr(args, "model_fields_set", ()):  # verl's and Search-R1's trainer.project_name
        named.append("job.args.project_name")
    if (named or (told and told.entity)) and "WANDB_API_KEY" not in task.secrets:
        what = named[0] if named else "placement.wandb" if task.placement.wandb else "job.wandb"
        print(f"warning: {what} names a W&B {'project' if named else 'entity'} but WANDB_API_KEY is not among the "
              f"task's secrets, so nothing is logged to W&B: add `secrets: [WANDB_API_KEY]` and export it where you "
              f"launch", file=sys.stderr)
    elif (named or told) and not os.environ.get("WANDB_API_KEY"):
        print("warning: WANDB_API_KEY is not set in this environment: a launch from here logs nothing to W&B "
              "(export it first)", file=sys.stderr)


def _warn_working_dir_moved(task, plan) -> None:
    """What changed for a task whose relative job.working_dir named the current directory's: it is of the
    task file's directory now (issue 48)."""
    from .workdir import moved

    said = moved(task.job.working_dir, task.base_dir) if plan.job.working_dir else None
    if said:
        print(f"warning: {said}", file=sys.stderr)


def _warn_shared_storage(provider, plan) -> None:
    for note in provider.notes(plan):
        print(f"warning: {note}", file=sys.stderr)


def cmd_render(args) -> int:
    task = _task(args.task)
    provider = _provider(args.provider)
    plan = provider.plan(task)
    _warn_shared_storage(provider, plan)
    _warn_working_dir_moved(task, plan)
    if args.output:  # where the files go, for a provider whose CLI resolves paths from there
        provider.render_dir = Path(args.output) if (Path(args.output).is_dir() or args.output.endswith(os.sep)) \
            else Path(args.output).parent
    files = provider.render(plan)
    if not args.output:
        main_name, *others = files
        sys.stdout.write(files[main_name])
        if others:
            print(f"(with -o PATH, also written beside it: {', '.join(others)})", file=sys.stderr)
        return 0
    output = Path(args.output)
    if output.is_dir() or args.output.endswith(os.sep):  # a directory: every file under its own name
        targets = {name: output / name for name in files}
    else:
        targets = {name: (output if i == 0 else output.parent / name) for i, name in enumerate(files)}
        files = _renamed(files, next(iter(files)), output.name)
    _refuse_overwriting(targets, files, Path(args.task), args.force)
    for name, content in files.items():
        targets[name].parent.mkdir(parents=True, exist_ok=True)
        targets[name].write_text(content)
        print(f"wrote {targets[name]}", file=sys.stderr)
    return 0


def _refuse_overwriting(targets: dict[str, Path], files: dict[str, str], task: Path, force: bool) -> None:
    """BadInput, before anything is written, where a file would go over the task file itself (never
    done) or over a file rlhf-tasks did not write (its header says which it did: the user's), unless
    --force. A file already as it would be written, or one rlhf-tasks rendered before, is rewritten."""
    from .providers.shipping import WRITTEN_BY, written_by_us

    theirs = []
    for name, target in targets.items():
        if not target.exists() and not target.is_symlink():
            continue
        if target.resolve() == task.resolve():
            raise BadInput(f"-o: {target} is the task file itself ({task}): render never writes over it, --force "
                           f"or not; nothing written; choose another path")
        if target.is_dir():
            raise BadInput(f"-o: {target} is a directory, where {name} would go; nothing written")
        try:
            old = target.read_text(errors="replace")
        except OSError as exc:
            raise BadInput(f"-o: {target} cannot be read ({exc}); nothing written") from None
        if old != files[name] and not written_by_us(old):
            theirs.append(target)
    if theirs and not force:
        more = f" (and {len(theirs) - 1} more: {', '.join(map(str, theirs[1:4]))}{', ...' if len(theirs) > 4 else ''})" \
            if len(theirs) > 1 else ""
        raise BadInput(f"-o: {theirs[0]}{more} exists and rlhf-tasks did not write it (it has no "
                       f"`{WRITTEN_BY}` header): nothing written; choose another path, or add --force to write "
                       f"over it")


def _renamed(files: dict[str, str], old: str, new: str) -> dict[str, str]:
    """The rendered files name each other by their default names (`sky launch ... NAME.sky.yaml`,
    `sbatch NAME.sbatch`); written under another name, the main file is named as written."""
    import re

    if old == new:
        return files
    whole = re.compile(rf"(?<![\w./-]){re.escape(old)}(?![\w.-])")
    return {name: whole.sub(lambda _: new, text) for name, text in files.items()}


def cmd_launch(args) -> int:
    from .launch import launch

    return launch(_task(args.task), _provider(args.provider, args), keep=args.keep, fresh=args.fresh)


def _token(args, name: str | None) -> str | None:
    from . import state

    return os.environ.get("RAY_AUTH_TOKEN") or (state.token(name) if name else None)


def _ended(name: str, record: dict) -> str:
    """What is known of a cluster that has ended: when, how its job ended, where its logs are."""
    from . import state

    job = record.get("job") or {}
    how = ""
    if job.get("status"):
        from .agent.protocol import TERMINAL_JOB_STATES

        how = f"; its job {job['submission_id']} " + (f"ended {job['status']}" if job["status"] in TERMINAL_JOB_STATES
                                                     else f"was last seen {job['status']}")
        how += f" ({job['how']})" if job.get("how") else ""
    capped = record.get("budget") or {}
    if capped.get("words"):  # the head ended it at placement.max_cost or max_duration
        how += f"; {capped['words']}; the last checkpoint: {capped.get('checkpoint') or 'none yet'}"
    logs = state.run_dir(name) / "nodes"
    where = f"; node logs: {logs}" if logs.is_dir() else ""
    return f"the cluster ended at {record['ended']}{how}{where} (launch it again to use it)"


def _jobs(args):
    """A Jobs client for --address (or the cluster named by --cluster / the only known one)."""
    from . import state
    from .jobs import Jobs, dashboard_from_env

    name = args.cluster
    if name is None and not args.address and len(state.known()) == 1:
        name = state.known()[0]
    record = state.load(name) if name else None
    if name and not args.address:
        if record is None:
            raise BadInput(f"--cluster: no cluster named {name} was launched from here "
                           f"(known: {', '.join(state.known()) or 'none'})")
        if record.get("ended"):
            raise StepFailed(f"asking cluster {name}", _ended(name, record))
    address = args.address or dashboard_from_env() or (record or {}).get("dashboard")
    if not address:
        raise BadInput("--address: no dashboard address given (e.g. --address http://localhost:8265 through "
                       "your port forward), and no single known cluster to use")
    return Jobs(address, _token(args, name))


def cmd_submit(args) -> int:
    from . import state
    from .jobs import Jobs
    from .agent.protocol import TERMINAL_JOB_STATES, head_address, next_submission_id, submission_id

    task = _task(args.task)
    plan = _provider(args.provider).plan(task)
    record = state.load(task.name) or {}
    cluster_key = record.get("cluster_id") or hashlib.sha256(args.address.encode()).hexdigest()[:8]
    sid = submission_id(task.name, cluster_key)
    token = _token(args, task.name)
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


def cmd_status(args) -> int:
    from . import state

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
    from .jobs import dashboard_from_env

    if not (args.address or args.cluster or dashboard_from_env() or len(state.known()) == 1):
        # no cluster to ask of a job of that id: the name of a cluster never launched from here
        were = [f"{name} (ended)" if ended else name for name, ended in state.launched().items()]
        raise BadInput(f"NAME: no cluster named {args.job} was launched from here "
                       f"({'launched from here: ' + ', '.join(were) if were else 'none was'}); "
                       f"a job's id names its cluster with --cluster NAME")
    status = _jobs(args).status(args.job)
    if status is None:
        raise BadInput(_no_such_job(args))
    print(status)
    return 0


def _no_such_job(args, asked: bool = True) -> str:
    """`status`/`logs` of an id the cluster has no job of (`asked`: a cluster was asked); a cluster's
    name says how to ask for it, and its last recorded job."""
    from . import state

    record = state.load(args.job)
    said = f"JOB: no job {args.job} on this cluster" if asked else f"JOB: {args.job} is not a job's id"
    if record is not None:
        sid = (record.get("job") or {}).get("submission_id")
        its = f"its job's logs with `rlhf-tasks logs {sid} --cluster {args.job}`, " if sid else ""
        said += (f"; {args.job} is a cluster's name: {its}its jobs with `rlhf-tasks list --cluster {args.job}`, "
                 f"one job's logs with `rlhf-tasks logs JOB --cluster {args.job}`, every node's logs with "
                 f"`rlhf-tasks logs {args.job} --bundle`")
    return said


def _training_status(name: str, record: dict) -> list[str]:
    """The last step `launch` read of the training (runs/NAME/metrics.jsonl) and its W&B run."""
    from . import state
    from .progress import last_step, status_line

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
    from .agent.protocol import AgentError, alive_nodes
    from .jobs import last_job

    provider = record.get("provider", "?")
    header = f"{name}: a cluster launched from here, on {provider}"
    if record.get("ended"):
        return f"{header}; {_ended(name, record)}"
    said = _provider(provider).status(name) if record.get("provider") else None
    lines = said.splitlines() if said else [header]  # a provider's own report names the cluster itself
    token = _token(None, name)
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


def cmd_logs(args) -> int:
    if args.bundle:
        return _bundle(args)
    from . import state
    from .jobs import PreflightShown

    if not args.address and not args.cluster and state.load(args.job) is not None:
        raise BadInput(_no_such_job(args, asked=False))  # a cluster's name, said before any cluster is asked
    jobs = _jobs(args)
    if jobs.status(args.job) is None:  # Ray answers an unknown id's log with nothing: say so instead
        raise BadInput(_no_such_job(args))
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
    from . import state
    from .doctor import saved_plans

    recorded = (state.load(name) or {}).get("secrets") or []
    return sorted({*recorded, *(secret for plan in saved_plans(name) for secret in plan.secrets)})


def _bundle(args) -> int:
    """`logs NAME --bundle`: every node's logs of a running cluster in one .tar.gz, through its dashboard."""
    from . import state
    from .agent.protocol.bundle import bundle_from, summary_lines

    args.cluster = args.cluster or args.job
    jobs = _jobs(args)
    secrets = {n: os.environ[n] for n in bundle_secret_names(args.cluster) if os.environ.get(n)}
    if jobs.token:
        secrets["RAY_AUTH_TOKEN"] = jobs.token
    bundle, found = bundle_from(jobs.address, jobs.token, secrets, str(state.run_dir(args.cluster)),
                                args.cluster, "asked for with `rlhf-tasks logs --bundle`")
    if not found.get("nodes"):
        provider = (state.load(args.cluster) or {}).get("provider")
        kept = _provider(provider).bundle_here(args.cluster, secrets) if provider else None
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
    from .agent.protocol import TERMINAL_JOB_STATES, http_request, wait_for
    from .console import say

    jobs = _jobs(args)
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
    from . import state

    for name in [args.cluster] if args.cluster else state.known():
        record = state.load(name) or {}
        if not record.get("ended") and (record.get("job") or {}).get("submission_id") == args.job:
            state.update(name, job={"submission_id": args.job, "status": status, "how": how})
            return


def cmd_list(args) -> int:
    from .jobs import shown_command

    for job in _jobs(args).list():
        command = shown_command(job.get("entrypoint") or "")
        print(f"{job.get('submission_id') or job.get('job_id')}\t{job.get('status')}\t"
              f"{command if len(command) <= 100 else command[:99] + '…'}")
    return 0


def cmd_ps(args) -> int:
    """Every cluster launched from here and not ended, on every provider: its state as its provider
    reports it now (asked; unreachable said as such), its age and its cost so far, one line each."""
    import time

    from . import state

    names = state.known()
    if not names:
        print("no cluster launched from here is running (rlhf-tasks launch TASK.yaml starts one)")
        return 0
    rows = [("NAME", "PROVIDER", "AGE", "COST", "STATE (as its provider reports it now)")]
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
        rows.append((name, provider, _hm(age) if age is not None else "?", cost, _state_now(name, provider)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])
    return 0


def _state_now(name: str, provider_name: str) -> str:
    """`ps`'s state column: the provider's own line, or why there is none."""
    from .agent.protocol import AgentError

    try:
        provider = _provider(provider_name)
        said = provider.state_line(name)
    except (OSError, ValueError, StepFailed, BadInput, AgentError) as exc:
        return f"unreachable: {exc}".replace("\n", " ")
    if said:
        return said.replace("\n", " ")
    where = provider.state_elsewhere
    return f"not asked here ({where.format(name=name)} says it)" if where else f"{provider_name} reports none"


def cmd_down(args) -> int:
    """Stop a cluster; say which job that stops, and keep the job's last known state in the record."""
    from . import state
    from .agent.protocol import TERMINAL_JOB_STATES
    from .jobs import last_job

    name = args.target
    if name.endswith((".yaml", ".yml")):
        name = _task(name).name
    record = state.load(name)
    provider_name = args.provider or (record or {}).get("provider")
    if provider_name is None:
        raise BadInput(f"down: no cluster named {name} is known here; pass --provider")
    if record and record.get("ended") and not args.provider:
        print(f"{name}: {_ended(name, record)}")
        return 0
    job = last_job(name, record, _token(args, name)) if record and not record.get("ended") else None
    running = job is not None and job["status"] not in TERMINAL_JOB_STATES
    if running:
        said = f"was last seen {job['status']} (the dashboard did not answer)" if job.get("seen") else \
            f"is {job['status']}"
        print(f"{name}: job {job['submission_id']} {said}: stopping the cluster stops it", flush=True)
    print(f"stopping {name} on {provider_name} ...", flush=True)
    print(_provider(provider_name).down(name))
    if job is not None:  # the record keeps how the job ended
        if running:
            print(f"stopped job {job['submission_id']} with the cluster (it was {job['status']})")
            job = {"submission_id": job["submission_id"], "status": "STOPPED",
                   "how": f"stopped by `rlhf-tasks down` while {job['status']}"}
        state.update(name, job={k: v for k, v in job.items() if k != "seen"})
    return 0


def cmd_forward(args) -> int:
    """The head's dashboard on this machine through the provider's tunnel, until Ctrl-C."""
    from . import state

    record = state.load(args.name)
    provider_name = args.provider or (record or {}).get("provider")
    if provider_name is None:
        raise BadInput(f"NAME: no cluster named {args.name} was launched from here (known: "
                       f"{', '.join(state.known()) or 'none'}); pass --provider")
    if record and record.get("ended"):  # no dashboard to reach, whatever the provider's forward would say
        raise StepFailed(f"forwarding {args.name}'s dashboard", _ended(args.name, record))
    return _provider(provider_name).forward(args.name, args.port)


def cmd_env(args) -> int:
    """Shell lines that point Ray's own CLI (and rlhf-tasks) at a cluster launched from here."""
    import shlex

    from . import state

    record = state.load(args.name)
    if record is None:
        raise BadInput(f"NAME: no cluster named {args.name} was launched from here (known: "
                       f"{', '.join(state.known()) or 'none'})")
    if record.get("ended"):
        raise StepFailed(f"setting up a shell for {args.name}", _ended(args.name, record))
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
    from . import state

    provider = _provider(record["provider"]) if record.get("provider") else None
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

    from .models import NAME_PATTERN

    if not re.fullmatch(NAME_PATTERN, name):
        raise BadInput(f"NAME: {name!r} is not a cluster's name: a task's name is lowercase letters, digits and "
                       f"dashes, 1 to 40 of them, starting and ending with a letter or digit")
    return name


def cmd_token(args) -> int:
    """For `dstack apply` / `sky launch` by hand: export RAY_AUTH_TOKEN=$(rlhf-tasks token NAME)."""
    from . import state

    name = _task(args.target).name if args.target.endswith((".yaml", ".yml")) else _cluster_name(args.target)
    record = state.load(name)
    if record and _provider(record.get("provider", "")).makes_token:
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
    from .doctor import doctor

    return doctor(args.target, args.address, args.provider, args.timeout)


def cmd_recipes(args) -> int:
    from .recipes import catalogue

    for recipe in catalogue():
        print(f"{recipe['name']}: {recipe['summary']}\n  needs: {recipe['needs']}")
        for arg, info in recipe["args"].items():
            default = "required" if info["required"] else f"default {info['default']!r}"
            print(f"    {arg} ({default}) {info['description']}".rstrip())
    tasks = sorted(Path("tasks").glob("*.yaml")) if Path("tasks").is_dir() else []
    if tasks:
        print("\ntasks in ./tasks:")
        import yaml

        for path in tasks:
            data = yaml.safe_load(path.read_text()) or {}
            print(f"  {path}: {data.get('job', {}).get('recipe', '?')} on {data.get('nodes', '?')} node(s)")
    return 0


def cmd_schema(args) -> int:
    from . import providers
    from .spec import PROVIDER_PLACEMENT, json_schema

    owned = {key: providers.provider_class(key).placement_options for key in PROVIDER_PLACEMENT}
    print(json.dumps(json_schema({key: model for key, model in owned.items() if model}), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf-tasks", description="One task file -> a multi-node Ray cluster on "
                                     "any provider -> an RLHF job, submitted and followed.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"rlhf-tasks {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    p = add("check", cmd_check, "validate a task and print what would run")
    p.add_argument("task")
    p.add_argument("--provider", help="check for this provider (default: say which providers can run it)")
    p.add_argument("--json", action="store_true", help="print the resolved cluster plan as JSON")
    p = add("render", cmd_render, "write the provider's native file(s); pure: no cluster, no network")
    p.add_argument("task")
    p.add_argument("--provider", required=True)
    p.add_argument("-o", "--output", help="path of the main file (others go beside it); stdout when omitted. Never "
                   "over the task file, nor over a file rlhf-tasks did not write (without its `Rendered by "
                   "rlhf-tasks` header) unless --force")
    p.add_argument("--force", action="store_true", help="with -o: write over files rlhf-tasks did not write")
    p = add("launch", cmd_launch, "render, apply, wait for the cluster, submit and follow the job")
    p.add_argument("task")
    p.add_argument("--provider", default="local", help="where to run it (default: local)")
    p.add_argument("--keep", action="store_true", help="keep the cluster running after the job (until `down`)")
    p.add_argument("--fresh", action="store_true", help="start the run over: the head moves the old checkpoints "
                   "aside (to CHECKPOINTS.old-<UTC time>, never deleted) before prepare, so nothing resumes from them; "
                   "and it logs to a new W&B run (by default a launch of this name, its restarts and relaunches "
                   "continue one W&B run)")
    launch_parser = p
    p = add("submit", cmd_submit, "submit a task's job through a dashboard address (e.g. a forwarded port)")
    p.add_argument("task")
    p.add_argument("--address", required=True, help="e.g. http://localhost:8265")
    p.add_argument("--provider", default="local", help="provider whose plan to use (paths, checkpoint dir)")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--again", action="store_true", help="run it again when its job already ran on this cluster: "
                   "as the next submission id (<task>-<cluster>-r1, -r2, ...); refused while one still runs")
    for name, func, help_text in (("status", cmd_status, "a job's status, or a cluster's (NAME of a cluster launched "
                                   "from here: its machines as the provider reports them, Ray's nodes, its last job); "
                                   "without either, every cluster launched from here (as `ps`)"), ("logs", cmd_logs, "a job's logs"),
                                  ("stop", cmd_stop, "stop a job")):
        p = add(name, func, help_text)
        p.add_argument("job", metavar="JOB", **({"nargs": "?"} if name == "status" else {}))
        p.add_argument("--address")
        p.add_argument("--cluster", help="name of a cluster launched from here (for its address and token)")
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true")
            p.add_argument("--raw", action="store_true", help="the log as Ray keeps it: preflight's result as its "
                           "JSON line (by default, its verdict and table, as launch shows it)")
            p.add_argument("--bundle", action="store_true", help="JOB is a cluster's NAME: every node's logs (the "
                           "agents', services', Ray's), each node's first error, in one .tar.gz under runs/NAME")
        if name == "stop":
            p.add_argument("--wait", type=float, default=120, metavar="SECONDS", help="how long to wait for it to stop")
    add("ps", cmd_ps, "every cluster launched from here, on every provider: its state as the provider reports it "
        "now, its age and its cost so far (also `status` without a name)")
    p = add("list", cmd_list, "list the jobs on a cluster")
    p.add_argument("--address")
    p.add_argument("--cluster")
    p = add("down", cmd_down, "stop a cluster launched from here")
    p.add_argument("target", metavar="TASK.yaml|NAME")
    p.add_argument("--provider")
    p = add("forward", cmd_forward, "forward the head's dashboard to 127.0.0.1:PORT through the provider's tunnel "
            "(RunPod: ssh to the head pod; KubeRay: kubectl port-forward; dstack: dstack attach), for submit, logs, "
            "Ray's CLI and a browser; until Ctrl-C")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--port", type=int, help="local port (default: the task's ray.dashboard_port)")
    p.add_argument("--provider")
    p = add("env", cmd_env, "shell lines for Ray's own CLI against a cluster launched from here: "
            "eval \"$(rlhf-tasks env NAME)\" sets RAY_API_SERVER_ADDRESS (the dashboard, for `ray job`), RAY_ADDRESS (the "
            "GCS, for `ray status` and `ray.init()`, where it is reachable from here: the local provider), "
            "RAY_AUTH_MODE and RAY_AUTH_TOKEN")
    p.add_argument("name", metavar="NAME")
    p = add("token", cmd_token, "print the cluster's Ray token (made once, kept with mode 0600) for applying a "
            "rendered file by hand: export RAY_AUTH_TOKEN=$(rlhf-tasks token NAME)")
    p.add_argument("target", metavar="TASK.yaml|NAME")
    p.add_argument("--new", action="store_true", help="make a new token (a new cluster)")
    p = add("doctor", cmd_doctor, "check a running cluster: token, nodes, versions, interfaces, bandwidth, services, "
            "the shared checkpoint dir, disk and /dev/shm (exit 0 when all pass)")
    p.add_argument("target", metavar="TASK.yaml|NAME")
    p.add_argument("--address", help="the dashboard, e.g. a forwarded http://localhost:8265 (default: the one "
                   "recorded when the cluster was launched from here)")
    p.add_argument("--provider", help="with a task file: the provider whose plan to expect (default: the recorded "
                   "one, else local)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="deadline for the checks on the cluster "
                   "(default: the task's preflight.timeout)")
    add("recipes", cmd_recipes, "list the recipes and what each needs")
    add("schema", cmd_schema, "print the task file's JSON Schema")
    parser.set_defaults(launch_parser=launch_parser)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """For `launch`, the provider's own options first: every provider's for --help, else the
    chosen provider's (a first look at --provider says which)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv[:1] == ["launch"]:
        _launch_options(parser.get_default("launch_parser"), argv[1:])
    return parser.parse_args(argv)


def _launch_options(launch_parser: argparse.ArgumentParser, rest: list[str]) -> None:
    """--provider's choices, and the providers' own `launch` options, each group naming its provider."""
    from . import providers

    names = providers.names()
    provider = next(action for action in launch_parser._actions if action.dest == "provider")
    provider.choices = names
    if "-h" in rest or "--help" in rest:
        shown = ["local"] + [name for name in names if name != "local"]
    else:
        first = argparse.ArgumentParser(add_help=False)
        first.add_argument("--provider", default="local")
        shown = [name for name in [first.parse_known_args(rest)[0].provider] if name in names]
        _foreign_options(rest, shown, names)
    flags: set[str] = set()
    for name in shown:
        options = [option for option in providers.provider_class(name).options if option.flag not in flags]
        if options:
            group = launch_parser.add_argument_group(f"options of --provider {name}")
            for option in options:
                flags.add(option.flag)
                group.add_argument(option.flag, dest=option.dest, help=option.help, **option.kwargs)


def _foreign_options(rest: list[str], shown: list[str], names: list[str]) -> None:
    """BadInput, in words, for a provider's own `launch` option given without that provider
    (`launch x.yaml --managed` runs on local, which has no --managed), instead of the whole usage."""
    from . import providers

    own = {option.flag for name in shown for option in providers.provider_class(name).options}
    for word in rest:
        if word == "--":
            return
        flag = word.split("=", 1)[0]
        if not flag.startswith("--") or flag in own:
            continue
        owners = [name for name in names if flag in {o.flag for o in providers.provider_class(name).options}]
        if owners:
            chosen = shown[0] if shown else "?"
            raise BadInput(f"{flag}: an option of --provider {' or '.join(owners)}, and this launch runs on "
                           f"{chosen}{' (the default)' if '--provider' not in ' '.join(rest) else ''}; add "
                           f"--provider {owners[0]}, or drop {flag}")


def _reader_left() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says POLLERR)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is no file
        return False


def main(argv: list[str] | None = None) -> int:
    from .agent.protocol import AgentError

    try:
        args = _parse(argv)
        code = args.func(args)
        sys.stdout.flush()  # a pipe's reader that left early shows here, not at exit
        return code
    except BrokenPipeError:
        if not _reader_left():
            raise  # a connection's broken pipe, not ours
        # `rlhf-tasks schema | head`: the reader has what it wanted and left; no traceback, and
        # nothing left to write at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (StepFailed, AgentError) as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
