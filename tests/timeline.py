"""Where `make test`'s time went, from the lines `RLHF_TASKS_TIMELINE=FILE make test` wrote (conftest.py):
each worker's span and busy time, and the files that took longest in each.

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
            worker, began, ended, nodeid = line.rstrip("\n").split("\t", 3)
            runs.append((worker, float(began), float(ended), nodeid))
    if not runs:
        raise SystemExit(f"{args.file}: no tests")
    start = min(r[1] for r in runs)
    print(f"{len(runs)} tests, {max(r[2] for r in runs) - start:.0f} s from the first start to the last end")
    for worker in sorted({r[0] for r in runs}):
        mine = [r for r in runs if r[0] == worker]
        busy = sum(r[2] - r[1] for r in mine)
        files: dict[str, float] = defaultdict(float)
        for _, began, ended, nodeid in mine:
            files[nodeid.split("::")[0]] += ended - began
        print(f"{worker}: {len(mine)} tests, busy {busy:.0f} s, "
              f"from {min(r[1] for r in mine) - start:.0f} s to {max(r[2] for r in mine) - start:.0f} s")
        for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:args.files]:
            print(f"    {seconds:7.0f} s  {name}")


if __name__ == "__main__":
    main()
