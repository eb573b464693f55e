"""Write the tiny-grpo prompt set: DIR/prompts.jsonl.

    python3 -m rlhf_tasks.demo.prepare --out DIR [--num-prompts 1000] [--seed 0]

Each line is {"prompt": "3+4=", "answer": "7"}: single-digit additions whose sum is a
single digit, small enough for a tiny policy to learn with GRPO in about a minute on
CPU. The sum is drawn uniformly, so a policy that collapses onto one digit scores only
about 0.1. The output depends only on the arguments, and is written atomically, so
reruns are safe and leave an up-to-date file alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

FILENAME = "prompts.jsonl"


def make_prompts(num_prompts: int, seed: int) -> list[dict[str, str]]:
    """Draw `num_prompts` additions a+b with a uniformly drawn single-digit sum."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        total = rng.randrange(10)
        a = rng.randrange(total + 1)
        rows.append({"prompt": f"{a}+{total - a}=", "answer": str(total)})
    return rows


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m rlhf_tasks.demo.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write prompts.jsonl into")
    parser.add_argument("--num-prompts", type=int, default=1000, help="number of prompts (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / FILENAME
    text = "".join(json.dumps(row) + "\n" for row in make_prompts(args.num_prompts, args.seed))
    if path.is_file() and path.read_text() == text:
        print(f"{path}: already up to date ({args.num_prompts} prompts, seed {args.seed})")
        return 0
    write_atomic(path, text)
    print(f"wrote {args.num_prompts} prompts to {path} (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
