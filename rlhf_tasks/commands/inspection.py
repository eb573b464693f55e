"""The commands that read and say, with no cluster made or asked: `check` (a task validated, asked of
each provider's and framework's own code, what would run and what it may cost), `recipes` (the
catalogue) and `schema` (the task file's JSON Schema). `check`'s warnings are render's too."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import BadInput
from .targets import make_provider, read_task


def _fitting_provider(task) -> tuple[str, list[str], dict[str, str]]:
    """For `check` without --provider: the providers whose own checks pass (local first),
    and why the others refuse; bad input when none can run the task."""
    from .. import providers

    fits, refusals = [], {}
    for name in ["local"] + [n for n in providers.names() if n != "local"]:
        try:
            make_provider(name).fits(task)
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
    from ..spec import PROVIDER_PLACEMENT

    if "local" in fits:
        return "local"
    named = {n for n in PROVIDER_PLACEMENT if getattr(task.placement, n)} | set(task.checkpoints.shared)
    named = [n for n in fits if n in named]
    if len(named) == 1:
        return named[0]
    raise BadInput(f"--json: the plan is one provider's: give --provider ({', '.join(fits)} can run it"
                   + (f"; the task names {', '.join(named)}" if named else "") + ")")


def cmd_check(args) -> int:
    task = read_task(args.task)
    name, fits, refusals = (args.provider, [args.provider], {}) if args.provider else _fitting_provider(task)
    if args.json and not args.provider:
        name = _json_provider(task, fits)
    provider = make_provider(name)
    plan = provider.plan(task)
    if args.provider:
        warn_shared_storage(provider, plan)
    _warn_wandb(task)
    warn_working_dir_moved(task, plan)
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
    print(f"{args.task}: ok")
    if task.groups:
        print(f"  cluster   {task.nodes} node(s) in {len(task.groups)} groups" + (f" on {name}" if args.provider else ""))
        for group in task.groups:
            price = f", ${group.price_per_hour:.2f}/h each" if group.price_per_hour is not None else ""
            print(f"  group     {group.name}: {_shape_words(group.nodes, group.resources)}{price}")
    else:
        print(f"  cluster   {_shape_words(task.nodes, task.resources)}" + (f" on {name}" if args.provider else ""))
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
        each = provider if other == name else make_provider(other)
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


def _shape_words(nodes: int, res) -> str:
    """`3 node(s) x H100:8, 8 CPU(s) each`: a task's (or a group's) nodes and what each has."""
    return f"{nodes} node(s) x {res.gpus or 'no GPU'}" + (f", {res.cpus} CPU(s) each" if res.cpus else "")


def _ask_ray_runtime_env(plan) -> list[str]:
    """Ray's own parsing of job.runtime_env (runtimeenv.ask_ray; Ray imported only for a task that has one)."""
    from ..runtimeenv import ask_ray

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
        from ..workdir import human

        upload = provider.upload
        left = f"; left out: {', '.join(p.lstrip('/') for p in upload.left_out)}" if upload.left_out else ""
        lines.append(f"  working_dir {upload.path} packs {human(upload.size)} (measured with {upload.how}{left}): "
                     f"{provider.upload_words(plan)}")
    elif words := provider.working_dir_words(plan):
        lines.append(f"  working_dir {words}")
    return lines


def _span(seconds: float) -> str:
    """`30s`, `2 m`, `1 h 30 m`: a grace or a cap, as `check` says it."""
    from ..agent.protocol.spend import hm

    if seconds < 60 or (seconds < 3600 and seconds % 60):
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f} m" if seconds < 3600 else hm(seconds)


def _cost_line(provider, plan, neutral: bool = False) -> str | None:
    """`check`'s cost line: the price per hour where it is known (the task's placement.price_per_hour,
    or where the provider takes it from), and the most the run may cost: up to the first cap
    (placement.max_cost at the price, placement.max_duration), then placement.stop_grace, as the head
    agent enforces them (agent/budget.py), counted from its start. None on a machine that bills
    nothing (local) with neither a price nor a cap."""
    from ..agent.protocol.spend import hm

    budget = plan.budget
    price = budget.price_per_hour
    caps = ([budget.max_duration_s] if budget.max_duration_s else []) + (  # as agent/budget.py's cap_seconds
        [budget.max_cost / price * 3600.0] if budget.max_cost is not None and price else [])
    cap = min(caps) if caps else None
    source = None if neutral else provider.price_source
    if price is None and cap is None and not neutral and not provider.bills:
        return None
    bound = None if neutral or not price else provider.price_bound
    heard = f"; {bound} ${plan.node_price_bound:.2f}/h per node" if bound and plan.node_price_bound else ""
    launch_price = None if neutral else provider.launch_price
    counted = (f"; the head counts {source} where it prices the offers" if source else
               f"; the head counts {launch_price} where it prices them, else this price" if launch_price else
               "; the head counts this price, not the provider's") if bound else ""
    given = _group_prices(plan) if price is not None and price == plan.task_price else None
    words = [f"${price:.2f}/h for the cluster ({given or 'placement.price_per_hour'}{heard}{counted})" if price is not None else
             f"the price per hour comes from {source}" if source else
             "price per hour not given (placement.price_per_hour)"]
    grace = f"the cluster ends within placement.stop_grace {_span(budget.stop_grace_s)} after it"
    by_cost = budget.max_cost is not None and (price or source) and (
        budget.max_duration_s is None or price is None or cap < budget.max_duration_s)
    if by_cost:
        most = f"at most about ${budget.max_cost + price * budget.stop_grace_s / 3600:.2f}: " if price else ""
        after = f", after {hm(cap)}" if price else ", at its price"
        words.append(f"{most}the head stops the job at ${budget.max_cost:.2f} (placement.max_cost{after}) and {grace}, "
                     f"counted from the head agent's start, over every attempt of the training")
    elif budget.max_duration_s:
        most = (f"at most about ${price * (budget.max_duration_s + budget.stop_grace_s) / 3600:.2f}: "
                if price is not None else "")
        words.append(f"{most}the head stops the job after {hm(budget.max_duration_s)} (placement.max_duration) and "
                     f"{grace}, counted from the head agent's start, over every attempt of the training")
    else:
        words.append("no cap (placement.max_cost, placement.max_duration): nothing ends the bill but the job's end")
    retries = None if neutral else provider.retries(plan)
    if retries is not None:
        words.append(_retry_words(provider, plan, retries, cap is not None or by_cost))
    return "  cost      " + "; ".join(words)


def _group_prices(plan) -> str | None:
    """Each group's price and what the split saves against every node at the dearest group's price (one node
    type for all roles, as a task without groups runs): None where the groups give no prices."""
    groups = plan.groups
    if not groups or groups[0].price_per_hour is None:
        return None
    each = " + ".join(f"{g.name} {g.nodes} x ${g.price_per_hour:.2f}" for g in groups)
    dearest = max(groups, key=lambda g: g.price_per_hour)
    one_type = plan.nodes * dearest.price_per_hour
    saved = one_type - plan.task_price
    split = (f"; every node at {dearest.name}'s ${dearest.price_per_hour:.2f}/h would be ${one_type:.2f}/h: the "
             f"groups save ${saved:.2f}/h ({saved / one_type:.0%})" if saved > 0 else "")
    return f"groups[i].price_per_hour per node: {each}{split}"


def _retry_words(provider, plan, retries, capped: bool) -> str:
    """What `check` says of the provider's own relaunches: what it relaunches after, and how the caps hold
    across them (each attempt's head adds the spend record of the attempts before it)."""
    from ..agent.protocol.spend import SPEND_FILE

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
    from ..plan import wandb_options

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


def warn_working_dir_moved(task, plan) -> None:
    """What changed for a task whose relative job.working_dir named the current directory's: it is of the
    task file's directory now (issue 48)."""
    from ..workdir import moved

    said = moved(task.job.working_dir, task.base_dir) if plan.job.working_dir else None
    if said:
        print(f"warning: {said}", file=sys.stderr)


def warn_shared_storage(provider, plan) -> None:
    for note in provider.notes(plan):
        print(f"warning: {note}", file=sys.stderr)


def cmd_recipes(args) -> int:
    from ..recipes import catalogue

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
    from .. import providers
    from ..spec import PROVIDER_PLACEMENT, json_schema

    owned = {key: providers.provider_class(key).placement_options for key in PROVIDER_PLACEMENT}
    print(json.dumps(json_schema({key: model for key, model in owned.items() if model}), indent=2))
    return 0
