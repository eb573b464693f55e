"""How long the local provider takes to form a Ray cluster, against the floor of bare
`ray start` on the same machine in the same run (the machines are noisy: compare the
ratio, not the seconds).

    .venv/bin/python benchmarks/cluster_formation.py [--nodes 3] [--rounds 3]

bare:   `ray start --head`, workers poll the GCS port every 0.2 s and then `ray start
        --address`, until the dashboard's State API lists every node ALIVE.
ours:   `rlhf-tasks launch` of a one-line job on the local provider, until the
        launcher reports the cluster up (node agents, token auth, readiness checks).
Rounds alternate bare/ours so drift hits both. Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rlhf_tasks.agent.protocol import alive_nodes, probe_tcp  # noqa: E402
from rlhf_tasks.agent.protocol.ports import free_ports  # noqa: E402

BIN = Path(sys.executable).parent


def bare(nodes: int) -> float:
    gcs, dash, client = free_ports(3, host="")
    temp = tempfile.mkdtemp(prefix="rb-", dir="/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    common = ["--block", "--object-store-memory", "80000000", "--num-cpus", "1", "--dashboard-agent-listen-port", "0"]
    procs = []
    start = time.monotonic()
    deadline = start + 180

    def node_temp(rank):  # one session dir per node: raylets sharing one race for socket names
        return ["--temp-dir", f"{temp}/n{rank}"]

    try:
        procs.append(subprocess.Popen([BIN / "ray", "start", "--head", "--node-ip-address", "127.0.1.1", "--port",
                                       str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                                       "--ray-client-server-port", str(client), *common, *node_temp(0)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        while probe_tcp("127.0.1.1", gcs) is not None:
            if time.monotonic() > deadline:
                raise SystemExit("bare: the head's GCS did not open in 180 s")
            time.sleep(0.2)
        for rank in range(1, nodes):
            procs.append(subprocess.Popen([BIN / "ray", "start", "--address", f"127.0.1.1:{gcs}", "--node-ip-address",
                                           f"127.0.1.{rank + 1}", *common, *node_temp(rank)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        while True:
            try:
                if len(alive_nodes(f"http://127.0.0.1:{dash}", None)) == nodes:
                    return time.monotonic() - start
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"bare: {nodes} nodes not ALIVE in 180 s")
            time.sleep(0.2)
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def ours(nodes: int, workdir: Path) -> float:
    task = workdir / "bench.yaml"
    task.write_text(f"name: bench\nnodes: {nodes}\nresources: {{cpus: 1}}\nray: {{object_store_memory: 80MB}}\n"
                    "job: {recipe: command, working_dir: null, args: {entrypoint: 'true'}}\n")
    env = dict(os.environ, RLHF_TASKS_HOME=str(workdir / "home"), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.Popen([BIN / "rlhf-tasks", "launch", str(task)], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, text=True)
    elapsed = None
    for line in proc.stdout:
        if elapsed is None and re.search(r"rlhf-tasks: cluster up", line):
            elapsed = time.monotonic() - start
    if proc.wait() != 0 or elapsed is None:
        raise SystemExit("launch failed; see runs/bench/nodes in " + str(workdir))
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rlhf-bench-"))
    results = {"bare": [], "ours": []}
    for round_ in range(args.rounds):
        results["bare"].append(bare(args.nodes))
        results["ours"].append(ours(args.nodes, workdir))
        print(f"round {round_ + 1}: bare {results['bare'][-1]:.1f}s, ours {results['ours'][-1]:.1f}s", flush=True)
    b, o = statistics.median(results["bare"]), statistics.median(results["ours"])
    print(f"median over {args.rounds} rounds, {args.nodes} nodes: bare {b:.1f}s, ours {o:.1f}s, ratio {o / b:.2f}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
