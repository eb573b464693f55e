"""dstack's own CLI, driven for what `launch`, `down` and the launcher's summary need of a run: its
state (`dstack ps --json`), its jobs' logs as dstack's server kept them (`dstack logs`), ending a
`dstack attach` or `dstack apply` as dstack expects (SIGINT), `dstack fleet delete` while the run
ends; and the interpreter that holds dstack's package, which `launch` asks dstack's server through.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from ...errors import StepFailed
from ..base import end_process, require_cli

#: How many of dstack's latest runs `ps` looks through for a cluster's run.
PS_RUNS = 100


#: dstack's run states of a run that is over (core/models/runs.py RunStatus.is_finished).
RUN_OVER = ("terminated", "failed", "done")


def runs_named(dstack: str, name: str) -> list[dict] | None:
    """The runs of that name as `dstack ps --json` gives them, newest first; None when dstack cannot be asked."""
    try:
        out = subprocess.run([dstack, "ps", "--json", "--last", str(PS_RUNS)], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        return [run for run in json.loads(out.stdout).get("runs") or []
                if (run.get("run_spec") or {}).get("run_name") == name]
    except (OSError, subprocess.TimeoutExpired, ValueError, AttributeError):
        return None


def run_over(dstack: str, name: str) -> bool:
    """Whether dstack says the run `name` is over (`dstack ps --json`); False when it cannot be asked."""
    runs = runs_named(dstack, name)
    return bool(runs) and str(runs[0].get("status")) in RUN_OVER


def run_words(dstack: str, name: str) -> list[str]:
    """dstack's word on the run and each of its jobs (`dstack ps --json`: the run's status and termination reason,
    each job's last submission with its host and why it ended), each job named as the summary names nodes (job N is
    rank N): e.g. a worker's machine lost mid-run, which dstack's server fails `instance_unreachable` once it has not
    answered for 2 minutes (jobs_running.py JOB_DISCONNECTED_RETRY_TIMEOUT) and which ends the run `job_failed`.
    Nothing when dstack does not say."""
    runs = runs_named(dstack, name)
    if not runs:
        return []
    run, jobs = runs[0], []

    def words(reason) -> str:
        return str(reason).replace("_", " ")
    for job in sorted(run.get("jobs") or [], key=lambda j: (j.get("job_spec") or {}).get("job_num") or 0):
        sub = (job.get("job_submissions") or [{}])[-1]
        host = (sub.get("job_provisioning_data") or {}).get("hostname") or "no host"
        why = [words(sub["termination_reason"])] if sub.get("termination_reason") else []
        if sub.get("termination_reason_message"):
            why.append(sub["termination_reason_message"])
        if sub.get("exit_status") is not None:
            why.append(f"exit status {sub['exit_status']}")
        jobs.append(f"node{(job.get('job_spec') or {}).get('job_num')} ({host}) {sub.get('status')}"
                    + (f": {', '.join(why)}" if why else ""))
    reason = f" ({words(run['termination_reason'])})" if run.get("termination_reason") else ""
    return [f"dstack: the run {name} {run.get('status')}{reason}" + (f"; {'; '.join(jobs)}" if jobs else "")]


def server_head_log(dstack: str, name: str, directory: Path, env: dict[str, str]) -> str:
    """Job 0's log as dstack's server kept it (`dstack logs NAME`: the head's, result line included), for a run
    that ended before `dstack apply` attached to it: apply then shows none of it (it attaches only to a run that
    is running or done, and a failed job ends a multi-node run at once, JOB_FAILED). "" when dstack has none."""
    try:
        out = subprocess.run([dstack, "logs", name], cwd=directory, env=env, capture_output=True, timeout=120,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = out.stdout.decode(errors="replace").replace("\r\n", "\n")
    if out.returncode != 0 or not text.strip():
        return ""
    return f"[dstack: `dstack apply` ended without the head's log; `dstack logs {name}` from dstack's server:]\n" \
        + text + ("" if text.endswith("\n") else "\n")


def bundle_from_dstack_logs(dstack: str, name: str, jobs: int, directory: Path, env: dict[str, str],
                            secrets: dict[str, str], out_dir: str, reason: str) -> str | None:
    """A failure bundle made here of each job's log as dstack's server kept it (`dstack logs NAME --job N`: what
    each node's agent printed, the head's with the job's log it relays), the errors found in each, secrets
    scrubbed: for a run that is over, whose dashboard can no longer give Ray's logs. Its path, or None when dstack
    gave no log."""
    from ...agent.protocol.bundle import find_errors, first_error, node_order, scrub, write_bundle

    nodes, files, problems = [], [], []
    for job in range(jobs):
        try:
            out = subprocess.run([dstack, "logs", name, "--job", str(job)], cwd=directory, env=env,
                                 capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"dstack logs {name} --job {job}: {exc}")
            continue
        if out.returncode != 0:
            problems.append(f"dstack logs {name} --job {job}: "
                            f"{out.stderr.decode(errors='replace').strip()[-300:] or f'exit code {out.returncode}'}")
            continue
        text = scrub(out.stdout.decode(errors="replace").replace("\r\n", "\n"), secrets)
        label, file = f"node{job}", f"dstack-logs-job{job}.log"
        found = find_errors(text, file)
        nodes.append({"label": label, "ip": "", "state": f"dstack job {job}", "head": job == 0, "rank": job,
                      "first_error": first_error(found), "findings": found})
        files.append({"node": label, "label": label, "name": file, "text": text, "truncated": False,
                      "found": [f"{f['kind']}: {f['error']}" for f in found][:20]})
    if not files:
        return None
    first = [{"label": n["label"], "ip": "", "error": n["first_error"]["error"], "kind": n["first_error"]["kind"],
              "at": n["first_error"]["at"], "file": n["first_error"]["file"]} for n in node_order(nodes)]
    gathered = {"reason": scrub(reason, secrets), "made_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "nodes": [{k: v for k, v in n.items() if k != "findings"} for n in nodes], "first_errors": first,
                "files": files, "problems": problems,
                "state": json.dumps({"run": name, "jobs": [n["state"] for n in nodes]}, indent=2)}
    try:
        return write_bundle(gathered, out_dir, name)
    except OSError:
        return None


def end_attach(proc: subprocess.Popen) -> None:
    """End a `dstack attach` (or `dstack apply`) this launcher started: SIGINT, so that it closes its SSH tunnel
    itself (`dstack apply -y` detaches on it and leaves the run as it is), then SIGTERM and SIGKILL if it does not
    end. A `dstack apply` left behind would hold the dashboard's port for the next launch ("port 8265 is already in
    use") while it waits up to 30 s for the finished run's final status."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        end_process(proc)


def delete_fleet(name: str, deadline_s: float = 300) -> str:
    """`dstack fleet delete NAME -y`, again while dstack says the fleet is in use (its run still ending), until
    `deadline_s`; StepFailed with dstack's words after it."""
    dstack = require_cli("dstack", "dstack")
    started = time.monotonic()
    while True:
        out = subprocess.run([dstack, "fleet", "delete", name, "-y"], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL)
        said = (out.stdout.strip() + "\n" + out.stderr.strip()).strip()
        if out.returncode == 0 or "does not exist" in said:
            return said or f"dstack fleet delete {name}: done"
        elapsed = time.monotonic() - started
        if elapsed > deadline_s or not re.search(r"in use|being processed", said):
            raise StepFailed(f"dstack fleet delete {name}", said or f"exit code {out.returncode}")
        print(f"dstack: the fleet {name} is still in use by its ending run; deleting again "
              f"({elapsed:.0f}s of {deadline_s:.0f}s)", flush=True)
        time.sleep(3)  # between tries of a command dstack refuses while the run ends


#: The interpreter that holds dstack's package, where the `dstack` command is no Python script of its own (a
#: pyenv or asdf shim, a wrapper): `launch` asks dstack's server through it.
PYTHON_ENV = "RLHF_TASKS_DSTACK_PYTHON"


def dstack_python(dstack: str) -> str:
    """The interpreter the `dstack` command runs on: $RLHF_TASKS_DSTACK_PYTHON, this one when the command is
    beside it, else the command's `#!` when that names a Python (else this one)."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    if Path(dstack).parent == Path(sys.executable).parent:
        return sys.executable
    try:
        with open(dstack, "rb") as handle:
            first = handle.readline().decode(errors="replace").strip()
    except OSError:
        return sys.executable
    if first.startswith("#!"):
        words = shlex.split(first[2:])
        if words and "python" in Path(words[0]).name:
            return words[0]
    return sys.executable

