"""KubeRay's part played on namespace hosts (tests/kuberay_harness.py): the rendered RayJob runs
the way the operator would run it. Pure tests check what the operator makes of the rendered
objects (its `ray start` after our command, its env, wait-gcs-ready, the SidecarMode submitter)
and that the shell lines it builds do what the render means. The cluster run on the harness
(tiny-grpo on 3 pods, a late and a lost worker) goes through `launch` and kubectl:
tests/test_kuberay_launch.py."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from subprocess import list2cmdline

import yaml

import kuberay_harness as kh
from rlhf_tasks import providers
from rlhf_tasks.providers.kuberay import RAY_ENV_FILE
from rlhf_tasks.spec import parse_task


def render(task: dict) -> tuple[object, dict, dict]:
    provider = providers.get("kuberay")
    plan = provider.plan(parse_task(task, "t.yaml"))
    (text,) = provider.render(plan).values()
    configmap, rayjob = yaml.safe_load_all(text)
    return plan, configmap, rayjob


def tiny_grpo(ckpt: Path, steps: int = 150, save_every: int = 25) -> dict:
    return {"name": "tiny", "nodes": 3, "resources": {"cpus": 1}, "env": {"PYTHONUNBUFFERED": "1"},
            "preflight": "off", "ray": {"object_store_memory": "80MB"},
            "checkpoints": {"path": str(ckpt), "shared": {"kuberay": {"claim": "ckpt"}}},
            "wait": {"head": "3m", "nodes": "3m"},
            "job": {"recipe": "tiny-grpo", "working_dir": None, "timeout": "10m",
                    "args": {"steps": steps, "save_every": save_every, "prompts_per_step": 8, "group_size": 8,
                             "num_prompts": 200}}}


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# --- what the operator makes of the rendered objects (no cluster) ----------------------------

def test_the_head_pod_runs_our_command_then_kuberays_ray_start_with_its_env_and_the_submitter(tmp_path):
    plan, _, rayjob = render(tiny_grpo(tmp_path / "ckpt"))
    ours = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
    pod = kh.build_pod(rayjob, "tiny-x2b4c", "tiny-q7z9k", "tiny-x2b4c-head-abcde")
    assert pod["metadata"]["labels"].items() >= {"ray.io/cluster": "tiny-x2b4c", "ray.io/node-type": "head",
                                                 "ray.io/group": "headgroup"}.items()
    spec = pod["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["rlhf-tasks-prepare"]
    assert [c["name"] for c in spec["containers"]] == ["ray-head", "ray-job-submitter"]
    assert spec["restartPolicy"] == "Never"  # SidecarMode
    ray, submitter = spec["containers"]
    start = ("ray start --head  --block  --dashboard-agent-listen-port=52365  --dashboard-host=0.0.0.0 "
             " --dashboard-port=8265  --metrics-export-port=8080  --num-cpus=1  --object-store-memory=80000000 "
             " --port=6379  --ray-client-server-port=10001 ")
    assert ray["command"] == ["/bin/bash", "-c", "--"]
    assert ray["args"] == [" %s  && ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; %s" % (ours, start)]
    env = env_of(ray)
    assert env["KUBERAY_GEN_RAY_START_CMD"] == start and env["RAY_ADDRESS"] == "127.0.0.1:6379"
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "tiny-x2b4c", "key": "auth_token"}}
    assert env["RLHF_TASKS_RANK"] == "0" and "FQ_RAY_IP" not in env
    assert {"name": "shared-mem", "mountPath": "/dev/shm"} in ray["volumeMounts"]  # no shm_size: KubeRay's own
    # The prepare init container: FQ_RAY_IP (KubeRay's, for every init container), no token.
    prepare = env_of(spec["initContainers"][0])
    assert prepare["FQ_RAY_IP"] == "tiny-x2b4c-head-svc.default.svc.cluster.local" and "RAY_AUTH_TOKEN" not in prepare
    senv = env_of(submitter)
    assert senv["RAY_JOB_SUBMISSION_ID"] == "tiny-q7z9k" and senv["RAY_AUTH_MODE"] == "token"
    assert senv["RAY_AUTH_TOKEN"] == env["RAY_AUTH_TOKEN"] and senv["PYTHONUNBUFFERED"] == "1"
    assert submitter["command"] == ["/bin/bash", "-ce", "--"]
    (line,) = submitter["args"]
    assert line.startswith("until python -c \"import urllib.request; r=urllib.request.urlopen("
                           "'http://localhost:8265/api/gcs_healthz', timeout=10)")
    assert line.endswith("ray job submit --address http://127.0.0.1:8265 --submission-id tiny-q7z9k -- %s ;"
                         % rayjob["spec"]["entrypoint"])


def test_a_worker_pod_waits_for_the_gcs_then_joins_the_head_service():
    _, _, rayjob = render(tiny_grpo(Path("/tmp/c")))
    pod = kh.build_pod(rayjob, "tiny-x2b4c", "tiny-q7z9k", "tiny-x2b4c-workers-worker-bcdfg", "workers")
    spec = pod["spec"]
    (wait,) = spec["initContainers"]
    fqdn = "tiny-x2b4c-head-svc.default.svc.cluster.local"
    assert wait["name"] == "wait-gcs-ready" and "ray health-check --address %s:6379 > /dev/null 2>&1" % fqdn \
        in wait["args"][0] and "sleep 5" in wait["args"][0]
    wenv = env_of(wait)
    assert wenv["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "tiny-x2b4c", "key": "auth_token"}}
    assert wenv["FQ_RAY_IP"] == fqdn and wenv["RLHF_TASKS_RANK"] == "1"
    (ray,) = spec["containers"]
    assert ray["args"][0].endswith("ray start  --address=%s:6379  --block  --dashboard-agent-listen-port=52365 "
                                   " --metrics-export-port=8080  --num-cpus=1  --object-store-memory=80000000 " % fqdn)
    env = env_of(ray)
    assert env["FQ_RAY_IP"] == fqdn and env["RAY_IP"] == "tiny-x2b4c-head-svc" and env["RAY_ADDRESS"] == fqdn + ":6379"
    assert spec["restartPolicy"] == "Always" and pod["metadata"]["labels"]["ray.io/group"] == "workers"


def test_kuberays_own_params_and_resources_fill_what_the_render_leaves_out():
    params = kh.set_missing_params({"num-cpus": "4"}, False, "h.ns.svc.cluster.local")
    line = kh.ray_start_command(False, params, {"limits": {"cpu": "8", "memory": "2Gi", "nvidia.com/gpu": "2"}})
    assert line == ("ray start  --address=h.ns.svc.cluster.local:6379  --block  --dashboard-agent-listen-port=52365 "
                    " --memory=2147483648  --metrics-export-port=8080  --num-cpus=4  --num-gpus=2 ")
    assert kh.ray_start_command(True, {"block": "true", "include-dashboard": "false"}, {"requests": {"cpu": "500m"}}) \
        == "ray start --head  --block  --include-dashboard=false  --num-cpus=1 "


def fake_bin(tmp_path: Path, **scripts: str) -> dict:
    """A PATH whose commands are the given shell scripts, before the system's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body + "\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}


def test_the_submitter_hands_ray_an_entrypoint_that_runs_the_job_runner_in_the_jobs_environment(tmp_path):
    """KubeRay pastes the entrypoint unquoted into its `bash -ce` line: nothing of it may run in
    the submitter's shell, and what Ray then runs (its CLI joins the words with list2cmdline, its
    job runs them with a shell) must be the runner, with the agent first on the job's PYTHONPATH."""
    _, _, rayjob = render(tiny_grpo(tmp_path / "ckpt"))
    pod = kh.build_pod(rayjob, "tiny-x2b4c", "tiny-q7z9k", "tiny-x2b4c-head-abcde")
    submitter = pod["spec"]["containers"][1]
    out = tmp_path / "argv.json"
    env = fake_bin(tmp_path, python="exit 0", python3=f"echo ran-in-the-submitter >> {tmp_path}/leak",
                   ray=f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" >> {out}")
    done = subprocess.run([*submitter["command"], *submitter["args"]], env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "leak").exists(), "part of the entrypoint ran in the submitter's shell"
    argv = json.loads(out.read_text())
    assert argv[:5] == ["job", "submit", "--address", "http://127.0.0.1:8265", "--submission-id"]
    job_line = list2cmdline(argv[argv.index("--") + 1:])  # ray/dashboard/modules/job/cli.py
    ran = tmp_path / "ran"
    env = fake_bin(tmp_path, python3=f'echo "$PYTHONPATH $*" > {ran}')
    done = subprocess.run(["/bin/sh", "-c", job_line], env={**env, "PYTHONPATH": "/image/lib"}, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert ran.read_text() == ("/opt/rlhf-tasks/lib:/image/lib /opt/rlhf-tasks/lib/rlhf_tasks/agent/__main__.py "
                               "--plan /opt/rlhf-tasks-configmap/tiny.plan.json --ray-started --skip-setup\n")


def test_a_failing_setup_stops_the_pod_before_kuberays_ray_start(tmp_path):
    """KubeRay's line is `OURS && ulimit ...; ray start ...`: `;` binds looser than `&&`, so
    our part must end the shell itself when it fails, or Ray starts without it."""
    _, _, rayjob = render(tiny_grpo(tmp_path / "ckpt"))
    ray = kh.build_pod(rayjob, "c", "j", "p", "workers")["spec"]["containers"][0]
    env = fake_bin(tmp_path, python3="exit 3", ray=f"touch {tmp_path}/ray-started")
    done = subprocess.run([*ray["command"], *ray["args"]], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 3 and not (tmp_path / "ray-started").exists()
    # and when it succeeds, Ray starts after it, with the environment file sourced
    env_file = tmp_path / "ray.env"
    env = fake_bin(tmp_path, python3="exit 0", ray=f'echo "$MARK" > {tmp_path}/ray-started')
    args = ray["args"][0].replace(RAY_ENV_FILE, str(env_file))
    env_file.write_text("export MARK=sourced\n")
    done = subprocess.run([*ray["command"], args], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ray-started").read_text() == "sourced\n"


# --- the cluster run ---------------------------------------------------------------------------
