"""Proves the Slurm testbed: a real 3-node Slurm cluster, as the Slurm provider will use it.

One cluster for the whole module; the last cluster test closes it and checks that no
Slurm process is left.
"""
from __future__ import annotations

import os
import re
import secrets
import time

import pytest

try:
    import slurm_testbed as stmod
    import testbed as tbmod
except ImportError:  # tests/ imported as a package
    from tests import slurm_testbed as stmod
    from tests import testbed as tbmod

slurm = stmod.make_slurm_fixture(3)

ONE_TASK_PER_NODE = "--nodes=3 --ntasks=3 --ntasks-per-node=1"


def script(tmp_path, body: str, name: str = "job.sh"):
    path = tmp_path / name
    path.write_text("#!/bin/bash\nset -e\n" + body.strip() + "\n")
    return path


def sleepers(slurm, seconds: int) -> dict[str, int]:
    """{host: number of `sleep <seconds>` processes on it}."""
    def is_sleep(cmd: str) -> bool:  # srun runs the command by its full path
        argv = cmd.split()
        return len(argv) == 2 and os.path.basename(argv[0]) == "sleep" and argv[1] == str(seconds)
    return {h.name: sum(is_sleep(cmd) for _, cmd in slurm.host_processes(h.index))
            for h in slurm.testbed.hosts}


def step_daemons(slurm, job: int) -> list[tuple[str, int]]:
    """(host, pid) of the job's slurmstepd processes (named ``slurmstepd: [<job>.<step>]``)."""
    return [(h.name, pid) for h in slurm.testbed.hosts
            for pid, cmd in slurm.host_processes(h.index)
            if cmd.startswith(f"slurmstepd: [{job}.")]


def test_every_node_runs_the_step_once_with_the_exported_env(slurm, tmp_path):
    secret = secrets.token_hex(8)
    job = slurm.sbatch(script(tmp_path, f"""
srun {ONE_TASK_PER_NODE} bash -c 'echo task $SLURM_NODEID $(hostname) $SECRET_NAME_ONLY_VAR \
    $(command -v python3) $(command -v rlhf-tasks)'
"""), "--nodes=3", env=slurm.env(SECRET_NAME_ONLY_VAR=secret))
    assert slurm.wait_job(job, 60) == ("COMPLETED", 0), slurm.output(job)
    tasks = sorted(line.split()[1:] for line in slurm.output(job).splitlines()
                   if line.startswith("task "))
    venv = [os.path.join(tbmod.BIN_DIR, prog) for prog in ("python3", "rlhf-tasks")]
    assert tasks == [[str(i), f"node{i}", secret, *venv] for i in range(3)]


def test_nodelist_and_names_resolve_to_testbed_ips(slurm, tmp_path):
    job = slurm.sbatch(script(tmp_path, 'scontrol show hostnames "$SLURM_JOB_NODELIST"'),
                       "--nodes=3")
    assert slurm.wait_job(job, 60) == ("COMPLETED", 0), slurm.output(job)
    assert slurm.output(job).split() == ["node0", "node1", "node2"]
    for h in slurm.testbed.hosts:
        assert slurm.sh("hostname --ip-address", h.index).split() == [h.ip]
        assert slurm.sh("getent hosts node0", h.index).split() == [
            slurm.testbed.hosts[0].ip, "node0"]


def test_failed_job_reports_its_exit_code(slurm, tmp_path):
    job = slurm.sbatch(script(tmp_path, "echo about to fail\nexit 3"))
    assert slurm.wait_job(job, 60) == ("FAILED", 3)
    assert "about to fail" in slurm.output(job)
    # the job completion record (job_state's fallback once slurmctld forgets the job) agrees
    record = next(line for line in slurm.jobcomp.read_text().splitlines()
                  if line.startswith(f"JobId={job} "))
    fields = stmod.parse_fields(record)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "3:0")
    # and there is no accounting database: sacct cannot answer
    assert "accounting storage is disabled" in slurm.run(["sacct", "-j", str(job)]).output


def test_overlap_step_runs_beside_a_running_step(slurm, tmp_path):
    job = slurm.sbatch(script(tmp_path, f"srun {ONE_TASK_PER_NODE} sleep 302"), "--nodes=3")
    try:
        tbmod.poll(lambda: sleepers(slurm, 302) == {f"node{i}": 1 for i in range(3)}, 30,
                   "the first step on every node")
        # without --overlap a second step waits for the first one's resources (Slurm >=
        # 20.11): started first, it is still waiting when the --overlap step has finished
        plain = slurm.run(f"srun --jobid={job} {ONE_TASK_PER_NODE} hostname", background=True,
                          name="srun-plain")
        out = slurm.sh(f"srun --jobid={job} --overlap {ONE_TASK_PER_NODE} hostname", timeout=30)
        assert sorted(out.split()) == ["node0", "node1", "node2"]
        assert plain.running() and not re.search(r"^node\d", plain.output, re.M), plain.output
        assert slurm.job_state(job).state == "RUNNING"
    finally:
        slurm.scancel(job)  # frees the nodes for the next tests
    assert slurm.wait_job(job, 60).state == "CANCELLED"
    assert plain.wait(30) != 0  # gives up: "Job/step already completing or completed"


def test_scancel_ends_the_job_and_its_step_processes(slurm, tmp_path):
    job = slurm.sbatch(script(tmp_path, f"srun {ONE_TASK_PER_NODE} sleep 300"), "--nodes=3")
    try:
        tbmod.poll(lambda: sleepers(slurm, 300) == {f"node{i}": 1 for i in range(3)}, 30,
                   "the step on every node")
        assert len(step_daemons(slurm, job)) == 4  # the batch step on node0, step 0 on each
    finally:
        slurm.scancel(job)
    assert slurm.wait_job(job, 60).state == "CANCELLED"
    tbmod.poll(lambda: not any(sleepers(slurm, 300).values()), 30,
               "the step's processes to be gone")
    tbmod.poll(lambda: not step_daemons(slurm, job), 30, "the job's slurmstepd to exit")


def test_a_daemon_that_cannot_start_fails_the_boot_at_once(slurm, tmp_path):
    """A second cluster on the same hosts: its slurmctld/slurmd find their ports taken."""
    before = sorted(slurm.slurm_processes())
    started = time.monotonic()
    with pytest.raises(tbmod.TestbedError, match="exited") as err:
        stmod.SlurmCluster(slurm.testbed, tmp_path / "second", boot_timeout=60)
    assert time.monotonic() - started < 20, "reported at the deadline, not when it died"
    assert "Address already in use" in str(err.value)
    assert sorted(slurm.slurm_processes()) == before  # the first cluster is untouched
    assert set(slurm.node_states().values()) == {"idle"}


def test_close_leaves_no_slurm_process(slurm):
    """Last test: it closes the module's cluster."""
    before = slurm.slurm_processes()
    assert sorted(host for host, _, prog in before if prog == "slurmd") == ["node0", "node1", "node2"]
    assert {prog for _, _, prog in before} == {"munged", "slurmctld", "slurmd"}
    slurm.close()
    assert slurm.slurm_processes() == []
    assert all(not p.running() for p in (slurm.munged, slurm.slurmctld, *slurm.slurmd.values()))
    assert all(h.alive for h in slurm.testbed.hosts)  # the testbed itself is not the cluster's


def test_missing_slurm_is_reported(monkeypatch):
    monkeypatch.setattr(stmod, "SLURMD", "/nonexistent/slurmd")
    assert "slurmd missing" in stmod.slurm_missing()
