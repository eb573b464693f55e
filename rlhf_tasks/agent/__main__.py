"""The agent's entry point, run by its path: `python3 LIB/rlhf_tasks/agent/__main__.py --plan
plan.json` (and the job's gate, `... gate FILE TIMEOUT_S -- CMD...`, and preflight's job,
`... preflight --nodes N ...`): read the plan and the provider's contract, set up this node's
environment, run the head's, a worker's or the every-node flow (or, where someone else starts
Ray, one of attached.py's roles), and end with one result line whatever happened; SIGTERM
stops it cleanly. (Run as a module it works too, where the working directory is known to
hold no other rlhf_tasks: the tests.)
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    # Run by its path, as every provider starts it: import the package this file belongs to (so that
    # no `rlhf_tasks/` elsewhere on sys.path can be what runs, as one in the working directory is for
    # `python3 -m`), then run it as `-m` would. This file's directory leaves sys.path.
    import importlib as _importlib
    import os as _os
    import runpy as _runpy
    import sys as _sys

    _sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    _importlib.import_module("rlhf_tasks.agent")  # the shipped package, from its own root
    del _sys.path[0]
    _runpy.run_module("rlhf_tasks.agent", run_name="__main__", alter_sys=True)
    _sys.exit(0)

import argparse
import json
import os
import signal
import sys
from typing import List, Optional

from .attached import BeforeRayFlow, StartedHeadFlow, bundle_hold, hold_bundle
from .budget import SIGNAL as WATCH_SIGNAL
from .budget import Ending
from .contract import locate, read_contract
from .ending import end_machine
from .forensics import tee_stdout
from .head import HeadFlow
from .hub import online
from .jobrunner import gate_main
from .limits import raise_open_files
from .protocol import PLAN_VERSION, PREFLIGHT_COMMAND, AgentError, log, result_line
from .raynode import Node, node_env
from .worker import EveryNodeFlow, WorkerFlow


def load_plan(path: str) -> dict:
    try:
        with open(path) as handle:
            plan = json.load(handle)
    except (OSError, ValueError) as exc:
        raise AgentError("reading the plan %s" % path, str(exc), code=2)
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        found = plan.get("version") if isinstance(plan, dict) else None
        raise AgentError("reading the plan %s" % path, "it is plan version %s, and this agent reads version %d: "
                         "render it again with the rlhf-tasks that shipped this agent" % (found, PLAN_VERSION), code=2)
    return plan


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)


_flows = []  # the flow running now, for the budget watch's signal


def _on_watch(signum, frame):
    """The head's budget or idle watch ends the cluster (budget.Watch): raise its ending here,
    in the main thread, once."""
    watch = getattr(_flows[-1], "watch", None) if _flows else None
    ending = watch.take() if watch is not None else None
    if ending is not None:
        raise ending


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gate"]:
        return gate_main(argv[1:])
    if argv[:1] == [PREFLIGHT_COMMAND]:
        from .preflight import main as preflight_main  # Ray and torch only there

        return preflight_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python3 rlhf_tasks/agent/__main__.py", description="rlhf-tasks node agent (runs on every node)")
    parser.add_argument("--plan", required=True, help="the cluster plan (JSON) rendered by rlhf-tasks")
    parser.add_argument("--skip-setup", action="store_true", help="the provider already ran the setup commands")
    parser.add_argument("--state-dir", default=None, help="where process-group files live (default: /tmp/rlhf-tasks)")
    parser.add_argument("--log-dir", default=None, help="where Ray's and the services' output goes (default: state dir)")
    started = parser.add_mutually_exclusive_group()  # Ray started by someone else (see attached.py)
    started.add_argument("--before-ray", metavar="ENV_FILE", help="just before someone else's `ray start`: setup, "
                         "the head's prepare, a worker's every-node services (left running), the environment for "
                         "Ray written to ENV_FILE")
    started.add_argument("--ray-started", action="store_true", help="the job runner on a head whose Ray someone "
                         "else started: services, every node, preflight, the job")
    args = parser.parse_args(argv)
    attached = args.before_ray or args.ray_started
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(WATCH_SIGNAL, _on_watch)
    result = {"exit_code": 2, "rank": None, "error": None, "steps": []}  # type: dict
    plan_end = None  # the plan's self_end: how this machine ends itself once the agent is done
    node = flow = None
    signalled = False  # the cluster is being torn down: no waiting for anyone
    try:
        plan = load_plan(args.plan)
        plan_end = plan.get("self_end") if not args.before_ray else None
        info = read_contract(plan["contract"], os.environ)
        if attached and info.rank == 0:
            info.head = None  # this node is the head: its own address, no service name to resolve yet
        info = locate(info)
        result["rank"] = info.rank
        log.label = "node%d" % info.rank
        log("%s node %d of %d, address %s, head %s" % (plan["provider"], info.rank, info.nodes, info.node_addr, info.head))
        env = node_env(plan, info, os.environ)
        net = {k: env[k] for k in sorted(plan["network_env"]) if k in env}
        log("network preset %s: %s" % (plan["network"], " ".join(
            "%s=%s%s" % (k, v, " (from the node's environment)" if os.environ.get(k) and k not in plan["env"] else "")
            for k, v in net.items()) or "none"))
        state_dir = args.state_dir or os.path.join(plan["ray"].get("temp_dir") or "/tmp", "rlhf-tasks")
        log_dir = args.log_dir or state_dir
        for directory in (state_dir, log_dir):
            os.makedirs(directory, exist_ok=True)
        tee_stdout(log_dir, info.rank)  # the agent's log, for a failure's bundle
        node = Node(plan, info, env, state_dir, log_dir)
        raise_open_files(plan.get("open_files"))  # before anything starts: all of it inherits the limit
        if plan["setup"] and not args.skip_setup:
            node.run_commands("setup", plan["setup"], online(env, plan))
        if node.group is not None and node.group["setup"]:  # the group's own: never run by the provider
            node.run_commands("group %s setup" % node.group_name, node.group["setup"], online(env, plan))
        if attached and plan["job"].get("mode") == "every_node":
            raise AgentError("choosing the node's flow", "job mode every_node runs no Ray, and here Ray is started "
                             "by someone else", code=2)
        if args.before_ray:
            flow = BeforeRayFlow(node, args.before_ray)
        elif args.ray_started:
            if info.rank != 0:
                raise AgentError("choosing the node's flow", "--ray-started runs on the head (rank 0), this is "
                                 "rank %d" % info.rank, code=2)
            flow = StartedHeadFlow(node)
        elif plan["job"].get("mode") == "every_node":
            flow = EveryNodeFlow(node)
        else:
            flow = HeadFlow(node) if info.rank == 0 else WorkerFlow(node)
        _flows.append(flow)
        result["exit_code"] = flow.run()
    except Ending as exc:
        log(exc.message)
        result.update(exit_code=exc.code, ended=exc.message, **({"error": exc.message, "failed_step": exc.step}
                                                               if exc.code else {}))
    except AgentError as exc:
        log("ERROR: %s" % exc)
        result.update(exit_code=exc.code, error=str(exc), failed_step=exc.step)
    except OSError as exc:  # the dashboard stopped answering, a disk filled up: say it in one line
        log("ERROR: %s" % exc)
        result.update(exit_code=1, error=str(exc))
    except KeyboardInterrupt:
        signalled = True
        log("interrupted")
        result.update(exit_code=130, error="interrupted")
    except SystemExit as exc:
        signalled = True
        log("stopping (signal)")
        result.update(exit_code=exc.code, error="stopped by signal %d" % (exc.code - 128))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        signal.signal(WATCH_SIGNAL, signal.SIG_IGN)  # nor the budget watch
        if flow is not None and result["exit_code"] and not signalled and hasattr(flow, "gather_forensics"):
            flow.gather_forensics(result.get("error") or "exit code %s" % result["exit_code"])  # before any teardown
        if flow is not None:
            flow.stop(signalled=signalled)
            result.update(flow.result())
        if node is not None:
            node.stop_all()
            result["steps"] = node.steps
            log("stopped the processes this agent started")
        status = settle_spend(flow, result, signalled)
        hold = bundle_hold(node, result) if args.ray_started and node is not None and not signalled else 0.0
        if hold:
            result["bundle_held_s"] = hold  # the launcher fetches it now, not once this runner has exited
        print(result_line(result), flush=True)
        if hold:
            hold_bundle(result["forensics"]["bundle"], hold)
        if plan_end is not None:
            end_machine(plan_end, head=result.get("rank") == 0)
    return result["exit_code"] if status is None else status


def settle_spend(flow, result: dict, signalled: bool) -> Optional[int]:
    """The head's last word on the training's spend (its record written with how this attempt ended, and in
    the result line); the exit status where it must be one the provider does not relaunch (the plan's
    budget.cap_exit): at a cap, and at a failure once the training used the error retries it has."""
    watch = getattr(flow, "watch", None)
    if watch is None:
        return None
    budget = flow.plan.get("budget") or {}
    capped = watch.capped()
    ended = "capped" if capped else "done" if result["exit_code"] == 0 else "stopped" if signalled else "failed"
    result["spend"] = watch.settle(ended)
    cap_exit = int(budget.get("cap_exit", 1))
    if capped:
        return cap_exit
    if ended == "failed" and not watch.retried_failure_left():
        failed = watch.spend.failed_before + 1
        log("the job failed on %d attempt%s of the training (placement.retry.errors %d): this attempt ends with exit "
            "status %d, which the provider does not relaunch" % (failed, "" if failed == 1 else "s",
                                                                 budget.get("error_retries") or 0, cap_exit))
        return cap_exit
    return None


if __name__ == "__main__":
    sys.exit(main())
