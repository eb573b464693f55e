"""Where `make test`'s time went, from the lines `RLHF_TASKS_TIMELINE=FILE make test` wrote (conftest.py):
each worker's span and busy time, the files that took longest in each, and, where the workers counted it
(tests/cpuacct.py, as root), the CPU each file cost with all it started, and what tests left running.

    python tests/timeline.py FILE [--files N]
"""

from __future__ import annotations

import argparse
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--files", type=int, default=8, help="how many files to list per worker")
    args = parser.parse_args()
    runs = []
    with open(args.file) as lines:
        for line in lines:
            worker, began, ended, nodeid, *counted = line.rstrip("\n").split("\t")
            cpu, left = (counted + ["", ""])[:2]
            runs.append((worker, float(began), float(ended), nodeid, float(cpu) if cpu else None,
                         int(left) if left else None))
    if not runs:
        raise SystemExit(f"{args.file}: no tests")
    start = min(r[1] for r in runs)
    span = max(r[2] for r in runs) - start
    print(f"{len(runs)} tests, {span:.0f} s from the first start to the last end")
    for worker in sorted({r[0] for r in runs}):
        mine = [r for r in runs if r[0] == worker]
        busy = sum(r[2] - r[1] for r in mine)
        files: dict[str, float] = defaultdict(float)
        for _, began, ended, nodeid, *_ in mine:
            files[nodeid.split("::")[0]] += ended - began
        print(f"{worker}: {len(mine)} tests, busy {busy:.0f} s, "
              f"from {min(r[1] for r in mine) - start:.0f} s to {max(r[2] for r in mine) - start:.0f} s")
        for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:args.files]:
            print(f"    {seconds:7.0f} s  {name}")
    counted = [r for r in runs if r[4] is not None]
    if not counted:
        return
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for _, began, ended, nodeid, used, _ in counted:
        cpu[nodeid.split("::")[0]] += used
        wall[nodeid.split("::")[0]] += ended - began
    total = sum(cpu.values())
    print(f"CPU of the counted tests: {total:.0f} s, {total / span:.2f} cores over the span on average; by file:")
    for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:args.files * 3]:
        print(f"    {seconds:7.0f} s CPU in {wall[name]:6.0f} s  {name}")
    for worker in sorted({r[0] for r in counted}):  # a test after which the worker's cgroup holds more than before
        mine = [r for r in counted if r[0] == worker]
        for prev, r in zip(mine, mine[1:]):
            if r[5] > prev[5]:
                print(f"{worker}: {r[5]} processes in its cgroup after {r[3]} ({prev[5]} before)")


if __name__ == "__main__":
    main()
