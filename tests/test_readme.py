"""README's first commands work as written in a fresh shell (issue 32, item 11): a new shell
has no `.venv/bin` on its PATH, so `rlhf-tasks` alone is "command not found" until README's
`source .venv/bin/activate`. README keeps exactly two commands for a fresh machine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, need

README = (ROOT / "README.md").read_text()


def blocks(section: str) -> list[list[str]]:
    """The indented code blocks of README's `## section`, as their command lines."""
    text = README.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"(?:^    \S.*\n)+", text, flags=re.M)
    return [[line[4:].split("  #")[0].strip() for line in block.splitlines()] for block in found]


def fresh_shell(script: str) -> subprocess.CompletedProcess:
    """bash as a new login would start it here: no rc files, a PATH without this venv."""
    return subprocess.run(["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={ROOT}", "bash", "--norc",
                           "--noprofile", "-e", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_fresh_machine_has_exactly_two_commands():
    assert blocks("On a fresh machine")[0] == ["make demo", "make test"]


def test_the_commands_after_make_work_in_a_fresh_shell():
    venv = ROOT / ".venv"
    need(Path(sys.prefix).resolve() == venv.resolve(), f"the tests run from {venv} (make test), as README's user has it")
    after = blocks("On a fresh machine")[1]
    assert after[0].startswith("source .venv/bin/activate"), after
    assert any(line.startswith("rlhf-tasks ") for line in after[1:])
    bare = fresh_shell("\n".join(after[1:]))  # without the line that says how: not found, as the issue saw
    assert bare.returncode == 127 and "rlhf-tasks: command not found" in bare.stderr, bare.stderr
    out = fresh_shell("\n".join(after))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tiny-grpo" in out.stdout and "tasks/tiny-grpo.yaml: ok" in out.stdout


def test_make_demo_says_where_the_command_is():
    out = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "source .venv/bin/activate" in out.stdout, out.stdout
