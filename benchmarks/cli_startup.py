"""Start-up time of `rlhf-tasks` commands that must stay light (no ray, torch or provider
SDK at start-up), against `ray --help` measured in the same run.

    .venv/bin/python benchmarks/cli_startup.py [--runs 5]

Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

COMMANDS = {
    "rlhf-tasks --help": [BIN / "rlhf-tasks", "--help"],
    "rlhf-tasks check tiny-grpo": [BIN / "rlhf-tasks", "check", "tasks/tiny-grpo.yaml"],
    "rlhf-tasks render (dstack)": [BIN / "rlhf-tasks", "render", "tasks/verl-ppo-gsm8k.yaml", "--provider", "dstack"],
    "rlhf-tasks render (slurm, groups)": [BIN / "rlhf-tasks", "render", "benchmarks/groups.yaml", "--provider", "slurm"],
    "rlhf-tasks render (kuberay, groups)": [BIN / "rlhf-tasks", "render", "benchmarks/groups.yaml", "--provider",
                                            "kuberay"],
    "rlhf-tasks render (dstack, groups)": [BIN / "rlhf-tasks", "render", "benchmarks/groups.yaml", "--provider",
                                           "dstack"],
    "ray --help": [BIN / "ray", "--help"],
}


def median_seconds(argv, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    results = {name: median_seconds(argv, runs) for name, argv in COMMANDS.items()}
    base = results["ray --help"]
    for name, seconds in results.items():
        print(f"{name:32s} {seconds * 1000:7.0f} ms  ({seconds / base:.2f} x ray --help)")


if __name__ == "__main__":
    main()
