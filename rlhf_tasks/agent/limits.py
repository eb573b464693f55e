"""The open-files limit a job's framework needs (the plan's `open_files`, its recipe's: Search-R1's
guide runs `ulimit -n 65535`), raised in the agent's own process before it starts anything, so that
setup, Ray (raylet, workers, the job's driver) and the every-node command inherit it. Ray sets none
for them: Ray 2.60 raises the limit only in a process calling `ray.init` (ray/_private/worker.py,
init), never in `ray start`. Only the soft limit is raised: the hard one is the node's (its
container's, its login's), and an unprivileged process cannot raise it, so a node whose hard limit is
lower is refused, saying both limits and what to change. Standard library only.
"""

from __future__ import annotations

from typing import Optional

from .protocol import AgentError, log

STEP = "raising the open-files limit"


def _words(limit: int) -> str:
    import resource

    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def raise_open_files(wanted: Optional[int]) -> None:
    """Set this process's soft RLIMIT_NOFILE to `wanted` where it is lower and the hard limit allows;
    AgentError (code 2: the node, not the run, is wrong) where the hard limit is lower; never lowers it."""
    if not wanted:
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        log("open files: soft limit %s, at least the %d the job needs" % (_words(soft), wanted))
        return
    if hard != resource.RLIM_INFINITY and hard < wanted:
        raise AgentError(STEP, "the job needs a soft limit of %d open files (RLIMIT_NOFILE, `ulimit -n`) and this "
                         "node's hard limit is %d (soft %d), which only a privileged process can raise: raise the "
                         "hard limit where the node starts (a container's `--ulimit nofile=%d:%d`, the scheduler's "
                         "or the login's limits: /etc/security/limits.conf, systemd's LimitNOFILE), or set "
                         "job.open_files to at most %d to run with what this node allows"
                         % (wanted, hard, soft, wanted, wanted, hard), code=2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    log("open files: soft limit raised from %d to %d (hard limit %s) for all this node starts"
        % (soft, wanted, _words(hard)))
