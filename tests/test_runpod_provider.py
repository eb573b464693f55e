"""The RunPod provider (rlhf_tasks/providers/runpod): what `render` writes, checked against
RunPod's own OpenAPI schemas; the contracts the agent reads; and `launch` / `status` /
`down` as a user runs them (the CLI in a subprocess) against the schema-checked stand-in of
RunPod's REST API v2 (tests/runpod_standin.py).

Fast tests run pods as local processes of an image that ignores its command; the testbed
tests (root; CI) put each pod on a namespace host, `<podId>.runpod.internal` resolving to
it, an Instant Cluster's overlay on `ens1`, and run the real thing: the rendered start
script, the node agent, Ray and the job."""

from __future__ import annotations

import base64
import ctypes
import gzip
import json
import lzma
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import testbed as tbmod
from runpod_standin import A40, Contract, ProcessRunner, RunPodStandIn, TestbedRunner
from testbed import poll

from rlhf_tasks import providers
from rlhf_tasks.errors import BadInput, StepFailed
from rlhf_tasks.agent.contract import read_contract
from rlhf_tasks.agent.protocol import parse_result
from rlhf_tasks.providers.runpod import RunPodProvider
from rlhf_tasks.providers.runpod.render import MAX_ARGS
from rlhf_tasks.spec import parse_task

from conftest import ROOT

KEY = "rpa_PROVIDERKEY_5d1e7c3a9b"  # distinctive: searched for everywhere
TOKEN = "runpod-contract-token-0123456789abcdef"
#: An image whose entrypoint ignores its command (fast tests: the API side only).
IDLE_IMAGE = ("bash", "-c", "exec sleep 600", "container")
testbed3 = tbmod.make_testbed_fixture(3, scope="module")

#: What a job prints of the file its job.working_dir holds (its own working directory).
SHOW_SHIPPED = "cat shipped.txt"
CHECK_NODES = ("python3 -c \"import ray; ray.init(); n = sum(1 for x in ray.nodes() if x['Alive']); "
               "print('CONTRACT alive nodes', n); assert n == {nodes}\"")


def command_task(nodes: int = 3, submit: str = "head", **extra) -> dict:
    task = {"name": "rp-contract", "nodes": nodes, "resources": {"cpus": 1}, "network": "runpod-global", "preflight": "off",
            "env": {"PYTHONUNBUFFERED": "1"}, "secrets": ["WANDB_API_KEY"], "ray": {"object_store_memory": "80MB"},
            "checkpoints": {"resume": "never"}, "wait": {"head": "4m", "nodes": "4m"},
            "job": {"recipe": "command", "submit": submit, "working_dir": None, "timeout": "5m",
                    "args": {"entrypoint": CHECK_NODES.format(nodes=nodes)}}}
    task.update(extra)
    return task


def tiny_task(steps: int = 20, **extra) -> dict:
    """tasks/tiny-grpo.yaml with fewer steps, its checkpoints on each pod's own disk."""
    task = yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    task["checkpoints"]["path"] = "/opt/checkpoints/tiny-grpo"
    task["job"]["args"].update(steps=steps, save_every=10, num_prompts=200)
    task["preflight"] = "off"  # on where a test asks for it (preflight's own tests cover it; ~8 s a cluster)
    task.update(extra)
    return task


def rendered(task: dict) -> tuple[RunPodProvider, object, dict[str, str]]:
    provider = providers.get("runpod")
    plan = provider.plan(parse_task(task, "t.yaml"))
    return provider, plan, provider.render(plan)


#: What the rendered requests' env says for the secrets of command_task: references, never values.
REFERENCES = {"WANDB_API_KEY": "{{ RUNPOD_SECRET_rlhf-tasks.rp-contract.WANDB_API_KEY }}",
              "RAY_AUTH_TOKEN": "{{ RUNPOD_SECRET_rlhf-tasks.rp-contract.RAY_AUTH_TOKEN }}"}


def script_of(args: str) -> str:
    """The start script a pod's args run (base64 of gzip inside `bash -c '...'`: a first stage whose python3
    unpacks the script, base64 of xz, from its here-document)."""
    command = shlex.split(args)[2]
    encoded = command.split()[1]
    first = gzip.decompress(base64.b64decode(encoded)).decode()
    packed = first.split("<<'RLHF_TASKS_START'\n", 1)[1].split("\nRLHF_TASKS_START\n", 1)[0]
    return lzma.decompress(base64.b64decode(packed)).decode()


# ------------------------------------------------------------------ render: pure, RunPod's own schemas


@pytest.mark.parametrize("variant", ["pods", "cluster", "client", "volume"])
def test_rendered_requests_pass_runpods_schemas_and_run_the_start_script(variant, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-secret-value")
    extra = {"pods": {}, "cluster": {"network": "runpod-cluster"}, "volume": {
        "checkpoints": {"path": "/ckpt/run", "shared": {"runpod": {"network_volume": "vol123"}}}}}.get(variant, {})
    task = command_task(submit="client" if variant == "client" else "head", **extra)
    provider, plan, files = rendered(task)
    assert list(files) == ["rp-contract.runpod.json", "rp-contract.start.sh"]
    document = json.loads(files["rp-contract.runpod.json"])
    contract = Contract()
    script = files["rp-contract.start.sh"]
    for text in files.values():
        assert "wandb-secret-value" not in text and "ray-secret-value" not in text
    if variant == "cluster":
        body = document["cluster"]
        assert contract.errors("CreateClusterRequest", body) == []
        assert body["compute"] == {"gpuTypeId": "NVIDIA A40", "gpuCountPerPod": 1, "podCount": 3}
        assert body["type"] == "TRAINING" and body["env"] == REFERENCES
        bodies = [body]
    else:
        bodies = [document["head"], *document["workers"]]
        assert [b["name"] for b in bodies] == ["rp-contract-head", "rp-contract-worker-1", "rp-contract-worker-2"]
        for rank, body in enumerate(bodies):
            assert contract.errors("CreatePodRequest", body) == [], body["name"]
            assert body["globalNetworking"] is True and body["cloud"] == "SECURE"
            assert body["env"]["RAY_WORKER"] == str(rank) and body["env"]["EXPECTED_WORKERS"] == "2"
            assert body["env"].get("HEAD_POD_ID") == ("${HEAD_POD_ID}" if rank else None)
            assert {k: body["env"][k] for k in REFERENCES} == REFERENCES
        head = bodies[0]
        if variant == "client":  # SSH on the head only, for the dashboard's forward
            assert head["ports"] == ["22/tcp"] and head["startSsh"] is True
            assert all("ports" not in b and "startSsh" not in b for b in bodies[1:])
        else:
            assert "ports" not in head and "startSsh" not in head
        if variant == "volume":
            assert all(b["mounts"] == {"network": [{"volumeId": "vol123", "path": "/ckpt/run"}]} for b in bodies)
            assert provider.shared_storage_warning(plan) is None
    # Secrets are references to account secrets in RunPod's vault; the note says how to make them by hand.
    assert ("By hand, before the requests: create rlhf-tasks.rp-contract.WANDB_API_KEY (your WANDB_API_KEY), "
            "rlhf-tasks.rp-contract.RAY_AUTH_TOKEN (rlhf-tasks token rp-contract) in RunPod's console (Secrets) or "
            "with POST https://api.runpod.io/v2/account/secrets") in document["note"]
    for body in bodies:
        assert len(body["args"]) < MAX_ARGS
        assert script_of(body["args"]) == script  # the pod runs exactly the rendered script
    # It carries the agent and the plan verbatim, runs the agent (with the setup), and parses.
    assert (ROOT / "rlhf_tasks" / "agent" / "head.py").read_text() in script and plan.to_json() in script
    assert "cat > /opt/rlhf-tasks/lib/rlhf_tasks/agent/__main__.py <<'RLHF_TASKS_EOF'" in script
    agent = [line for line in script.splitlines() if line.startswith("PYTHONPATH=")]
    assert agent == ["PYTHONPATH=/opt/rlhf-tasks/lib${PYTHONPATH:+:$PYTHONPATH} python3 /opt/rlhf-tasks/lib/rlhf_tasks/agent/__main__.py "
                     "--plan /opt/rlhf-tasks/rp-contract.runpod.plan.json --log-dir "
                     "/opt/rlhf-tasks/logs"]  # without --skip-setup: the agent runs the setup
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_a_named_working_dir_is_shipped_in_the_start_script_or_refused_at_check(tmp_path):
    """RunPod: nothing of this machine reaches a pod but its create request, so job.working_dir
    (with submit: head) travels in the start script, packed as Ray would upload it; one too big
    for a pod's args is refused at `check`, naming the field and what to do."""
    import io
    import tarfile

    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "reward_fn.py").write_text("def reward(x):\n    return 1.0\n")
    (code / "pkg" / "util.py").write_text("X = 1\n")
    (code / "skip.log").write_text("left out by job.excludes\n")
    task = command_task()
    task["job"].update(working_dir=str(code), excludes=["*.log"])
    provider, plan, files = rendered(task)
    assert plan.job.working_dir == "."  # on the pod: where the archive is unpacked, the head submits from
    script = files["rp-contract.start.sh"]
    encoded = script.split("<<'RLHF_TASKS_WORKDIR'\n")[1].split("\nRLHF_TASKS_WORKDIR")[0].replace("\n", "")
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(encoded))) as tar:
        assert sorted(tar.getnames()) == ["pkg/util.py", "reward_fn.py"]
        assert tar.extractfile("reward_fn.py").read() == b"def reward(x):\n    return 1.0\n"
    assert script.index("RLHF_TASKS_WORKDIR") < script.rindex("agent/__main__.py --plan")  # before the agent runs
    assert "shipped in the pods' start command" in provider.working_dir_words(plan)
    assert rendered(task)[2] == files  # the same bytes for the same files
    # Not named (the recipe's default `.`): nothing shipped, and check says where the job runs.
    provider, plan, files = rendered(command_task(job={**command_task()["job"], "working_dir": None}))
    assert "RLHF_TASKS_WORKDIR" not in files["rp-contract.start.sh"]
    # A credentials file is never shipped (a pod's args are readable in its configuration): refused, naming it.
    (code / ".env").write_text("WANDB_API_KEY=not-for-a-pods-args\n")
    with pytest.raises(BadInput, match=r"job.working_dir: .*code holds \.env, which would be shipped in the pods' start "
                                       r"command.*leave it out with job.excludes"):
        rendered(task)
    task["job"]["excludes"].append(".env")
    # Too big for a pod's args: refused at check, exit 2, naming the field and what to do.
    (code / "vocab.py").write_text(base64.b64encode(os.urandom(200 * 1024)).decode())
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(task))
    out = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "check", str(path), "--provider", "runpod"],
                         capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"job.working_dir: {code} packs" in out.stderr and "set job.submit: client" in out.stderr, out.stderr


def test_render_of_the_demo_ships_its_code_and_picks_a_gpu_for_global_networking():
    provider, plan, files = rendered(yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text()))
    document = json.loads(files["tiny-grpo.runpod.json"])
    assert "every pod gets 1x NVIDIA A40" in document["note"]
    assert document["head"]["gpu"] == {"id": "NVIDIA A40", "count": 1}
    script = files["tiny-grpo.start.sh"]
    assert "cat > /opt/rlhf-tasks/lib/rlhf_tasks/demo/train.py <<'RLHF_TASKS_EOF'" in script
    assert script.count("PYTHONPATH=/opt/rlhf-tasks/lib${PYTHONPATH:+:$PYTHONPATH} python3 /opt/rlhf-tasks/lib/rlhf_tasks/agent/__main__.py") == 1
    assert "pod's own disk" in provider.shared_storage_warning(plan)


def test_gpu_names_and_the_catalogue_task():
    _, plan, files = rendered(yaml.safe_load((ROOT / "tasks" / "openrlhf-m-grpo-qwen2.5-vl-3b.yaml").read_text()))
    head = json.loads(files["openrlhf-m-grpo-qwen25-vl-3b.runpod.json"])["head"]
    assert head["gpu"] == {"id": "NVIDIA H100 80GB HBM3", "count": 2} and head["disk"] == 500
    assert head["image"] == "nvcr.io/nvidia/pytorch:24.07-py3"
    assert set(head["env"]) == {"RAY_WORKER", "EXPECTED_WORKERS", "WANDB_API_KEY", "HF_TOKEN", "RAY_AUTH_TOKEN"}
    from rlhf_tasks.providers.runpod.render import cross_node_traffic

    assert "vLLM engines spread over the 2 pods (gloo weight sync)" in cross_node_traffic(plan)


def test_global_networking_preset_and_the_task_overrides_it():
    _, plan, _ = rendered(command_task(env={"NCCL_SOCKET_NTHREADS": "4"}))
    assert plan.network_env == {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}",
                                "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_FAMILY": "AF_INET", "NCCL_LAUNCH_MODE": "GROUP",
                                "NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "1",
                                "FORCE_MODEL_INIT_TO_CUDA": "1"}
    assert plan.env["NCCL_SOCKET_NTHREADS"] == "4"  # the agent applies the task's env after the preset
    _, cluster, _ = rendered(command_task(network="runpod-cluster"))
    assert cluster.network_env == {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}"}


def test_the_socket_family_is_one_nccl_reads():
    """The guide's `NCCL_NET_SOCKET_FAMILY=IPv4` is no variable of NCCL's: NCCL reads NCCL_SOCKET_FAMILY and
    takes only AF_INET or AF_INET6 (src/misc/socket.cc, ncclEnvSocketFamily, v2.10 to v2.30: any other value,
    `IPv4` too, leaves the family free), so the preset forces IPv4 as NCCL spells it."""
    _, plan, _ = rendered(command_task())
    assert "NCCL_NET_SOCKET_FAMILY" not in plan.network_env
    assert plan.network_env["NCCL_SOCKET_FAMILY"] in ("AF_INET", "AF_INET6")


def test_the_agent_reads_the_guides_variables_and_the_instant_cluster_ones():
    _, plan, _ = rendered(command_task())
    contract = plan.model_dump()["contract"]
    head = read_contract(contract, {"RUNPOD_POD_ID": "headpod"})  # RAY_WORKER unset, no EXPECTED_WORKERS
    assert (head.rank, head.nodes, head.head, head.node_addr, head.cluster_id) == (
        0, 3, None, "headpod.runpod.internal", "headpod")
    worker = read_contract(contract, {"RUNPOD_POD_ID": "w1", "RAY_WORKER": "1", "HEAD_POD_ID": "headpod",
                                      "EXPECTED_WORKERS": "2"})
    assert (worker.rank, worker.nodes, worker.head, worker.node_addr) == (1, 3, "headpod.runpod.internal",
                                                                          "w1.runpod.internal")
    _, cluster, _ = rendered(command_task(network="runpod-cluster"))
    node = read_contract(cluster.model_dump()["contract"], {"NODE_RANK": "2", "NUM_NODES": "3", "NUM_TRAINERS": "8",
                                                            "PRIMARY_ADDR": "10.78.1.10", "NODE_ADDR": "10.78.1.12"})
    assert (node.rank, node.nodes, node.head, node.node_addr, node.gpus) == (2, 3, "10.78.1.10", "10.78.1.12", 8)


@pytest.mark.parametrize("change,field", [
    ({"network": "infiniband"}, "network: infiniband"),
    ({"network": "runpod-cluster", "nodes": 1}, "nodes: an Instant Cluster has at least 2 nodes"),
    ({"checkpoints": {"path": "/c", "shared": {"runpod": {"volume": "x"}}}}, "checkpoints.shared.runpod.network_volume: Field required"),
])
def test_what_runpod_refuses_names_the_field(change, field):
    with pytest.raises(BadInput, match=field.replace(".", r"\.")):
        rendered(command_task(**change))


def test_limits_runpods_document_does_not_state_are_not_imposed():
    """Neither "50 env variables" nor "2 to 8 nodes" is in RunPod's v2 document (podCount: 2 to 250)."""
    _, plan, files = rendered(command_task(secrets=[f"S{i}" for i in range(60)]))
    head_env = json.loads(files["rp-contract.runpod.json"])["head"]["env"]
    assert len(head_env) == 63  # and RAY_WORKER, EXPECTED_WORKERS, RAY_AUTH_TOKEN
    _, plan, files = rendered(command_task(network="runpod-cluster", nodes=12))
    assert json.loads(files["rp-contract.runpod.json"])["cluster"]["compute"]["podCount"] == 12


def test_a_failed_job_ends_the_launch_with_exit_1_and_says_why(tmp_path, capsys, monkeypatch):
    """The pods' log streams reach the launcher's one follower: the head pod's result line ends
    the job, and the summary adds what the pods cost (the real client against the stand-in)."""
    from rlhf_tasks.follow import LogTail, follow_head_log
    from rlhf_tasks.outcome import summarise, verdict
    from rlhf_tasks.providers.runpod import logs
    from rlhf_tasks.providers.runpod.api import RunPodClient

    monkeypatch.setenv("RLHF_TASKS_HOME", str(tmp_path / "home"))
    log = ("Running entrypoint\n\x1b[36m(Worker pid=5)\x1b[0m noise\nTraceback (most recent call last):\n"
           "AssertionError: 2 nodes\n2026-11-22 13:42:19,891\tINFO worker.py:1 -- shutting down\n")
    result = {"exit_code": 1, "error": "running job rp-contract-abc failed: it ended FAILED",
              "failed_step": "running job rp-contract-abc", "steps": [{"step": "job", "seconds": 3.2}],
              "job": {"submission_id": "rp-contract-abc", "status": "FAILED", "attempts": [
                  {"submission_id": "rp-contract-abc", "status": "FAILED", "cause": "the job FAILED"},
                  {"submission_id": "rp-contract-abc-r1", "status": "FAILED", "cause": None}]},
              "job_log_tail": log}
    (tmp_path / "head.out").write_text(log + "RLHF_TASKS_RESULT " + json.dumps(result) + "\n"
                                       + "[10:00:00] start.sh: the pod stays up (and billed) until it is terminated\n")
    runner = ProcessRunner(tmp_path / "pods", entrypoint=("bash", "-c", f"cat {tmp_path / 'head.out'}; exec sleep 600",
                                                          "container"))
    api = RunPodStandIn(runner, api_key=KEY).start()
    client = RunPodClient(KEY, base_url=api.url)
    try:
        head = client.create_pod({"image": "x", "gpu": {"id": A40, "count": 1}, "name": "rp-contract-head"})["id"]
        poll(lambda: client.get_pod(head)["status"] == "RUNNING", 30, "the pod running")
        _, plan, _ = rendered(command_task(nodes=1))
        cluster = logs.cluster(client, plan, [client.get_pod(head)], None, tmp_path, {"gpu": A40, "count": 1,
                                                                                      "price": 0.4}, {}, {})
        outcome = follow_head_log(cluster, plan, LogTail(cluster.node_logs))
        assert not cluster.head_alive()  # the head agent has ended; its pod stays up until `down`
        summarise(plan, outcome, time.monotonic() - 60, cluster)
        with pytest.raises(StepFailed, match="^running job rp-contract-abc: it ended FAILED"):
            verdict(plan, outcome, True)
        cluster.close()
    finally:
        client.close()
        api.close()
        runner.close()
    out = capsys.readouterr().out
    assert out.splitlines().count("AssertionError: 2 nodes") == 1 and "RLHF_TASKS_RESULT" not in out and "stays up" not in out
    assert "job rp-contract-abc: FAILED in 60s wall time" in out and "attempts: 2 (" in out
    assert "the job's last line: AssertionError: 2 nodes" in out and "head steps: job 3s" in out
    assert f"pods: 1 x 1x {A40} in " in out and "so far" in out


# ------------------------------------------------------------------ launch against the stand-in (fast)


@pytest.fixture
def standin(tmp_path):
    runner = ProcessRunner(tmp_path / "pods", entrypoint=IDLE_IMAGE)
    api = RunPodStandIn(runner, api_key=KEY).start()
    yield api
    api.close()
    runner.close()
    assert api.errors == [], "the stand-in broke RunPod's contract or crashed"


def cli_env(tmp_path: Path, url: str, **extra) -> dict[str, str]:
    env = dict(os.environ, RLHF_TASKS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               RUNPOD_API_URL=url, RUNPOD_API_KEY=KEY, WANDB_API_KEY="wandb-value-42")
    env.pop("RAY_AUTH_TOKEN", None)
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def run_cli(args: list[str], env: dict, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, **kw)


def write_task(tmp_path: Path, task: dict) -> str:
    path = tmp_path / f"{task['name']}.yaml"
    path.write_text(yaml.safe_dump(task))
    return str(path)


def live_pods(api: RunPodStandIn) -> list[str]:
    return [p.name for p in api.pods.values() if p.status != "TERMINATED"]


#: The task's `secrets:` values in cli_env (and the API key): what no message or file may hold.
SECRET_VALUES = {"RUNPOD_API_KEY": KEY, "WANDB_API_KEY": "wandb-value-42"}


def sent_secrets(api: RunPodStandIn | None) -> dict[str, str]:
    """The values RunPod was sent for the task's secrets and the Ray token (the account secrets the
    launch created in RunPod's vault), by secret name; and no create request carried a value: their
    env holds the values of neither, only references."""
    found = {}
    for request in api.requests if api is not None else []:
        if request.method == "POST" and request.path == "/v2/account/secrets" and request.body:
            found[request.body["name"]] = request.body["value"]
    for request in api.requests if api is not None else []:
        if request.method == "POST" and request.path in ("/v2/pods", "/v2/clusters") and request.body:
            text = json.dumps(request.body)
            for name, value in {**found, **SECRET_VALUES}.items():
                assert value not in text, f"the value of {name} in a create request"
    return found


def assert_key_nowhere(*texts: str, directories: tuple[Path, ...] = (), api: RunPodStandIn | None = None) -> None:
    """Neither the API key nor any value of the task's secrets nor a Ray token the launch made (every
    value RunPod was sent, `api`) in what was said or in any file under `directories` (records, node
    logs, renders): only the token's own file, clusters/NAME/token, holds a token."""
    secrets = {**SECRET_VALUES, **sent_secrets(api)}
    assert not api or any(name.endswith(".RAY_AUTH_TOKEN") for name in secrets), "no token was sent to look for"
    for text in texts:
        for name, value in secrets.items():
            assert value not in text, f"{name} in what was said"
    for directory in directories:
        for path in Path(directory).rglob("*"):
            if not path.is_file() or (path.name == "token" and path.parent.parent.name == "clusters"):
                continue
            data = path.read_bytes()
            for name, value in secrets.items():
                assert value.encode() not in data, f"{name} in {path}"


@pytest.mark.parametrize("change,words", [
    ({"resources": {"cpus": 1, "gpus": "B300:8"}}, "resources.gpus: RunPod has no GPU type 'B300'"),
    ({"resources": {"cpus": 1, "gpus": "MI300X:1"}}, "resources.gpus: Global Networking needs NVIDIA GPUs"),
    ({"resources": {"cpus": 1, "gpus": "H100:9"}}, "resources.gpus: RunPod offers at most 8x NVIDIA H100"),
    ({"placement": {"regions": ["CA-MTL-1"]}}, "placement.regions: CA-MTL-1 has no Global Networking"),
    ({"placement": {"regions": ["EU-XX-9"]}}, "placement.regions: RunPod has no data center 'EU-XX-9'"),
    ({"placement": {"regions": ["US-KS-2"]}}, "placement.regions: no data center with Global Networking offers "
                                              "NVIDIA A40"),
])
def test_a_gpu_type_or_data_center_that_does_not_fit_is_exit_2_before_anything_is_created(
        standin, tmp_path, change, words):
    out = run_cli(["launch", write_task(tmp_path, command_task(**change)), "--provider", "runpod", "-y"],
                  cli_env(tmp_path, standin.url))
    assert out.returncode == 2, out.stdout + out.stderr
    assert words in out.stderr
    assert not [r for r in standin.requests if r.method != "GET"] and standin.pods == {}
    assert not (tmp_path / "home" / "clusters").exists()


def test_the_key_missing_wrong_or_unconfirmed_price_creates_nothing(standin, tmp_path):
    task = write_task(tmp_path, command_task())
    out = run_cli(["launch", task, "--provider", "runpod", "-y"], cli_env(tmp_path, standin.url, RUNPOD_API_KEY=None))
    assert out.returncode == 2 and "RUNPOD_API_KEY is not set" in out.stderr, out.stderr
    out = run_cli(["launch", task, "--provider", "runpod", "-y"], cli_env(tmp_path, standin.url,
                                                                          RUNPOD_API_KEY="rpa_wrong"))
    assert out.returncode == 2 and "the RunPod API key is missing, wrong or expired" in out.stderr, out.stderr
    assert "rpa_wrong" not in out.stdout + out.stderr
    out = run_cli(["launch", task, "--provider", "runpod"], cli_env(tmp_path, standin.url), stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "-y: creating the pods needs your confirmation" in out.stderr, out.stderr
    # Before asking, it said what it would cost and why the link matters.
    assert "RunPod: 3 pod(s) x 1x NVIDIA A40, Secure Cloud, in EU-RO-1: $1.20/h ($0.40/h per pod)" in out.stdout
    assert "job.timeout 5m: 0.25 GPU-hours, at most $0.10 for the job" in out.stdout
    assert "Global Networking links the pods at 100 Mbit/s" in out.stdout
    assert standin.pods == {} and not (tmp_path / "home" / "clusters").exists()


def test_a_gpu_given_by_memory_is_created_as_the_type_launch_chose(standin, tmp_path):
    """`resources.gpus: 48GB..:1` (issue 47, item 3): launch says which of the catalog's GPU types of that memory it
    chose (the cheapest that fits: A40; the AMD one has no Global Networking) and creates the pods with it."""
    standin.fail_create(1, 400, "Bad Request", "no capacity")  # the head's request is all this test needs
    out = run_cli(["launch", write_task(tmp_path, command_task(resources={"cpus": 1, "gpus": "48GB..:1"})),
                   "--provider", "runpod", "-y"], cli_env(tmp_path, standin.url))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"chosen: {A40}, the cheapest that fits" in out.stdout, out.stdout
    created = [r.body for r in standin.requests if r.method == "POST" and r.path == "/v2/pods"]
    assert [body["gpu"] for body in created] == [{"id": A40, "count": 1}]


def test_a_failed_third_pod_leaves_no_pod_and_names_runpods_message(standin, tmp_path):
    standin.fail_create(3, 400, "Bad Request", "no capacity: no 1x NVIDIA A40 available with global networking "
                                               "in EU-RO-1")
    volume = standin.add_network_volume("ckpt", "EU-RO-1")
    task = command_task(checkpoints={"path": "/ckpt/run", "shared": {"runpod": {"network_volume": volume}}})
    out = run_cli(["launch", write_task(tmp_path, task), "--provider", "runpod", "-y"], cli_env(tmp_path, standin.url))
    assert out.returncode == 1, out.stdout + out.stderr
    assert ("failed: creating pod rp-contract-worker-2: RunPod API POST /pods: 400 Bad Request: no capacity: no 1x "
            "NVIDIA A40 available with global networking in EU-RO-1; terminated 2 pod(s)") in out.stderr
    assert live_pods(standin) == [] and len(standin.pods) == 2
    assert all(p.status == "TERMINATED" for p in standin.pods.values())
    assert all(pod.popen.poll() is not None for pod in standin.runner.pods)  # the containers are gone
    creates = [r.body for r in standin.requests if r.method == "POST" and r.path == "/v2/pods"]
    head, worker = creates[0], creates[1]
    # What was sent is what render printed, with the head's id filled in and the data center chosen: the
    # secrets as references to the account secrets the launch made, which the failed launch deleted again.
    assert {k: head["env"][k] for k in REFERENCES} == REFERENCES
    assert standin.secrets == {} and "deleted 2 account secret(s) from RunPod's vault" in out.stderr
    assert worker["env"]["HEAD_POD_ID"] == next(iter(standin.pods)) and worker["dataCenterIds"] == ["EU-RO-1"]
    assert head["mounts"] == {"network": [{"volumeId": volume, "path": "/ckpt/run"}]}
    # Nothing is kept of a launch that never started: no token, no record, no staged files.
    assert not (tmp_path / "home" / "clusters" / "rp-contract").exists()
    assert not (tmp_path / "home" / "runs" / "rp-contract" / "runpod").exists()
    assert_key_nowhere(out.stdout, out.stderr, directories=(tmp_path,), api=standin)


def test_ctrl_c_while_the_pods_start_terminates_them(tmp_path):
    runner = ProcessRunner(tmp_path / "pods", entrypoint=IDLE_IMAGE)
    # placed at once (dataCenterId known), then slow to start: the launcher creates all three
    with RunPodStandIn(runner, api_key=KEY, provision_delay=600, datacenter_while_provisioning=True) as api:
        log = tmp_path / "launch.log"
        with open(log, "w") as out:
            launch = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch",
                                       write_task(tmp_path, command_task()), "--provider", "runpod", "-y"],
                                      env=cli_env(tmp_path, api.url), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            poll(lambda: "pod rp-contract-worker-2" in log.read_text() or launch.poll() is not None, 120,
                 "the launcher to create the third pod")
            assert len(live_pods(api)) == 3
            launch.send_signal(signal.SIGINT)
            assert launch.wait(120) == 1
        finally:
            if launch.poll() is None:
                launch.kill()
        said = log.read_text()
        assert "failed: starting the pods: interrupted (Ctrl-C); terminated 3 pod(s)" in said, said
        assert live_pods(api) == []
        assert api.errors == []
        assert_key_nowhere(said, directories=(tmp_path,), api=api)
    runner.close()


def test_rate_limits_and_server_errors_are_retried(standin, tmp_path):
    standin.rate_limit(2, retry_after=1)
    standin.fail_requests(1)
    out = run_cli(["launch", write_task(tmp_path, command_task(resources={"cpus": 1, "gpus": "B300:1"})),
                   "--provider", "runpod", "-y"], cli_env(tmp_path, standin.url))
    assert out.returncode == 2 and "RunPod has no GPU type 'B300'" in out.stderr  # got there after the retries
    assert "429 Too Many Requests; retrying in 1.0s (Retry-After)" in out.stdout
    assert "503 Service Unavailable; retrying" in out.stdout
    assert_key_nowhere(out.stdout, out.stderr, directories=(tmp_path,))


def test_status_and_down_touch_only_this_tasks_pods(standin, tmp_path):
    from rlhf_tasks.providers.runpod.api import RunPodClient

    client = RunPodClient(KEY, base_url=standin.url)
    body = {"image": "x", "gpu": {"id": A40, "count": 1}}
    ours = [client.create_pod({**body, "name": name})["id"] for name in ("rp-contract-head", "rp-contract-worker-1")]
    theirs = [client.create_pod({**body, "name": name})["id"] for name in ("rp-contract-2-head", "rp-contract-web")]
    env = cli_env(tmp_path, standin.url)
    poll(lambda: all(client.get_pod(i)["status"] == "RUNNING" for i in ours), 30, "pods running")
    down = run_cli(["down", "rp-contract", "--provider", "runpod"], env)
    assert down.returncode == 0, down.stderr
    assert f"terminated 2 pod(s) ({ours[0]}, {ours[1]})" in down.stdout
    assert sorted(live_pods(standin)) == ["rp-contract-2-head", "rp-contract-web"]
    assert all(client.get_pod(i)["status"] == "RUNNING" for i in theirs)
    assert_key_nowhere(down.stdout, down.stderr, directories=(tmp_path / "home",))
    client.close()


# ------------------------------------------------------------------ what RunPod's document leaves open (fast)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_TASKS_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def create_in_process(client, task: dict, datacenters: list[str] | None = None) -> tuple[list[dict], object]:
    """What `launch` does from the catalog's fit to the pods running, in this process."""
    from rlhf_tasks import state
    from rlhf_tasks.providers.runpod import catalog, pods

    _, plan, files = rendered(task)
    requests = json.loads(files[f"{plan.name}.runpod.json"])
    fit = catalog.fit(client, plan)
    before = state.before_launch(plan.name, state.run_dir(plan.name) / "runpod")
    state.save(plan.name, {"provider": "runpod", "pods": []})
    with pods.Launching(client, plan.name, before) as launching:
        return pods.create(client, plan, requests, {"WANDB_API_KEY": "w"}, datacenters or fit["datacenters"],
                           launching), fit


def test_workers_are_created_once_the_head_has_its_data_center(standin, home, capsys):
    """RunPod's `dataCenterId` is null while a pod is PROVISIONING ("assigned by scheduler"): the
    workers, placed with the head, wait for it (a null would make `dataCenterIds: [null]`, a 422)."""
    from rlhf_tasks.providers.runpod.api import RunPodClient

    standin.provision_delay = 1.5
    client = RunPodClient(KEY, base_url=standin.url)
    members, _ = create_in_process(client, command_task(nodes=3))
    creates = [r for r in standin.requests if r.method == "POST" and r.path == "/v2/pods"]
    assert [r.status for r in creates] == [201, 201, 201]
    assert [r.body["dataCenterIds"] for r in creates] == [["EU-RO-1"]] * 3
    assert [m["dataCenterId"] for m in members] == ["EU-RO-1"] * 3
    out = capsys.readouterr().out
    assert "pod rp-contract-head (" in out and ") is in EU-RO-1" in out
    client.close()


def test_secrets_go_through_runpods_vault_and_nothing_is_left_after_down(tmp_path, home):
    """The create requests carry references to account secrets, never a value; the pods' containers see
    the values (RunPod substitutes them at boot: the stand-in plays it); `status` lists them; a leftover
    of an earlier cluster of the name is replaced; `terminate` (down's) deletes them, and nothing else."""
    from rlhf_tasks.providers.runpod import pods
    from rlhf_tasks.providers.runpod.api import RunPodClient

    image = ("bash", "-c", 'printf %s "$WANDB_API_KEY" > seen; exec sleep 600', "container")
    runner = ProcessRunner(tmp_path / "pods", entrypoint=image)
    with RunPodStandIn(runner, api_key=KEY) as api:
        client = RunPodClient(KEY, base_url=api.url)
        theirs = client.create_secret("hf-token", "not-ours")["id"]
        client.create_secret("rlhf-tasks.rp-contract.WANDB_API_KEY", "stale-from-an-earlier-launch")
        members, _ = create_in_process(client, command_task(nodes=2))
        creates = [r.body for r in api.requests if r.method == "POST" and r.path == "/v2/pods"]
        assert len(creates) == 2
        for body in creates:  # a reference, never the value; the token's reference left out: no token was given
            assert body["env"]["WANDB_API_KEY"] == REFERENCES["WANDB_API_KEY"] and "RAY_AUTH_TOKEN" not in body["env"]
            assert "w" not in body["env"].values()
        assert sorted(s["name"] for s in client.list_secrets()) == ["hf-token", "rlhf-tasks.rp-contract.WANDB_API_KEY"]
        assert all("value" not in s for s in client.list_secrets())  # write-only
        # Every pod's container saw the value, not the reference (and not the stale one).
        seen = [tmp_path / "pods" / m["id"] / "seen" for m in members]
        poll(lambda: all(p.exists() and p.read_text() for p in seen), 30, "the pods to write what they see")
        assert [p.read_text() for p in seen] == ["w", "w"]
        assert all(client.get_pod(m["id"])["env"]["WANDB_API_KEY"] == REFERENCES["WANDB_API_KEY"] for m in members)
        assert "account secrets in RunPod's vault: rlhf-tasks.rp-contract.WANDB_API_KEY" in \
            pods.status(client, "rp-contract")
        said = pods.terminate(client, "rp-contract")
        assert "deleted 1 account secret(s) from RunPod's vault (rlhf-tasks.rp-contract.WANDB_API_KEY)" in said
        assert [s["id"] for s in client.list_secrets()] == [theirs]  # nothing of ours left, theirs kept
        client.close()
        assert api.errors == []
    runner.close()


@pytest.mark.parametrize("rate", [1.1, None])
def test_the_cap_counts_what_runpod_bills_the_pods_or_the_catalog_where_it_gives_no_cost(
        standin, home, monkeypatch, capsys, rate):
    """Issue 48, item 2: the pods' `cost` ("Current cost in USD per hour", RunPod's Pod schema), not the catalog's
    list price ("the rate actually billed for a pod is reported as `cost` on the pod itself"): `launch` sums what
    the created pods cost once they run (0.0 while placing: the stand-in's reading), says it and counts it; the
    head reads its own pod's with its pod-scoped key. Where RunPod gives no cost, the catalog's, said."""
    from rlhf_tasks.agent.budget import machine_price
    from rlhf_tasks.providers.runpod import RunPodProvider

    standin.billed_rate = rate
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    monkeypatch.setenv("RUNPOD_API_URL", standin.url)
    task = command_task(nodes=3, placement={"max_cost": 5, "price_per_hour": 99})
    provider = RunPodProvider(y=True)
    plan = provider.plan(parse_task(task, "t.yaml"))
    assert plan.budget.machine_price.field == "cost" and plan.budget.price_per_hour is None
    cluster = provider.apply(plan, {"WANDB_API_KEY": "w"})
    try:
        out = capsys.readouterr().out
        assert "RunPod: 3 pod(s) x 1x NVIDIA A40, Secure Cloud, in EU-RO-1: $1.20/h ($0.40/h per pod)" in out
        if rate:  # 0.40 x 1.1 for each of the 3 pods, not the catalog's 1.20 (nor the task's ignored 99)
            assert cluster.price_per_hour == pytest.approx(1.32)
            assert "RunPod bills the 3 pod(s) $1.32/h (the sum of their `cost`; the catalog's list price: " \
                   "$1.20/h): the cap counts that" in out, out
        else:
            assert cluster.price_per_hour == pytest.approx(1.20)
            assert "RunPod gives no cost for rp-contract-head, rp-contract-worker-1, rp-contract-worker-2: counted " \
                   "at the catalog's $0.40/h per pod, $1.20/h for the 3 pod(s)" in out, out
        # The head's plan, in its start script: the catalog's price, and where to read its pod's own.
        head = next(p for p in standin.pods.values() if p.name.endswith("-head"))
        script = script_of(head.args)
        start = re.search(r"cat > \S*rp-contract\.runpod\.plan\.json <<'(\w+)'\n", script)
        shipped = json.loads(script[start.end():].split(f"\n{start.group(1)}\n", 1)[0])
        assert shipped["budget"]["price_per_hour"] == pytest.approx(1.20)
        env = {"RUNPOD_API_URL": standin.url, "RUNPOD_POD_ID": head.id, "RUNPOD_API_KEY": head.pod_key}
        price, said = machine_price(shipped["budget"], 3, env)
        if rate:
            assert price == pytest.approx(1.32) and said == ("budget: counting RunPod's `cost` of this pod, $0.4400/h, "
                                                             "for each of the 3 nodes: $1.32/h (the plan's price, "
                                                             "from the catalog: $1.20/h)")
        else:
            assert price == pytest.approx(1.20) and said == ("budget: RunPod's `cost` of this pod is not given (0.0): "
                                                             "counting the plan's $1.20/h")
        assert [r.by for r in standin.requests if r.method == "GET" and r.path == f"/v2/pods/{head.id}"][-1] == \
            f"pod:{head.id}"  # the pod's own key, never the account's
    finally:
        cluster.close()
        provider.down(plan.name)


def test_the_catalogs_price_fills_in_only_the_pods_runpod_gives_no_cost_and_the_head_says_what_it_reads():
    from rlhf_tasks.agent.budget import machine_price
    from rlhf_tasks.providers.runpod.pods import billed, head_counts
    from rlhf_tasks.providers.runpod.render import MACHINE_PRICE

    pods = [{"name": "h", "cost": 0.5}, {"name": "w1", "cost": 0.0}, {"name": "w2"}]
    assert billed(pods, 0.4) == (1.3, "RunPod gives no cost for w1, w2: counted at the catalog's $0.40/h per pod, "
                                      "$1.30/h for the 3 pod(s) (the catalog's list price: $1.20/h)")
    assert billed(pods, None)[0] is None
    assert head_counts([{"cost": 0.5}, {"cost": 0.6}], 1.1) == (
        "the head counts its own pod's cost for each of the 2 pods, $1.00/h, not their sum $1.10/h (its pod-scoped "
        "key reads only its pod)")
    assert head_counts([{"cost": 0.5}, {"cost": 0.5}], 1.0) is None
    budget = {"machine_price": MACHINE_PRICE.model_dump(), "price_per_hour": 1.2}
    assert machine_price(budget, 3, {}) == (1.2, "budget: cannot read RunPod's `cost` of this pod (not set here: "
                                                 "RUNPOD_API_KEY, RUNPOD_POD_ID): counting the plan's $1.20/h")
    price, said = machine_price(budget, 3, {"RUNPOD_API_URL": "http://127.0.0.1:9/v2", "RUNPOD_POD_ID": "p",
                                            "RUNPOD_API_KEY": "pod-key-7f3a9c"}, deadline_s=0)
    assert price == 1.2 and said.startswith("budget: could not read RunPod's `cost` of this pod (connection to ") \
        and said.endswith("refused): counting the plan's $1.20/h") and "pod-key-7f3a9c" not in said


def test_each_data_center_is_tried_in_turn_and_each_refusal_is_said(standin, home, capsys):
    """RunPod: `dataCenterIds` are preferences, and a create "places one specific GPU type. It does
    not search for capacity": one create per candidate, on to the next on 400 (no capacity) or
    403 (a pool the account cannot use); when all refuse, each one's answer is said."""
    from rlhf_tasks.providers.runpod.api import RunPodClient

    standin.catalog.stock[(A40, "US-KS-2")] = "LOW"
    standin.no_capacity = {"EU-RO-1"}
    client = RunPodClient(KEY, base_url=standin.url)
    members, fit = create_in_process(client, command_task(nodes=2))
    assert fit["datacenters"] == ["EU-RO-1", "US-KS-2"]  # MEDIUM before LOW
    creates = [(r.status, r.body["dataCenterIds"]) for r in standin.requests
                   if r.method == "POST" and r.path == "/v2/pods"]
    assert creates == [(400, ["EU-RO-1"]), (201, ["US-KS-2"]), (201, ["US-KS-2"])]
    out = capsys.readouterr().out
    assert "RunPod: EU-RO-1 refused pod rp-contract-head (400 Bad Request: no capacity: no 1x NVIDIA A40" in out
    assert [m["dataCenterId"] for m in members] == ["US-KS-2"] * 2

    standin.requests.clear()
    standin.no_capacity, standin.forbidden = {"US-KS-2"}, {"EU-RO-1"}
    with pytest.raises(StepFailed) as info:
        create_in_process(client, command_task(name="rp-other", nodes=2))
    said = str(info.value)
    assert said.startswith("creating pod rp-other-head: no data center took it: EU-RO-1: the account cannot access "
                           "the requested pool (403 Forbidden: access denied); US-KS-2: 400 Bad Request: no capacity")
    assert [(r.status, r.body["dataCenterIds"]) for r in standin.requests if r.method == "POST" and r.path == "/v2/pods"] == [
        (403, ["EU-RO-1"]), (400, ["US-KS-2"])]
    client.close()


def test_data_centers_without_stock_are_dropped_and_clusters_go_by_cluster_stock(standin, home):
    """Availability `NONE` is no candidate (the document's own sample drops it), and an Instant Cluster
    is placed by the GPU catalog's `product=CLUSTER` stock: the data centers' stock is for pods."""
    from rlhf_tasks.providers.runpod import catalog
    from rlhf_tasks.providers.runpod.api import RunPodClient

    client = RunPodClient(KEY, base_url=standin.url)
    standin.catalog.stock[(A40, "US-KS-2")] = "NONE"
    _, plan, _ = rendered(command_task(placement={"regions": ["US-KS-2"]}))
    with pytest.raises(BadInput, match=r"placement\.regions: no data center with Global Networking offers NVIDIA A40 "
                                       r"\(looked in US-KS-2: NONE\)"):
        catalog.fit(client, plan)
    # pods: A40 is HIGH in CA-MTL-1, MEDIUM in EU-RO-1; Instant Clusters: only EU-RO-1 has them
    members, fit = create_in_process(client, command_task(network="runpod-cluster", nodes=2))
    assert fit["datacenters"] == ["EU-RO-1"]
    assert [c.body["dataCenterIds"] for c in standin.requests if c.method == "POST" and c.path == "/v2/clusters"] == [["EU-RO-1"]]
    assert len(members) == 2 and list(standin.clusters.values())[0].datacenter == "EU-RO-1"
    client.close()


def test_save_logs_follows_a_pod_through_quiet_drops_and_clean_ends_to_its_end(tmp_path):
    """Every pod's log file gets each line once (the result line above all), however the stream
    behaves: quiet past the read timeout, dropped, ended while the pod runs; and ends when the pod does."""
    from rlhf_tasks.providers.runpod import logs
    from rlhf_tasks.providers.runpod.api import RunPodClient

    result = 'RLHF_TASKS_RESULT {"exit_code": 0}'
    script = f"echo start; sleep 2; echo a; echo b; echo '{result}'; sleep 2; echo late"
    runner = ProcessRunner(tmp_path / "pods", entrypoint=("bash", "-c", script, "container"))
    api = RunPodStandIn(runner, api_key=KEY, stream_lifetime=1.0).start()
    client = RunPodClient(KEY, base_url=api.url, timeout=0.4, max_attempts=3, backoff=0.02, max_backoff=0.1)
    try:
        pod = client.create_pod({"image": "x", "gpu": {"id": A40, "count": 1}, "name": "rp-logs-head"})
        api.drop_log_stream_after = 3
        path = tmp_path / "node-0.log"
        logs.save_logs(client, pod, path, threading.Event())
        name = f"runpod-log-{pod['id']}"
        poll(lambda: not any(t.name == name for t in threading.enumerate()), 60, "the log thread to end with the pod")
        assert client.get_pod(pod["id"])["status"] == "EXITED"
        text = path.read_text()
        assert [line for line in text.splitlines() if not line.startswith("[runpod ")] == [
            "start", "a", "b", result, "late"], text
        assert "container exited with code 0" in text and "[rlhf-tasks]" not in text
        assert [r.path for r in api.requests].count(f"/v2/pods/{pod['id']}/logs") >= 4
    finally:
        client.close()
        api.close()
        runner.close()
    assert api.errors == []


# ------------------------------------------------------------------ on the testbed: the real thing


#: The test image: a container's own /opt, home and /etc/ssh (with an sshd config that works in a
#: namespace host), then its command, as a container runtime would run it. (Its home is below /opt:
#: the machine's /root holds the interpreter the hosts share; what every host must see under /opt, a
#: checkout cloned there, stays: tests/testbed.py tmpfs_script.)
IMAGE = r"""#!/bin/bash
set -e
{opt}
mkdir -p /opt/root
export HOME=/opt/root
mount -t tmpfs tmpfs /etc/ssh
printf '%s\n' 'Port 22' 'HostKey /etc/ssh/ssh_host_ed25519_key' 'AuthorizedKeysFile /opt/root/.ssh/authorized_keys' \
  'UsePAM no' 'PasswordAuthentication no' 'KbdInteractiveAuthentication no' 'PermitRootLogin prohibit-password' \
  'AllowTcpForwarding yes' 'StrictModes no' 'PidFile none' 'UseDNS no' > /etc/ssh/sshd_config
exec "$@"
""".replace("{opt}", "\n".join(tbmod.tmpfs_script("/opt")))


def image(tb) -> tuple[str, ...]:
    """The played image's entrypoint, written once per testbed and never rewritten in place: the hand-made
    test starts its hosts one after another, and a rewrite (truncate, then write) while the host before
    opened it gave that host's bash an empty script (it printed nothing and exited: once, in CI's load)."""
    path = tb.dir / "image-entrypoint.sh"
    if not path.exists() or path.read_text() != IMAGE:
        fresh = path.with_name(path.name + ".new")
        fresh.write_text(IMAGE)
        os.replace(fresh, path)
    return ("bash", str(path))


def test_the_played_images_entrypoint_is_written_once(tmp_path):
    """A second host's start does not rewrite the file a first host's bash may be opening."""
    class Bed:
        dir = tmp_path
    first = image(Bed)
    before = os.stat(first[1])
    assert image(Bed) == first and Path(first[1]).read_text() == IMAGE
    after = os.stat(first[1])
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.fixture
def tb_standin(testbed3):
    tbmod.ensure_sshd()
    runner = TestbedRunner(testbed3, entrypoint=image(testbed3))
    api = RunPodStandIn(runner, api_key=KEY, ssh_public_keys=(testbed3._ssh_keys().with_suffix(".pub")).read_text())
    api.start()
    yield api
    api.close()
    for host in range(3):  # every pod's processes died with it
        assert testbed3.processes(host) == [], f"processes left on node{host}"
    assert api.errors == [], "the stand-in broke RunPod's contract or crashed"


def test_launch_the_demo_on_global_networking_pods(testbed3, tb_standin, tmp_path):
    api = tb_standin
    env = cli_env(tmp_path, api.url)
    out = run_cli(["launch", write_task(tmp_path, tiny_task(steps=10, nodes=2)), "--provider", "runpod", "-y"], env, timeout=900)
    said = out.stdout + out.stderr
    (tmp_path / "launch.out").write_text(said)
    assert out.returncode == 0, said[-6000:]
    # The pods went PROVISIONING -> STARTING -> RUNNING and found each other by name (two: the claim needs no third).
    assert said.count("-> RUNNING, ") == 2 and ".runpod.internal (10.77.0." in said
    # The job's log and the summary came from the head pod's log stream.
    assert "training on 2 node(s)" in out.stdout and "done: steps 1..10" in out.stdout
    assert "== summary ==" in out.stdout and "SUCCEEDED" in out.stdout
    assert "the job's last line: done: steps 1..10" in out.stdout and "RLHF_TASKS_RESULT" not in out.stdout
    assert "network preset auto: GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in out.stdout
    # The launcher terminated the pods after the job: nothing bills, nothing runs, nothing is left in the vault.
    assert "stopping the runpod cluster tiny-grpo" in out.stdout and live_pods(api) == []
    assert "stored 1 secret(s) in RunPod's vault" in out.stdout and api.secrets == {}
    for host in range(3):
        assert testbed3.processes(host) == []
    logs = tmp_path / "home" / "runs" / "tiny-grpo" / "nodes"
    assert "RLHF_TASKS_RESULT" in (logs / "node-0.log").read_text()
    assert "head ready after" in (logs / "node-1.log").read_text()
    record = json.loads((tmp_path / "home" / "clusters" / "tiny-grpo" / "cluster.json").read_text())
    assert record["ended"] and record["job"]["status"] == "SUCCEEDED"
    down = run_cli(["down", "tiny-grpo"], env)
    assert down.returncode == 0 and "the cluster ended at" in down.stdout
    assert_key_nowhere(said, down.stdout, down.stderr, directories=(tmp_path, testbed3.dir), api=api)


def test_launch_the_demo_on_an_instant_cluster_over_ens1_then_status_and_down(testbed3, tb_standin, tmp_path):
    api = tb_standin
    env = cli_env(tmp_path, api.url)
    out = run_cli(["launch", write_task(tmp_path, tiny_task(steps=10, nodes=2, network="runpod-cluster")), "--provider",
                   "runpod", "-y", "--keep"], env, timeout=900)
    said = out.stdout + out.stderr
    (tmp_path / "launch.out").write_text(said)
    assert out.returncode == 0, said[-6000:]
    assert "created Instant Cluster tiny-grpo" in said and "rank 0, overlay 10.78." in said
    # Every node found the overlay interface that holds NODE_ADDR; Ray and gloo ran over it.
    assert "network preset runpod-cluster: GLOO_SOCKET_IFNAME=ens1 NCCL_SOCKET_IFNAME=ens1" in out.stdout
    assert "runpod node 0 of 2, address 10.78." in out.stdout
    assert "done: steps 1..10" in out.stdout and "SUCCEEDED" in out.stdout
    # --keep: the cluster stays until `down`.
    status = run_cli(["status", "tiny-grpo"], env)
    assert status.returncode == 0, status.stderr
    assert "Instant Cluster tiny-grpo" in status.stdout and status.stdout.count("\tRUNNING\t") == 2
    assert "account secrets in RunPod's vault: rlhf-tasks.tiny-grpo.RAY_AUTH_TOKEN" in status.stdout
    down = run_cli(["down", "tiny-grpo"], env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "deleted Instant Cluster" in down.stdout and "(2 pods)" in down.stdout
    assert api.clusters == {} and live_pods(api) == [] and api.secrets == {}
    assert "deleted 1 account secret(s) from RunPod's vault (rlhf-tasks.tiny-grpo.RAY_AUTH_TOKEN)" in down.stdout
    for host in range(3):
        assert testbed3.processes(host) == []
    assert_key_nowhere(said, status.stdout, down.stdout, directories=(tmp_path, testbed3.dir), api=api)


class NetnsRelay:
    """A port on a testbed host's loopback that leads to a port on this machine's: the laptop
    reaches the API stand-in as it would reach api.runpod.io. The listening socket is made
    in a thread that entered the host's network namespace (setns is per thread)."""

    def __init__(self, netns: str, target_port: int, address: str = "127.0.0.1"):
        self.target_port, self.port, self.address = target_port, None, address
        self.accepted: queue.Queue = queue.Queue()
        ready = threading.Event()
        threading.Thread(target=self._connect, daemon=True).start()  # made here: this namespace
        threading.Thread(target=self._listen, args=(netns, ready), daemon=True).start()
        assert ready.wait(10) and self.port, "relay did not start"

    def _listen(self, netns: str, ready: threading.Event) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns")
        finally:
            os.close(fd)
        self.server = socket.socket()
        self.server.bind((self.address, 0))
        self.server.listen(32)
        self.port = self.server.getsockname()[1]
        ready.set()
        while True:
            try:
                self.accepted.put(self.server.accept()[0])
            except OSError:
                return

    def _connect(self) -> None:
        while True:
            inside = self.accepted.get()
            if inside is None:
                return
            outside = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()
        self.accepted.put(None)


def tunnels(tb) -> list[str]:
    """The `ssh -N` processes on the laptop."""
    lines = []
    for pid in tb.processes("laptop"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"ssh", b"-N"]:
            lines.append(b" ".join(argv).decode())
    return lines


def test_client_submission_through_the_ssh_forward_from_a_laptop(testbed3, tb_standin, tmp_path):
    """The launcher runs on the laptop, which reaches RunPod's API and the pods' public
    addresses, not the head's 127.0.0.1 dashboard: only through `ssh -L` to the head pod."""
    tb, api = testbed3, tb_standin
    # The laptop's key, registered with RunPod, in the laptop's ssh-agent.
    agent = tb.run("laptop", ["ssh-agent", "-D", "-a", "/tmp/rp-agent.sock"], name="ssh-agent")
    poll(lambda: tb.run("laptop", "test -S /tmp/rp-agent.sock", background=False).returncode == 0, 30, "ssh-agent")
    tb.sh("laptop", f"SSH_AUTH_SOCK=/tmp/rp-agent.sock ssh-add {tb._ssh_keys()}")
    relay = NetnsRelay(tb.laptop.netns, int(api.url.split(":")[2].split("/")[0]))
    try:
        home = tmp_path / "laptop-home"
        env = tb.env(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", RLHF_TASKS_HOME=str(home), RUNPOD_API_KEY=KEY,
                     RUNPOD_API_URL=f"http://127.0.0.1:{relay.port}/v2", SSH_AUTH_SOCK="/tmp/rp-agent.sock")
        task = write_task(tmp_path, command_task(nodes=2, submit="client"))
        launch = tb.run("laptop", [sys.executable, "-m", "rlhf_tasks.cli", "launch", task, "--provider", "runpod",
                                   "-y", "--keep"], env=env, cwd=ROOT, name="launch")
        assert launch.wait(600) == 0, launch.output[-6000:]
        said = launch.output
        assert "forwarding the head's dashboard to http://127.0.0.1:" in said and "through ssh root@10.77.0." in said
        assert "submitted job rp-contract-" in said and "CONTRACT alive nodes 2" in said and "SUCCEEDED" in said
        head_ip = next(p.public_ip for p in api.pods.values() if p.name == "rp-contract-head")
        # The dashboard is on the head's 127.0.0.1 only: from the laptop, not at the head's address.
        assert not tb.http("laptop", f"http://{head_ip}:8265/api/gcs_healthz", timeout=3).ok
        assert tunnels(tb) == []  # the launcher's tunnel ended with it
        # `forward` opens the tunnel again, for submit, logs, Ray's CLI and a browser.
        forward = tb.run("laptop", [sys.executable, "-m", "rlhf_tasks.cli", "forward", "rp-contract", "--port",
                                    "18765"], env=env, cwd=ROOT, name="forward")
        poll(lambda: tb.http("laptop", "http://127.0.0.1:18765/api/gcs_healthz", timeout=3).ok, 60,
             "the forwarded dashboard")
        jobs = tb.run("laptop", [sys.executable, "-m", "rlhf_tasks.cli", "list", "--cluster", "rp-contract"],
                      env=env, cwd=ROOT, background=False, timeout=120)
        assert jobs.returncode == 0 and "SUCCEEDED" in jobs.output, jobs.output
        forward.send_signal(signal.SIGINT)
        forward.wait(30)
        down = tb.run("laptop", [sys.executable, "-m", "rlhf_tasks.cli", "down", "rp-contract"], env=env, cwd=ROOT,
                      background=False, timeout=300)
        assert down.returncode == 0 and "terminated 2 pod(s)" in down.output, down.output
        assert live_pods(api) == [] and tunnels(tb) == []
        assert_key_nowhere(said, jobs.output, down.output, directories=(home,), api=api)
    finally:
        relay.close()
        agent.kill()


def test_the_hand_made_start_script_with_only_the_guides_variables(testbed3, tmp_path):
    """start.sh on three hosts as someone creating pods by hand would run it: the guide's
    variables only (and what RunPod sets itself), the workers started well before the head; the
    task's job.working_dir, shipped in the script, is the job's working directory."""
    tb = testbed3
    code = tmp_path / "code"
    code.mkdir()
    (code / "shipped.txt").write_text("shipped in the start script\n")
    task = command_task(checkpoints={"path": str(tmp_path / "ckpt"), "resume": "never"})
    task["job"].update(working_dir=str(code),
                       args={"entrypoint": ["bash", "-c", f"{SHOW_SHIPPED} && {CHECK_NODES.format(nodes=3)}"]})
    _, _, files = rendered(task)
    script = tmp_path / "start.sh"
    script.write_text(files["rp-contract.start.sh"])
    ids = ["handhead0000a1", "handwork0000b2", "handwork0000c3"]
    for host, pod_id in enumerate(ids):
        tb.add_alias(f"{pod_id}.runpod.internal", host)
    guide = {"RAY_AUTH_TOKEN": TOKEN}
    procs = {}
    try:
        for host in (1, 2):
            procs[host] = tb.run(host, [*image(tb), "bash", str(script)], name="start-worker", env=tb.env(
                **guide, RUNPOD_POD_ID=ids[host], RAY_WORKER="1", HEAD_POD_ID=ids[0]))
        started = time.monotonic()
        poll(lambda: all("waiting for the head at" in procs[h].output for h in (1, 2)), 120,
             "the workers to wait for the head")
        procs[0] = tb.run(0, [*image(tb), "bash", str(script)], name="start-head", env=tb.env(
            **guide, RUNPOD_POD_ID=ids[0], EXPECTED_WORKERS="2", DEBUG_RAY="1"))
        waited = time.monotonic() - started
        result = poll(lambda: parse_result(procs[0].output), 300, "the head agent's result line", 0.5)
        head = procs[0].output
        assert result["exit_code"] == 0 and (result["job"] or {})["status"] == "SUCCEEDED", head[-5000:]
        assert "CONTRACT alive nodes 3" in head and "--ray-debugger-external" in head
        assert "shipped in the start script" in head  # job.working_dir reached the job's working directory
        assert ("network preset runpod-global: FORCE_MODEL_INIT_TO_CUDA=1 GLOO_SOCKET_IFNAME=eth0 NCCL_IB_DISABLE=1 "
                "NCCL_LAUNCH_MODE=GROUP") in head and " NCCL_SOCKET_FAMILY=AF_INET " in head
        assert f"runpod node 0 of 3, address {tb.hosts[0].ip}, head {tb.hosts[0].ip}" in head
        for host in (1, 2):
            output = procs[host].output
            assert f"head {tb.hosts[0].ip}" in output
            ready_after = float(output.split("head ready after ")[1].split("s")[0])
            assert ready_after >= 10, (ready_after, waited)  # they were waiting for the head, then joined
        poll(lambda: all("the node agent exited with code 0" in procs[h].output for h in (0, 1, 2)), 120,
             "every agent to end (the pods stay up)")
        assert all(proc.running() for proc in procs.values())  # no container restart runs the job twice
        assert TOKEN not in head
    except BaseException:
        for host, proc in sorted(procs.items()):  # pytest shows this with the failure
            print(f"--- node{host} ---\n{proc.output[-4000:]}")
        raise
    finally:
        for host in range(3):
            tb.kill(host)


def _check_warnings(capsys, task: dict, tmp_path: Path) -> list[str]:
    from rlhf_tasks.cli import main

    path = tmp_path / f"{task['name']}.yaml"
    path.write_text(yaml.safe_dump(task))
    assert main(["check", str(path), "--provider", "runpod"]) == 0
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]


def test_check_warns_of_the_ignored_shm_size_and_of_weight_sync_over_global_networking(capsys, tmp_path):
    """`check` said nothing of resources.shm_size (RunPod's create request has no /dev/shm size) nor of
    Global Networking's 100 Mbit/s for a recipe that syncs weights between pods: both warned, with the
    sync's time for one bf16 copy of the model where its name says its size (Qwen2.5-7B: 14 GB, about 19 m)."""
    verl = yaml.safe_load((ROOT / "tasks" / "verl-ppo-gsm8k.yaml").read_text())
    verl["network"] = "runpod-global"
    warnings = _check_warnings(capsys, verl, tmp_path)
    (shm,) = [w for w in warnings if "shm_size" in w]
    assert "resources.shm_size 128GB is not applied" in shm and "no size for /dev/shm" in shm
    (link,) = [w for w in warnings if "100 Mbit/s" in w]
    assert "network: runpod-global: Global Networking links the 2 pods at 100 Mbit/s" in link
    assert "verl shards the model over the pods" in link
    assert "one bf16 copy of Qwen/Qwen2.5-7B-Instruct's weights (14 GB) takes about 19 m" in link
    assert "network: runpod-cluster" in link
    # a model whose name says no size: the bandwidth, per GB
    verl["job"]["args"]["model"] = "my-org/house-model"
    del verl["resources"]["shm_size"]
    warnings = _check_warnings(capsys, verl, tmp_path)
    assert not any("shm_size" in w for w in warnings)
    (link,) = [w for w in warnings if "100 Mbit/s" in w]
    assert "each GB of weights takes 80 s at that rate" in link and "bf16 copy" not in link
    # an Instant Cluster, one pod, or a recipe that syncs no weights: no such warning
    for other in ({**verl, "network": "runpod-cluster"}, {**verl, "nodes": 1}, command_task(nodes=2)):
        assert not any("100 Mbit/s" in w for w in _check_warnings(capsys, other, tmp_path)), other
