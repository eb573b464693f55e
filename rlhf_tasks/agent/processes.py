"""The processes the agent starts and stops: each child in a session (process group) of its
own that dies with the agent, even by SIGKILL; groups signalled, waited for and killed;
a stale group an earlier agent left behind stopped through the file that records it.
The local provider stops its node agents with the same group functions.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

from .protocol import log

_LIBC = []  # type: list


def _die_with_agent() -> None:
    """preexec_fn: the kernel kills this child when the agent dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG). A child in a session of its own is invisible to a scheduler that
    tracks processes by ancestry once the agent is gone; `ray start --block` then takes
    its own processes with it (Ray's kernel fate sharing)."""
    if _LIBC and _LIBC[0] is not None:
        _LIBC[0].prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _load_libc() -> None:
    """Load libc before forking (an import in the child could deadlock)."""
    if not _LIBC:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            _LIBC.append(libc if sys.platform.startswith("linux") and hasattr(libc, "prctl") else None)
        except (OSError, ImportError):
            _LIBC.append(None)


class Child(object):
    """A process in its own session whose group id is recorded in `pgid_file`, so a
    restarted agent stops exactly its own stale Ray, never anyone else's; it dies with
    the agent."""

    def __init__(self, name: str, argv, env: Dict[str, str], log_path: Optional[str] = None,
                 pgid_file: Optional[str] = None, shell: bool = False, stdin=None, die_with_agent: bool = True):
        self.name, self.pgid_file, self.log_path = name, pgid_file, log_path
        out = open(log_path, "ab") if log_path else None
        _load_libc()
        self.proc = subprocess.Popen(argv, env=env, shell=shell, executable="/bin/bash" if shell and os.path.exists("/bin/bash") else None,
                                     stdin=stdin, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, preexec_fn=_die_with_agent if die_with_agent else None)
        if out:
            out.close()
        if pgid_file:
            with open(pgid_file, "w") as handle:
                handle.write(str(self.proc.pid))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 15.0, enough: Optional[Callable[[], bool]] = None) -> None:
        """SIGTERM, then SIGKILL after `grace`; once `enough()` holds, what is left is killed at once."""
        if self.alive():
            if kill_group(self.proc.pid, grace, enough or (lambda: self.proc.poll() is not None),
                          whole=enough is None) and grace:
                log("%s did not end within %gs of SIGTERM: killed" % (self.name, grace))
        else:
            kill_group(self.proc.pid, 0.0, lambda: True)  # leftovers of an exited leader
        if self.pgid_file and os.path.exists(self.pgid_file):
            os.remove(self.pgid_file)

    def tail(self, lines: int = 20) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - 8192))
            return "\n".join(handle.read().decode("utf-8", "replace").splitlines()[-lines:])


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _members(pgid: int) -> Optional[List[str]]:
    """The command names of process group `pgid`'s running members (zombies left out); None where
    /proc cannot tell them."""
    if not os.path.isdir("/proc"):
        return None
    names = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as handle:
                head, tail = handle.read().rsplit(")", 1)
            fields = tail.split()
        except (OSError, IndexError, ValueError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            names.append(head.split("(", 1)[-1])
    return names


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a running member (zombies do not count, where /proc
    tells them apart)."""
    try:
        os.killpg(pgid, 0)
    except OSError as exc:
        if exc.errno != errno.EPERM:
            return False
    members = _members(pgid)
    return members is None or bool(members)


def group_has(pgid: int, name: str) -> bool:
    """Whether process group `pgid` has a running member whose command is `name` (the kernel's
    15-character comm)."""
    return name[:15] in (_members(pgid) or [])


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid`; a group that is gone is no error."""
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def kill_group(pgid: int, grace: float, gone: Callable[[], bool], whole: bool = True) -> bool:
    """SIGTERM the group, wait up to `grace` seconds for `gone()` (and, when `whole`, for the
    group to end), then SIGKILL what is left. Whether the grace ran out."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return False
    deadline = time.monotonic() + grace
    done = (lambda: gone() and not group_alive(pgid)) if whole else gone
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)
    ran_out = not done()
    if group_alive(pgid):
        signal_group(pgid, signal.SIGKILL)
    return ran_out


def stop_stale(pgid_file: str) -> None:
    """Stop a Ray (or service) an earlier agent on this node started and left behind."""
    try:
        with open(pgid_file) as handle:
            pgid = int(handle.read().strip())
    except (OSError, ValueError):
        return
    if group_alive(pgid):
        log("stopping a stale process group %d left by an earlier agent (%s)" % (pgid, os.path.basename(pgid_file)))
        kill_group(pgid, 15.0, lambda: True)
    os.remove(pgid_file)
