"""rlhf-tasks command line. Thin: parses arguments, calls the layers, maps errors to
exit codes (0 ok, 2 bad input with nothing launched or written, 1 a failed step).
Imports nothing heavy (ray, torch, provider SDKs) at start-up. The commands themselves are
rlhf_tasks/commands/, one module per kind."""

from __future__ import annotations

import argparse
import os
import sys

from .commands.cluster import (cmd_doctor, cmd_down, cmd_env, cmd_forward, cmd_launch, cmd_ps, cmd_status,
                               cmd_token)
from .commands.inspection import cmd_check, cmd_recipes, cmd_schema
from .commands.job import cmd_list, cmd_logs, cmd_stop, cmd_submit
from .commands.render import cmd_render
from .errors import BadInput, StepFailed


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
