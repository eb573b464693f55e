"""`sky launch --infra slurm` run by SkyPilot itself on the project's real Slurm.

SkyPilot 0.14.1's own CLI and API server (on the testbed's laptop, loopback), its optimizer, its
Slurm provisioner (an sbatch "virtual instance" job, srun --overlap into it over SSH through the
login node) and its setup and run machinery, against tests/slurm_testbed.py's Slurm
(slurmctld + one slurmd per namespace host).  tests/sky/README.md ("Slurm") says what is real
and what is played; tests/sky/slurm_infra.py builds it.
"""

from __future__ import annotations

import re
import sys
import time

import pytest

import slurm_testbed as stmod
import testbed as tbmod
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "sky"))
import slurm_infra  # noqa: E402  (tests/sky has no __init__: a package named sky would hide SkyPilot's)

ANSI = re.compile(r"\x1b\[[0-9;]*m")
slurm = stmod.make_slurm_fixture(2, real_memory_mb=8192)


def plain(text: str) -> str:
    return ANSI.sub("", text)


@pytest.fixture(scope="module")
def sky_slurm(slurm, tmp_path_factory):
    pytest.importorskip("sky")
    started = time.monotonic()
    cache = slurm_infra.prepare()
    infra = slurm_infra.SkySlurm(slurm, tmp_path_factory.mktemp("skyslurm"), cache)
    infra.prepare_s = time.monotonic() - started
    yield infra
    infra.close()


def node_sh(infra, cmd: str) -> str:
    """A shell command on the login node (its /root is the cluster's shared home)."""
    return infra.slurm.run(["/bin/bash", "-c", cmd], 0, cwd="/root", timeout=60).output


def test_sky_check_enables_the_testbed_slurm(sky_slurm):
    """`sky check slurm` reaches the login node over SSH, runs sinfo there and enables the
    cluster named in ~/.slurm/config; `sky gpus list` asks the same Slurm for its GPUs."""
    out = plain(sky_slurm.sky("check", "slurm", timeout=240, check=True).output)
    assert re.search(r"Slurm: enabled", out), out
    assert re.search(rf"{slurm_infra.SLURM_CLUSTER}: enabled", out), out
    gpus = plain(sky_slurm.sky("show-gpus", "--infra", "slurm", timeout=120, check=True).output)
    assert "No GPUs found in any Slurm partition" in gpus, gpus  # the testbed's nodes have none


def test_sky_launch_runs_setup_and_run_on_two_slurm_nodes(sky_slurm):
    """A trivial two-node task through `sky launch -c t1 t1.yaml --infra slurm`: SkyPilot's
    sbatch job holds both nodes, its runtime is installed on them, setup runs on each node with
    its SKYPILOT_SETUP_NODE_RANK, run on each with SKYPILOT_NODE_RANK, the job SUCCEEDS; `sky
    down` cancels the Slurm job."""
    (sky_slurm.laptop_home / "t1.yaml").write_text(
        "name: t1\nnum_nodes: 2\nresources:\n  cpus: 1\n  memory: 1\n"
        "setup: echo SETUP rank=$SKYPILOT_SETUP_NODE_RANK\n"
        "run: |\n"
        "  echo RUN rank=$SKYPILOT_NODE_RANK host=$(hostname) ips=$(echo $SKYPILOT_NODE_IPS)"
        " omp=${OMP_NUM_THREADS-unset} pwd=$PWD\n")
    sky_slurm.sky("check", "slurm", timeout=240, check=True)
    started = time.monotonic()
    launch = sky_slurm.sky("launch", "-c", "t1", "t1.yaml", "--infra", "slurm", "-y", timeout=600)
    launch_s = time.monotonic() - started
    out = plain(launch.output)
    logs = node_sh(sky_slurm, "cd /root/.sky_clusters/t1-*/ && for f in $(find sky_logs -name '*.log'); "
                              "do echo \"--- $f\"; cat \"$f\"; done")
    print(f"sky launch took {launch_s:.0f} s\n{out}\n{logs}")
    assert launch.returncode == 0, out + logs
    assert "Job finished (status: SUCCEEDED)" in out, out
    assert re.search(r"\(setup pid=\d+\) SETUP rank=0", out), out
    assert re.search(r"\(setup pid=\d+, ip=10\.77\.0\.11\) SETUP rank=1", out), out
    # run: one Slurm task per node (SlurmCodeGen: srun --ntasks-per-node=1, rank = SLURM_PROCID),
    # in ~/sky_workdir of the cluster's own home; SkyPilot's runner's OMP_NUM_THREADS=1 reaches it
    ips = "10.77.0.10 10.77.0.11"
    assert re.search(rf"\(head, rank=0, pid=\d+\) RUN rank=0 host=node0 ips={ips} omp=1 "
                     r"pwd=/root/\.sky_clusters/t1-\w+/sky_workdir$", out, re.M), out
    assert re.search(rf"\(worker1, rank=1, pid=\d+, ip=10\.77\.0\.11\) RUN rank=1 host=node1 ips={ips} omp=1 ",
                     out), out
    jobs = node_sh(sky_slurm, "squeue -h -o '%i %j %T %D'")
    assert re.search(r"^\d+ t1-\w+ RUNNING 2$", jobs, re.M), jobs  # SkyPilot's virtual instance
    queue = plain(sky_slurm.sky("queue", "t1", timeout=120, check=True).output)
    assert re.search(r"^1\s+t1\s+root\s.*SUCCEEDED", queue, re.M), queue
    down = sky_slurm.sky("down", "t1", "-y", timeout=300)
    assert down.returncode == 0, down.output
    tbmod.poll(lambda: not node_sh(sky_slurm, "squeue -h -o '%j'").strip(), 60, "SkyPilot's Slurm job to end")
    status = plain(sky_slurm.sky("status", timeout=120, check=True).output)
    assert "No existing clusters." in status, status

