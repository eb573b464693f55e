"""What a launch reads and keeps of the launches of its name before it, kept here (state.py):
one live cluster per name (a launch on another provider under a live cluster's name is
refused), the training's spend (a training already at its cap is refused; the head's word
on it is kept for the next attempt), and the W&B run id its restarts and relaunches continue."""

from __future__ import annotations

import re

from .console import say
from .errors import BadInput
from .plan import Plan
from .providers import Provider
from .spec import Task


def refuse_live_cluster(name: str, provider: Provider) -> None:
    """One live cluster per name: a launch on another provider under the name of a cluster that
    still lives would overwrite its record (and its token), leaving it running, billed and out of
    reach of `env`, `status` and `down`. Refused before anything is created or written; the same
    provider's own relaunch rules stand (local refuses a running cluster, RunPod pods of the name)."""
    from . import providers, state

    record = state.load(name)
    if not record or record.get("ended") or record.get("provider") in (None, provider.name):
        return
    other = record["provider"]
    try:
        live = providers.provider_class(other).live(record)
    except BadInput:  # a provider not installed here: take the record's word
        live = True
    if not live:
        return
    from .jobs import last_job

    job = last_job(name, record, state.token(name)) or {}  # its dashboard's word where it answers here
    what = (f"its job {job['submission_id']} " + (f"was last seen {job['status']}" if job.get("seen") else
                                                  f"is {job['status']}")) if job.get("submission_id") else \
        "no job of it seen yet"
    raise BadInput(f"name: a cluster named {name} is live on {other} ({what}); launching it on {provider.name} "
                   f"would replace its record and leave it running out of reach. Stop it first with "
                   f"`rlhf-tasks down {name}` (or rename this task); nothing was launched")


def refuse_spent(plan: Plan) -> None:
    """BadInput, before anything is rented, when the training's attempts so far (the launcher's record) reached
    a cap already: a launch without --fresh continues the training, and its head would end at once."""
    from .agent.protocol import spend as bmod

    seconds, cost, _ = bmod.totals(plan.budget.spent)
    left = bmod.cap_seconds(plan.budget.model_dump(), seconds, cost)
    if not plan.budget.spent or left is None or left > 0:
        return
    from . import state

    which = "placement.max_cost" if plan.budget.max_cost is not None and plan.budget.price_per_hour and \
        cost >= plan.budget.max_cost else "placement.max_duration"
    raise BadInput(f"{which}: the training {plan.budget.training} spent ${cost:.2f} over {bmod.hm(seconds)} in "
                   f"{len(plan.budget.spent)} attempts already ({state.spend_path(plan.name)}), which reaches "
                   f"{which} ({f'${plan.budget.max_cost:.2f}' if which.endswith('cost') else bmod.hm(plan.budget.max_duration_s or 0)}): "
                   f"a launch without --fresh continues that training and its budget. Raise {which}, or start a new "
                   f"training with `rlhf-tasks launch --fresh`; nothing was launched")


def keep_spend(plan: Plan, spend: dict | None) -> None:
    """The head's word on the training's spend (its result line) merged into the launcher's record."""
    if not spend or spend.get("training") != plan.budget.training:
        return
    from . import state
    from .agent.protocol import spend as bmod

    record = state.training(plan.name)
    if record.get("training") != plan.budget.training:
        record = {"version": 1, "training": plan.budget.training, "attempts": {}}
    record["attempts"] = bmod.merge(record.get("attempts") or {}, plan.budget.spent, spend.get("attempts") or {})
    state.keep_training(plan.name, record)


def wandb_run(task: Task, fresh: bool = False) -> dict[str, str]:
    """W&B's run id and resume mode for this launch (WANDB_RUN_ID, WANDB_RESUME=allow, which wandb.init
    reads whatever framework calls it): the id kept in runs/NAME/wandb-run-id, so that the job's
    restarts, a relaunch and a later launch of the name continue one W&B run; `launch --fresh`
    makes a new id. Nothing where the task logs nothing to W&B (no WANDB_API_KEY secret). Writes
    nothing: `keep_wandb_run` does, once the launch goes ahead."""
    import secrets as random

    if "WANDB_API_KEY" not in task.secrets:
        return {}
    run_id = None if fresh else kept_wandb_run(task.name)
    if not run_id:
        run_id = f"{task.name}-{random.token_hex(4)}"
    return {"WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow"}


def kept_wandb_run(name: str) -> str | None:
    from . import state

    try:
        run_id = (state.run_dir(name) / "wandb-run-id").read_text().strip()
    except OSError:
        return None
    return run_id if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id) else None


def keep_wandb_run(name: str, env: dict[str, str]) -> None:
    """Keep the W&B run id this launch uses for the next one of the name, and say which it is."""
    from . import state

    run_id = env.get("WANDB_RUN_ID")
    if not run_id:
        return
    if kept_wandb_run(name) == run_id:
        say(f"W&B: continuing run id {run_id} (launch --fresh starts a new one)")
        return
    path = state.run_dir(name) / "wandb-run-id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    say(f"W&B: a new run id {run_id}; this name's restarts and next launches continue it")
