"""Node agent units (rlhf_tasks/agent/): role detection per provider contract, readiness polling with a
deadline and a diagnosis, network and debug presets, the Ray command line."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from rlhf_tasks import providers
from rlhf_tasks.agent import beacon, contract, jobrunner, processes, protocol, raynode
from rlhf_tasks.agent.contract import NodeInfo, read_contract
from rlhf_tasks.agent.protocol import AgentError, probe_tcp, wait_for
from rlhf_tasks.agent.raynode import node_env, ray_start_command
from rlhf_tasks.plan import Contract, command, env, template
from rlhf_tasks.spec import parse_task

from conftest import ROOT, stand_in


def plan_for(provider="local", **overrides):
    """The plan as the agent reads it (JSON data)."""
    data = {"name": "t", "nodes": 3, "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}}
    data.update(overrides)
    return json.loads(providers.get(provider).plan(parse_task(data)).to_json())


def contract_of(provider_name):
    return providers.get(provider_name).contract.model_dump()


CONTRACTS = [
    ("local", {"RLHF_TASKS_NODE_RANK": "2", "RLHF_TASKS_NUM_NODES": "3", "RLHF_TASKS_HEAD_ADDR": "127.0.1.1",
               "RLHF_TASKS_NODE_ADDR": "127.0.1.3"}, (2, 3, "127.0.1.1", "127.0.1.3")),
    ("dstack", {"DSTACK_NODE_RANK": "1", "DSTACK_NODES_NUM": "2", "DSTACK_MASTER_NODE_IP": "10.0.0.1",
                "DSTACK_NODES_IPS": "10.0.0.1\n10.0.0.2"}, (1, 2, "10.0.0.1", "10.0.0.2")),
    ("sky", {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "10.1.0.5\n10.1.0.6\n"},
     (0, 2, "10.1.0.5", "10.1.0.5")),
]


@pytest.mark.parametrize("provider,environ,expected", CONTRACTS, ids=[c[0] for c in CONTRACTS])
def test_each_providers_contract_travels_as_data(provider, environ, expected):
    info = read_contract(contract_of(provider), environ)
    assert (info.rank, info.nodes, info.head, info.node_addr) == expected


# Rule kinds on invented variables, shaped like RunPod's hand-made contract (a worker flag,
# a worker count, a head pod id in a name) and Slurm's (the head from a command's output).
POD_LIKE = Contract(rank=env("ACME_WORKER", default="0"), nodes=env("ACME_WORKERS", plus=1),
                    head=template("{ACME_HEAD_ID}.acme.internal"), cluster_id=env("ACME_HEAD_ID")).model_dump()


def test_template_plus_and_default_rules():
    worker = read_contract(POD_LIKE, {"ACME_WORKER": "1", "ACME_WORKERS": "3", "ACME_HEAD_ID": "abc123"})
    assert (worker.rank, worker.nodes, worker.head, worker.cluster_id) == (1, 4, "abc123.acme.internal", "abc123")
    head = read_contract(POD_LIKE, {"ACME_WORKERS": "1"})  # the head pod is not told its own id
    assert (head.rank, head.nodes, head.head) == (0, 2, None)


def test_a_worker_without_its_head_is_told_which_variable_is_missing():
    with pytest.raises(AgentError) as info:
        read_contract(POD_LIKE, {"ACME_WORKER": "1", "ACME_WORKERS": "3"})
    assert "$ACME_HEAD_ID is not set" in str(info.value) and info.value.code == 2


def test_command_rule_takes_the_head_from_its_output():
    calls = []

    def scontrol(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="gpu-a\ngpu-b\n", stderr="")

    contract = Contract(rank=env("BATCH_NODEID"), nodes=env("BATCH_NUM_NODES"),
                        head=command(["hostlist", "{BATCH_NODELIST}"], item=0)).model_dump()
    info = read_contract(contract, {"BATCH_NODEID": "1", "BATCH_NUM_NODES": "2", "BATCH_NODELIST": "gpu-[a-b]"},
                         run=scontrol)
    assert (info.rank, info.nodes, info.head) == (1, 2, "gpu-a")
    assert calls == [["hostlist", "gpu-[a-b]"]]


def test_missing_contract_variable_names_it():
    with pytest.raises(AgentError) as info:
        read_contract(contract_of("dstack"), {"DSTACK_NODE_RANK": "1", "DSTACK_NODES_NUM": "2"})
    assert "$DSTACK_MASTER_NODE_IP" in str(info.value) and info.value.code == 2
    with pytest.raises(AgentError, match="not an integer"):
        read_contract(contract_of("local"), {"RLHF_TASKS_NODE_RANK": "x", "RLHF_TASKS_NUM_NODES": "1",
                                             "RLHF_TASKS_HEAD_ADDR": "h"})
    with pytest.raises(AgentError, match="outside"):
        read_contract(contract_of("local"), {"RLHF_TASKS_NODE_RANK": "3", "RLHF_TASKS_NUM_NODES": "3",
                                             "RLHF_TASKS_HEAD_ADDR": "h"})


def test_the_agent_names_no_provider():
    """Contracts are data in the plan: the agent's source names no provider and none of their variables."""
    source = "".join(path.read_text() for path in sorted((ROOT / "rlhf_tasks" / "agent").rglob("*.py")))
    for word in ("DSTACK_", "SKYPILOT_", "SLURM_", "HEAD_POD_ID", "PRIMARY_ADDR", "RAY_WORKER", "EXPECTED_WORKERS",
                 "\"NODE_RANK\"", "runpod", "dstack", "skypilot", "slurm", "podnet", "ens1"):
        assert word.lower() not in source.lower(), word


def test_a_plan_of_another_version_is_refused(tmp_path):
    plan = plan_for()
    plan["version"] = 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    out = subprocess.run([sys.executable, "-m", "rlhf_tasks.agent", "--plan", str(path)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert "plan version 1" in out.stdout and f"reads version {protocol.PLAN_VERSION}" in out.stdout
    assert protocol.parse_result(out.stdout)["exit_code"] == 2


def test_wait_for_deadline_names_what_and_last_error():
    calls = []

    def check():
        calls.append(1)
        return False, f"attempt {len(calls)} refused"

    with pytest.raises(AgentError) as info:
        wait_for("the thing", check, timeout_s=0.6, interval=0.05, max_interval=0.1)
    text = str(info.value)
    assert "waiting for the thing" in text and f"attempt {len(calls)} refused" in text and len(calls) > 3


def test_wait_for_returns_value_when_ready():
    state = iter([(False, "no"), (False, "no"), (True, 42)])
    assert wait_for("x", lambda: next(state), 5, interval=0.01) == 42


def test_probe_tells_refused_from_timeout():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert "refused" in probe_tcp("127.0.0.1", port)

    listener = socket.socket()  # a full accept queue drops new SYNs: the connect times out
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        reason = None
        for _ in range(8):
            reason = probe_tcp("127.0.0.1", port, timeout=0.3)
            if reason is not None:
                break
            s = socket.socket()
            s.settimeout(0.3)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                pass
            fillers.append(s)
        assert reason is not None and "timed out" in reason
    finally:
        for s in fillers:
            s.close()
        listener.close()

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    try:
        assert probe_tcp("127.0.0.1", server.getsockname()[1]) is None
    finally:
        server.close()


def test_probe_names_a_name_that_does_not_resolve(monkeypatch):
    # The resolver is the remote boundary: tests send no DNS query off this machine.
    def no_such_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    assert "does not resolve" in probe_tcp("abc.runpod.internal", 6379)


def test_network_preset_fills_the_interface_that_holds_the_address():
    preset = {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}", "NCCL_IB_DISABLE": "1"}
    info = NodeInfo(1, 2, "127.0.0.1", contract.source_address("127.0.0.1"))
    assert raynode.network_env(preset, info) == {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo",
                                              "NCCL_IB_DISABLE": "1"}


def test_network_preset_without_an_interface_leaves_those_variables_unset():
    info = NodeInfo(1, 2, None, "192.0.2.77")  # TEST-NET-1: no interface here holds it
    assert raynode.network_env({"NCCL_SOCKET_IFNAME": "{iface}", "NCCL_IB_DISABLE": "0"}, info) == {"NCCL_IB_DISABLE": "0"}


def test_unknown_network_preset_names_the_field():
    from rlhf_tasks.errors import BadInput

    with pytest.raises(BadInput, match="network: 'runpod-global' is not a network of the local provider"):
        plan_for(network="runpod-global")


def test_task_env_overrides_presets_and_token_is_required():
    plan = plan_for(env={"NCCL_SOCKET_IFNAME": "eth9"}, network="ethernet")
    info = NodeInfo(1, 3, "127.0.1.1", "127.0.1.2")
    with pytest.raises(AgentError, match=r"\$RAY_AUTH_TOKEN is not set") as err:
        node_env(plan, info, {"PATH": "/bin"})
    assert err.value.code == 2
    env = node_env(plan, info, {"PATH": "/bin", "RAY_AUTH_TOKEN": "s3cret"})
    assert env["NCCL_SOCKET_IFNAME"] == "eth9" and env["NCCL_IB_DISABLE"] == "1"
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN"]) == ("token", "s3cret")
    assert env["RLHF_TASKS_HEAD_ADDR"] == "127.0.1.1" and env["RLHF_TASKS_NODE_RANK"] == "1"
    off = node_env(plan_for(ray={"auth": "none"}), info, {"RAY_AUTH_TOKEN": "x"})
    assert off["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in off


def test_the_head_sets_rays_health_checks_so_a_silent_node_is_declared_dead_within_node_silence():
    plan = plan_for(wait={"node_silence": "12s"})
    head = node_env(plan, NodeInfo(0, 3, "10.0.0.1", "10.0.0.1"), {"RAY_AUTH_TOKEN": "t"})
    assert (head["RAY_health_check_period_ms"], head["RAY_health_check_timeout_ms"],
            head["RAY_health_check_failure_threshold"]) == ("2000", "2000", "3")
    assert jobrunner.silence_bound(head)[0] == 12.0 and "within 12s" in jobrunner.silence_bound(head)[1]
    worker = node_env(plan, NodeInfo(1, 3, "10.0.0.1", "10.0.0.2"), {"RAY_AUTH_TOKEN": "t"})
    assert not any(key.startswith("RAY_health_check") for key in worker)  # only the GCS reads them
    own = node_env(plan, NodeInfo(0, 3, "10.0.0.1", "10.0.0.1"), {"RAY_AUTH_TOKEN": "t",
                                                                  "RAY_health_check_timeout_ms": "9000"})
    assert own["RAY_health_check_timeout_ms"] == "9000" and jobrunner.silence_bound(own)[0] == 33.0  # the node's wins
    assert jobrunner.silence_bound({})[0] == 65.0  # Ray's defaults: 5 x (3 s + 10 s)
    assert plan_for()["wait"]["node_silence_s"] == 30.0  # the default


def test_ray_ends_on_sigterm_without_its_drain_unless_the_node_or_the_task_wants_one():
    info = NodeInfo(0, 2, "10.0.0.1", "10.0.0.1")
    assert node_env(plan_for(), info, {"RAY_AUTH_TOKEN": "t"})["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"
    node = node_env(plan_for(), info, {"RAY_AUTH_TOKEN": "t", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "20"})
    task = node_env(plan_for(env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "10"}), info, {"RAY_AUTH_TOKEN": "t"})
    assert (node["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"], task["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]) == ("20", "10")


def test_after_a_loss_the_head_counts_nodes_rather_than_matching_addresses(monkeypatch):
    """A replacement with another address makes the count; a lost node Ray still lists ALIVE
    (one too many) is waited out; the lost node is found by its node id, not its address."""
    def node(node_id, ip):
        return {"node_id": node_id, "node_ip": ip, "resources_total": {"CPU": 1.0}}
    answers = [[node("h", "10.0.0.1"), node("b", "10.0.0.3")],                                  # b lost
               [node("h", "10.0.0.1"), node("b", "10.0.0.3"), node("b2", "10.0.0.9"), node("x", "10.0.0.3")],
               [node("h", "10.0.0.1"), node("b2", "10.0.0.9"), node("x", "10.0.0.3")]]        # x: same address as c
    seen = []

    def alive_nodes(dashboard, token):
        seen.append(len(seen))
        return answers[min(len(seen) // 2, len(answers) - 1)]
    monkeypatch.setattr(protocol, "alive_nodes", alive_nodes)
    monkeypatch.setattr(jobrunner, "alive_nodes", alive_nodes)
    monkeypatch.setattr(protocol.time, "sleep", lambda s: None)
    runner = jobrunner.JobRunner.__new__(jobrunner.JobRunner)
    runner.node = type("N", (), {"dashboard": "http://d", "token": None, "ray_alive": staticmethod(lambda c: c)})()
    runner.plan = {"nodes": 3, "ray": {"num_cpus": 1}, "wait": {"nodes_s": 60}}
    runner.expected, runner.node_ids = {"h": "10.0.0.1", "a": "10.0.0.2", "c": "10.0.0.3"}, ["a", "c", "h"]
    assert runner.missing_nodes() == ["10.0.0.2", "10.0.0.3"]  # c's address is there, but as node b, not c
    runner.wait_for_every_node()
    assert runner.expected == {"h": "10.0.0.1", "b2": "10.0.0.9", "x": "10.0.0.3"}
    assert set(runner.node_ids) == {"a", "c", "h", "b2", "x"}  # every node a metrics row may name


@pytest.mark.parametrize("debug,variable,flag", [("legacy", "RAY_DEBUG", True), ("post_mortem", "RAY_DEBUG_POST_MORTEM", False)])
def test_debug_presets(debug, variable, flag):
    plan = plan_for(ray={"debug": debug})
    info = NodeInfo(0, 3, "10.0.0.1", "10.0.0.1")
    assert variable in node_env(plan, info, {"RAY_AUTH_TOKEN": "t"})
    assert ("--ray-debugger-external" in ray_start_command(plan, info, head=True)) is flag


def test_ray_binds_the_private_address_and_keeps_the_dashboard_local():
    plan = plan_for("dstack")
    info = NodeInfo(0, 3, "10.0.0.1", "10.0.0.1")
    head = ray_start_command(plan, info, head=True)
    assert head[head.index("--node-ip-address") + 1] == "10.0.0.1"
    assert head[head.index("--dashboard-host") + 1] == "127.0.0.1"
    assert "0.0.0.0" not in head and "--block" in head
    worker = ray_start_command(plan, NodeInfo(1, 3, "10.0.0.1", "10.0.0.2"), head=False)
    assert worker[worker.index("--address") + 1] == "10.0.0.1:6379" and "--head" not in worker
    public = ray_start_command(plan_for("dstack", ray={"dashboard_public": True}), info, head=True)
    assert public[public.index("--dashboard-host") + 1] == "10.0.0.1"


def test_placeholders_fill_only_our_names():
    info = NodeInfo(0, 1, "10.0.0.1", "10.0.0.2")
    assert raynode.fill("http://{head_addr}:5000 ${HOME} {node_addr}", info) == "http://10.0.0.1:5000 ${HOME} 10.0.0.2"


def test_worker_gives_up_on_an_absent_head_with_a_diagnosis(tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    plan = plan_for(wait={"head": "2s"})
    plan["ray"]["ready_port"] = port
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    env = dict(os.environ, RLHF_TASKS_NODE_RANK="1", RLHF_TASKS_NUM_NODES="2", RLHF_TASKS_HEAD_ADDR="127.0.0.1",
               RLHF_TASKS_NODE_ADDR="127.0.1.2", RAY_AUTH_TOKEN="secret-token-value")
    out = subprocess.run([sys.executable, "-m", "rlhf_tasks.agent", "--plan", str(path), "--state-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"waiting for the head at 127.0.0.1:{port}" in out.stdout and "refused" in out.stdout
    assert "secret-token-value" not in out.stdout + out.stderr
    result = protocol.parse_result(out.stdout)  # the one structured line the launcher reads
    assert result["exit_code"] == 1 and result["rank"] == 1 and "waiting for the head" in result["failed_step"]


def test_service_readiness_over_http_post(tmp_path):
    """A service is ready only when a POST answers (the server answers GET with 405)."""
    script = tmp_path / "srv.py"
    script.write_text(
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(405); self.end_headers()\n"
        "    def do_POST(self):\n"
        "        n = int(self.headers['Content-Length']); body = self.rfile.read(n)\n"
        "        self.send_response(200 if b'query' in body else 400); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    info = NodeInfo(0, 1, "127.0.0.1", "127.0.0.1")
    agent = raynode.Node(plan_for(), info, dict(os.environ), str(tmp_path), str(tmp_path))
    service = {"name": "rm", "where": "head", "command": f"{sys.executable} {script} {port}", "env": {},
               "timeout": 20, "ready": {"http": f"http://{{node_addr}}:{port}/get_reward",
                                        "method": "POST", "json": {"query": ["q"]}}}
    try:
        agent.plan["services"] = [service]
        agent.start_services(("head",))
        assert agent.services[0].alive()
        assert protocol.http_check(f"http://127.0.0.1:{port}/get_reward")[0] is False  # GET: 405
    finally:
        agent.stop_all()
    assert not agent.services[0].alive()


def test_a_service_that_dies_fails_fast_with_its_log(tmp_path):
    info = NodeInfo(0, 1, "127.0.0.1", "127.0.0.1")
    agent = raynode.Node(plan_for(), info, dict(os.environ), str(tmp_path), str(tmp_path))
    agent.plan["services"] = [{"name": "rm", "where": "head", "command": "echo cannot load model >&2; exit 3",
                               "env": {}, "timeout": 60, "ready": {"tcp": 1, "host": "{node_addr}"}}]
    with pytest.raises(AgentError) as info_:
        agent.start_services(("head",))
    assert "exited with code 3" in str(info_.value) and "cannot load model" in str(info_.value)


def test_stale_process_group_of_our_own_is_stopped(tmp_path):
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    pgid_file = tmp_path / "t-node0-ray.pgid"
    pgid_file.write_text(str(proc.pid))
    done = threading.Event()
    threading.Thread(target=lambda: (proc.wait(), done.set()), daemon=True).start()
    processes.stop_stale(str(pgid_file))
    assert done.wait(10) and not pgid_file.exists()


def test_ready_beacon_answers_ready_then_done_until_closed():
    ready = beacon.ReadyBeacon("127.0.0.1", 0)
    port = ready.sock.getsockname()[1]
    assert beacon.probe_ready("127.0.0.1", port) is None
    ready.done()  # the run is over: a worker leaves at once, none joins
    assert beacon.probe_ready("127.0.0.1", port) == beacon.RUN_OVER
    assert not beacon.reachable(beacon.probe_ready, "127.0.0.1", port)()[0]
    ready.close()
    assert "refused" in beacon.probe_ready("127.0.0.1", port)


def test_a_silent_port_is_not_a_ready_beacon():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    try:
        reason = beacon.probe_ready("127.0.0.1", server.getsockname()[1], timeout=0.3)
        assert reason is not None and "beacon" in reason
    finally:
        server.close()


def every_node_run(tmp_path, entrypoint: list[str]) -> tuple[list[str], dict]:
    """A one-node plan in job.mode every_node (no Ray) and the agent's command line and env."""
    plan = plan_for(nodes=1)
    plan["job"].update(mode="every_node", entrypoint=entrypoint)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    env = dict(os.environ, RLHF_TASKS_NODE_RANK="0", RLHF_TASKS_NUM_NODES="1", RLHF_TASKS_HEAD_ADDR="127.0.0.1",
               RLHF_TASKS_NODE_ADDR="127.0.0.1", RAY_AUTH_TOKEN="t", PYTHONPATH=str(ROOT))
    return [sys.executable, "-m", "rlhf_tasks.agent", "--plan", str(path), "--state-dir", str(tmp_path / "state")], env


def test_every_node_mode_runs_the_command_itself_and_exits_with_its_code(tmp_path):
    argv, env = every_node_run(tmp_path, [sys.executable, "-c",
                                          "import sys; print('rank {rank} of {nodes}, head {head_addr}'); sys.exit(7)"])
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 7, out.stdout + out.stderr
    assert "rank 0 of 1, head 127.0.0.1" in out.stdout and "ray start" not in out.stdout
    result = protocol.parse_result(out.stdout)
    assert result["exit_code"] == 7 and result["job"] == {"status": "FAILED", "exit_code": 7}


def _lowered_open_files(soft: int, hard: int):
    """preexec_fn: the agent starts where the open-files limit is (soft, hard), as a container's may be."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


SHOW_OPEN_FILES = [sys.executable, "-c", "import resource; print('job open files %d/%d' % "
                   "resource.getrlimit(resource.RLIMIT_NOFILE))"]


def test_the_agent_raises_the_open_files_soft_limit_for_all_it_starts(tmp_path):
    """The plan's open_files (the recipe's: Search-R1's `ulimit -n 65535`) raises the agent's soft
    RLIMIT_NOFILE before it starts anything, so the job (here its command; Ray's processes alike) inherits it."""
    argv, env = every_node_run(tmp_path, SHOW_OPEN_FILES)
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["open_files"] = 3000
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
                         preexec_fn=_lowered_open_files(1024, 4096))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "open files: soft limit raised from 1024 to 3000 (hard limit 4096)" in out.stdout
    assert "job open files 3000/4096" in out.stdout
    plan["open_files"] = 512  # already allowed: left as it is (never lowered)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
                         preexec_fn=_lowered_open_files(1024, 4096))
    assert "open files: soft limit 1024, at least the 512 the job needs" in out.stdout
    assert "job open files 1024/4096" in out.stdout


def test_an_open_files_limit_above_the_hard_limit_is_refused_naming_both(tmp_path):
    argv, env = every_node_run(tmp_path, SHOW_OPEN_FILES)
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["open_files"] = 65535
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
                         preexec_fn=_lowered_open_files(1024, 4096))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "job open files" not in out.stdout  # nothing started
    result = protocol.parse_result(out.stdout)
    assert result["failed_step"] == "raising the open-files limit"
    assert ("the job needs a soft limit of 65535 open files (RLIMIT_NOFILE, `ulimit -n`) and this node's hard limit "
            "is 4096 (soft 1024)") in result["error"]
    assert "--ulimit nofile=65535:65535" in result["error"] and "job.open_files" in result["error"]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_what_the_agent_started_dies_with_it_even_by_sigkill(tmp_path):
    """The agent's children run in sessions of their own, which a scheduler that tracks a
    task by ancestry or process group loses once the agent is gone (an OOM kill, SIGKILL
    after KillWait): the kernel kills them with it."""
    argv, env = every_node_run(tmp_path, [sys.executable, "-c",
                                          "import os, time; print('job pid', os.getpid(), flush=True); time.sleep(600)"])
    agent = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    job_pid = None
    try:
        line = ""
        while not line.startswith("job pid"):
            line = agent.stdout.readline()
            assert line, "the agent ended before its job started"
        job_pid = int(line.split()[-1])
        assert os.getpgid(job_pid) == job_pid != os.getpgid(agent.pid)  # a session of its own
        agent.kill()
        agent.wait(10)
        wait_for("the job's process to die with the agent", lambda: (not _running(job_pid), job_pid), 10,
                 interval=0.05)
    finally:
        agent.kill()
        if job_pid and _running(job_pid):  # the failure case: do not leave it behind
            os.kill(job_pid, 9)


# --------------------------------------------------------------------------- the job's gate

def start_gate(tmp_path, command, timeout_s=60):
    gate = jobrunner.Gate(str(tmp_path / "job.gate"))
    argv = gate.wrap(command, timeout_s)
    assert argv[:5] == ["python3", str(ROOT / "rlhf_tasks" / "agent" / "__main__.py"), "gate", str(tmp_path / "job.gate"),
                        str(timeout_s)]
    proc = subprocess.Popen([sys.executable] + argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    return gate, proc


def test_a_gated_job_runs_its_command_only_when_the_head_says_go_and_becomes_it(tmp_path):
    out = tmp_path / "ran"
    gate, proc = start_gate(tmp_path, [sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write(str(os.getpid()))"])
    # The gate's own line first: a gate whose Python has not started yet would pass the wait below too.
    assert "the job's gate is waiting for the head's word (up to 60s)" in proc.stdout.readline()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(1.0)  # waiting at the gate: the command has not run
    assert not out.exists()
    gate.open()
    assert proc.wait(30) == 0, proc.stdout.read()
    assert out.read_text() == str(proc.pid)  # exec: the job's process is the command itself


def test_a_closed_gate_ends_the_job_without_running_its_command_and_says_why(tmp_path):
    out = tmp_path / "ran"
    gate, proc = start_gate(tmp_path, ["touch", str(out)])
    gate.close("preflight (interfaces) failed: node2 cannot reach node0")
    assert proc.wait(30) == 1
    assert "the job's command was not started: preflight (interfaces) failed: node2" in proc.stdout.read()
    assert not out.exists()


def test_a_gate_without_word_gives_up_at_its_deadline(tmp_path):
    gate, proc = start_gate(tmp_path, ["true"], timeout_s=1)
    assert proc.wait(30) == 1
    assert "the head gave no word within 1s" in proc.stdout.read()


def test_a_gate_carrying_preflight_puts_its_arguments_between_the_gates_and_the_command(tmp_path):
    checks = protocol.preflight_argv({"min_bandwidth_bits": 1e9, "torch": False}, 3, 60, wait_nodes=600)
    gate = jobrunner.Gate(str(tmp_path / "job.gate"), checks, "t-c1")
    command = ["python3", "train.py", "--", "--lr", "1e-6"]  # a command with its own `--`
    assert gate.wrap(command, 100) == ["python3", str(ROOT / "rlhf_tasks" / "agent" / "__main__.py"), "gate",
                                       str(tmp_path / "job.gate"), "100", "--preflight", *checks[3:], "--", *command]
    assert checks[:3] == ["python3", protocol.AGENT_ENTRY, "preflight"] and "--" not in checks


class ScriptedJobs(object):
    """A job's (status, log) at each poll, as the dashboard would answer them."""

    def __init__(self, polls):
        self.polls = list(polls)

    def status(self, sid):
        return self.polls[0][0]

    def logs(self, sid):
        status, text = self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]
        return text


def test_a_gated_jobs_followers_show_its_log_from_after_preflights_result_line():
    line = protocol.PREFLIGHT_PREFIX + '{"passed": true}\n'
    ran = ScriptedJobs([("RUNNING", "preflight: nodes\n"), ("RUNNING", "preflight: nodes\n" + line[:12]),
                        ("RUNNING", "preflight: nodes\n" + line + "step 1\n"),
                        ("SUCCEEDED", "preflight: nodes\n" + line + "step 1\nstep 2\n")])
    out = io.StringIO()
    follower = protocol.JobFollower(ran, "t-c1", out, after=protocol.PREFLIGHT_PREFIX)
    assert follower.run() == "SUCCEEDED" and out.getvalue() == "step 1\nstep 2\n"
    assert follower.shown == len("preflight: nodes\n" + line + "step 1\nstep 2\n")  # where the log is, in its chars
    # a job whose gate ended before preflight's result (it failed to start): everything it said is shown
    failed = ScriptedJobs([("FAILED", "Traceback ...\nModuleNotFoundError: No module named 'ray'\n")])
    out = io.StringIO()
    assert protocol.JobFollower(failed, "t-c1", out, after=protocol.PREFLIGHT_PREFIX).run() == "FAILED"
    assert out.getvalue() == "Traceback ...\nModuleNotFoundError: No module named 'ray'\n"


@pytest.mark.parametrize("argv", [[], ["job.gate", "10"], ["job.gate", "10", "--"], ["job.gate", "--", "true"],
                                  ["job.gate", "10", "--nodes", "3", "--", "true"]])
def test_a_gate_refuses_a_malformed_command_line(argv, capsys):
    assert jobrunner.gate_main(argv) == 2 and "usage: python3 LIB/rlhf_tasks/agent/__main__.py gate" in capsys.readouterr().err


def test_a_gate_for_a_missing_command_exits_127_naming_it(tmp_path):
    gate, proc = start_gate(tmp_path, ["no-such-command-here"])
    gate.open()
    assert proc.wait(30) == 127 and "cannot run no-such-command-here" in proc.stdout.read()


# --------------------------------------------------------------------------- the prestarted `ray start`

def fake_ray(tmp_path, console_script=True):
    """A `ray` on PATH that records its argv: pip's console script over a stand-in
    ray.scripts.scripts (importable from PYTHONPATH), or a shell script."""
    package = tmp_path / "lib" / "ray" / "scripts"
    package.mkdir(parents=True)
    (tmp_path / "lib" / "ray" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "scripts.py").write_text(
        "import json, os, sys\n"
        "def main():\n"
        "    open(os.environ['RAY_ARGV_FILE'], 'w').write(json.dumps({'argv': sys.argv, 'pid': os.getpid()}))\n"
        "    return 0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ray = bin_dir / "ray"
    if console_script:  # what pip writes
        ray.write_text(f"#!{sys.executable}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
                       "from ray.scripts.scripts import main\nif __name__ == '__main__':\n"
                       "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n")
    else:
        ray.write_text("#!/bin/sh\nprintf '{\"argv\": [\"ray\"], \"shell\": \"%s\"}' \"$*\" > \"$RAY_ARGV_FILE\"\n")
    ray.chmod(0o755)
    stand_in(ray)  # it records its argv; it starts no cluster
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(tmp_path / "lib"),
                RAY_ARGV_FILE=str(tmp_path / "argv.json"))


def test_ray_start_is_prestarted_and_handed_its_arguments(tmp_path):
    env = fake_ray(tmp_path)
    assert raynode.console_script_python(str(tmp_path / "bin" / "ray")) == [sys.executable]
    agent = raynode.Node(plan_for(), NodeInfo(1, 3, "127.0.0.1", "127.0.0.1"), env, str(tmp_path), str(tmp_path))
    agent.prestart_ray()
    try:
        prestarted = agent.prestarted
        assert prestarted is not None and prestarted.alive()  # imported, waiting for its arguments
        agent.start_ray(head=False)
        assert agent.ray is prestarted and prestarted.proc.wait(30) == 0
    finally:
        agent.stop_all()
    ran = json.loads((tmp_path / "argv.json").read_text())
    assert ran["argv"] == ray_start_command(agent.plan, agent.info, head=False)
    assert ran["pid"] == prestarted.proc.pid


def test_a_ray_that_is_not_pips_console_script_is_started_the_plain_way(tmp_path):
    env = fake_ray(tmp_path, console_script=False)
    assert raynode.console_script_python(str(tmp_path / "bin" / "ray")) is None
    agent = raynode.Node(plan_for(), NodeInfo(1, 3, "127.0.0.1", "127.0.0.1"), env, str(tmp_path), str(tmp_path))
    agent.prestart_ray()
    assert agent.prestarted is None
    try:
        agent.start_ray(head=False)
        assert agent.ray.proc.wait(30) == 0
    finally:
        agent.stop_all()
    assert "--address 127.0.0.1:" in json.loads((tmp_path / "argv.json").read_text())["shell"]


def test_a_prestarted_ray_start_that_died_is_replaced_by_a_plain_one(tmp_path, capsys):
    env = fake_ray(tmp_path)
    (tmp_path / "lib" / "ray" / "scripts" / "scripts.py").write_text(
        "raise ImportError('cannot import name ray._raylet')\n")
    agent = raynode.Node(plan_for(), NodeInfo(1, 3, "127.0.0.1", "127.0.0.1"), env, str(tmp_path), str(tmp_path))
    agent.prestart_ray()
    prestarted = agent.prestarted
    assert prestarted.proc.wait(30) == 1  # its import failed
    try:
        agent.start_ray(head=False)
        assert agent.ray is not prestarted
        assert agent.ray.proc.args == ray_start_command(agent.plan, agent.info, head=False)  # the plain way
    finally:
        agent.stop_all()
    out = capsys.readouterr().out
    assert "the prestarted `ray start` exited with code 1; starting it the plain way" in out
    assert "cannot import name ray._raylet" in out  # its log's tail says why


# --------------------------------------------------------------------------- a worker whose head went away

def test_a_worker_leaves_once_its_head_has_been_gone_for_head_gone_s_not_before(tmp_path):
    """docs/design.md: a worker leaves when its head's beacon has been gone for 10 s (issue 32, item 13):
    the default is 10 s, and with it set to 2 s here the worker stays 2 s and leaves within a
    second or two after (the beacon is probed once a second)."""
    import inspect
    import time

    from rlhf_tasks.agent.beacon import ReadyBeacon
    from rlhf_tasks.agent.processes import Child
    from rlhf_tasks.agent.worker import WorkerFlow

    assert inspect.signature(WorkerFlow.supervise).parameters["head_gone_s"].default == 10.0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    plan = plan_for()
    plan["ray"]["ready_port"] = port
    node = raynode.Node(plan, NodeInfo(1, 3, "127.0.0.1", "127.0.0.1"), dict(os.environ), str(tmp_path), str(tmp_path))
    node.ray = Child("ray", ["sleep", "120"], node.env)  # a live process in the raylet's place
    beacon = ReadyBeacon("127.0.0.1", port)
    ended = {}

    def supervise():
        ended["code"] = WorkerFlow(node).supervise(head_gone_s=2.0)
        ended["at"] = time.monotonic()
    thread = threading.Thread(target=supervise, daemon=True)
    try:
        thread.start()
        wait_for("the worker to have seen its head", lambda: (probe_tcp("127.0.0.1", port) is None, "no"), 10)
        thread.join(1.5)
        assert thread.is_alive()  # the head answers: it stays
        beacon.close()
        gone = time.monotonic()
        thread.join(30)
        assert ended.get("code") == 0, ended
        assert 2.0 <= ended["at"] - gone <= 4.5, ended["at"] - gone
    finally:
        beacon.close()
        node.ray.stop(grace=1.0)


def _fake_ray(tmp_path, raylet_ignores_sigterm: bool = False):
    """A process group shaped like `ray start --block`'s: a leader that takes its time on SIGTERM
    (Ray's handler stops its processes one by one), a raylet, and a process that ignores SIGTERM
    (the GCS and the autoscaler's monitor take about a second each)."""
    raylet = tmp_path / "raylet"  # its name is what the agent looks for
    raylet.write_bytes(open(sys.executable, "rb").read())
    raylet.chmod(0o755)
    ignore = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    plain = "import time; print('up', flush=True); time.sleep(600)"
    script = (f"import subprocess, sys, signal, time\n"
              f"subprocess.Popen([{str(raylet)!r}, '-c', {ignore if raylet_ignores_sigterm else plain!r}])\n"
              f"subprocess.Popen([sys.executable, '-c', {ignore!r}])\n"
              f"signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"print('up', flush=True)\n"
              f"time.sleep(600)\n")
    log = tmp_path / "ray.log"
    child = processes.Child("ray", [sys.executable, "-c", script], dict(os.environ), str(log))
    wait_for("the fake Ray", lambda: (log.read_text().count("up") == 3, "not up"), 30, interval=0.05)
    assert processes.group_has(child.proc.pid, "raylet")
    return child


def test_a_nodes_ray_is_killed_once_its_raylet_has_left(tmp_path, capsys):
    """At a node's end SIGTERM lets the raylet leave the cluster (the GCS marks its node dead at once); the
    rest of Ray is killed then, without waiting out the grace for what takes its time on SIGTERM."""
    child = _fake_ray(tmp_path)
    done = threading.Event()
    threading.Thread(target=lambda: (raynode.stop_ray(child, grace=60.0), done.set()), daemon=True).start()
    assert done.wait(20), "stop_ray waited for the processes that ignore SIGTERM"
    wait_for("the killed group to end", lambda: (not processes.group_alive(child.proc.pid), "alive"), 10)
    assert "killed" not in capsys.readouterr().out


def test_a_raylet_that_does_not_leave_is_killed_after_the_grace_and_said(tmp_path, capsys):
    child = _fake_ray(tmp_path, raylet_ignores_sigterm=True)
    raynode.stop_ray(child, grace=0.5)
    wait_for("the killed group to end", lambda: (not processes.group_alive(child.proc.pid), "alive"), 10)
    assert "ray did not end within 0.5s of SIGTERM: killed" in capsys.readouterr().out


def test_an_answer_that_breaks_off_is_an_oserror_with_a_reason():
    """A dashboard that dies while it sends a file (the head's Ray ending under a launcher's gather) breaks
    its chunked answer off: the callers handle OSError, not http.client's IncompleteRead."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nonly part of it")
        conn.close()
    threading.Thread(target=answer, daemon=True).start()
    try:
        with pytest.raises(OSError, match="broke off"):
            protocol.http_request("http://127.0.0.1:%d/api/v0/logs/file" % server.getsockname()[1])
    finally:
        server.close()


def test_a_ray_the_agent_did_not_start_is_left_running_at_its_end():
    """KubeRay starts Ray itself, and the agent stands beside it (attached.StartedRay): at the node's end the
    agent stops what it started, which is not that Ray."""
    from rlhf_tasks.agent.attached import StartedRay

    with socket.create_server(("127.0.0.1", 0)) as gcs:
        ray = StartedRay("127.0.0.1", gcs.getsockname()[1])
        raynode.stop_ray(ray)
        assert ray.alive()


def test_amd_nodes_name_their_gpus_in_the_one_variable_ray_torch_and_verl_read(monkeypatch):
    """Ray's own AMD detection (AMDGPUAcceleratorManager, Ray 2.60) and torch's ROCm parsing
    (torch.cuda._parse_visible_devices, as a ROCm build runs it) on the environment the agent gives
    Ray: Slurm's ROCR_VISIBLE_DEVICES alone makes Ray refuse the node; the agent's HIP_VISIBLE_DEVICES
    names the same GPUs, and neither ROCR's nor CUDA's is left for verl to refuse in a worker."""
    import torch
    from ray._private.accelerators.amd_gpu import AMDGPUAcceleratorManager as AMD

    def ray_sees(env: dict) -> list[str] | None:
        for key in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return AMD.get_current_process_visible_accelerator_ids()

    plan = plan_for("slurm", resources={"gpus": "MI300X:4"}, env={"NCCL_PROTO": "LL"})
    info = NodeInfo(0, 3, "10.0.0.1", "10.0.0.1")
    slurm = {"RAY_AUTH_TOKEN": "t", "ROCR_VISIBLE_DEVICES": "4,5,6,7", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    with pytest.raises(RuntimeError, match="Please use HIP_VISIBLE_DEVICES instead of ROCR_VISIBLE_DEVICES"):
        ray_sees({"ROCR_VISIBLE_DEVICES": "4,5,6,7"})  # what Slurm alone gives a node
    env = node_env(plan, info, slurm)
    assert env["HIP_VISIBLE_DEVICES"] == "4,5,6,7" and env["NCCL_PROTO"] == "LL"
    assert "ROCR_VISIBLE_DEVICES" not in env and "CUDA_VISIBLE_DEVICES" not in env  # verl refuses either beside HIP's
    assert ray_sees(env) == ["4", "5", "6", "7"]
    AMD.set_current_process_visible_accelerator_ids(["6"])  # what Ray does for a worker given one GPU
    assert os.environ["HIP_VISIBLE_DEVICES"] == "6" and "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")  # torch's code as a ROCm build takes this path
    assert torch.cuda._parse_visible_devices() == [6]
    ray_sees(env)
    assert torch.cuda._parse_visible_devices() == [4, 5, 6, 7]

    # HIP's counts within ROCR's where a node sets both: the host's GPUs, in one variable
    assert node_env(plan, info, {**slurm, "HIP_VISIBLE_DEVICES": "1,3"})["HIP_VISIBLE_DEVICES"] == "5,7"
    with pytest.raises(AgentError, match="HIP_VISIBLE_DEVICES=0,4 does not pick from ROCR_VISIBLE_DEVICES=4,5"):
        node_env(plan, info, {"RAY_AUTH_TOKEN": "t", "ROCR_VISIBLE_DEVICES": "4,5", "HIP_VISIBLE_DEVICES": "0,4"})
    # CUDA's alone (HIP reads it where its own is unset), or nothing: the node's first GPUs
    assert node_env(plan, info, {"RAY_AUTH_TOKEN": "t", "CUDA_VISIBLE_DEVICES": "2,3"})["HIP_VISIBLE_DEVICES"] == "2,3"
    assert ray_sees(node_env(plan, info, {"RAY_AUTH_TOKEN": "t"})) == ["0", "1", "2", "3"]
    # the task's own env wins; NVIDIA nodes keep their scheduler's CUDA_VISIBLE_DEVICES untouched
    own = plan_for("slurm", resources={"gpus": "MI300X:4"}, env={"HIP_VISIBLE_DEVICES": "0"})
    assert node_env(own, info, slurm)["HIP_VISIBLE_DEVICES"] == "0"
    nvidia = node_env(plan_for("slurm", resources={"gpus": "H100:4"}), info, {"RAY_AUTH_TOKEN": "t", "CUDA_VISIBLE_DEVICES": "1"})
    assert nvidia["CUDA_VISIBLE_DEVICES"] == "1" and "HIP_VISIBLE_DEVICES" not in nvidia
