"""launch: the one follower. A provider's `apply` brings the cluster up and hands back a
handle (providers/base.Cluster); this module takes a launch from the task to its verdict:
the refusals before anything is rented (launch_records.py), the secrets, the apply, the
following of the job (follow.py), the summary and the verdict (outcome.py), what becomes
of the cluster after (stopped where the provider bills for it, kept with --keep), Ctrl-C's
cancel, and the relaunch of a lost head."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

from .agent.protocol import AgentError, started_job
from .console import say
from .errors import BadInput, HeadLost, StepFailed
from .follow import HeadEnded, LogTail, follow_dashboard, follow_head_log, head_submission, start_through_dashboard
from .launch_records import keep_spend, keep_wandb_run, refuse_live_cluster, refuse_spent, wandb_run
from .outcome import Outcome, summarise, verdict
from .plan import Plan
from .progress import Training
from .providers import Provider
from .spec import Task


def collect_secrets(task: Task, provider: Provider, plan: Plan) -> dict[str, str]:
    """Values of the task's secrets from this environment; missing ones are named once, never
    shown, before anything starts: bad input where the provider cannot launch without them."""
    values = {name: os.environ[name] for name in task.secrets if os.environ.get(name)}
    missing = [name for name in task.secrets if name not in values]
    if missing:
        refusal = provider.refuses_missing_secrets(plan, missing)
        if refusal:
            raise BadInput(f"secrets: {', '.join(missing)} not set in your environment; {refusal}: export "
                           f"{'it' if len(missing) == 1 else 'them'}, or take {'it' if len(missing) == 1 else 'them'} "
                           f"out of the task's secrets")
        say(f"not set in your environment, so not passed: {', '.join(missing)}")
    return values


def launch(task: Task, provider: Provider, keep: bool = False, fresh: bool = False) -> int:
    """Launch the task, and relaunch it whole when its head is lost, as often as the
    provider says (`launch --retry N` on local): the new cluster resumes from the checkpoint
    (with `fresh`, from the fresh run's: the old ones are moved aside once, by this launch's stamp),
    and the training's steps are read on as one (rlhf_tasks.progress)."""
    refuse_live_cluster(task.name, provider)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) if fresh else None
    relaunches = provider.relaunches()
    wandb_env = wandb_run(task, fresh)
    training = None
    try:
        for attempt in range(relaunches + 1):
            try:
                return launch_once(task, provider, keep, stamp, training, wandb_env)
            except HeadLost as exc:
                training = getattr(exc, "training", None) or training
                if attempt == relaunches:
                    raise
                say(f"the head is lost ({exc}); relaunching {task.name}, {attempt + 1} of {relaunches}: "
                    f"it resumes from the checkpoint")
        raise AssertionError("unreachable")
    finally:
        if training is not None:
            training.close()


def launch_once(task: Task, provider: Provider, keep: bool, fresh: str | None = None,
                training: Training | None = None, wandb_env: dict[str, str] | None = None) -> int:
    from . import state

    started = time.monotonic()
    plan = provider.plan(task)
    if keep:
        plan = plan.replace(keep_cluster=True)
    if fresh:
        if not plan.checkpoint_dir:
            raise BadInput("--fresh: the task has no checkpoint directory to start over from (checkpoints.path)")
        plan = plan.replace(fresh=fresh)
    if wandb_env:
        plan = plan.replace(env={**wandb_env, **plan.env})  # the task's own env wins
    trained = state.training(task.name, fresh)
    plan = plan.replace(budget=plan.budget.model_copy(update={"training": trained["training"],
                                                              "spent": trained["attempts"]}))
    refuse_spent(plan)
    ask_ray_runtime_env(task, plan)
    provider.ready(plan)  # bad input found here (a missing CLI) leaves nothing written or removed
    secrets = collect_secrets(task, provider, plan)
    if wandb_env and secrets.get("WANDB_API_KEY"):
        keep_wandb_run(task.name, wandb_env)
    before = provider.before_launch(task.name)
    say(f"launching {task.name} on {provider.name}: {task.nodes} nodes; its files go to {state.run_dir(task.name)}")
    state.keep_training(task.name, trained)  # the training this launch belongs to, for the next one of the name
    if plan.fresh:
        say(f"--fresh: the run starts over; the head moves the old checkpoints aside before prepare, nothing deleted: "
            f"{plan.checkpoint_dir} -> {plan.checkpoint_dir}.old-{plan.fresh} (its log says where they went)")
    cluster = None
    job_started = interrupted = command_started = False
    try:
        cluster = provider.apply(plan, secrets)
        if cluster.price_per_hour is not None:  # the provider's own price (RunPod's catalog, dstack's plan)
            plan = plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": cluster.price_per_hour}))
        if plan.budget.price_per_hour is not None and "price_per_hour" not in (state.load(plan.name) or {}):
            state.update(plan.name, price_per_hour=plan.budget.price_per_hour)  # `ps` counts the cost so far
        state.update(plan.name, secrets=plan.secrets)  # their names (never values): `logs --bundle` scrubs them
        training = training or training_view(task, plan, started)
        tail = LogTail(cluster.node_logs, None if cluster.node_logs else cluster.head_log, out=training)
        via_head_log = plan.job.submit == "head" and bool(cluster.node_logs or plan.job.mode == "every_node")
        if via_head_log:  # the head runs the job: from here on the cluster is the user's, to `down`
            job_started = True
            say("every node runs the job's command (no Ray); following the node agents' logs" if plan.job.mode ==
                "every_node" else "following the head's log (Ctrl-C before the job's command starts cancels the "
                "launch and stops the cluster; after, it stops following, not the job)")

            def record_start(sid: str) -> None:  # what `down` knows where the dashboard does not answer
                if plan.job.mode != "every_node":  # every_node runs no Ray job to name
                    state.update(plan.name, job={"submission_id": sid, "status": "RUNNING"})

            outcome = follow_head_log(cluster, plan, tail, on_start=record_start)
        else:
            try:
                sid, node_ids = start_through_dashboard(cluster, plan, tail, secrets)
                job_started = command_started = True
                outcome = follow_dashboard(cluster, plan, tail, sid, node_ids, secrets)
            except HeadEnded as ended:  # the job was over before it could be followed: the head's line says how
                job_started = command_started = True
                tail.pump()
                outcome = Outcome.from_result(ended.result)
                say(f"the head ended before its job could be followed here; its result line says job "
                    f"{outcome.submission_id} ended {outcome.status}")
        if outcome.status is not None or not (state.load(plan.name) or {}).get("job"):  # not over `down`'s word
            state.update(plan.name, job={"submission_id": outcome.submission_id, "status": outcome.status})
        if outcome.budget:  # `status NAME` says it too
            state.update(plan.name, budget={k: outcome.budget.get(k) for k in ("words", "checkpoint")})
        keep_spend(plan, outcome.spend)
        training.close()
        summarise(plan, outcome, started, cluster, training)
        if keep and not outcome.budget:
            idle = plan.budget.idle_s
            say(f"the cluster keeps running: `eval \"$(rlhf-tasks env {plan.name})\"` sets up this shell for Ray's own "
                f"CLI, `rlhf-tasks list --cluster {plan.name}` lists its jobs, `rlhf-tasks down {plan.name}` stops it"
                + (f"; it ends itself after {idle:.0f}s without a running job (placement.idle)" if idle else ""))
        return verdict(plan, outcome, via_head_log)
    except KeyboardInterrupt as exc:  # wherever it lands: while bringing the cluster up, submitting, or following
        interrupted = True
        if training is not None:
            training.close()
        if cluster is not None:  # what becomes of the cluster is decided here, not by its close()
            cluster.interrupted = True
        print(file=sys.stderr)
        said = started_job(cluster.read_head_log()) if cluster is not None else None
        if command_started or said:
            sid = ((state.load(task.name) or {}).get("job") or {}).get("submission_id") or said
            if not sid and cluster is not None and cluster.dashboard:
                found, value = head_submission(cluster.dashboard, cluster.token, task.name)
                sid = value if found else None
            if plan.job.mode == "every_node":  # no Ray job to stop: the command runs on every node
                say("stopped following; the job's command keeps running on every node")
            elif sid:
                say(f"stopped following; job {sid} keeps running. Stop it with: rlhf-tasks stop {sid} "
                    f"--cluster {task.name}" + (f" (with `rlhf-tasks forward {task.name}` running in another shell: "
                                                f"the launch's own forward of the dashboard has ended)"
                                                if provider.forward_after_launch else ""))
            say(f"the cluster keeps running; stop it with: rlhf-tasks down {task.name}" if keep or
                plan.job.submit == "client" else
                f"the cluster ends itself when the job ends (or now: rlhf-tasks down {task.name})")
            return 130
        made = cluster is not None or state.before_launch(task.name, before.staged).record != before.record
        return cancel(task.name, provider, made, cluster.read_head_log if cluster is not None else lambda: "",
                      getattr(exc, "waiting_for", None))
    except BaseException as exc:
        if isinstance(exc, HeadLost) and training is not None:
            exc.training = training  # the relaunch goes on reading the same training
        if not job_started and not provider.stop_after_job:
            undone = provider.abandon(before)
            if undone:
                say(f"cleaned up what this launch created for {task.name}: {'; '.join(undone)}")
        raise
    finally:
        if training is not None and not isinstance(sys.exc_info()[1], HeadLost):
            training.close()
        if cluster is not None:
            cluster.close()
        if provider.stop_after_job and cluster is not None and not keep and not interrupted:
            say(f"stopping the {provider.name} cluster {task.name}")
            say(provider.down(task.name))


def ask_ray_runtime_env(task: Task, plan) -> None:
    """job.runtime_env as Ray's own parsing judges it, before anything is rented (as `check` asks it):
    a refusal here costs nothing, the head's `ray job submit` would refuse it once the cluster is up."""
    from .runtimeenv import ask_ray

    try:
        ask_ray(plan.job.runtime_env, plan.job.working_dir, plan.job.excludes)
    except BadInput as exc:
        raise BadInput(f"{task.source}: {exc}") from None


def training_view(task: Task, plan: Plan, started: float) -> Training:
    """What follows the training in the job's log (rlhf_tasks.progress): the recipe's reader of
    its framework's metric lines; its steps go to runs/NAME/metrics.jsonl."""
    from . import state

    try:
        reader = task.job.metrics_reader()
    except Exception:  # noqa: BLE001 - no progress line rather than no run
        reader = None
    return Training(reader, sys.stdout, state.run_dir(task.name), plan.budget.price_per_hour, started, say=say,
                    on_wandb=lambda url: state.update(task.name, wandb_url=url))


def cancel(name: str, provider: Provider, made: bool, head_log: Callable[[], str] = lambda: "",
           waiting: str | None = None) -> int:
    """Ctrl-C before the job's command started cancels the launch. The head would start the
    job on its own (behind its gate, once every node is in) with nobody following, and
    neither its gate nor, on every provider, its dashboard can be reached from here; `down`
    can: it stops the cluster, and the job never runs. (`made`: this launch got as far as
    making a cluster; `head_log`: the head's log, to tell whether the job started meanwhile;
    `waiting`: what the launcher was waiting for when Ctrl-C came, see agent.protocol.wait_for.)"""
    if waiting:
        say(f"interrupted while waiting for {waiting}")
    if not made:
        say(f"interrupted before a cluster was made for {name}: nothing runs")
        return 130
    again = f"the cluster may still be running, and its head start the job: stop it with: rlhf-tasks down {name}"
    say(f"interrupted before the job's command started: stopping the cluster {name}, so that the job does not run "
        f"({provider.down_again})")
    try:
        say(provider.down(name))
    except KeyboardInterrupt:
        say(f"interrupted again: {again}{left_running(provider, name)}")
        return 130
    except (StepFailed, BadInput, AgentError) as exc:
        say(f"could not stop it ({exc}): {again}{left_running(provider, name)}")
        return 130
    sid = started_job(head_log())
    say(f"job {sid} had just started; it stopped with the cluster" if sid else
        f"the job of {name} did not run; launch it again to run it")
    return 130


def left_running(provider: Provider, name: str) -> str:
    """What the provider says is still there of cluster `name` (its machines), as lines to
    append to a message; "" when it says nothing or cannot be asked."""
    try:
        said = provider.status(name)
    except (StepFailed, BadInput, AgentError, OSError, KeyboardInterrupt):
        return ""
    return "; what is left of it:\n  " + "\n  ".join(said.splitlines()) if said else ""
