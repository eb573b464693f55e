"""What the launcher reads of RunPod's pods: each pod's log streamed into `node-<rank>.log`
(`save_logs`, `logs_dir`), and the handle over them (`cluster`): when the head agent has
ended, what the pods cost, and with `submit: client` the dashboard through an ssh tunnel.
The launcher follows the job and summarises it; nothing here does."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ... import state
from ...console import say
from ...agent.protocol import parse_result
from ...plan import Plan
from ..base import Cluster
from ..ssh import SshTunnel
from .api import ENDED, RunPodClient


def save_logs(client: RunPodClient, pod: dict, path: Path, stop: threading.Event) -> None:
    """Append a pod's log to a file until the pod ends or `stop` (a daemon thread). The stream
    is followed through quiet spells, drops and clean ends while the pod runs, each line once
    (`RunPodClient.pod_logs`): the head's result line is what the launcher waits for."""
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


def cluster(client: RunPodClient, plan: Plan, members: list[dict], token: str | None, directory: Path, fit: dict,
            tunnels: dict[str, SshTunnel], stops: dict[str, threading.Event]) -> Cluster:
    """The handle the launcher follows: every pod's log streamed into node-<rank>.log (the head
    agent prints the job's log and its result line there), the pods and their price for the
    summary, and with `submit: client` the head's 127.0.0.1 dashboard through `ssh -L` to the
    head pod's direct SSH endpoint. Without a client submission the dashboard is never exposed."""
    head, created = members[0], time.monotonic()
    logs, stop = logs_dir(plan.name, members, skip_head=False, client=client, stops=stops)
    tunnel = dashboard = None
    if plan.job.submit == "client":
        direct = head["ssh"]["direct"]
        tunnel = tunnels[plan.name] = SshTunnel(direct, plan.ray.dashboard_port, directory / "ssh-tunnel.log")
        tunnel.start()
        dashboard = f"http://127.0.0.1:{tunnel.local_port}"
        say(f"forwarding the head's dashboard to {dashboard} through ssh {direct['username']}@{direct['host']} "
            f"-p {direct['port']} (after this launch: rlhf-tasks forward {plan.name})")
        # Where `rlhf-tasks forward NAME` puts it, for `env`, `list --cluster` and `submit` later.
        state.update(plan.name, dashboard=f"http://127.0.0.1:{plan.ray.dashboard_port}")
    checked = {"at": 0.0, "alive": True, "read": 0}

    def head_agent_ended() -> bool:
        """Whether the head agent's result line is in its log (read on from where it was left)."""
        try:
            with open(logs / "node-0.log", "rb") as handle:
                handle.seek(checked["read"])
                chunk = handle.read()
        except OSError:
            return False
        complete = chunk[: chunk.rfind(b"\n") + 1]
        checked["read"] += len(complete)
        if parse_result(complete.decode("utf-8", "replace")) is not None:
            checked["alive"], checked["at"] = False, float("inf")  # for good
            return True
        return False

    def head_alive() -> bool:
        """Until the head agent's result line (the pod itself stays up after it), and while its pod runs."""
        if head_agent_ended():
            return False
        if time.monotonic() - checked["at"] > 3:
            checked["at"] = time.monotonic()
            try:
                checked["alive"] = client.get_pod(head["id"])["status"] not in ENDED
            except Exception:  # noqa: BLE001 - unknown is not dead
                pass
        return checked["alive"]

    def describe() -> list[str]:
        hours = (time.monotonic() - created) / 3600
        # the pods' billed cost (pods.billed, which apply put in the plan), else the catalog's
        hourly = plan.budget.price_per_hour or (fit["price"] * plan.nodes if fit.get("price") else None)
        price = f", about ${hourly * hours:.2f} so far" if hourly else ""
        lines = [f"pods: {len(members)} x {fit['count']}x {fit['gpu']} in {head.get('dataCenterId')}{price}"]
        if plan.checkpoint_dir and not plan.checkpoint_shared:
            lines.append(f"checkpoints {plan.checkpoint_dir} are on each pod's own disk")
        return lines

    def close() -> None:
        stop.set()
        if tunnel is not None:
            tunnel.close()

    return Cluster(name=plan.name, cluster_id=head["id"], dashboard=dashboard, token=token, head_alive=head_alive,
                   node_logs=[str(logs / f"node-{rank}.log") for rank in range(len(members))], describe=describe,
                   tend=tunnel.tend if tunnel else (lambda: []), close=close,
                   price_per_hour=plan.budget.price_per_hour)  # the pods' cost (pods.billed), else the catalog's
