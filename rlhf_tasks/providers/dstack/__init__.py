"""dstack: one `type: task` configuration with `nodes: N` (or, for a task's node groups, dstack's own `groups:`,
render.DstackRender.node_groups), applied with `dstack apply`.

dstack starts the same commands on every node and sets DSTACK_NODE_RANK,
DSTACK_MASTER_NODE_IP and DSTACK_NODES_NUM; the node agent reads them. Only job 0's
ports are forwarded by `dstack apply`, which is the head: its dashboard port is the
one port we expose. Secrets and the Ray token are dstack project secrets, one per cluster and
variable (`rlhf_tasks__<cluster>__<VARIABLE>`, secret_name), which the job's env references as
`${{ secrets.NAME }}`: dstack's server puts the values in when it hands each job to its runner
(server/services/jobs/__init__.py interpolate_job_spec_secrets, called by the jobs_submitted and
jobs_running pipelines), so neither the rendered file, nor the run spec the server stores, nor the
CLI's command line or environment holds a value. `launch` sets them through dstack's API
(dstack_api.py, the values on its stdin), `down` deletes them, as does the launcher once the run
it followed is over.

Checkpoints go to a directory on each host (`instance_path`) unless the task names shared
storage in `checkpoints.shared.dstack`: a network volume (for several nodes only on backends whose
volumes attach to several instances: SHARING), or a host directory the user declares shared (an NFS
mount on every fleet host).

What dstack's server does with the file, read in dstack 0.22.5's own code: it runs `commands` as
`<shell> -i -c "<items joined with ' && '>"` (jobs/configurators/base.py, _commands and
_join_shell_commands), so they are rendered as one item that starts with `set -e`; `files:` entries are
archived by the CLI (utils/files.py create_file_archive: .gitignore and .dstackignore respected, at most
DSTACK_SERVER_CODE_UPLOAD_LIMIT, 2 MiB by default, per archive: server/routers/files.py) and unpacked on
every node; with `image:` and no `user:` or CPU architecture the server reads the image's configuration
from its registry at submit time (_user, _requirements); a fleet terminates only instances above
`nodes.min` when they idle (fleets.py, idle_duration); an SSH fleet refuses the fields of a cloud fleet
(server/services/fleets.py, _validate_fleet_configuration_subtype_specific_fields); a run needs a fleet
(cli/utils/common.py NO_FLEETS_WARNING), and `dstack apply -d` submits a run no offer fits.

The package: `render.py` (the pure half: checks, plan, the rendered task and fleet), `options.py`
(placement.dstack, checkpoints.shared.dstack, which storage the nodes share), `offers.py` (resources and
price in dstack's words), `project_secrets.py`, `archive.py` (job.working_dir as dstack's `files:`),
`cli.py` (dstack's CLI driven: ps, logs, attach, fleet delete), `dstack_api.py` (dstack's Python API, run
by the interpreter that holds dstack); this module adds `launch`, `down`, `forward` and the run's state.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ... import state
from ...agent.protocol import RESULT_PREFIX
from ...errors import BadInput, StepFailed
from ...plan import Plan
from ..base import Cluster, hold_forward, require_cli, start_tunnel, stop_with_cli, write_files
from .cli import (PS_RUNS, bundle_from_dstack_logs, delete_fleet, dstack_python, end_attach, run_over, run_words,
                  server_head_log)
from .offers import plan_price
from .options import dstack_placement
from .project_secrets import SECRET_VALUE_MAX, secret_name, secret_variables
from .render import DstackRender, fleet_name


class DstackProvider(DstackRender):
    """The provider: the pure part (DstackRender), and `launch`, `down`, `forward` and the run's state through
    dstack's CLI and its Python API."""

    state_elsewhere = "dstack ps"
    #: `dstack apply`'s port forward ends with the launch (Ctrl-C detaches it): `forward` is `dstack attach`.
    forward_after_launch = True
    #: The fleet this launch applied (and `abandon` deletes when the launch fails before its job).
    _made_fleet: str | None = None
    #: The project secrets this launch set (and `abandon` deletes when the launch fails before its job).
    _set_secrets: list[str] = []
    #: The environment this launch runs dstack's commands with: the launcher's, less the secrets' variables.
    _cli_env: dict[str, str] | None = None

    def ready(self, plan: Plan) -> None:
        require_cli("dstack", "dstack")
        limit = self.over_limit(plan)
        if limit:
            raise BadInput(limit)

    def refuses_missing_secrets(self, plan: Plan, missing: list[str]) -> str | None:
        return ("`launch` sets each as a dstack project secret that the job's env references, and dstack's server "
                "fails a job whose secret is not there (\"Secrets interpolation error\")")

    def ask(self, what: str, args: list[str], directory: Path | None, env: dict[str, str],
            given: dict | None = None) -> dict:
        """dstack's server through dstack's own Python API (dstack_api.py, run by the `dstack` command's
        interpreter; `given` on its stdin, as JSON: never on its command line): the answer as data, or StepFailed
        with what dstack said."""
        script = str(Path(__file__).with_name("dstack_api.py"))
        out = subprocess.run([dstack_python(require_cli("dstack", "dstack")), "-I", script, *args], cwd=directory,
                             env=env, capture_output=True, text=True, timeout=300,
                             **({"input": json.dumps(given)} if given is not None else {"stdin": subprocess.DEVNULL}))
        if out.returncode != 0:
            raise StepFailed(what, (out.stderr.strip() or out.stdout.strip())[-2000:] or f"exit code {out.returncode}")
        return json.loads(out.stdout)

    def fleet_to_make(self, plan: Plan, fleets: list[str]) -> str | None:
        """The rendered fleet, when `launch` applies it: the task names no fleets of its own, no fleet of that
        name is there, and the run has no other fleet (dstack runs nothing without one) or the fleet is the
        task's own SSH hosts. A fleet already there is the user's, and stays."""
        name = fleet_name(plan)
        if plan.placement.fleets or name in fleets:
            return None
        return name if (dstack_placement(plan.placement).ssh or not fleets) else None

    def refuse_without_offers(self, plan: Plan, answer: dict, yml: str) -> None:
        """BadInput, before anything is submitted, when dstack's own plan has no offer for a job of the run
        (`dstack apply -d` would submit it, and the job would fail FAILED_TO_START_DUE_TO_NO_CAPACITY)."""
        empty = [job for job in answer.get("jobs", []) if not job.get("offers")]
        if not empty:
            return
        fleets = list(plan.placement.fleets) or answer.get("fleets") or []
        where = f"the fleets {', '.join(fleets)}" if fleets else "no fleet"
        field, which = "resources", f"({empty[0].get('requirements')})"
        lacking = [(index, group) for index, group in enumerate(plan.groups)
                   if any(job.get("group") == group.name for job in empty)]
        if lacking:  # dstack plans each node group apart, and names each job's group (dstack_api.py plan)
            field = f"groups[{lacking[0][0]}].resources"
            which = "(" + "; ".join(
                f"group {group.name}, groups[{index}].resources: " + next(
                    str(job.get("requirements")) for job in empty if job.get("group") == group.name)
                for index, group in lacking) + ")"
        raise BadInput(
            f"dstack's plan for {plan.name} has no offer for {len(empty)} of its {len(answer['jobs'])} jobs "
            f"{which} on {where}: `dstack apply -f {yml}` would submit a run that fails "
            f"with no capacity. See what fits with `dstack offer` (its --gpu, --cpu, --disk options), then change "
            f"{field} (amounts are minimums unless in resources.exact), placement.fleets, backends or regions, or "
            f"apply a fleet that has the hosts ({fleet_name(plan)}.dstack.yml is rendered beside the task)")

    def counted_plan(self, plan: Plan, answer: dict) -> Plan:
        """The plan with the price its head counts: dstack's plan's (plan_price), where it prices the offers; the
        task's otherwise. BadInput, before anything is submitted, for a cap no price can count."""
        price = plan_price(answer, plan.task_price)
        if price is None and plan.budget.max_cost is not None:
            raise BadInput(f"placement.max_cost: dstack's plan for {plan.name} prices its offers at $0 (an SSH fleet's "
                           f"hosts: dstack knows no price of them), so the head agent could not count the cost; give "
                           f"placement.price_per_hour (US dollars per hour for the whole cluster), or use "
                           f"placement.max_duration")
        return plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": price}))

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """The fleet when the run has none (`dstack apply` of the rendered fleet), dstack's plan asked (no offer:
        refused before anything is submitted), then `dstack apply` of the task, which attaches and forwards
        job 0's ports (the head's dashboard) to localhost."""
        dstack = require_cli("dstack", "dstack")
        directory, token, env = self.stage(plan, secrets)
        values = {name: env[name] for name in secret_variables(plan) if env.get(name)}
        env = {k: v for k, v in env.items() if k not in values}  # dstack's CLI needs none of them: the server does
        self._cli_env = env
        yml = f"{plan.name}.dstack.yml"
        dashboard = f"http://localhost:{plan.ray.dashboard_port}"
        self._made_fleet = self.fleet_to_make(plan, self.ask("listing dstack's fleets", ["fleets"], directory, env)
                                              ["fleets"])
        record = {"provider": self.name, "cluster_id": plan.name, "dashboard": dashboard,
                  "dashboard_port": plan.ray.dashboard_port}  # the head's port, which `forward` forwards
        if self._made_fleet:
            record["fleet_made"] = self._made_fleet  # `down` deletes it
            state.save(plan.name, record)
            print(f"dstack: applying the fleet {self._made_fleet} (the run has none): dstack apply -f "
                  f"{self._made_fleet}.dstack.yml", flush=True)
            made = subprocess.run([dstack, "apply", "-f", f"{self._made_fleet}.dstack.yml", "-y"], cwd=directory,
                                  env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if made.returncode != 0:
                raise StepFailed(f"dstack apply -f {self._made_fleet}.dstack.yml",
                                 (made.stdout + made.stderr).strip()[-2000:])
        answer = self.ask("asking dstack for the run's plan", ["plan", yml], directory, env)
        self.refuse_without_offers(plan, answer, yml)
        counted = self.counted_plan(plan, answer)
        if counted.budget.price_per_hour != plan.budget.price_per_hour:  # the head reads its price from the files
            plan = counted
            write_files(directory, self.render(plan))
            print(f"dstack: the head counts ${plan.budget.price_per_hour:.2f}/h for the cluster (dstack's plan: the "
                  f"dearest offer that fits each of the {plan.nodes} nodes)", flush=True)
        self.set_secrets(plan, values, record, directory, env)
        path = directory / "dstack-apply.log"
        with open(path, "ab") as log:  # an earlier launch's part stays; this one's head log starts at `start`
            start = log.tell()
            # its own session: a terminal's Ctrl-C reaches the launcher only, whose close() then SIGINTs it once
            # (`-y`: detach). A second SIGINT while dstack's CLI handles the first stops the run: ABORTED_BY_USER
            proc = subprocess.Popen([dstack, "apply", "-f", str(directory / yml), "-y"],
                                    cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

        kept: list[str] = []  # the head's log as dstack's server kept it, once `dstack apply` ended without it

        def head_log() -> str:
            """`dstack apply`'s output; once it has ended without the head's result line, after a run that ended
            before it attached (a job of seconds, or a failed job, which ends a multi-node run at once), job 0's
            log from dstack's server too. Only once apply said `NAME provisioning completed` (its own run was
            running or over by then): before that, `dstack logs NAME` could be an earlier run's of the name."""
            with open(path, "rb") as handle:
                handle.seek(start)
                text = handle.read().decode(errors="replace")
            if proc.poll() is None or RESULT_PREFIX in text or f"{plan.name} provisioning completed" not in text:
                return text
            if not kept:
                kept.append(server_head_log(dstack, plan.name, directory, env))
            return text + kept[0]
        def gather_here(reason: str) -> tuple[str, str] | None:
            scrub = {**secrets, **({"RAY_AUTH_TOKEN": token} if token else {})}
            made = bundle_from_dstack_logs(dstack, plan.name, plan.nodes, directory, env, scrub,
                                           str(state.run_dir(plan.name)), reason)
            return (made, f"each node's log as dstack's server kept it (`dstack logs {plan.name} --job N`)") \
                if made else None
        def close() -> None:
            """End the attach; once the run is over (not after Ctrl-C, which leaves it to `down`), its secrets go."""
            over = proc.poll() is not None
            end_attach(proc)
            if over and not cluster.interrupted and self._set_secrets and run_over(dstack, plan.name):
                print(forget_secrets(self, plan.name, env), flush=True)
                self._set_secrets = []
        state.save(plan.name, record)
        cluster = Cluster(name=plan.name, cluster_id=plan.name, dashboard=dashboard, token=token,
                          head_alive=lambda: proc.poll() is None, head_log=head_log, gather_here=gather_here,
                          close=close, price_per_hour=plan.budget.price_per_hour,
                          describe=lambda: [] if proc.poll() is None else [
                              f"dstack apply exited with code {proc.poll()}", *run_words(dstack, plan.name)])
        return cluster

    def set_secrets(self, plan: Plan, values: dict[str, str], record: dict, directory: Path,
                    env: dict[str, str]) -> None:
        """The task's secrets and the Ray token as dstack project secrets (secret_name), their values on
        dstack_api.py's stdin; their names recorded first, so that `down` (and `abandon`) delete them."""
        if not values:
            return
        names = {secret_name(plan.name, variable): value for variable, value in values.items()}
        long = [variable for variable in values if len(values[variable]) > SECRET_VALUE_MAX]
        if long:
            raise BadInput(f"secrets: {', '.join(long)} holds more than {SECRET_VALUE_MAX} characters, the most a "
                           f"dstack secret may hold (server/services/secrets.py); nothing was submitted")
        record["dstack_secrets"] = sorted(names)
        state.save(plan.name, record)
        self._set_secrets = sorted(names)
        self.ask("setting the task's secrets as dstack project secrets", ["secrets-set"], directory, env, names)
        print(f"dstack: set {len(names)} project secret(s), which the job's env references: "
              f"{', '.join(sorted(names))}", flush=True)

    def abandon(self, before: state.Before) -> list[str]:
        gone = None
        if self._set_secrets:
            try:
                self.ask("deleting the dstack project secrets this launch set", ["secrets-delete", *self._set_secrets],
                         None, self._cli_env or dict(os.environ))
                gone = f"the dstack project secrets it set ({', '.join(self._set_secrets)})"
            except StepFailed as exc:
                gone = f"the dstack project secrets this launch set are left ({', '.join(self._set_secrets)}): {exc}"
            self._set_secrets = []
        undone = super().abandon(before) + ([gone] if gone else [])
        if self._made_fleet:
            try:
                delete_fleet(self._made_fleet, deadline_s=60)
                undone.append(f"the fleet {self._made_fleet} it applied (dstack fleet delete)")
            except StepFailed as exc:
                undone.append(f"the fleet {self._made_fleet} this launch applied is left: {exc}")
            self._made_fleet = None
        return undone

    def forward(self, name: str, port: int | None = None) -> int:
        """`dstack attach NAME -p LOCAL:PORT` (dstack's own SSH tunnel through the fleet host to the head's dashboard
        port) until Ctrl-C. The address is said and recorded once the dashboard answers through it. The attach is
        ended with SIGINT, as dstack's CLI expects: its tunnel is a background `ssh -f` it closes itself
        (`ssh -O exit`) on the way out, which a SIGTERM would leave holding the port."""
        record = state.load(name) or {}
        remote = record.get("dashboard_port") or 8265
        local = port or remote
        tunnel, said = start_tunnel([require_cli("dstack", "dstack"), "attach", name, "-p", f"{local}:{remote}"])
        return hold_forward(name, tunnel, "dstack attach", f"http://localhost:{local}", timeout=120, said=said,
                            recorded=bool(record), end=end_attach,
                            then=f"eval \"$(rlhf-tasks env {name})\", rlhf-tasks logs {name} --bundle, "
                                 f"rlhf-tasks list --cluster {name}")

    def state_line(self, name: str) -> str | None:
        """The run's status as `dstack ps --json` gives it (dstack's Run: status, status_message, cost)."""
        out = subprocess.run([require_cli("dstack", "dstack"), "ps", "--json", "--last", str(PS_RUNS)],
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise StepFailed("asking dstack for its runs (dstack ps)", (out.stderr or out.stdout).strip()[-300:]
                             or f"exit code {out.returncode}")
        runs = [run for run in json.loads(out.stdout).get("runs") or []
                if (run.get("run_spec") or {}).get("run_name") == name]
        if not runs:
            return f"no run named {name} among dstack's last {PS_RUNS} runs"
        run = runs[0]
        message = f" ({run['status_message']})" if run.get("status_message") and \
            run["status_message"] != run.get("status") else ""
        return f"dstack run {name}: {run.get('status')}{message}, ${float(run.get('cost') or 0):.2f} so far (dstack's)"

    def down(self, name: str) -> str:
        """`dstack stop` of the run, then `dstack fleet delete` of the fleet `launch` applied for it (none: the
        fleet is the user's, and stays)."""
        record = state.load(name) or {}
        said = stop_with_cli([require_cli("dstack", "dstack"), "stop", name, "-y"], name)
        if record.get("dstack_secrets"):
            said += "\n" + forget_secrets(self, name, dict(os.environ), record)
        if record.get("fleet_made"):
            said += "\n" + delete_fleet(record["fleet_made"])
        return said


def forget_secrets(provider: DstackProvider, name: str, env: dict[str, str], record: dict | None = None) -> str:
    """Delete the project secrets `launch` set for cluster `name` (its record names them), and the names from
    the record: what was done."""
    record = record if record is not None else (state.load(name) or {})
    names = record.get("dstack_secrets") or []
    answer = provider.ask(f"deleting {name}'s dstack project secrets", ["secrets-delete", *names], None, env)
    if state.load(name) is not None:
        state.update(name, dstack_secrets=[])
    deleted = answer.get("deleted") or []
    return (f"dstack: deleted {len(deleted)} project secret(s) of {name}: {', '.join(deleted)}" if deleted else
            f"dstack: no project secret of {name} was left")

