"""Provider contracts on the multi-host testbed: what we render for dstack and SkyPilot,
run on separate hosts with exactly the environment each provider's runner sets, forms
a Ray cluster and runs the job (submitted by the head, or from a laptop through an SSH
port forward). A head-submitted dstack run that succeeds is test_preflight.py's healthy
run (its preflight, its job, its workers leaving when the head says the run is over)."""

from __future__ import annotations

import json
import re
import shlex
import tarfile
from pathlib import Path

import pytest
import yaml

import testbed as tbmod
from rlhf_tasks import providers
from rlhf_tasks.agent.protocol import parse_result
from rlhf_tasks.spec import parse_task

from conftest import ROOT

testbed2 = tbmod.make_testbed_fixture(2)
testbed3 = tbmod.make_testbed_fixture(3)

TOKEN = "contract-test-token-0123456789abcdef"
JOB = ("python3 -c \"import ray; ray.init(); n = sum(1 for x in ray.nodes() if x['Alive']); "
       "print('CONTRACT alive nodes', n); assert n == {nodes}\"")


def contract_task(tmp_path: Path, nodes: int, submit: str, service: bool = True, preflight: bool = False) -> dict:
    """A small command job; preflight (its own tests) only where a test asks for it: it adds ~8 s."""
    task = {
        "preflight": preflight,
        "name": f"contract-{submit}",
        "nodes": nodes,
        "resources": {"cpus": 1},
        "env": {"PYTHONUNBUFFERED": "1"},
        "secrets": ["WANDB_API_KEY"],
        "setup": [f"echo setup ran on $(hostname) >> {tmp_path}/setup.log"],
        "ray": {"object_store_memory": "80MB"},
        "checkpoints": {"path": str(tmp_path / "ckpt")},
        "wait": {"head": "3m", "nodes": "3m"},
        "job": {"recipe": "command", "submit": submit, "working_dir": None, "timeout": "5m",
                "args": {"entrypoint": JOB.format(nodes=nodes)}},
    }
    if service:  # a node-local service on every node, checked over HTTP before the job
        task["services"] = [{"name": "web", "where": "every_node", "timeout": "1m",
                             "command": "python3 -m http.server --bind {node_addr} 23111",
                             "ready": {"http": "http://{node_addr}:23111/"}}]
    return task


def render(provider_name: str, task: dict, directory: Path) -> dict[str, str]:
    provider = providers.get(provider_name)
    files = provider.render(provider.plan(parse_task(task)))
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    return files


def place(tb, host: int, sources: dict[str, Path]) -> None:
    """Put shipped files at their destinations on one host, as the provider would upload them.
    /opt is the host's own (tests/testbed.py own), so the machine's /opt is untouched."""
    tb.own(host, "/opt")
    script = ["true"]
    for destination, source in sources.items():  # a target is replaced whole, as dstack's runner does
        script.append(f"rm -rf {shlex.quote(destination)} && mkdir -p {shlex.quote(str(Path(destination).parent))}")
        script.append(f"cp -r {shlex.quote(str(source))} {shlex.quote(destination)}")
    tb.sh(host, " && ".join(script))


def dstack_env(tb, rank: int, nodes: int, rendered_env: list[str], secrets: dict | None = None) -> dict[str, str]:
    """What dstack's runner sets on a node, plus the configuration's `env` as dstack's server hands it to the
    runner: each `${{ secrets.NAME }}` filled with dstack's own interpolator from the project's secrets
    (server/services/jobs/__init__.py interpolate_job_spec_secrets), which `launch` set from the user's
    environment (`secrets` among them; an empty one is not set)."""
    from dstack._internal.utils.interpolator import VariablesInterpolator

    local = {"WANDB_API_KEY": "", "RAY_AUTH_TOKEN": TOKEN, **(secrets or {})}
    entries = dict(entry.partition("=")[::2] for entry in rendered_env)
    project = {}
    for key, value in entries.items():
        reference = re.fullmatch(r"\$\{\{ secrets\.(\w+) \}\}", value)
        if reference and local.get(key):
            project[reference.group(1)] = local[key]
    interpolate = VariablesInterpolator({"secrets": project}).interpolate
    env = {k: interpolate(v) for k, v in entries.items() if not re.fullmatch(r"\$\{\{ secrets\.\w+ \}\}", v)
           or local.get(k)}
    ips = [h.ip for h in tb.hosts[:nodes]]
    return tb.env(**env, DSTACK_NODE_RANK=str(rank), DSTACK_MASTER_NODE_IP=ips[0], DSTACK_NODES_IPS="\n".join(ips),
                  DSTACK_NODES_NUM=str(nodes), DSTACK_GPUS_PER_NODE="0", DSTACK_GPUS_NUM="0",
                  DSTACK_RUN_NAME="contract-run")


def start_dstack(tb, tmp_path: Path, task: dict, secrets: dict | None = None) -> list:
    files = render("dstack", task, tmp_path / "rendered")
    config = yaml.safe_load(files[f"{task['name']}.dstack.yml"])
    assert TOKEN not in json.dumps(config)
    mounts = {m.split(":")[1]: tmp_path / "rendered" / m.split(":")[0] for m in config["files"]}
    procs = []
    for rank in range(task["nodes"]):
        place(tb, rank, mounts)
        env = dstack_env(tb, rank, task["nodes"], config["env"], secrets)
        procs.append(tb.run(rank, " && ".join(config["commands"]), env=env, name=f"dstack-node{rank}"))
    return procs


def test_dstack_failing_job_fails_the_head(testbed2, tmp_path):
    """Also the failure's forensics (issue 22): node1's task prints a traceback and exits, the
    head's service dies; the head's result names each node's first error, and its bundle
    holds both nodes' files without the secret the job printed or the Ray token."""
    task = contract_task(tmp_path, 2, "head", service=False)
    die = tmp_path / "die"
    task["job"]["args"]["entrypoint"] = f"python3 {ROOT / 'tests' / 'data' / 'fail_on_last_rank.py'} {die}"
    task["job"]["max_restarts"] = 0  # the failure path itself; restarts have their own tests
    task["secrets"] = ["FX_SECRET"]
    task["services"] = [{"name": "reward", "where": "head", "timeout": "1m", "ready": {"http": "http://{node_addr}:23111/"},
                         "command": f"python3 -m http.server --bind {{node_addr}} 23111 & s=$!; "
                                    f"while [ ! -e {die} ]; do sleep 0.2; done; kill $s; "
                                    f"echo 'reward: CUDA error: an illegal memory access' >&2; exit 3"}]
    secret = "fx-secret-value-0123456789"
    procs = start_dstack(testbed2, tmp_path, task, {"FX_SECRET": secret})
    assert procs[0].wait(240) == 1, procs[0].output[-4000:]
    assert "FAILED" in procs[0].output
    assert procs[1].wait(90) == 0
    found = parse_result(procs[0].output)["forensics"]
    firsts = {e["label"]: e for e in found["first_errors"]}
    assert firsts["node1"]["error"] == "RuntimeError: bad shard on rank 1", found
    assert firsts["node0"]["error"].startswith("service reward exited with code 3"), found
    assert found["bundle"].startswith("/opt/rlhf-tasks/logs/forensics-contract-head-")
    testbed2.sh(0, f"cp {found['bundle']} {tmp_path}/bundle.tar.gz")  # /opt is the head host's own
    with tarfile.open(tmp_path / "bundle.tar.gz") as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert {"node0/rlhf-tasks/agent-node0.log", "node0/rlhf-tasks/service-reward-node0.log", "node0/raylet.out",
            "node0/gcs_server.out", "node1/rlhf-tasks/agent-node1.log", "node1/raylet.out"} <= set(members), sorted(members)
    assert "CUDA error: an illegal memory access" in members["node0/rlhf-tasks/service-reward-node0.log"]
    assert any(n.startswith("node1/worker-") and n.endswith(".err") for n in members)
    assert "shard with key [secret FX_SECRET]" in "".join(members.values())
    assert not any(secret in text or TOKEN in text for text in members.values())


def test_dstack_client_submission_through_a_forwarded_port_then_a_worker_rejoins_when_its_raylet_dies(testbed2,
                                                                                                     tmp_path):
    """A client-mode cluster: the laptop submits through an SSH port forward (the dashboard is
    bound to the head's 127.0.0.1), the cluster stays up after the job, and a worker whose
    raylet dies rejoins it (its agent starts Ray again)."""
    tb = testbed2
    task = contract_task(tmp_path, 2, "client")
    task_file = tmp_path / "task.yaml"
    task_file.write_text(yaml.safe_dump(task))
    procs = start_dstack(tb, tmp_path, task)
    tbmod.poll(lambda: "cluster ready for a client submission" in procs[0].output or None, 180,
               "the head to report the cluster ready")
    port = tb.laptop_forward(8265, host=0)
    # The dashboard is bound to the head's 127.0.0.1 only: the laptop reaches it through the tunnel.
    assert not tb.http("laptop", f"http://{tb.hosts[0].ip}:8265/api/gcs_healthz", timeout=3).ok
    assert tb.http("laptop", f"http://127.0.0.1:{port}/api/gcs_healthz").ok
    refused = tb.http("laptop", f"http://127.0.0.1:{port}/api/jobs/")
    assert refused.status in (401, 403), refused
    home = tmp_path / "laptop-home"
    submit = tb.run("laptop", ["rlhf-tasks", "submit", str(task_file), "--address", f"http://127.0.0.1:{port}",
                               "--provider", "dstack", "--follow"],
                    env=tb.env(RAY_AUTH_TOKEN=TOKEN, RLHF_TASKS_HOME=str(home)), name="submit")
    assert submit.wait(240) == 0, submit.output[-4000:]
    assert "CONTRACT alive nodes 2" in submit.output and "SUCCEEDED" in submit.output
    assert procs[0].running() and procs[1].running()  # a client-mode cluster stays up until `down`
    # Kill the worker host's raylet by PID, inside that host's own process table.
    tb.sh(1, "kill -9 $(ps -eo pid,comm | awk '$2 == \"raylet\" {print $1}')")
    tbmod.poll(lambda: "rejoining (1/3)" in procs[1].output or None, 60, "the worker agent to rejoin")

    def two_alive():
        r = tb.http(0, "http://127.0.0.1:8265/api/v0/nodes?limit=100&filter_keys=state&filter_predicates=%3D"
                       "&filter_values=ALIVE", headers={"Authorization": f"Bearer {TOKEN}"})
        return r.ok and len(r.json()["data"]["result"]["result"]) == 2 or None

    tbmod.poll(two_alive, 120, "two ALIVE nodes after the rejoin", 0.5)
    assert procs[1].running()


def test_the_rendered_demo_runs_on_hosts_that_have_only_what_it_ships(testbed3, tmp_path):
    """tasks/tiny-grpo.yaml rendered for dstack, its `commands` run as they stand on three
    hosts with dstack's environment. The hosts' python finds ray and torch but not the demo:
    the checkout its editable install points at is hidden on every host, so the job can only
    run from the copy shipped under /opt/rlhf-tasks/lib."""
    tb = testbed3
    task = yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    task["checkpoints"]["path"] = "/opt/checkpoints/tiny-grpo"  # a directory on each host, as instance_path gives
    task["job"]["args"].update(steps=10, save_every=5, num_prompts=200)
    files = render("dstack", task, tmp_path / "rendered")
    config = yaml.safe_load(files["tiny-grpo.dstack.yml"])
    mounts = {m.split(":")[1]: tmp_path / "rendered" / m.split(":")[0] for m in config["files"]}
    assert (mounts["/opt/rlhf-tasks"] / "lib" / "rlhf_tasks" / "demo" / "train.py").is_file()  # the demo is shipped
    where = "python3 -c 'import os, rlhf_tasks.demo as d; print(os.path.dirname(d.__file__))'"
    checkout = tb.sh(0, where, cwd="/").strip().splitlines()[-1]
    for rank in range(3):
        place(tb, rank, mounts)
        tb.sh(rank, f"mount -t tmpfs tmpfs {shlex.quote(checkout)}", cwd="/")  # this host's mounts only
        hidden = tb.run(rank, "python3 -c 'import rlhf_tasks.demo.train'", cwd="/", background=False)
        assert hidden.returncode != 0 and "No module named 'rlhf_tasks.demo.train'" in hidden.output, hidden.output
    procs = [tb.run(rank, " && ".join(config["commands"]), env=dstack_env(tb, rank, 3, config["env"]), cwd="/",
                    name=f"demo-node{rank}") for rank in range(3)]
    head = procs[0]
    assert head.wait(600) == 0, head.output[-4000:]
    out = head.output
    assert "wrote 200 prompts to /opt/checkpoints/tiny-grpo/data/prompts.jsonl" in out, out[-4000:]
    assert "service reward ready" in out and "training on 3 node(s)" in out and "done: steps 1..10" in out
    assert "SUCCEEDED" in out and "Collecting" not in out  # ray, torch and numpy were there: nothing installed
    assert TOKEN not in out
    for worker in procs[1:]:
        assert worker.wait(120) == 0, worker.output[-3000:]
    assert tb.sh(0, "ls /opt/checkpoints/tiny-grpo").split().count("step_000010.pt") == 1


def test_skypilot_setup_then_run_on_every_host(testbed2, tmp_path):
    tb = testbed2
    task = contract_task(tmp_path, 2, "head")
    files = render("sky", task, tmp_path / "rendered")
    config = yaml.safe_load(files[f"{task['name']}.sky.yaml"])
    assert set(config["secrets"]) == {"WANDB_API_KEY", "RAY_AUTH_TOKEN"}
    mounts = {dst: tmp_path / "rendered" / src for dst, src in config["file_mounts"].items()}
    ips = "\n".join(h.ip for h in tb.hosts)
    secrets = {"RAY_AUTH_TOKEN": TOKEN}  # `sky launch --secret RAY_AUTH_TOKEN`; WANDB_API_KEY not given
    for rank in range(2):
        place(tb, rank, mounts)
        env = tb.env(**config["envs"], **secrets, SKYPILOT_SETUP_NODE_RANK=str(rank), SKYPILOT_NUM_NODES="2",
                     SKYPILOT_SETUP_NODE_IPS=ips)
        tb.run(rank, config["setup"], env=env, background=False, check=True, name="sky-setup")
    assert (tmp_path / "setup.log").read_text().count("setup ran on") == 2
    procs = []
    for rank in range(2):
        env = tb.env(**config["envs"], **secrets, SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS=ips,
                     SKYPILOT_NUM_NODES="2", SKYPILOT_NUM_GPUS_PER_NODE="0", SKYPILOT_TASK_ID="sky-contract-1")
        procs.append(tb.run(rank, config["run"], env=env, name=f"sky-node{rank}"))
    assert procs[0].wait(240) == 0, procs[0].output[-4000:]
    assert "CONTRACT alive nodes 2" in procs[0].output
    assert "--dashboard-agent-listen-port 52366" in procs[0].output  # never SkyPilot's 52365
    assert procs[1].wait(90) == 0, procs[1].output[-3000:]


@pytest.mark.parametrize("provider_name", ["dstack", "sky"])
def test_missing_token_is_a_clear_error(testbed2, tmp_path, provider_name):
    task = contract_task(tmp_path, 2, "head", service=False)
    files = render(provider_name, task, tmp_path / "rendered")
    main = next(iter(files))
    config = yaml.safe_load(files[main])
    command = config["commands"][-1] if provider_name == "dstack" else config["run"]
    mounts = ({m.split(":")[1]: tmp_path / "rendered" / m.split(":")[0] for m in config["files"]}
              if provider_name == "dstack" else
              {dst: tmp_path / "rendered" / src for dst, src in config["file_mounts"].items()})
    place(testbed2, 0, mounts)
    env = (dstack_env(testbed2, 0, 2, ["PYTHONUNBUFFERED=1"]) if provider_name == "dstack" else
           testbed2.env(SKYPILOT_NODE_RANK="0", SKYPILOT_NODE_IPS=testbed2.hosts[0].ip, SKYPILOT_NUM_NODES="2"))
    proc = testbed2.run(0, command, env=env, name="no-token")
    assert proc.wait(60) == 2
    assert "$RAY_AUTH_TOKEN is not set" in proc.output
