"""A test worker's CPU, counted whole: the worker moves itself into a cgroup of its own (cgroup v1's
`cpuacct`, as root), and everything it starts stays there, however it detaches (a host's Ray daemons, a
server in the background, what a namespace host runs). The cgroup's counter, read before and after a test,
is the CPU that test cost, whatever ran beside it; its process count after a test shows what the test left
running. Used by the timeline (`RLHF_TASKS_TIMELINE=FILE make test`, conftest.py; tests/timeline.py).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpuacct")


class Account:
    """This process's own cpuacct cgroup, or nothing where there is none to make (not root, cgroup v2 only)."""

    def __init__(self, name: str):
        self.dir: Path | None = None
        try:
            path = ROOT / name
            path.mkdir(exist_ok=True)
            (path / "cgroup.procs").write_text(str(os.getpid()))
            self.dir = path
        except OSError:
            pass

    def seconds(self) -> float | None:
        """The CPU its processes have used since it was made, the ended ones' included."""
        return int((self.dir / "cpuacct.usage").read_text()) / 1e9 if self.dir else None

    def processes(self) -> int | None:
        """How many processes it holds: the worker, the servers its session keeps, and what a test left."""
        return len((self.dir / "cgroup.procs").read_text().split()) if self.dir else None

    def close(self) -> None:
        """Back to the root cgroup; the cgroup itself stays while anything is left in it (shown by processes())."""
        if self.dir:
            (ROOT / "cgroup.procs").write_text(str(os.getpid()))
            try:
                self.dir.rmdir()
            except OSError:
                pass
