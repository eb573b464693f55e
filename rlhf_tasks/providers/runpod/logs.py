"""Following a job on RunPod's pods: each pod's log streamed into `node-<rank>.log`
(`save_logs`, `logs_dir`), the head pod's log followed to the agent's result line and
summarised (`follow`, `finish`), or, with `submit: client`, the head's dashboard reached
through an ssh tunnel for the launcher to follow (`client_cluster`)."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

from ... import state
from ...errors import StepFailed
from ...launch import say
from ...node import RESULT_PREFIX, parse_result
from ...plan import Plan
from ..base import Cluster
from ..ssh import SshTunnel
from .api import RunPodClient
from .pods import ENDED


def save_logs(client: RunPodClient, pod: dict, path: Path, stop: threading.Event) -> None:
    """Append a pod's log to a file until the pod ends or `stop` (a daemon thread)."""
    def run():
        try:
            with open(path, "a") as out:
                for item in client.pod_logs(pod["id"], tail=5000, stop=stop):
                    out.write((item.line if item.source == "container" else
                               f"[runpod {pod['name']}] {item.line}") + "\n")
                    out.flush()
        except Exception as exc:  # noqa: BLE001 - the file says why it ends
            with open(path, "a") as out:
                out.write(f"[rlhf-tasks] the log stream ended: {exc}\n")
    threading.Thread(target=run, name=f"runpod-log-{pod['id']}", daemon=True).start()


def logs_dir(name: str, members: list[dict], skip_head: bool, client: RunPodClient,
             stops: dict[str, threading.Event]) -> tuple[Path, threading.Event]:
    """A fresh `nodes/` directory of the run, each pod's log streamed into node-<rank>.log
    (the head's too unless `skip_head`) until the stop event, kept in `stops` by name."""
    logs = state.run_dir(name) / "nodes"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("node-*.log"):
        old.unlink()
    stop = stops[name] = threading.Event()
    for rank, pod in enumerate(members):
        if rank or not skip_head:
            save_logs(client, pod, logs / f"node-{rank}.log", stop)
    return logs, stop


def follow(client: RunPodClient, plan: Plan, members: list[dict], token: str | None, started: float, fit: dict,
           stops: dict[str, threading.Event]) -> Cluster:
    """Stream the head pod's log (the head agent prints the job's log) until its result line:
    the job's end. The dashboard is never exposed."""
    head = members[0]
    logs, stop = logs_dir(plan.name, members, skip_head=True, client=client, stops=stops)
    say(f"following the head pod {head['name']}'s log (Ctrl-C stops following; the pods keep running)")
    budget = plan.wait.head_s + plan.wait.nodes_s + (plan.job.timeout_s or 0) + 600
    timer = threading.Timer(budget, stop.set) if plan.job.timeout_s else None
    if timer:
        timer.daemon = True
        timer.start()
    result = None
    try:
        with open(logs / "node-0.log", "a") as out:
            for item in client.pod_logs(head["id"], tail=5000, stop=stop):
                line = item.line if item.source == "container" else f"[runpod {head['name']}] {item.line}"
                out.write(line + "\n")
                out.flush()
                if item.line.startswith(RESULT_PREFIX):  # for the launcher: the summary says it
                    result = parse_result(item.line)
                    break
                if item.source == "container":
                    print(item.line, flush=True)
                else:
                    say(f"runpod: {head['name']}: {item.line}")
    finally:
        if timer:
            timer.cancel()
    if result is None:
        why = (f"no result after {budget:.0f}s" if stop.is_set() else "the head pod's log ended without the "
               "agent's result line")
        stop.set()
        raise StepFailed(f"following the head pod {head['name']}", f"{why} (its log: {logs / 'node-0.log'})")
    return finish(plan, members, token, started, fit, result, logs)


def finish(plan: Plan, members: list[dict], token, started: float, fit: dict, result: dict, logs: Path) -> Cluster:
    """The summary of the head agent's result, and the launch's exit code in `Cluster.finished`."""
    job = result.get("job") or {}
    status, sid = job.get("status"), job.get("submission_id")
    code = result.get("exit_code")
    if code is None:  # the head keeps the cluster (launch --keep): the job's status decides
        code = 0 if status == "SUCCEEDED" else 1
    state.update(plan.name, job={"submission_id": sid, "status": status})
    elapsed = time.monotonic() - started
    lines = [f"job {sid}: {status or 'not run'} in {elapsed:.0f}s wall time"]
    attempts = job.get("attempts") or []
    if len(attempts) > 1:
        lines.append(f"attempts: {len(attempts)} (" + "; ".join(
            f"{a['submission_id']} {a['status'] or 'stopped'}" + (f": {a['cause']}" if a.get("cause") else "")
            for a in attempts) + ")")
    if result.get("error"):
        lines.append(f"failed: {result['error']}")
    said = job_said(result.get("job_log_tail") or "")
    if said:
        lines.append(f"the job's last line: {said}")
    steps = ", ".join(f"{s['step']} {s['seconds']:.0f}s" for s in result.get("steps") or [])
    if steps:
        lines.append(f"head steps: {steps}")
    price = f", about ${fit['price'] * plan.nodes * elapsed / 3600:.2f} so far" if fit.get("price") else ""
    lines.append(f"pods: {len(members)} x {fit['count']}x {fit['gpu']} in {members[0].get('dataCenterId')}{price}")
    if plan.checkpoint_dir:
        lines.append(f"checkpoints: {plan.checkpoint_dir}" + ("" if plan.checkpoint_shared else
                                                               " (on each pod's disk)"))
    lines.append(f"node logs: {logs}")
    print("\n== summary ==\n" + "\n".join("  " + line for line in lines), flush=True)
    if plan.keep_cluster:
        say(f"the pods keep running: `rlhf-tasks status {plan.name}`, `rlhf-tasks down {plan.name}` "
            f"terminates them")
    if code:
        print(f"failed: {result.get('error') or f'job {sid} ended {status}'}", file=sys.stderr, flush=True)
    return Cluster(name=plan.name, cluster_id=members[0]["id"], dashboard="", token=token,
                   head_alive=lambda: False, logs_dir=str(logs), finished=code)


def client_cluster(client: RunPodClient, plan: Plan, members: list[dict], token, directory: Path,
                   tunnels: dict[str, SshTunnel], stops: dict[str, threading.Event]) -> Cluster:
    """submit: client: the launcher reaches the head's 127.0.0.1 dashboard through `ssh -L` to the
    head pod's direct SSH endpoint; the pods' logs go to files the launcher echoes."""
    head = members[0]
    direct = head["ssh"]["direct"]
    tunnel = SshTunnel(direct, plan.ray.dashboard_port, directory / "ssh-tunnel.log")
    tunnels[plan.name] = tunnel
    tunnel.start()
    dashboard = f"http://127.0.0.1:{tunnel.local_port}"
    say(f"forwarding the head's dashboard to {dashboard} through ssh {direct['username']}@{direct['host']} "
        f"-p {direct['port']} (after this launch: rlhf-tasks forward {plan.name})")
    # Where `rlhf-tasks forward NAME` puts it, for `env`, `list --cluster` and `submit` later.
    state.update(plan.name, dashboard=f"http://127.0.0.1:{plan.ray.dashboard_port}")
    logs, _ = logs_dir(plan.name, members, skip_head=False, client=client, stops=stops)
    checked = {"at": 0.0, "alive": True}

    def head_alive() -> bool:
        if parse_result(_read(logs / "node-0.log")) is not None:
            return False  # the head agent has ended
        if time.monotonic() - checked["at"] > 3:
            checked["at"] = time.monotonic()
            try:
                checked["alive"] = client.get_pod(head["id"])["status"] not in ENDED
            except Exception:  # noqa: BLE001 - unknown is not dead
                pass
        return checked["alive"]

    return Cluster(name=plan.name, cluster_id=head["id"], dashboard=dashboard, token=token, head_alive=head_alive,
                   head_log=lambda: _read(logs / "node-0.log"), logs_dir=str(logs), tend=tunnel.tend)


def job_said(log: str) -> str | None:
    """The job's own last line: not Ray's log records nor its worker-prefixed lines."""
    for line in reversed(log.splitlines()):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if line and not line.startswith("(") and not re.match(r"^\d{4}-\d\d-\d\d \d", line):
            return line
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
