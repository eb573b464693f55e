"""Failure forensics, the pure parts: finding each node's first error (tracebacks, OOM kills,
exits), scrubbing secrets, the bundle and its index, and the summary's wording
(rlhf_tasks/agent/protocol/bundle.py, which the launcher uses too); preflight's verdict on a
node and a node keeping its files (rlhf_tasks/agent/forensics.py, the node's side). The
cluster tests that fail a run on purpose check the whole path."""

from __future__ import annotations

import json
import tarfile

from rlhf_tasks.agent import forensics
from rlhf_tasks.agent.protocol import bundle

WORKER_ERR = """:job_id:02000000
:task_name:shard
Traceback (most recent call last):
  File "/job/train.py", line 12, in shard
    raise RuntimeError("bad shard on rank 2")
RuntimeError: bad shard on rank 2
"""

DRIVER = """2026-11-24 14:02:10,001\tINFO worker.py:1900 -- Connecting to existing Ray cluster
(shard pid=412, ip=10.0.0.3) Traceback (most recent call last):
(shard pid=412, ip=10.0.0.3)   File "/job/train.py", line 12, in shard
(shard pid=412, ip=10.0.0.3) RuntimeError: bad shard on rank 2
Traceback (most recent call last):
  File "/job/driver.py", line 30, in <module>
    ray.get(refs)
ray.exceptions.WorkerCrashedError: The worker died unexpectedly while executing this task.
"""


def test_a_traceback_is_named_by_its_exception_line():
    found = bundle.find_errors(WORKER_ERR, "worker-ab-02000000-412.err")
    assert [(f["kind"], f["error"]) for f in found] == [("traceback", "RuntimeError: bad shard on rank 2")]


def test_lines_a_driver_relays_from_another_node_are_not_this_nodes():
    found = bundle.find_errors(DRIVER, "job-driver-x.log", node_ip="10.0.0.1")
    assert [f["error"] for f in found] == [
        "ray.exceptions.WorkerCrashedError: The worker died unexpectedly while executing this task."]
    assert found[0]["at"] == "14:02:10"  # the last timestamp before it


#: The tails of real drivers' logs (Ray 2.60, tests/data/raise_on_another_node.py on 2 local nodes).
_GET = """Traceback (most recent call last):
  File "/job/raise_on_another_node.py", line 47, in <module>
    ray.get(ref)
  File "/venv/lib/python3.11/site-packages/ray/_private/worker.py", line 1053, in get_objects
    raise value.as_instanceof_cause()
"""
TASK_RAISED = "2026-11-26 10:39:44,101\tINFO worker.py:2029 -- Connected to Ray cluster.\n" + _GET + \
    """ray.exceptions.RayTaskError(RuntimeError): \x1b[36mray::work()\x1b[39m (pid=6192, ip=10.0.0.3)
  File "/job/raise_on_another_node.py", line 25, in work
    raise RuntimeError("checksum mismatch in shard 7")
RuntimeError: checksum mismatch in shard 7
"""
ACTOR_RAISED = _GET + """ray.exceptions.RayTaskError(ValueError): \x1b[36mray::Shard.step()\x1b[39m (pid=8104, \
ip=10.0.0.3, actor_id=d74af721aa0028f00cd7f12302000000, repr=<raise_on_another_node.Shard object at 0x7f2d57e576d0>)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/job/raise_on_another_node.py", line 31, in step
    raise ValueError("loss is nan at step 3")
ValueError: loss is nan at step 3
"""
ACTOR_DIED = _GET.replace("raise value.as_instanceof_cause()", "raise value") + \
    """ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
\tclass_name: Shard
\tactor_id: 30e36992c62ac87354fdbfef02000000
\tpid: 9817
\tnamespace: 7bd54d0e-db6d-474b-ab90-3b6686baba3e
\tip: 10.0.0.3
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker \
unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the process was killed \
by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the worker crashed unexpectedly due \
to SIGSEGV or another unexpected error. If the process was killed by the kernel OOM killer (verifiable by checking for \
OOM in dmesg of the OOMing node), consider enabling resource isolation via --enable-resource-isolation to prevent node \
deaths by resource contention and significant loss of progress by uninformed kernel OOM killing.
"""


def test_a_task_or_actor_that_raised_on_another_node_is_named_by_its_cause_and_that_node():
    """Ray's wrapper line (RayTaskError, ActorDiedError) in the driver's log names where it was
    raised (`ip=`); the cause is the traceback's last exception line (issue 32, item 4a)."""
    for text, cause, where in [
            (TASK_RAISED, "RuntimeError: checksum mismatch in shard 7", "ray::work(), pid 6192"),
            (ACTOR_RAISED, "ValueError: loss is nan at step 3", "ray::Shard.step(), pid 8104")]:
        (found,) = bundle.find_errors(text, "job-driver-x.log", node_ip="10.0.0.1")
        assert found["error"] == "%s (raised in %s)" % (cause, where) and found["raised_on"] == "10.0.0.3", found
    (died,) = bundle.find_errors(ACTOR_DIED, "job-driver-x.log", node_ip="10.0.0.1")
    assert died["raised_on"] == "10.0.0.3" and died["error"].startswith(
        "ActorDiedError: actor Shard (pid 9817) died: its worker process has died. Worker exit type: SYSTEM_ERROR "
        "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
        "include: (1) the process was killed by the OOM killer"), died
    assert "--enable-resource-isolation" not in died["error"]  # Ray's advice is not the cause
    oom = _GET + ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
                  "Memory on the node (IP: 10.0.0.3, ID: 5a1c) where the task (task ID: 7f, name=work, pid=77, "
                  "memory used=3.10GB) was running was 3.70GB / 3.84GB (0.96), which exceeds the threshold (0.95).\n")
    (killed,) = bundle.find_errors(oom, "job-driver-x.log", node_ip="10.0.0.1")
    assert killed["raised_on"] == "10.0.0.3" and "OutOfMemoryError: Task was killed" in killed["error"], killed


class _Logs(object):
    """Two nodes' files as Ray's log API would list and read them (gather's side of RayLogs)."""

    def __init__(self, files):
        self.by_id = files

    def nodes(self):
        return [{"node_id": "n%d" % i, "node_ip": "10.0.0.%d" % (i + 1), "state": "ALIVE", "is_head_node": i == 0}
                for i in range(2)]

    def files(self, node_id):
        return list(self.by_id[node_id])

    def read(self, node_id, name, lines=0):
        return self.by_id[node_id][name].encode()


def test_the_summary_names_the_node_where_it_was_raised_not_the_drivers():
    agent = "[10:39:40] node%d: local node %d of 2\n"
    ray = _Logs({"n0": {"rlhf-tasks/agent-node0.log": agent % (0, 0), "job-driver-x.log": TASK_RAISED.replace(
                     "10.0.0.3", "10.0.0.2")},
                 "n1": {"rlhf-tasks/agent-node1.log": agent % (1, 1)}})
    gathered = bundle.gather(ray, {}, "the job FAILED")
    lines = bundle.summary_lines({"first_errors": gathered["first_errors"]})
    assert lines == ["first error on each node:",
                     "  node1 (10.0.0.2) at 10:39:44: RuntimeError: checksum mismatch in shard 7 (raised in "
                     "ray::work(), pid 6192) [node0/job-driver-x.log]"], lines


def test_an_oom_kill_wins_over_a_later_traceback_and_old_kills_are_ignored():
    text = ("[  100.5] Out of memory: Killed process 77 (old) total-vm:1kB\n"
            "[ 5000.1] Out of memory: Killed process 4242 (VLLM::EngineCor) total-vm:10kB\n")
    oom = bundle.find_errors(text, "rlhf-tasks/node-facts.txt", since_uptime=1000.0)
    assert [f["error"] for f in oom] == ["the kernel killed VLLM::EngineCor (pid 4242): out of memory"]
    later = bundle.find_errors(WORKER_ERR, "worker-a-02000000-1.err")
    assert bundle.first_error(later + oom)["kind"] == "oom"


def test_a_process_the_agent_started_that_exits_non_zero_is_an_error_and_zero_is_not():
    text = ("[14:00:01] node1: service reward ready after 1.0s\n"
            "[14:00:05] node1: the job's command ended with exit code 0 after 3.0s\n"
            "[14:01:07] node1: service reward exited with code 3; its last lines:\n"
            "[14:01:09] node1: ERROR: supervising the raylet failed: it died 4 times\n")
    found = bundle.find_errors(text, "rlhf-tasks/agent-node1.log")
    assert [f["kind"] for f in found] == ["exit", "agent"]
    first = bundle.first_error(found)
    assert first["at"] == "14:01:07" and first["error"].startswith("service reward exited with code 3")


def test_a_traceback_the_agent_relays_is_found_in_its_own_file_not_the_agents_log():
    assert bundle.find_errors("[14:00:00] node0: following job x\n" + DRIVER, "rlhf-tasks/agent-node0.log") == []


def test_a_traceback_in_rays_own_logs_is_rays_noise_not_a_cause():
    text = "Traceback (most recent call last):\n  File x\nOSError: [Errno 98] Address already in use\n"
    assert [f["kind"] for f in bundle.find_errors(text, "monitor.log")] == ["ray"]
    assert [f["kind"] for f in bundle.find_errors(text, "rlhf-tasks/service-reward-node0.log")] == ["traceback"]


def test_rays_own_error_lines_count_only_when_nothing_better_is_found():
    ray = bundle.find_errors("[2026-11-24 14:00:00,123 E 11 11] raylet.cc:99: Failed to connect\n", "raylet.out")
    assert ray[0]["kind"] == "ray" and ray[0]["at"] == "14:00:00"
    nodes = [{"label": "node1", "ip": "b", "first_error": ray[0]},
             {"label": "node2", "ip": "c", "first_error": dict(bundle.find_errors(WORKER_ERR, "worker-1-2-3.err")[0],
                                                               at="14:05:00")}]
    assert [n["label"] for n in bundle.node_order(nodes)] == ["node2"]
    assert [n["label"] for n in bundle.node_order(nodes[:1])] == ["node1"]


def test_scrub_replaces_every_secret_value_and_leaves_short_ones():
    text = "token=tok-123456789 key=hf_abcdef again hf_abcdef; x=ab"
    out = bundle.scrub(text, {"RAY_AUTH_TOKEN": "tok-123456789", "HF_TOKEN": "hf_abcdef", "SHORT": "ab"})
    assert out == "token=[secret RAY_AUTH_TOKEN] key=[secret HF_TOKEN] again [secret HF_TOKEN]; x=ab"


def test_tail_keeps_the_end_from_a_lines_start():
    data = b"".join(b"line %d\n" % i for i in range(1000))
    kept, cut = bundle.tail(data, 100)
    assert cut and kept.endswith(b"line 999\n") and kept.startswith(b"line ") and len(kept) <= 100


def test_every_file_is_cut_to_its_last_tail_lines_lines(tmp_path):
    """docs/failures.md: "Every file is cut to its last 2000 lines (256 KiB)" (issue 32, item 13): the line cut,
    on the head's own files (read here) and as asked of Ray's log API for the other nodes'."""
    import threading
    import urllib.parse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    assert bundle.TAIL_LINES == 2000
    (tmp_path / "raylet.out").write_bytes(b"".join(b"line %d\n" % i for i in range(5000)))  # 48 KiB: under the byte cut
    kept = bundle.read_local(str(tmp_path), "raylet.out")
    lines = kept.decode().splitlines()
    assert len(lines) == 2000 and lines[0] == "line 3000" and lines[-1] == "line 4999"
    assert bundle.tail(kept) == (kept, False)  # the line cut, not the byte cut, made it
    asked = []

    class Logs(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            asked.append(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Logs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        bundle.RayLogs(f"http://127.0.0.1:{server.server_address[1]}", None).read("n1", "raylet.out")
    finally:
        server.shutdown()
        server.server_close()
    assert asked == [{"node_id": ["n1"], "filename": ["raylet.out"], "lines": ["2000"]}]


def test_wanted_keeps_ours_rays_and_the_jobs_workers_not_idle_ones():
    files = ["raylet.out", "raylet.err", "gcs_server.out", "python-core-worker-1.log", "rlhf-tasks/",
             "rlhf-tasks/agent-node2.log", "rlhf-tasks/forensics-x.tar.gz", "job-driver-j-1.log",
             "worker-aa-ffffffff-1.err", "worker-bb-02000000-2.out", "worker-bb-02000000-2.err", "dashboard_agent.log"]
    assert bundle.wanted(files) == ["rlhf-tasks/agent-node2.log", "raylet.out", "raylet.err", "gcs_server.out",
                                "job-driver-j-1.log", "dashboard_agent.log", "worker-bb-02000000-2.err",
                                "worker-bb-02000000-2.out"]


class FakeRay:
    """Ray's log API for three nodes: node2 raised, node1 was lost."""

    def __init__(self, secret):
        self.secret = secret

    def nodes(self):
        return [{"node_id": "h", "node_ip": "10.0.0.1", "is_head_node": True, "state": "ALIVE"},
                {"node_id": "w2", "node_ip": "10.0.0.3", "is_head_node": False, "state": "ALIVE"},
                {"node_id": "w1", "node_ip": "10.0.0.2", "is_head_node": False, "state": "DEAD",
                 "state_message": "missing too many heartbeats", "end_time_ms": 2_000_000_000_000}]

    def jobs(self):
        return []

    def files(self, node_id):
        return {"h": ["rlhf-tasks/agent-node0.log", "job-driver-x.log"],
                "w2": ["rlhf-tasks/agent-node2.log", "worker-ab-02000000-9.err", "raylet.out"]}[node_id]

    def read(self, node_id, name):
        if name == "job-driver-x.log":
            return DRIVER.encode()
        if name.startswith("worker-"):
            return WORKER_ERR.replace("rank 2", "rank 2 with key " + self.secret).encode()
        return f"[14:00:00] node: using {self.secret}\n".encode()


def test_the_bundle_holds_every_nodes_files_an_index_and_no_secret(tmp_path):
    secret = "s3cr3t-value-42"
    gathered = bundle.gather(FakeRay(secret), {"HF_TOKEN": secret}, "job x ended FAILED")
    firsts = {e["label"]: e for e in gathered["first_errors"]}
    assert firsts["node2"]["error"] == "RuntimeError: bad shard on rank 2 with key [secret HF_TOKEN]"
    assert firsts["node0"]["error"].startswith("ray.exceptions.WorkerCrashedError")
    assert firsts["10.0.0.2"]["kind"] == "dead" and "missing too many heartbeats" in firsts["10.0.0.2"]["error"]
    path = bundle.write_bundle(gathered, str(tmp_path), "demo")
    with tarfile.open(path) as tar:
        names = tar.getnames()
        contents = {n: tar.extractfile(n).read().decode() for n in names if tar.getmember(n).isfile()}
    stem = names[0].split("/")[0]
    assert f"{stem}/node2/worker-ab-02000000-9.err" in names and f"{stem}/node0/job-driver-x.log" in names
    assert f"{stem}/node2/rlhf-tasks/agent-node2.log" in names
    assert all(secret not in text for text in contents.values())
    index = json.loads(contents[f"{stem}/index.json"])
    entry = next(f for f in index["files"] if f["file"] == "node2/worker-ab-02000000-9.err")
    assert entry["node"] == "node2" and entry["address"] == "10.0.0.3" and entry["found"][0].startswith("traceback: ")
    assert "node2 (10.0.0.3)" in contents[f"{stem}/index.txt"]


def test_the_summary_names_each_node_then_the_bundle():
    part = {"bundle": "/logs/forensics-x.tar.gz", "gathered": True, "first_errors": [
        {"label": "node2", "ip": "10.0.0.3", "at": "14:02:11", "kind": "oom", "file": "rlhf-tasks/node-facts.txt",
         "error": "the kernel killed VLLM::EngineCor (pid 4242): out of memory"},
        {"label": "node0", "ip": "10.0.0.1", "at": "14:02:12", "kind": "traceback", "file": "job-driver-x.log",
         "error": "ray.exceptions.RayActorError: The actor died unexpectedly"}]}
    assert bundle.summary_lines(part) == [
        "first error on each node:",
        "  node2 (10.0.0.3) at 14:02:11: the kernel killed VLLM::EngineCor (pid 4242): out of memory "
        "[rlhf-tasks/node-facts.txt]",
        "  node0 (10.0.0.1) at 14:02:12: ray.exceptions.RayActorError: The actor died unexpectedly [job-driver-x.log]",
        "every node's logs: /logs/forensics-x.tar.gz"]
    assert bundle.summary_lines({"gathered": True, "first_errors": [], "bundle": None}) == [
        "no node's logs name an error (the bundle holds them all)"]


def test_preflight_failures_land_on_the_node_they_name():
    found = forensics.preflight_findings(
        {"failures": [{"step": "interfaces", "message": "node2 (10.0.0.3): Gloo on lo"}]}, "14:00:00")
    assert list(found) == ["10.0.0.3"] and found["10.0.0.3"][0]["error"] == "preflight (interfaces): node2 (10.0.0.3): Gloo on lo"
    # preflight's verdict names the node's failure better than an exit its own log shows
    exit_line = bundle.find_errors("[13:59:00] node2: the raylet exited (code 1); rejoining (1/3)\n",
                                   "rlhf-tasks/agent-node2.log")
    assert bundle.first_error(exit_line + found["10.0.0.3"])["kind"] == "preflight"


def test_the_launcher_keeps_the_heads_first_errors_with_a_bundle_it_has(tmp_path):
    from rlhf_tasks.outcome import merge_forensics

    head = {"gathered": True, "bundle": "/opt/rlhf-tasks/logs/forensics-x.tar.gz", "first_errors": [{"label": "node2"}]}
    here = {"gathered": True, "bundle": str(tmp_path / "f.tar.gz"), "first_errors": [], "where": "gathered from here"}
    merged = merge_forensics(head, here)
    assert merged["first_errors"] == [{"label": "node2"}] and merged["bundle"] == here["bundle"]
    assert merged["where"] == "gathered from here; the head's own is /opt/rlhf-tasks/logs/forensics-x.tar.gz on the head machine"
    local = tmp_path / "head.tar.gz"
    local.write_bytes(b"")
    assert merge_forensics(dict(head, bundle=str(local)), here)["bundle"] == str(local)  # the head's, when it is here
    assert merge_forensics(None, here) is here and merge_forensics(head, None) is head


def test_a_node_keeps_its_files_where_rays_log_api_reads_them_and_says_when_a_service_exits(tmp_path, capsys):
    import types

    from rlhf_tasks.agent.processes import Child

    logs = tmp_path / "ray" / "n1" / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (tmp_path / "agent-node1.log").write_text("[14:00:00] node1: hello\n")
    service = Child("reward", "echo 'CUDA error' >&2; exit 3", {"PATH": "/usr/bin:/bin"},
                    str(tmp_path / "service-reward-node1.log"), shell=True)
    service.proc.wait()
    node = types.SimpleNamespace(info=types.SimpleNamespace(rank=1), log_dir=str(tmp_path), services=[service],
                                 plan={"ray": {"temp_dir": str(tmp_path / "ray")}, "services": [{"name": "reward"}]})
    keeper = forensics.keeper(node)
    assert forensics.keeper(node) is keeper
    keeper.tick()
    keeper.tick()  # said once
    said = capsys.readouterr().out
    assert said.count("service reward exited with code 3") == 1 and "CUDA error" in said
    own = logs / bundle.OWN
    assert sorted(p.name for p in own.iterdir()) == ["agent-node1.log", "node-facts.txt", "service-reward-node1.log"]
    assert (own / "service-reward-node1.log").read_text().strip() == "CUDA error"
    assert "disk /dev/shm:" in (own / "node-facts.txt").read_text()
