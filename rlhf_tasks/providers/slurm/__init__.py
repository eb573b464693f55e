"""Slurm: one self-contained batch script, submitted with `sbatch`.

The script carries the node agent and its plan (heredocs it writes to a directory of
the job beside its output, on the shared filesystem), and runs one step,
`srun --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=1`, with the agent on
every node: rank from SLURM_NODEID, the head the first host of `scontrol show hostnames
"$SLURM_JOB_NODELIST"` resolved to its IPv4 address (never 127.0.1.1: the agent then
takes its address on the route to the second host). The head agent submits the job
when the cluster is ready and exits with its result; the workers leave when the head
goes away; the script exits with the step's code, so Slurm's record of the job is the
job's. No sleeps: the agents wait for conditions. Secrets and the Ray token reach the
job from the submitting environment (`--export=ALL`), never through the script.

An `image` runs with pyxis (`srun --container-image`, the default) or, as verl's AMD
script does, with `docker run`/`podman run` on every node (`placement.slurm.container`).
Inside a container there is no `scontrol`, so the script expands the host list once
(RLHF_TASKS_HOSTS) and the contract reads it from there. A docker/podman container is not
the Slurm step's: the engine runs it (podman's conmon, docker's containerd-shim) outside
the step, so Slurm's signals and its final SIGKILL reach only the engine's client. Each
node's task therefore runs the client under a small wrapper (`container.sh`, beside the
agent) that stops and removes the container by its name, `<task name>-<job id>`, however
the task ends (its end, or Slurm's SIGTERM on scancel or the time limit); and after the
agents' step, one more step stops and removes every node's container by name, for a task
Slurm killed before it could (`--kill-on-bad-exit` sends SIGKILL KillWait after SIGTERM).

`launch` submits with `sbatch --parsable` and hands the launcher a handle: the agents'
output files on the shared filesystem (`rlhf-tasks-<id>/node<N>.out`; the head's holds the
Ray job's log) and Slurm's record of the job (its state and reason while it waits, its exit
code at the end); the launcher never needs to reach the cluster's dashboard. `status` asks Slurm for
the job and, through a second step beside the first (`srun --overlap`), Ray for the job;
`down` is `scancel`, waiting until every step is gone. For docker/podman, `down` first asks
(`scancel --signal=TERM`: a signal, not the kill): the wrappers stop their containers, a
clean-up step after the agents' removes any a killed task left on every node, and the job
ends by itself; only if it has not within a deadline is it cancelled. (After scancel's kill
the wrappers would have only Slurm's KillWait to stop them.)

Slurm's own options (the guides' `--nodelist`, `--output`/`--error`, `--mail-type`/`--mail-user`,
`--overcommit`) are fields of `placement.slurm`; any other passes through `placement.slurm.sbatch`, refused where
it sets what a line of the render sets (sbatch takes the later line silently) and, where sbatch is installed and
configured, by `sbatch --test-only` (`check`, and `launch` before anything is written), in sbatch's words.

The package, by concern: `render` (pure: the task's checks and the batch script), `placement` (the task's
placement.slurm and what a passed-through sbatch option may not fight), `container` (the image under pyxis,
docker or podman: the wrapper and the container's command), `commands` (Slurm's commands run here: the
job's record, sbatch --test-only, the files sbatch names); this module submits, follows, asks and cancels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ... import state
from ...agent.protocol import AgentError, parse_result, wait_for
from ...console import say
from ...errors import BadInput, StepFailed
from ...plan import Plan
from ..base import Cluster
from .commands import (FINAL_STATES, SLURM_CONFS, SlurmJob, exit_text, filename, job_info, sbatch_test_only,
                       sbatch_version, slurm_command, slurm_config)
from .container import CONTAINER_STOP_S, ENGINES
from .placement import DEFAULT_OUTPUT, slurm_placement
from .render import SlurmRender, run_dir_of


class SlurmProvider(SlurmRender):
    def ready(self, plan: Plan) -> None:
        """The commands launch needs, and Slurm's own word on the script (sbatch --test-only), before anything
        is written."""
        self.can_submit(plan)
        self.sbatch_test(plan)

    def can_submit(self, plan: Plan) -> None:
        if plan.job.mode == "ray" and plan.job.submit == "client":
            raise BadInput("job.submit: `launch --provider slurm` follows the job the head submits; for a client "
                           "submission render the script, sbatch it, and forward the head's dashboard port (ssh -L)")
        for name in ("sbatch", "scontrol", "scancel"):
            slurm_command(name)

    def ask_own_code(self, plan: Plan) -> list[str]:
        return [self.sbatch_test(plan)]

    def sbatch_test(self, plan: Plan) -> str:
        """The script as Slurm's own sbatch takes it, where sbatch is installed here: `sbatch --test-only`
        (its option parser over the #SBATCH lines, then slurmctld's answer: the partition, nodes, features and
        GPUs exist, the limits hold). A refusal is BadInput with sbatch's words, naming the field of each line
        without which sbatch does not refuse it; else the line `check` prints (what sbatch said, or why nothing
        was checked: no sbatch, or no Slurm it reaches)."""
        sbatch = shutil.which("sbatch")
        name = f"{plan.name}.sbatch"
        if sbatch is None:
            return f"sbatch --test-only of {name}: not checked: sbatch is not on PATH here (it is on a login node)"
        if slurm_config() is None:
            return (f"sbatch --test-only of {name}: not checked: no Slurm configuration here for sbatch (SLURM_CONF, "
                    f"{', '.join(SLURM_CONFS)})")
        version, script = sbatch_version(sbatch), self.script(plan)
        taken, words = sbatch_test_only(sbatch, script)
        if taken:
            return f"{version}'s sbatch --test-only takes {name}: {words}"
        if taken is None:
            return f"{version}'s sbatch --test-only of {name}: not checked: it reached no Slurm here ({words})"
        blamed = []  # the lines without which sbatch does not refuse it: the passed ones first, then the fields'
        for option, where in sorted(self.sbatch_lines(plan), key=lambda line: (
                not line[1].startswith("placement.slurm.sbatch"), not line[1].startswith("placement.slurm"))):
            without, _ = sbatch_test_only(sbatch, script.replace(f"\n#SBATCH {option}\n", "\n", 1))
            if without is not False:
                blamed.append((option, where))
            if without is None:  # its parser took the rest, and no Slurm answers (each try waits MessageTimeout)
                break
        fields = [where for _, where in blamed if not where.startswith("the script")] or ["placement.slurm"]
        without = (" (it does not refuse it without #SBATCH " + ", nor without ".join(option for option, _ in blamed)
                   + ")" if blamed else f" (its #SBATCH lines: {' '.join(self.sbatch_options(plan))})")
        raise BadInput(f"{', '.join(dict.fromkeys(fields))}: {version}'s sbatch --test-only refuses {name}: "
                       f"{words}{without}")

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """sbatch; the handle reads the agents' output on the shared filesystem and Slurm's
        record of the job (its state while it waits, its exit code at the end)."""
        self.can_submit(plan)  # the launcher asked sbatch --test-only before (ready)
        sbatch = slurm_command("sbatch")
        directory, token, env = self.stage(plan, secrets)
        slurm = slurm_placement(plan.placement)
        for pattern in (slurm.output, slurm.error):  # Slurm opens them in a directory that must be there
            if pattern and "/" in pattern:
                (directory / pattern.rpartition("/")[0]).mkdir(parents=True, exist_ok=True)
        out = subprocess.run([sbatch, "--parsable", f"{plan.name}.sbatch"], cwd=directory, env=env,
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise StepFailed("sbatch", out.stderr.strip() or out.stdout.strip() or f"exit code {out.returncode}")
        job_id = out.stdout.strip().splitlines()[-1].split(";")[0]
        state.save(plan.name, {"provider": self.name, "cluster_id": job_id, "job_id": job_id,
                               "directory": str(directory), "mode": plan.job.mode, "image": plan.image,
                               "container": slurm_placement(plan.placement).container if plan.image else None,
                               "dashboard_port": plan.ray.dashboard_port})
        say(f"submitted Slurm job {job_id} ({directory / (plan.name + '.sbatch')})")
        job = SlurmJob(job_id)
        run_dir = run_dir_of(directory, job_id)
        script_logs = [filename(pattern, plan.name, job_id, directory)
                       for pattern in (slurm.output or DEFAULT_OUTPUT, slurm.error) if pattern]
        return Cluster(name=plan.name, cluster_id=job_id, token=token, head_alive=job.running,
                       node_logs=[str(run_dir / f"node{rank}.out") for rank in range(plan.nodes)]
                       + [str(path) for path in script_logs if path],
                       tend=job.changes, describe=job.describe)

    def status(self, name: str) -> str | None:
        record = state.load(name)
        if not record or record.get("provider") != self.name:
            return None
        job_id = record["job_id"]
        info = job_info(job_id)
        if not info:
            return f"Slurm job {job_id}: unknown to Slurm (finished long ago?)"
        reason = f" ({info['Reason']})" if info.get("Reason") not in (None, "", "None") else ""
        lines = [f"Slurm job {job_id}: {info.get('JobState')}{reason}, nodes {info.get('NodeList') or '-'}, "
                 f"run time {info.get('RunTime', '-')} of {info.get('TimeLimit', '-')}, {exit_text(info)}"]
        head_out = run_dir_of(Path(record["directory"]), job_id) / "node0.out"
        result = parse_result(head_out.read_text(errors="replace")) if head_out.exists() else None
        if result is not None:
            job = result.get("job") or {}
            lines.append(f"job {job.get('submission_id') or '-'}: {job.get('status') or 'not run'} "
                         f"(the head agent ended with exit code {result.get('exit_code')})")
        elif info.get("JobState") == "RUNNING" and record.get("mode") == "ray" and not record.get("image"):
            lines.append(self._ray_jobs(name, job_id, info, record.get("dashboard_port", 8265)))
        else:
            lines.append(f"job: see the head agent's output, {head_out}")
        return "\n".join(lines)

    def _ray_jobs(self, name: str, job_id: str, info: dict, port: int) -> str:
        """Ray's view of the jobs, asked on the head through a second step beside the agents'."""
        hosts = subprocess.run([slurm_command("scontrol"), "show", "hostnames", info.get("NodeList", "")],
                               capture_output=True, text=True).stdout.split()
        if not hosts:
            return "Ray jobs: the head node is not known yet"
        query = ("import json, os, sys, urllib.request\n"
                 "token = os.environ.get('RAY_AUTH_TOKEN')\n"
                 "request = urllib.request.Request('http://127.0.0.1:%s/api/jobs/' % sys.argv[1],"
                 " headers={'Authorization': 'Bearer ' + token} if token else {})\n"
                 "for job in json.load(urllib.request.urlopen(request, timeout=10)):\n"
                 "    print('job %s: %s' % (job.get('submission_id'), job.get('status')))\n")
        token = state.token(name)
        env = {**os.environ, **({"RAY_AUTH_TOKEN": token} if token else {})}
        argv = [slurm_command("srun"), f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1",
                f"--nodelist={hosts[0]}", "python3", "-c", query, str(port)]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        except subprocess.TimeoutExpired:
            return f"Ray jobs: no answer from the head ({hosts[0]}) within 60s"
        if out.returncode != 0:
            return f"Ray jobs: not reachable yet on {hosts[0]} ({(out.stderr.strip().splitlines() or ['?'])[-1]})"
        return out.stdout.strip() or "Ray jobs: none submitted yet"

    def down(self, name: str) -> str:
        record = state.load(name)
        if not record or not record.get("job_id"):
            return f"no Slurm job named {name} is known here"
        job_id = record["job_id"]
        scancel, squeue = slurm_command("scancel"), slurm_command("squeue")

        def gone() -> tuple[bool, object]:
            steps = subprocess.run([squeue, "-h", "-s", "-j", job_id], capture_output=True, text=True).stdout.strip()
            job_state = job_info(job_id).get("JobState")
            done = not steps and (job_state is None or job_state in FINAL_STATES)
            return done, f"job {job_state}, steps: {steps.replace(chr(10), '; ') or 'none'}"

        if record.get("container") in ENGINES and job_info(job_id).get("JobState") == "RUNNING":
            # Asked, not killed: each node's wrapper stops its container by name, the script's
            # clean-up step removes any a killed task left, and the job ends by itself (FAILED:
            # its agents were stopped by a signal). scancel's kill would leave the wrappers only
            # KillWait for that, and a container outlives a job that ends before it is stopped.
            subprocess.run([scancel, "--signal=TERM", job_id], capture_output=True, text=True)
            limit = CONTAINER_STOP_S + 60  # the containers' stop, then the clean-up step on a busy cluster
            try:
                wait_for(f"Slurm job {job_id} to stop its containers and end", gone, limit, interval=0.2,
                         max_interval=1.0, report=say)
                state.forget(name)
                return f"stopped Slurm job {job_id} and its {record['container']} containers; its steps are gone"
            except AgentError as exc:
                say(f"{exc}; cancelling it")
        subprocess.run([scancel, job_id], capture_output=True, text=True)
        wait_for(f"Slurm job {job_id} and its steps to end", gone, 300, interval=0.2, max_interval=1.0, report=say)
        state.forget(name)
        return f"cancelled Slurm job {job_id}; its steps are gone"
