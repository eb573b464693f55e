"""SkyPilot: one task YAML with `num_nodes: N`, launched with `sky launch` (a cluster)
or `sky jobs launch` (a managed job that SkyPilot recovers).

SkyPilot runs its own Ray on every node (GCS 6380, dashboard 8266, dashboard agent
52365, object manager 8076, client server 10001 on its head, workers on 11002-19999 on its
head and Ray's default 10002-19999 on the others: sky/provision/instance_setup.py), so ours
takes other ports, its workers included, and is never stopped machine-wide. SkyPilot's
command runner exports OMP_NUM_THREADS=1 and PYTHONWARNINGS=ignore before its `ray start`,
and its job hands them on to the task over the task's own envs (log_lib.add_ray_env_vars):
`run` puts back the task's value or unsets them, so that our Ray gives each of its workers
Ray's own default. `setup` runs the task's setup commands; `run` starts the node agent,
which reads SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS and SKYPILOT_NUM_NODES. Secrets and the
Ray token are `secrets:` with null values, filled by `sky launch --secret NAME` from the
local environment.

`sky launch` resolves `file_mounts` sources and `workdir` against the directory it runs
from, which the header names: the directory of the rendered file, so both are written
relative to it. The task's job.working_dir (with `submit: head`) is SkyPilot's `workdir`,
synced to ~/sky_workdir on every node, where SkyPilot's run script starts `run`; the head
submits the job from there.

Checkpoints go to a directory on each node unless the task names shared storage in
`checkpoints.shared.sky`: a bucket mounted at the path, or a SkyPilot volume. The
shared-memory size reaches the container as `docker run --shm-size` when the task has an
image; a VM without one keeps its own /dev/shm (the rendered file says so).

The package, by concern: `render` (pure: ports, the task's checks, SkyPilot's own code asked, the task
YAML), `resources` (GPUs, memory and disk in SkyPilot's words), `catalog` (its accelerator catalog read as
files, and its optimizer's price), `storage` (what every node shares: checkpoints.shared.sky), `forward`
(the dashboard's ssh forward), `joblog` (SkyPilot's job log: by node, its word on the job, the failure
bundle); this module drives the `sky` CLI: launch, status, down, forward.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ... import state
from ...agent.protocol import probe_tcp
from ...agent.protocol.ports import free_port
from ...errors import StepFailed
from ...plan import Plan
from ..base import Cluster, end_process, hold_forward, require_cli, stop_with_cli, write_files
from .catalog import optimizer_price
from .forward import FORWARD_TIMEOUT_S, listening, log_tail, open_forward
from .joblog import ANSI, bundle_from_job_log, by_node, skypilots_word
from .render import SkyRender

#: Where `sky` starts its local API server by default.
API_SERVER_PORT = 46580


class SkyProvider(SkyRender):
    state_elsewhere = "sky status {name}"  # asking starts SkyPilot's API server: `ps` leaves it to the user
    #: The launch's dashboard is its own `ssh -L`, gone with the launcher: `rlhf-tasks forward NAME` opens another.
    forward_after_launch = True
    #: (optimizer_price: none on Kubernetes, SSH, Slurm, or without an enabled cloud; launch says which)
    launch_price = ("SkyPilot's optimizer's price at launch (the dearest region it may fail over to, which "
                    "max_hourly_cost does not bound)")
    _started_api_server = False
    #: `sky launch` made the cluster (its job runs detached): a later failure here leaves it to `down`.
    _launched = False

    def counted_plan(self, plan: Plan) -> tuple[Plan, str]:
        """The plan with the price its head counts: SkyPilot's optimizer's for the rendered task (optimizer_price),
        where it prices it; the task's otherwise. With the words `launch` says."""
        try:
            import sky  # noqa: F401
        except ImportError:
            return plan, "SkyPilot's optimizer: not asked (skypilot is not installed here)"
        price, words = optimizer_price(self.task_config(plan))
        given = plan.budget.price_per_hour
        if price is None:
            return plan, f"{words}: the head counts " + (f"placement.price_per_hour, ${given:.2f}/h" if given is not None
                                                         else "no price")
        if given is not None:
            words += f" (placement.price_per_hour: ${given:.2f}/h)"
        return plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": price})), \
            f"{words}: the head counts ${price:.2f}/h"

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """`sky launch` (then the dashboard through `ssh -L` to the head, which SkyPilot
        names in ~/.ssh/config), or `sky jobs launch` for a managed job."""
        sky = require_cli("sky", "sky")
        managed = bool(self.chosen["managed"])
        # `sky launch` starts SkyPilot's API server when none runs; a failed launch stops it again.
        self._started_api_server = probe_tcp("127.0.0.1", API_SERVER_PORT, timeout=1.0) is not None
        directory, token, env = self.stage(plan, secrets)
        counted, said = self.counted_plan(plan)
        from ...console import say
        say(f"sky: {said}")
        if counted.budget.price_per_hour != plan.budget.price_per_hour:  # the head reads its price from the files
            plan = counted
            write_files(directory, self.render(plan))
        names = list(secrets) + ([plan.token_env] if token else [])
        secret_args = [arg for name in names for arg in ("--secret", name)]
        yaml_file = f"{plan.name}.sky.yaml"
        if managed:
            argv = [sky, "jobs", "launch", "-n", plan.name, yaml_file, *secret_args, "-y"]
        else:
            argv = [sky, "launch", "-c", plan.name, yaml_file, *secret_args, "-y", "--detach-run"]
        if managed:  # `sky jobs launch` streams the job's log (the head agent's among it) until the job ends
            log = directory / "sky-jobs-launch.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(argv, cwd=directory, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
            state.save(plan.name, {"provider": self.name, "cluster_id": plan.name, "managed": True})
            return Cluster(name=plan.name, cluster_id=plan.name, token=token, head_alive=lambda: proc.poll() is None,
                           node_logs=[str(log)], close=lambda: end_process(proc),
                           price_per_hour=plan.budget.price_per_hour,
                           describe=lambda: [] if proc.poll() is None else
                           [f"sky jobs launch exited with code {proc.returncode}"])
        self._launched = False
        proc = subprocess.Popen(argv, cwd=directory, env=env)
        try:
            returncode = proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C ends the `sky` client only: SkyPilot's API server goes on with the launch ("Request will
            # continue running asynchronously", sky/client/cli/command.py). The record makes the launcher's
            # Ctrl-C handling `down` the cluster (`sky down` kills the cluster's other requests first).
            from ...console import say
            try:
                proc.wait(30)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                end_process(proc)
            state.save(plan.name, {"provider": self.name, "cluster_id": plan.name})
            say(f"SkyPilot's API server goes on with the launch of {plan.name} after Ctrl-C (`sky api status` shows "
                f"it, `sky api cancel` cancels it); if `sky down {plan.name}` below finds no cluster yet, run it "
                f"again once `sky status` shows {plan.name}")
            raise
        if returncode != 0:
            raise StepFailed("sky launch", f"exit code {returncode}")
        self._launched = True
        port = plan.ray.dashboard_port
        local = port if not listening(port) else free_port()
        state.save(plan.name, {"provider": self.name, "cluster_id": plan.name, "dashboard_port": port})
        # SkyPilot's own record of the job: `sky logs NAME` follows the cluster's last job (every node's
        # output, prefixed by SkyPilot) and exits when it ends, with its status as exit code. Kept here: the
        # render's autostop takes the cluster, its logs with it, a minute after the job ends.
        job_log = directory / "sky-job.log"
        with open(job_log, "wb") as out:
            follower = subprocess.Popen([sky, "logs", plan.name], cwd=directory, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            tunnel = open_forward(plan.name, local, port, directory / "ssh-forward.log")
        except BaseException:
            end_process(follower)
            raise
        dashboard = f"http://localhost:{local}"
        state.update(plan.name, dashboard=dashboard, job_log=str(job_log))
        scrubbed = {**secrets, **({plan.token_env: token} if token else {})}

        def describe() -> list[str]:
            lines = []
            if follower.poll() is not None:
                lines += skypilots_word(plan.name, follower.returncode, job_log.read_text(errors="replace"))
            if tunnel.poll() is not None:
                lines.append(f"the ssh forward of the dashboard (ssh -L {local}:127.0.0.1:{port} {plan.name}) exited "
                             f"with code {tunnel.returncode}: {log_tail(directory / 'ssh-forward.log') or 'no output'}")
            return lines

        def head_log() -> str:
            """The head's lines of SkyPilot's job log (its prefix taken off), then, once the job is over,
            what SkyPilot says of it and each node's first error."""
            text = job_log.read_text(errors="replace") if job_log.exists() else ""
            lines = by_node(text).get(0, [])
            if follower.poll() is not None:
                lines += skypilots_word(plan.name, follower.returncode, text)
            return "".join(line + "\n" for line in lines)

        def gather_here(reason: str) -> tuple[str, str] | None:
            made = bundle_from_job_log(plan.name, job_log, scrubbed, str(state.run_dir(plan.name)), reason)
            return (made, f"each node's output in SkyPilot's job log (`sky logs {plan.name}`), kept here as it ran") \
                if made else None

        def close() -> None:
            end_process(tunnel)
            end_process(follower)
        def job_ended() -> str | None:
            """SkyPilot's word once `sky logs` ended with the job not SUCCEEDED (a node's failure ends them all)."""
            code = follower.poll()
            return None if code in (None, 0) else skypilots_word(plan.name, code, "")[0]
        return Cluster(name=plan.name, cluster_id=plan.name, dashboard=dashboard, token=token,
                       head_alive=lambda: tunnel.poll() is None and follower.poll() is None, head_log=head_log,
                       close=close, describe=describe, gather_here=gather_here, job_ended=job_ended,
                       price_per_hour=plan.budget.price_per_hour)

    def bundle_here(self, name: str, secrets: dict[str, str]) -> str | None:
        """`logs NAME --bundle` once the dashboard is gone (the job over, autostop may have taken the
        cluster): the bundle of the job log the launch kept here."""
        job_log = (state.load(name) or {}).get("job_log")
        if not job_log:
            return None
        return bundle_from_job_log(name, Path(job_log), secrets, str(state.run_dir(name)),
                                   "asked for with `rlhf-tasks logs --bundle`, from SkyPilot's job log kept here")

    def forward(self, name: str, port: int | None = None) -> int:
        """`ssh -N -L LOCAL:127.0.0.1:PORT NAME` through the ssh config SkyPilot writes for the cluster
        (~/.sky/generated/ssh/NAME, included from ~/.ssh/config), until Ctrl-C."""
        record = state.load(name) or {}
        remote = record.get("dashboard_port") or 8265
        local = port or remote
        log = state.run_dir(name) / self.name / "ssh-forward.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        tunnel = open_forward(name, local, remote, log)
        return hold_forward(name, tunnel, "ssh -L", f"http://localhost:{local}", timeout=FORWARD_TIMEOUT_S,
                            said=lambda: log_tail(log), recorded=bool(record),
                            silent_head=f" (the forward is up, the head's Ray dashboard does not answer: is the "
                                        f"cluster's Ray still running? sky status {name})",
                            then=f"eval \"$(rlhf-tasks env {name})\", rlhf-tasks logs {name} --bundle, "
                                 f"rlhf-tasks list --cluster {name}")

    def status(self, name: str) -> str | None:
        """`sky status NAME` (asks SkyPilot's API server, which it starts when none runs)."""
        out = subprocess.run([require_cli("sky", "sky"), "status", name], capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)
        said = ANSI.sub("", out.stdout + out.stderr).strip()
        if out.returncode != 0:
            raise StepFailed(f"sky status {name}", said or f"exit code {out.returncode}")
        row = next((line.split() for line in said.splitlines() if line.split()[:1] == [name]), None)
        if row is None:
            return f"{name}: SkyPilot has no such cluster (sky status {name}: {' '.join(said.split())[-300:]})"
        return f"{name}: SkyPilot says: " + "\n  ".join(line.rstrip() for line in said.splitlines() if line.strip())

    def state_line(self, name: str) -> str | None:
        return None  # asking `sky status` starts SkyPilot's API server: `ps` leaves it to the user

    def down(self, name: str) -> str:
        record = state.load(name) or {}
        sky = require_cli("sky", "sky")
        return stop_with_cli([sky, "jobs", "cancel", "-n", name, "-y"] if record.get("managed") else
                             [sky, "down", name, "-y"], name)

    def ready(self, plan: Plan) -> None:
        require_cli("sky", "sky")

    def refuses_missing_secrets(self, plan: Plan, missing: list[str]) -> str | None:
        return ("the rendered file names every secret with no value, and `sky launch` refuses one that no "
                "--secret gives (\"No value available for secret(s)\") unless a managed secrets provider has it")

    def abandon(self, before: state.Before) -> list[str]:
        """Also stop SkyPilot's local API server when this launch is what started it. Once `sky launch`
        made the cluster (its job runs detached), nothing is undone: its record stays, for `down`."""
        if self._launched:
            return []
        undone = super().abandon(before)
        if self._started_api_server:
            subprocess.run([require_cli("sky", "sky"), "api", "stop"], capture_output=True, text=True)
            undone.append("the SkyPilot API server it started")
        return undone
