"""What preflight adds between "cluster ready" and "job running", on three namespace hosts
(tests/testbed.py; needs root), with the dstack contract the tests use.

    sudo .venv/bin/python benchmarks/preflight.py [--rounds 3]

Each round starts the rendered dstack task on three hosts twice, with `preflight: off` and
on (with torch and the Gloo all_reduce: its longest form; alternating, so drift hits both),
and clocks from this process, polling the head's output every 50 ms. The head submits
preflight and the job (behind its gate) before the nodes are in, so:

  ready -> start     the head's "cluster ready" line to its "starting job" line (the gate
                     opens): what preflight adds (about nothing when it is off)
  ready -> running   to the job's own first line of output (Ray's job start-up included)
  preflight step     the head's own timing of the step, from its result line

Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import testbed as tbmod  # noqa: E402
from rlhf_tasks.agent.protocol import parse_result  # noqa: E402
from test_contracts import contract_task, dstack_env, place, render  # noqa: E402

import yaml  # noqa: E402


def one_run(tb, directory: Path, enabled: bool) -> dict:
    task = contract_task(directory, 3, "head", service=False)
    task["preflight"] = {"enabled": enabled, "min_bandwidth": "200Mbit", "torch": True}
    files = render("dstack", task, directory / "rendered")
    config = yaml.safe_load(files[f"{task['name']}.dstack.yml"])
    mounts = {m.split(":")[1]: directory / "rendered" / m.split(":")[0] for m in config["files"]}
    procs = []
    for rank in range(3):
        place(tb, rank, mounts)
        procs.append(tb.run(rank, " && ".join(config["commands"]), env=dstack_env(tb, rank, 3, config["env"]),
                            name=f"bench-node{rank}"))
    head, seen = procs[0], {}
    marks = {"ready": "cluster ready:", "start": "starting job", "running": "CONTRACT alive nodes 3"}  # printed by the job only
    deadline = time.monotonic() + 300
    while len(seen) < len(marks) and head.running() and time.monotonic() < deadline:
        out = head.output
        for key, text in marks.items():
            if key not in seen and text in out:
                seen[key] = time.monotonic()
        time.sleep(0.05)
    head.wait(120)
    for host in range(3):
        tb.kill(host)
    if len(seen) < len(marks):
        raise SystemExit(f"round failed (saw {sorted(seen)}):\n{head.output[-3000:]}")
    steps = {s["step"]: s["seconds"] for s in parse_result(head.output)["steps"]}
    return {"ready_start": seen["start"] - seen["ready"], "ready_running": seen["running"] - seen["ready"],
            "step": steps.get("preflight")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-preflight-"))
    rows = {True: [], False: []}
    with tbmod.Testbed(3, base / "testbed", shared=[base]) as tb:
        for index in range(args.rounds):  # the hosts' logs stay under `base` until the end
            for enabled in ((False, True) if index % 2 == 0 else (True, False)):
                directory = base / f"r{index}-{'on' if enabled else 'off'}"
                directory.mkdir()
                row = one_run(tb, directory, enabled)
                rows[enabled].append(row)
                print(f"round {index + 1}, preflight {'on ' if enabled else 'off'}: ready->start "
                      f"{row['ready_start']:.1f} s, ready->running {row['ready_running']:.1f} s"
                      + (f", preflight step {row['step']:.1f} s" if row["step"] is not None else ""), flush=True)
    print("\n| median of %d | ready -> start | ready -> job running | preflight step |" % args.rounds)
    print("|---|---|---|---|")
    for enabled in (False, True):
        med = {k: statistics.median(r[k] for r in rows[enabled]) for k in ("ready_start", "ready_running")}
        step = [r["step"] for r in rows[enabled] if r["step"] is not None]
        print(f"| preflight {'on' if enabled else 'off'} | {med['ready_start']:.1f} s | {med['ready_running']:.1f} s "
              f"| {statistics.median(step):.1f} s |" if step else
              f"| preflight {'on' if enabled else 'off'} | {med['ready_start']:.1f} s | {med['ready_running']:.1f} s | - |")
    added = (statistics.median(r["ready_running"] for r in rows[True])
             - statistics.median(r["ready_running"] for r in rows[False]))
    print(f"\npreflight adds {added:.1f} s to cluster ready -> job running (median of {args.rounds})")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
