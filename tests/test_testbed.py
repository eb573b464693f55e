"""Proves the multi-host testbed: namespaces, names, isolation, faults, SSH forward, Ray."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

try:
    import testbed as tbmod
except ImportError:  # tests/ imported as a package
    from tests import testbed as tbmod

testbed = tbmod.make_testbed_fixture(2)

ECHO_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode() + b"\\n")
    c.close()
"""

CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print("peer says", c.recv(100).decode().strip())
"""

# ICMP echo with a raw socket: no ping binary needed
PING = """
import os, socket, struct, sys
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
ip = socket.gethostbyname(sys.argv[1])
hdr = struct.pack("!BBHHH", 8, 0, 0, os.getpid() & 0xffff, 1) + b"testbed!"
pkt = hdr[:2] + struct.pack("!H", csum(hdr)) + hdr[4:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(5)
s.sendto(pkt, (ip, 0))
while True:
    data, addr = s.recvfrom(1024)
    if addr[0] == ip and data[20] == 0:
        print("pong from", addr[0]); break
"""

PY = tbmod.PYTHON


def py(code: str, *args: str) -> list[str]:
    return [PY, "-c", code, *args]


def test_root_required_but_never_skipped_in_ci(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("CI", raising=False)
    assert "root" in tbmod.require_root()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(tbmod.TestbedError, match="CI"):
        tbmod.require_root()


def test_hosts_reach_each_other_by_name(testbed):
    t = testbed
    assert [h.name for h in t.hosts] == ["node0", "node1"]
    assert t.hosts[0].ip != t.hosts[1].ip
    for h in t.hosts:
        t.run(h.index, py(ECHO_SERVER, "0.0.0.0", "7001"), name="echo")
    for i, peer in ((0, "node1"), (1, "node0")):
        t.wait_port(i, 7001, peer, timeout=10)
        out = t.run(i, py(CLIENT, peer, "7001"), background=False, check=True).output
        assert f"peer says {peer}" in out
        assert f"pong from {t.host(peer).ip}" in t.run(i, py(PING, peer), background=False,
                                                       check=True, timeout=20).output
    # lo is up on every host
    assert "127.0.0.1" in t.sh(1, "ip -br addr show lo")


def test_hostname_tmp_and_pid_isolation(testbed, tmp_path):
    t = testbed
    assert t.sh(0, "hostname").strip() == "node0"
    assert t.sh(1, "hostname").strip() == "node1"
    # own /tmp: a file written on node0 is neither on node1 nor on the real machine
    marker = f"/tmp/testbed-marker-{os.getpid()}"
    t.sh(0, f"echo hi > {marker}")
    assert t.sh(0, f"cat {marker}").strip() == "hi"
    assert t.run(1, f"test -e {marker}", background=False).returncode == 1
    assert not os.path.exists(marker)
    # shared filesystem outside /tmp (and the test's tmp_path, bound back in)
    shared = tmp_path / "ckpt"
    shared.mkdir()
    t.sh(0, f"echo from-node0 > {shared}/step1")
    assert t.sh(1, f"cat {shared}/step1").strip() == "from-node0"
    assert (shared / "step1").read_text().strip() == "from-node0"
    # own process table: node0's sleeper is invisible on node1; PID 1 is the host's init
    sleeper = t.run(0, ["sleep", "1000"])
    tbmod.poll(lambda: "sleep 1000" in t.sh(0, "ps -eo args"), 10, "sleeper visible on node0")
    assert "sleep 1000" not in t.sh(1, "ps -eo args")
    assert "hostinit" in t.sh(1, "ps -o args= -p 1")
    # several commands on one host see each other: pkill inside node0 only touches node0
    t.sh(1, "sleep 1000 >/dev/null 2>&1 & echo started")
    t.sh(0, "pkill -x sleep")
    assert sleeper.wait(10) == -signal.SIGTERM
    assert "sleep 1000" in t.sh(1, "ps -eo args")


def test_a_hosts_own_directories_never_hide_what_every_host_must_see(testbed, tmp_path, monkeypatch):
    """A directory of a host's own (testbed.own, a tmpfs by tmpfs_script) over one that holds what every
    host must see (a checkout cloned there) keeps that visible and hides the rest; a plan that would hide
    it is refused before it mounts anything, naming it."""
    top = tmp_path / "top"
    clone = top / "clone"
    clone.mkdir(parents=True)
    (clone / "marker").write_text("kept")
    (top / "other").write_text("machine's")
    real = tbmod.must_see()
    monkeypatch.setattr(tbmod, "must_see", lambda: sorted([*real, str(clone)]))
    testbed.own(0, str(top))
    testbed.sh(1, "\n".join(["set -e", *tbmod.tmpfs_script(str(top))]), cwd="/")
    for host in (0, 1):
        assert testbed.sh(host, f"cat {clone}/marker") == "kept"
        assert testbed.run(host, f"test -e {top}/other", background=False).returncode == 1
        testbed.check_sees(host, "its own directories")
    assert (top / "other").read_text() == "machine's"  # the machine's, untouched
    with pytest.raises(tbmod.TestbedError, match=f"would hide {clone} from its hosts .*must never hide the checkout"):
        testbed.mount(0, [(None, str(top))], "a tmpfs over the clone's parent")
    assert testbed.sh(0, f"cat {clone}/marker") == "kept"


def test_exact_environment(testbed, monkeypatch):
    monkeypatch.setenv("LEAKY_RUNNER_VAR", "1")
    env = testbed.env(DSTACK_NODE_RANK="1", DSTACK_MASTER_NODE_IP=testbed.hosts[0].ip)
    out = testbed.run(1, ["env"], env=env, background=False, check=True).output
    got = dict(line.split("=", 1) for line in out.splitlines())
    assert got == env
    assert "LEAKY_RUNNER_VAR" not in out


def test_alias_resolves_on_every_host(testbed):
    testbed.add_alias("abc123.runpod.internal", 0)
    for i in (0, 1):
        out = testbed.sh(i, "getent hosts abc123.runpod.internal")
        assert out.split()[0] == testbed.hosts[0].ip
    assert testbed.sh("laptop", "getent hosts node1").split()[0] == testbed.hosts[1].ip


def test_kill_host_processes_then_restart(testbed):
    t = testbed
    t.sh(0, "echo survives > /tmp/state")
    long = t.run(0, "sleep 1000 & sleep 1001 & wait", name="sleepers")
    tbmod.poll(lambda: len(t.processes(0)) >= 3, 10, "sleepers running")
    other = t.run(1, ["sleep", "1000"])
    t.kill(0)
    assert long.wait(10) == -signal.SIGKILL
    assert t.processes(0) == []
    assert other.running()  # node1 untouched
    # the host runs again, its /tmp kept (a crash, not a reboot)
    assert t.sh(0, "cat /tmp/state; hostname").split() == ["survives", "node0"]
    t.reboot(0)
    assert t.run(0, "test -e /tmp/state", background=False).returncode == 1
    assert t.sh(0, "hostname").strip() == "node0"
    assert other.running()


def test_proc_handle_signal_wait_and_timeout(testbed):
    p = testbed.run(0, "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.1; done")
    tbmod.poll(lambda: "ready" in p.output, 10, "trap installed")
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 7
    assert "got-term" in p.output and p.log.parent.name == "node0"
    with pytest.raises(tbmod.TestbedError, match="timed out"):
        testbed.run(1, ["sleep", "30"], background=False, timeout=0.5)


def test_laptop_reaches_head_loopback_only_through_ssh_forward(testbed):
    t = testbed
    t.run(0, [PY, "-m", "http.server", "--bind", "127.0.0.1", "8265"], name="dashboard")
    t.wait_port(0, 8265)
    assert t.http(0, "http://127.0.0.1:8265/").ok
    post = t.http(0, "http://127.0.0.1:8265/", data={"a": 1})  # http.server has no POST
    assert post.status == 501 and "Unsupported method" in post.body
    # not directly: the head's public address, nor the laptop's own loopback
    direct = t.http("laptop", "http://node0:8265/", timeout=3)
    assert direct.status is None and "refused" in direct.error.lower()
    assert t.http("laptop", "http://127.0.0.1:8265/", timeout=3).status is None
    port = t.laptop_forward(8265, host=0)
    assert port == 8265
    r = t.http("laptop", f"http://127.0.0.1:{port}/")
    assert r.ok and "Directory listing" in r.body
    assert t.laptop_forward(8265, host=0) == port  # idempotent
    # the forward is a real ssh client on the laptop
    assert "ssh -N" in t.sh("laptop", "ps -eo args")


@pytest.mark.cluster
def test_teardown_leaves_nothing_and_is_idempotent(tmp_path):
    reason = tbmod.require_root()
    if reason:
        pytest.skip(reason)
    t = tbmod.Testbed(2, tmp_path / "tb")
    t.run(0, ["sleep", "1000"])
    t.run(1, "sleep 1000 & sleep 1000 & wait")
    tbmod.poll(lambda: len(t.processes(1)) >= 3, 10, "sleepers")
    pids = [h.init_pid for h in t.hosts + [t.laptop]] + t.processes(0) + t.processes(1)
    names = [h.netns for h in t.hosts + [t.laptop]] + [t.bridge_ns]
    assert set(names) <= set(tbmod._netns_names())
    start = time.monotonic()
    t.close()
    assert time.monotonic() - start < 10
    assert not set(names) & set(tbmod._netns_names())
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")
                and open(f"/proc/{p}/stat").read().split(")")[1].split()[0] != "Z"]
    t.close()  # idempotent
    with pytest.raises(tbmod.TestbedError, match="down"):
        t.run(0, ["true"])


@pytest.mark.cluster
def test_stale_namespaces_of_dead_runs_are_removed():
    reason = tbmod.require_root()
    if reason:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = f"{tbmod.PREFIX}{dead.pid}-1-h0"
    assert not os.path.exists(f"/proc/{dead.pid}")
    subprocess.run(["ip", "netns", "add", ns], check=True)
    # a leftover process inside it, as a crashed run would leave
    orphan = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "sleep", "1000"])
    try:
        tbmod.poll(lambda: tbmod._netns_pids(ns), 5, "orphan in netns")
        assert ns in tbmod.cleanup_stale()
        assert orphan.wait(5) == -signal.SIGKILL
        assert ns not in tbmod._netns_names()
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


RAY_NODES = ("http://127.0.0.1:8265/api/v0/nodes?limit=1000&filter_keys=state"
             "&filter_predicates=%3D&filter_values=ALIVE")


def test_two_host_ray_cluster(testbed):
    t = testbed
    ray = os.path.join(tbmod.BIN_DIR, "ray")
    env = t.env(RAY_AUTH_MODE="disabled")
    common = ["--object-store-memory", "100000000", "--num-cpus", "1", "--block"]
    head = t.run(0, [ray, "start", "--head", "--node-ip-address", t.hosts[0].ip, "--port", "6379",
                     "--dashboard-host", "127.0.0.1", *common], env=env, name="ray-head")
    t.wait_port(0, 6379, t.hosts[0].ip, timeout=60)
    worker = t.run(1, [ray, "start", "--address", "node0:6379",
                       "--node-ip-address", t.hosts[1].ip, *common], env=env, name="ray-worker")

    def alive_nodes():
        assert head.running(), head.output[-3000:]
        assert worker.running(), worker.output[-3000:]
        r = t.http(0, RAY_NODES)
        nodes = r.json()["data"]["result"]["result"] if r.ok else []
        return nodes if len(nodes) == 2 else None

    nodes = tbmod.poll(alive_nodes, 90, "2 ALIVE Ray nodes", 0.5)
    assert {n["node_ip"] for n in nodes} == {t.hosts[0].ip, t.hosts[1].ip}
    # each host has its own Ray session dir in its own /tmp
    assert "session_latest" in t.sh(1, "ls /tmp/ray")
    # graceful stop: worker first (a worker whose head is gone drains for 30 s)
    worker.send_signal(signal.SIGTERM)
    worker.wait(60)
    head.send_signal(signal.SIGTERM)
    head.wait(60)
