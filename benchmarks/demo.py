"""`make demo` (`rlhf-tasks launch tasks/tiny-grpo.yaml`, local provider, 3 nodes) of two
checkouts side by side, rounds alternating, in one run (the machine is noisy: compare the
ratio, not the seconds).

    .venv/bin/python benchmarks/demo.py --base DIR [--rounds 3] [--steps 150]

DIR is another checkout of rlhf-tasks (e.g. `git worktree add /tmp/base <commit>`); both
run with this interpreter and its packages, each with PYTHONPATH set to its checkout, and
with an RLHF_TASKS_HOME of their own. Per run it reports the wall time of the whole launch
(up to its exit, cluster down), and when the launcher printed "cluster up" and the job's
first training step. Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKS = {"cluster up": re.compile(r"rlhf-tasks: cluster up"), "first step": re.compile(r"step \d+/\d+ ")}


def launch(checkout: Path, steps: int, workdir: Path) -> dict[str, float]:
    task = (ROOT / "tasks" / "tiny-grpo.yaml").read_text().replace("steps: 150", f"steps: {steps}")
    (workdir / "tiny-grpo.yaml").write_text(task)
    env = dict(os.environ, PYTHONPATH=str(checkout), RLHF_TASKS_HOME=str(workdir / "home"), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(workdir / "tiny-grpo.yaml")],
                            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    output = []
    for line in proc.stdout:
        output.append(line)
        for mark, pattern in MARKS.items():
            if mark not in seen and pattern.search(line):
                seen[mark] = time.monotonic() - start
    if proc.wait() != 0:
        raise SystemExit(f"{checkout}: launch failed:\n" + "".join(output[-40:]))
    return seen | {"whole launch": time.monotonic() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with (before a change)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    kinds = {"base": args.base.resolve(), "this": ROOT}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="demo-bench-") as tmp:
        for round_ in range(1, args.rounds + 1):
            for kind, checkout in kinds.items():
                workdir = Path(tmp) / f"{kind}{round_}"
                workdir.mkdir()
                runs[kind].append(launch(checkout, args.steps, workdir))
                print(f"round {round_}, {kind}: " + ", ".join(f"{m} {s:.1f} s" for m, s in runs[kind][-1].items()),
                      flush=True)
    print(f"\nmedians of {args.rounds} rounds, {args.steps} steps (base: {kinds['base']})\n")
    print("| mark | base | this | ratio |\n|---|---|---|---|")
    for mark in [*MARKS, "whole launch"]:
        base, this = (statistics.median(r[mark] for r in runs[k]) for k in kinds)
        print(f"| {mark} | {base:.1f} s | {this:.1f} s | {this / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
