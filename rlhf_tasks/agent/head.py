"""The head's bring-up (rank 0): prepare, `ray start --head`, the ready beacon once its GCS
serves, submitting preflight and the gated job while the workers join, the services,
waiting for every node, following preflight; then the job runner takes over (or the head
supervises Ray for a client's submission). At the end: the result, and a teardown that
lets the workers leave first. HeadPreflight is the head's side of the preflight job.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from .beacon import ReadyBeacon, reachable
from .budget import SPEND_FILE, Watch, machine_price
from .early import head_checks, node_probe
from .forensics import keeper, on_failure
from .hub import fetch_models, online
from .jobrunner import JobRunner
from .protocol import (CACHE_DIR, TERMINAL_JOB_STATES, AgentError, DashboardJobs, alive_nodes, cluster_check,
                       follow_preflight, groups_check, http_check, log, preflight_argv, preflight_report,
                       preflight_submission_id, probe_tcp, result_line, wait_for)
from .raynode import Node, package_root

#: How long a head that ends on its own waits for the workers to leave (they look at its
#: beacon every second, and leave when it says "done") before it stops its own Ray.
WORKER_LEAVE_S = 20.0
JOB_LOG_TAIL_CHARS = 64 * 1024  # how much of the job's log the result line repeats


def move_aside(directory, stamp):
    # type: (str, str) -> Optional[str]
    """`launch --fresh`: the old checkpoints moved aside, never deleted, before prepare, so that
    nothing resumes from them: the directory renamed to DIR.old-STAMP, or, where it cannot be (a
    mount point: a volume, a claim), its contents moved into DIR/.old-STAMP, a name no recipe
    resumes from. Once per launch (STAMP is the launch's): a relaunch of the same launch keeps
    what the fresh run made. Where they went; None when nothing was moved."""
    directory = directory.rstrip("/") or directory
    beside, inside = "%s.old-%s" % (directory, stamp), os.path.join(directory, ".old-%s" % stamp)
    if os.path.lexists(beside) or os.path.lexists(inside):
        log("fresh start: this launch moved the old checkpoints aside already (%s): %s is the fresh run's"
            % (beside if os.path.lexists(beside) else inside, directory))
        return None
    try:  # the training's spend record is no checkpoint (the fresh training's own may be there already), nor
        # are the fetched models and compiled kernels (.cache: Provider.cache_dir)
        entries = [entry for entry in os.listdir(directory) if entry not in (SPEND_FILE, CACHE_DIR)]
    except OSError:
        entries = []
    if not entries:
        log("fresh start: no old checkpoints in %s" % directory)
        return None
    moved = None
    if not os.path.lexists(os.path.join(directory, CACHE_DIR)):  # the caches stay where the nodes read them
        try:
            os.rename(directory, beside)
            moved = beside
        except OSError:  # a mount point (EBUSY, EXDEV): its contents go aside inside it
            pass
    if moved is None:
        os.mkdir(inside)
        for entry in entries:
            os.rename(os.path.join(directory, entry), os.path.join(inside, entry))
        moved = inside
    log("fresh start: moved the old checkpoints aside, nothing deleted: %s -> %s" % (directory, moved))
    return moved


class HeadFlow(object):
    """Rank 0: prepare, start the head and its services, wait for every node, then hand the
    job to the job runner (or keep the cluster up for a client's submission)."""

    def __init__(self, node: Node):
        self.node, self.plan, self.info = node, node.plan, node.info
        self.beacon = None  # type: Optional[ReadyBeacon]
        self.runner = None  # type: Optional[JobRunner]
        self.forensics = None  # type: Optional[dict]  (a failure's first errors and bundle: forensics.py)
        self.preflight_result = None  # type: Optional[dict]
        self.preflight_at = None  # type: Optional[str]  (when preflight's result came)
        self.probe = self.early = None  # this node's own probe and the checks the head runs as nodes announce themselves
        self.started_ms = int(time.time() * 1000)
        budget = self.plan.get("budget") or {}
        if budget.get("machine_price"):  # what the provider bills this machine, read now that it runs
            price, said = machine_price(budget, int(self.plan["nodes"]))
            log(said)
            self.plan["budget"] = dict(budget, price_per_hour=price)
        # The budget and idle watch, from the head's start: it holds with no launcher attached.
        self.watch = Watch(self.plan, lambda: DashboardJobs(node.dashboard, node.token).jobs(),
                           kept=bool(self.plan.get("keep_cluster")), client=self.plan["job"]["submit"] == "client")
        self.watch.stop_job = lambda sid: DashboardJobs(node.dashboard, node.token).stop(sid)
        self.watch.start()

    def run(self) -> int:
        node, plan = self.node, self.plan
        fetch_models(node)  # before anything of Ray: a model the hub does not know ends the head here
        node.prestart_ray()
        self.probe = node_probe(node)
        if self.probe is not None:
            self.early = head_checks(node, self.probe)
        if plan.get("fresh") and plan.get("checkpoint_dir"):
            move_aside(plan["checkpoint_dir"], plan["fresh"])
        if plan["prepare"]:
            node.run_commands("prepare", plan["prepare"], online(node.env, plan))
        started = time.monotonic()
        with node.step("ray head"):
            node.start_ray(head=True)
            gcs = (self.info.node_addr, plan["ray"]["port"])
            # Local probes of a few ms each: poll flat and fast, every tenth of a second counts here.
            wait_for("the Ray head's GCS on %s:%s" % gcs, node.ray_alive(reachable(probe_tcp, *gcs)), 180,
                     interval=0.1, max_interval=0.2)
            self.beacon = ReadyBeacon(self.info.node_addr, plan["ray"]["ready_port"],  # the workers join now
                                      on_hello=self.early.add if self.early is not None else None)
            log("Ray head's GCS up in %.1fs: the workers may join" % (time.monotonic() - started))
            wait_for("the Ray dashboard at %s" % node.dashboard,
                     node.ray_alive(lambda: http_check(node.dashboard + "/api/gcs_healthz")), 180,
                     interval=0.1, max_interval=0.2)
        where = "" if node.dashboard.startswith("http://127.0.0.1") and self.info.node_addr.startswith("127.") \
            else " (reach it through the provider's port forward)" if "127.0.0.1" in node.dashboard else ""
        log("Ray head up in %.1fs; dashboard %s%s" % (time.monotonic() - started, node.dashboard, where))
        return self.serve(started)

    def serve(self, started: float) -> int:
        """Once the head's Ray is up (`started`: when its bring-up began): preflight and the
        gated job submitted, the services, every node, preflight followed, then the job."""
        node, plan = self.node, self.plan
        # What waits for the nodes is submitted now, so that its start-up overlaps their joining:
        # the job behind a gate that runs preflight (it waits for the nodes itself) and opens once
        # the head saw preflight pass; preflight as a job of its own when no gated job carries it.
        jobs = DashboardJobs(node.dashboard, node.token)
        self.runner = runner = JobRunner(node, jobs, self.finish, self.watch)
        preflight = HeadPreflight(node, jobs, self.early) if plan["preflight"]["enabled"] else None
        gate = None
        try:
            if plan["job"]["submit"] == "head":
                gate = runner.submit_gated(preflight.argv() if preflight is not None else None)
            if preflight is not None:
                preflight.submit(gate.sid if gate is not None else None)
            node.start_services(("head", "every_node"))
            with node.step("nodes"):
                nodes, groups = plan["nodes"], plan.get("groups")
                if groups:  # each group with all its nodes, by their label and resources: a short one is named
                    check = groups_check(node.dashboard, node.token, groups)
                    what = "%d nodes to join, in groups %s" % (nodes, ", ".join(g["name"] for g in groups))
                else:
                    check = cluster_check(node.dashboard, node.token, nodes, (plan["ray"].get("num_cpus") or 0) * nodes,
                                          (plan["ray"].get("num_gpus") or 0) * nodes)
                    what = "%d nodes to join" % nodes
                have = wait_for(what, node.ray_alive(self.nodes_check(check)), plan["wait"]["nodes_s"],
                                interval=0.05, max_interval=0.05)
            if self.early is not None:  # preflight's driver needs no Ray of its own to know them
                self.early.nodes_alive(check.alive)
            log("cluster ready: %s (%.1fs after the head started)" % (have, time.monotonic() - started))
            keeper(node).tick()  # the head's files where Ray's log API reads them
            if preflight is not None:
                with node.step("preflight"):
                    self.preflight_result = preflight.follow(keep=self.keep_preflight,
                                                             local=gate.result if gate is not None else None)
        except BaseException as exc:
            if gate is not None:
                gate.close(str(exc) if isinstance(exc, AgentError) else "the head agent stopped")
            if preflight is not None:
                preflight.stop()
            raise
        if plan["job"]["submit"] == "head":
            if gate is not None:
                runner.open(gate)  # before anything else: the command waits on this
            return runner.submit_and_follow(gate)
        log("cluster ready for a client submission: forward port %s and run `rlhf-tasks submit`"
            % plan["ray"]["dashboard_port"])
        return self.supervise()

    def nodes_check(self, check):
        """`check` (the dashboard's node list) every 0.25 s; every 0.05 s once every node announced
        itself to the early checks (the last one is starting its Ray then: the job waits on this)."""
        last = {"at": 0.0, "said": (False, "not asked yet")}

        def paced():
            now = time.monotonic()
            if now - last["at"] >= 0.25 or (self.early is not None and self.early.announced()):
                last["at"], last["said"] = now, check()
            return last["said"]
        return paced

    def finish(self) -> None:
        """The job is over: say so in a result line now (the launcher reads it), and keep the
        cluster up when the plan says so. A failed job's logs are gathered first."""
        job = self.runner.job if self.runner else {}
        if job.get("status") != "SUCCEEDED":
            attempts = job.get("attempts") or [{}]
            self.gather_forensics("job %s ended %s%s" % (job.get("submission_id"), job.get("status") or "early", (
                ": %s" % attempts[-1]["cause"]) if attempts[-1].get("cause") else ""))
        if self.plan.get("keep_cluster") and not self.watch.at_cap.is_set():
            print(result_line(dict(self.result(), exit_code=None, rank=0, steps=self.node.steps)), flush=True)
            idle = (self.plan.get("budget") or {}).get("idle_s", 3600.0)
            log("the cluster stays up until `rlhf-tasks down %s`%s" % (self.plan["name"], (
                ", or until it has had no running job for %.0fs (placement.idle)" % idle) if idle else ""))
            self.watch.run_over.set()
            self.supervise()

    def keep_preflight(self, result: dict) -> None:
        """Preflight's result, and when it came: a failure's forensics name the nodes it blames."""
        self.preflight_result, self.preflight_at = result, time.strftime("%H:%M:%S")

    def gather_forensics(self, reason: str) -> None:
        """Once, before anything is torn down: every node's logs in a bundle, each node's first
        error (not for a job someone STOPPED: that is no failure to explain)."""
        if self.watch.at_cap.is_set() or self.watch.ending is not None:
            return  # the cluster ended itself at a cap or idle: no failure to explain
        if self.forensics is None and (self.runner is None or self.runner.job.get("status") != "STOPPED"):
            self.forensics = on_failure(self.node, reason, self.preflight_result, self.started_ms,
                                        self.preflight_at)

    def supervise(self) -> int:
        while self.node.ray.alive():
            time.sleep(1.0)
        raise AgentError("supervising the Ray head", "`ray start` exited with code %s:\n%s"
                         % (self.node.ray.proc.returncode, self.node.ray.tail()))

    def result(self) -> dict:
        runner = self.runner
        out = {"job": (runner.job if runner else None) or None, "node_ids": runner.node_ids if runner else []}
        if runner is not None and runner.follower is not None:
            out["job_log_chars"] = runner.follower.shown
            out["job_log_tail"] = runner.follower.log_text[-JOB_LOG_TAIL_CHARS:]
        if self.forensics is not None:
            out["forensics"] = self.forensics
        if self.watch.report is not None:
            out["budget"] = self.watch.report
        return out

    def stop(self, signalled: bool = False) -> None:
        """Tell the workers the run is over (the beacon answers "done") and let them leave
        before the head's Ray stops, so the head is the last to exit (a scheduler that kills
        the rest when one task fails then kills nothing); when the cluster is being torn down
        (a signal), just close the beacon."""
        self.watch.close()
        if self.early is not None:
            self.early.close()
        if self.probe is not None:
            self.probe.close()
        if self.beacon is None:
            return
        if signalled or self.node.ray is None or not self.node.ray.alive():
            self.beacon.close()
            return
        self.beacon.done()  # the workers leave at their next look (every second), not after a silence

        def workers_gone():
            try:
                left = [n for n in alive_nodes(self.node.dashboard, self.node.token) if not n.get("is_head_node")]
            except (OSError, AgentError):
                return True, 0
            return not left, "%d workers still up" % len(left)
        try:
            wait_for("the workers to leave", workers_gone, WORKER_LEAVE_S, interval=0.5, max_interval=1.0,
                     progress_every=WORKER_LEAVE_S + 1)
        except AgentError:
            log("the workers did not leave within %.0fs; stopping anyway" % WORKER_LEAVE_S)
        self.beacon.close()


class HeadPreflight(object):
    """The head's preflight: run the agent's preflight module across every node (in the job's
    gate, or as a Ray job of its own), print its table, keep its JSON beside the node logs, and
    fail (naming the step) before the job's command starts when a check failed. Low bandwidth
    is a warning.

    It is submitted as soon as the head is up and waits for the nodes itself: its driver
    and its probe on each node start while the others are still joining."""

    def __init__(self, node: Node, jobs: DashboardJobs, early=None):
        self.node, self.jobs, self.early = node, jobs, early  # early: the head's EarlyChecks (early.py)
        self.sid = preflight_submission_id(node.cluster_key())

    def argv(self) -> list:
        """Preflight's command line: it waits for the nodes, then its checks have their deadline."""
        plan = self.node.plan
        argv = preflight_argv(plan["preflight"], plan["nodes"], plan["preflight"]["timeout_s"],
                              wait_nodes=plan["wait"]["nodes_s"], root=package_root())
        return argv + (["--early", self.early.path] if self.early is not None else [])

    def submit(self, gated: Optional[str] = None) -> None:
        """Submit preflight as a Ray job of its own; or, when the gate of job `gated` runs it, follow that job."""
        node, settings = self.node, self.node.plan["preflight"]
        if gated:
            self.sid = gated
        elif self.jobs.status(self.sid) is not None:
            self.sid = "%s-%d" % (self.sid, int(time.time()))
        log("preflight: checking %d nodes (versions, interfaces, %severy pair's bandwidth) %s %s, once they are "
            "ALIVE; deadline %.0fs" % (node.plan["nodes"], "a Gloo all_reduce, " if settings.get("torch", True)
                                       else "", "in the gate of job" if gated else "as Ray job", self.sid,
                                       settings["timeout_s"]))
        if not gated:
            self.jobs.submit(self.sid, self.argv())

    def follow(self, keep=lambda result: None, local: Optional[str] = None) -> dict:
        """Once every node is ALIVE: its checks have `preflight.timeout` from now (`keep(result)`
        before a failure is raised: the failure's forensics name the nodes it blames)."""
        node = self.node
        result = follow_preflight(self.jobs, self.sid, time.time() + node.plan["preflight"]["timeout_s"], log,
                                  interval=0.25 if local else 0.15, local=local)
        keep(result)
        path = os.path.join(node.log_dir, "preflight.json")
        with open(path, "w") as handle:
            json.dump(result, handle, indent=2, sort_keys=True)
        preflight_report(result, log)
        if not result["passed"]:
            failure = result["failures"][0]
            raise AgentError("preflight (%s)" % failure["step"], "%s; the job's command was not started (details: %s)"
                             % (failure["message"], path))
        log("preflight: the result is in %s" % path)
        return result

    def stop(self) -> None:
        try:
            if self.jobs.status(self.sid) not in TERMINAL_JOB_STATES + (None,):
                self.jobs.stop(self.sid)
        except OSError:
            pass
