"""SkyPilot's job log (`sky logs NAME`, kept by `launch` beside the run): split by node, what SkyPilot says
of a job once it ended with each node's first error, and a failure bundle made from it.

`launch` keeps the log because SkyPilot's autostop takes the cluster, its logs with it, a minute after
the job: what happened is read from this copy.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

#: What SkyPilot's CLI colours its output with (taken off before its lines are read).
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


#: SkyPilot's prefix of a node's line in its job log: `(head, rank=0, pid=7) `, `(worker1, rank=1, pid=8, ip=...) `;
#: on a one-node cluster the task's name and no rank, `(NAME, pid=7) ` (skylet/executor/slurm.py, RayCodeGen's
#: name_str). Setup's `(setup pid=7)` is no node's.
_NODE_LINE = re.compile(r"^\((?:(?:head|worker\d+), rank=(\d+)|[^\s,()]+), pid=\d+(?:, ip=[^)]*)?\) ?(.*)$")
#: `sky logs`'s exit codes (sky.exceptions.JobExitCode in SkyPilot 0.14.1).
JOB_EXIT = {0: "SUCCEEDED", 100: "FAILED", 101: "NOT_FINISHED", 102: "NOT_FOUND", 103: "CANCELLED"}


def by_node(text: str) -> dict[int, list[str]]:
    """SkyPilot's job log split by node rank (setup's and SkyPilot's own lines left out)."""
    nodes: dict[int, list[str]] = {}
    for line in ANSI.sub("", text).splitlines():
        match = _NODE_LINE.match(line)
        if match:
            nodes.setdefault(int(match.group(1) or 0), []).append(match.group(2))
    return nodes


def _nodes(text: str) -> list[dict]:
    """Each node of SkyPilot's job log: its lines, the errors found in them and the first."""
    from ...agent.protocol.bundle import find_errors, first_error

    nodes = []
    for rank, lines in sorted(by_node(text).items()):
        node_text = "\n".join(lines) + "\n"
        found = find_errors(node_text, f"node{rank}.log")
        nodes.append({"label": f"node{rank}", "ip": "", "rank": rank, "head": rank == 0, "text": node_text,
                      "first_error": first_error(found), "findings": found})
    return nodes


def _first_errors(nodes: list[dict]) -> list[dict]:
    from ...agent.protocol.bundle import node_order

    return [{"label": n["label"], "ip": "", **{k: n["first_error"][k] for k in ("error", "kind", "at", "file")}}
            for n in node_order(nodes)]


def skypilots_word(name: str, code: int | None, text: str) -> list[str]:
    """What SkyPilot says of the job once `sky logs` ended: its status, and each node's first error."""
    from ...agent.protocol.bundle import describe

    lines = [f"SkyPilot: the job on {name} ended {JOB_EXIT.get(code, f'(sky logs exit code {code})')} "
             f"(sky queue {name})"]
    errors = _first_errors(_nodes(text)) if code != 0 else []
    if errors:
        lines.append("first error on each node, by SkyPilot's job log: " + "; ".join(describe(e) for e in errors))
    return lines


def bundle_from_job_log(name: str, job_log: Path, secrets: dict[str, str], out_dir: str, reason: str) -> str | None:
    """A failure bundle of SkyPilot's job log kept here: each node's lines, the errors found in them, secrets
    scrubbed. Its path, or None without a log."""
    import json

    from ...agent.protocol.bundle import scrub, write_bundle

    try:
        text = scrub(job_log.read_text(errors="replace"), secrets)
    except FileNotFoundError:
        return None
    nodes = _nodes(text)
    files = [{"node": "sky", "label": "skypilot", "name": "sky-logs.log", "text": text, "truncated": False, "found": []}]
    files += [{"node": n["label"], "label": n["label"], "name": f"{n['label']}.log", "text": n["text"],
               "truncated": False, "found": [f"{f['kind']}: {f['error']}" for f in n["findings"]][:20]} for n in nodes]
    first = _first_errors(nodes)
    gathered = {"reason": scrub(reason, secrets), "made_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "nodes": [{**{k: v for k, v in n.items() if k not in ("findings", "text")}, "state": "SkyPilot job log"}
                          for n in nodes], "first_errors": first,
                "files": files, "problems": [], "state": json.dumps({"cluster": name, "nodes": len(nodes)})}
    try:
        return write_bundle(gathered, out_dir, name)
    except OSError:
        return None
