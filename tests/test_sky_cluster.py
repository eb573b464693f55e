"""The SkyPilot render run by SkyPilot's own code on namespace hosts: SkyPilot's Ray (its pinned
2.9.3, head on 6380, /tmp/ray_skypilot) started as its provisioner starts it, setup run by its
backend, and the driver its RayCodeGen generates from the rendered task, queued through job_lib
on the head as its backend does (tests/sky/README.md says what is real and what is played)."""

from __future__ import annotations

import copy
import re
import sys
import time

import pytest
import yaml

import testbed as tbmod
from conftest import ROOT
from rlhf_tasks import providers
from rlhf_tasks.spec import parse_task

sys.path.insert(0, str(ROOT / "tests" / "sky"))
import skycluster  # noqa: E402  (tests/sky has no __init__: a package named sky would hide SkyPilot's)

TOKEN = "sky-cluster-test-token-0123456789abcdef"
sky_testbed = tbmod.make_testbed_fixture(2, scope="module")


@pytest.fixture(scope="module")
def sky_runtime():
    """SkyPilot's runtime virtualenv (installed from PyPI once, cached by version)."""
    pytest.importorskip("sky")
    return skycluster.runtime()


@pytest.fixture(scope="module")
def sky_cluster(sky_runtime, sky_testbed, tmp_path_factory):
    base = tmp_path_factory.mktemp("skyc")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(base / "client-home"))  # SkyPilot's client side: its logs, its user hash
        started = time.monotonic()
        cluster = skycluster.SkyCluster(sky_testbed, base, nodes=2)
        cluster.start_ray()
        cluster.ray_start_s = time.monotonic() - started
        yield cluster


def launch(cluster, task: dict, directory):
    """Render as a user does, then what `sky launch` does from the rendered file's directory:
    SkyPilot's Task from the YAML, the secret given by --secret, uploads, setup, the job."""
    import sky

    provider = providers.get("sky")
    provider.render_dir = directory
    files = provider.render(provider.plan(parse_task(task)))
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    config = yaml.safe_load(files[f"{task['name']}.sky.yaml"])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(directory)
        sky_task = sky.Task.from_yaml_config(copy.deepcopy(config))
        sky_task.update_secrets({"RAY_AUTH_TOKEN": TOKEN})
        sky_task.expand_and_validate_file_mounts()
        sky_task.expand_and_validate_workdir()
    cluster.place(sky_task, directory)
    return cluster.launch(sky_task, directory)


def test_skypilots_own_ray_holds_the_ports_we_stay_off(sky_cluster):
    """What SkyPilot's Ray 2.9.3 really listens on, beside the ports read from its code."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_sky_render import skypilot_ray_ports

    listening = {int(m) for m in re.findall(r":(\d+)\s", sky_cluster.tb.sh(0, "ss -Htln"))}
    single, _ = skypilot_ray_ports()
    assert single <= listening, (single - listening, sorted(listening))
    version = sky_cluster.tb.sh(0, f"{sky_cluster.runtime}/bin/python -c 'import ray; print(ray.__version__)'")
    assert version.strip() == skycluster.versions()[0]
    print(f"SkyPilot's Ray on 2 hosts started in {sky_cluster.ray_start_s:.0f} s")


def test_tiny_grpo_succeeds_through_skypilots_driver(sky_cluster, tmp_path):
    """tiny-grpo on 2 nodes through RayCodeGen's driver beside SkyPilot's own Ray: setup and run on both
    nodes, our Ray on the ports we keep, the job SUCCEEDED, the token in no log. A few steps and no
    preflight (test_preflight.py's claim): training more proves nothing more about SkyPilot."""
    from sky.skylet import job_lib

    task = yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    task["nodes"] = 2
    task["preflight"] = False
    task["checkpoints"]["path"] = "/opt/checkpoints/tiny-grpo"  # a directory on each host
    task["job"]["args"].update(steps=4, save_every=2, num_prompts=200)
    started = time.monotonic()
    job_id = launch(sky_cluster, task, tmp_path)
    status = sky_cluster.wait(job_id, 240)
    log = sky_cluster.run_log()
    took = time.monotonic() - started
    assert status == job_lib.JobStatus.SUCCEEDED, log[-5000:]
    assert "training on 2 node(s)" in log and "done: steps 1..4" in log and "SUCCEEDED" in log, log[-5000:]
    assert "(head, rank=0," in log and "(worker1, rank=1," in log  # SkyPilot's own prefixes: RayCodeGen ran both
    assert "--ray-client-server-port 20001" in log and "--min-worker-port 20002" in log
    assert TOKEN not in log
    print(f"tiny-grpo through SkyPilot's driver: {took:.0f} s")


def test_a_node_whose_run_fails_fails_skypilots_job(sky_cluster, tmp_path):
    from sky.skylet import job_lib

    task = {"name": "sky-fail", "nodes": 2, "preflight": False, "resources": {"cpus": 1},
            "ray": {"object_store_memory": "80MB"}, "checkpoints": {"path": "/opt/ckpt"},
            "wait": {"head": "2m", "nodes": "2m"},
            "services": [{"name": "web", "where": "every_node", "timeout": "1m",
                          "command": f"echo OMP=${{OMP_NUM_THREADS-unset}} WARN=${{PYTHONWARNINGS-unset}} "
                                     f"> {tmp_path}/env-$SKYPILOT_NODE_RANK; "
                                     # node 1 fails once node 0's service has written its file
                                     # (bounded: 30 s), else SkyPilot may cancel node 0 before.
                                     "if [ \"$SKYPILOT_NODE_RANK\" = 1 ]; then for i in $(seq 300); do "
                                     f"[ -s {tmp_path}/env-0 ] && break; sleep 0.1; done; "
                                     "echo 'node1: broken on purpose' >&2; exit 3; fi; "
                                     "exec python3 -m http.server --bind {node_addr} 23111",
                          "ready": {"http": "http://{node_addr}:23111/"}}],
            "job": {"recipe": "command", "submit": "head", "working_dir": None, "timeout": "3m",
                    "args": {"entrypoint": "python3 -c 'print(1)'"}}}
    job_id = launch(sky_cluster, task, tmp_path)
    status = sky_cluster.wait(job_id, 150)
    log = sky_cluster.run_log()
    assert status == job_lib.JobStatus.FAILED, (status, log[-5000:])
    assert "node1: broken on purpose" in log, log[-5000:]
    # SkyPilot's raylet has what its runner exported; our agent (and so our `ray start`) has not.
    theirs = sky_cluster.tb.sh(0, "for p in $(pgrep -f 'raylet.*:6380'); do tr '\\0' '\\n' < /proc/$p/environ; done")
    assert "OMP_NUM_THREADS=1" in theirs.splitlines() and "PYTHONWARNINGS=ignore" in theirs.splitlines()
    assert (tmp_path / "env-0").read_text().strip() == "OMP=unset WARN=unset"
