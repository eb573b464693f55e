"""The launcher is the one follower: what it shows of the node agents' logs, and how it reads
the head agent's result line, the same for every provider (no cluster needed: the logs are
files, as the local, Slurm and RunPod providers keep them)."""

from __future__ import annotations

import io
import json

import pytest

from rlhf_tasks.errors import HeadLost, StepFailed
from rlhf_tasks.follow import HeadEnded, LogTail, _watching, final_status_from_head, follow_head_log
from rlhf_tasks.outcome import Outcome, summarise, verdict
from rlhf_tasks.providers import Cluster, get
from rlhf_tasks.spec import parse_task

RESULT = "RLHF_TASKS_RESULT "


def plan_of(**job):
    task = parse_task({"name": "t", "nodes": 2, "preflight": "off", "wait": {"head": "1m", "nodes": "1m"},
                       "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}, **job}})
    return get("dstack").plan(task)


def result_line(**result) -> str:
    return RESULT + json.dumps(result) + "\n"


def test_every_line_once_no_result_line_and_nothing_after_it(tmp_path):
    head, worker = tmp_path / "node-0.log", tmp_path / "node-1.log"
    head.write_text("[10:00:00] node0: Ray head up\nstep 1\nstep")  # the last line is not complete yet
    worker.write_text("[10:00:01] node1: joined\n")
    out = io.StringIO()
    tail = LogTail([str(head), str(worker)], out=out)
    tail.pump()
    tail.pump()
    with open(head, "a") as handle:
        handle.write(" 2\n" + result_line(exit_code=None, job={"status": "SUCCEEDED"})
                     + "[10:00:09] node0: the cluster stays up until `rlhf-tasks down t`\n")
    tail.pump()
    tail.pump()
    shown = out.getvalue()
    assert shown.count("step 1\n") == 1 and "step 2\n" in shown and shown.count("joined") == 1
    assert RESULT not in shown and "stays up" not in shown  # the line ends the head's log for us


def quiet(tmp_path) -> LogTail:
    """The follower's tail of the head's log, showing nothing here."""
    return LogTail([str(tmp_path / "node-0.log")], out=io.StringIO())


def cluster_on(tmp_path, alive, **extra) -> Cluster:
    return Cluster(name="t", cluster_id="c1", token=None, head_alive=alive,
                   node_logs=[str(tmp_path / "node-0.log"), str(tmp_path / "node-1.log")], **extra)


def test_the_head_log_gives_the_outcome_with_attempts_steps_and_nodes(tmp_path, capsys):
    attempts = [{"submission_id": "t-c1", "status": "FAILED", "cause": "node 10.0.0.3 left the cluster"},
                {"submission_id": "t-c1-r1", "status": "SUCCEEDED", "cause": None}]
    (tmp_path / "node-0.log").write_text("job output\n" + result_line(
        exit_code=0, rank=0, steps=[{"step": "job", "seconds": 12.4}], node_ids=["a", "b"],
        job={"submission_id": "t-c1-r1", "status": "SUCCEEDED", "attempts": attempts}))
    plan = plan_of(max_restarts=1)
    outcome = follow_head_log(cluster_on(tmp_path, lambda: False, describe=lambda: ["pods: 2 in EU-RO-1"]), plan,
                              LogTail([str(tmp_path / "node-0.log")]))
    assert (outcome.submission_id, outcome.status, outcome.node_ids) == ("t-c1-r1", "SUCCEEDED", {"a", "b"})
    assert verdict(plan, outcome, True) == 0
    summarise(plan, outcome, 0.0, cluster_on(tmp_path, lambda: False, describe=lambda: ["pods: 2 in EU-RO-1"]))
    out = capsys.readouterr().out
    assert out.count("job output") == 1 and "job t-c1-r1: SUCCEEDED" in out and "attempts: 2 (" in out
    assert "head steps: job 12s" in out and "pods: 2 in EU-RO-1" in out and f"node logs: {tmp_path}" in out


def test_a_failed_job_names_its_last_line_and_fails_the_launch(tmp_path, capsys):
    log = "Traceback (most recent call last):\nAssertionError: 2 nodes\n2026-11-22 13:42:19,891\tINFO -- shutting down\n"
    (tmp_path / "node-0.log").write_text(log + result_line(
        exit_code=1, error="running job t-c1 failed: it ended FAILED", failed_step="running job t-c1",
        job={"submission_id": "t-c1", "status": "FAILED"}, job_log_tail=log))
    plan = plan_of()
    outcome = follow_head_log(cluster_on(tmp_path, lambda: False), plan, quiet(tmp_path))
    summarise(plan, outcome, 0.0)
    assert "the job's last line: AssertionError: 2 nodes" in capsys.readouterr().out
    with pytest.raises(StepFailed, match="running job t-c1: it ended FAILED"):
        verdict(plan, outcome, True)


def test_a_step_the_head_failed_before_the_job_is_named(tmp_path):
    (tmp_path / "node-0.log").write_text(result_line(
        exit_code=1, error="preflight (pairs) failed: node 2 unreachable", failed_step="preflight (pairs)", job=None))
    plan = plan_of()
    outcome = follow_head_log(cluster_on(tmp_path, lambda: False), plan, quiet(tmp_path))
    with pytest.raises(StepFailed, match=r"^preflight \(pairs\): node 2 unreachable \(the head's log is above\)$"):
        verdict(plan, outcome, True)


def test_a_result_line_ends_the_wait_while_the_heads_process_is_still_up(tmp_path):
    """A job of a second: the head said how it ended while its provider still calls it alive (dstack's run ends
    tens of seconds after its jobs): the wait for the dashboard or the nodes ends at that line, not there."""
    (tmp_path / "node-0.log").write_text("[10:00:00] node0: Ray head up\n" + result_line(
        job={"submission_id": "t-c1", "status": "SUCCEEDED"}, steps=[]))
    checks = []
    wrapped = _watching(cluster_on(tmp_path, lambda: True), quiet(tmp_path), lambda: checks.append(1) or (False, "no"))
    with pytest.raises(HeadEnded) as ended:
        wrapped()
    assert ended.value.result["job"]["status"] == "SUCCEEDED" and not checks


def test_the_jobs_end_state_is_the_heads_line_once_it_is_written_not_once_its_process_is_gone(tmp_path):
    (tmp_path / "node-0.log").write_text(result_line(job={"submission_id": "t-c1", "status": "FAILED"},
                                                     job_log_chars=5, job_log_tail="boom\n"))
    assert final_status_from_head(cluster_on(tmp_path, lambda: True), shown=1, timeout_s=1) == ("FAILED", "oom\n")


def test_a_head_without_its_line_yet_is_waited_for(tmp_path):
    (tmp_path / "node-0.log").write_text("[10:00:00] node0: Ray head up\n" + result_line(
        failed_step="preflight", error="x")[:-1])  # the line is not complete yet
    assert _watching(cluster_on(tmp_path, lambda: True), quiet(tmp_path), lambda: (False, "no"))() == (False, "no")


def test_a_head_gone_without_its_line_is_a_lost_head_with_the_providers_word(tmp_path):
    (tmp_path / "node-0.log").write_text("[10:00:00] node0: Ray head up\n")
    with pytest.raises(HeadLost, match="Slurm job 7 NODE_FAIL with exit code 0"):
        follow_head_log(cluster_on(tmp_path, lambda: False, describe=lambda: ["Slurm job 7 NODE_FAIL with exit code 0"]),
                        plan_of(), quiet(tmp_path))


def test_a_head_gone_after_its_provider_said_the_job_failed_is_that_failure_not_a_lost_head(tmp_path):
    """SkyPilot ended the job (a node's `run` failed: `sky logs` exited FAILED, srun killed the head's step) before
    the head said a word: the headline is the job's failure as the provider says it, not "the head's process
    exited" (a lost head, which a relaunch would retry), both while waiting for the cluster and following."""
    (tmp_path / "node-0.log").write_text("[10:00:00] node0: Ray head up\n")
    word = "SkyPilot: the job on t ended FAILED (sky queue t)"
    for wait in (lambda c: _watching(c, quiet(tmp_path), lambda: (False, "no"))(),
                 lambda c: follow_head_log(c, plan_of(), quiet(tmp_path))):
        with pytest.raises(StepFailed, match=r"^running the job: SkyPilot: the job on t ended FAILED") as failed:
            wait(cluster_on(tmp_path, lambda: False, job_ended=lambda: word))
        assert not isinstance(failed.value, HeadLost) and "process exited" not in str(failed.value)


def test_every_node_mode_fails_with_the_commands_exit_code(tmp_path):
    (tmp_path / "node-0.log").write_text(result_line(exit_code=3, job={"status": "FAILED", "exit_code": 3}))
    plan = get("dstack").plan(parse_task({"name": "t", "nodes": 2, "job": {"recipe": "torchrun", "args": {
        "script": "train.py"}}}))
    outcome = follow_head_log(cluster_on(tmp_path, lambda: False), plan, quiet(tmp_path))
    assert outcome == Outcome(None, "FAILED", exit_code=3)
    with pytest.raises(StepFailed, match="running the job: exit code 3"):
        verdict(plan, outcome, True)


def test_a_stopped_job_is_said_stopped_not_that_it_had_nothing_to_train(tmp_path, capsys):
    """`rlhf-tasks stop JOB` before the job's first metrics row: the summary says STOPPED, and
    not that the checkpoint was already at its last step (issue 20, item 7)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 476, "mean_reward": 0.9, "world_size": 2, "node_ids": ["x", "y"]}) + "\n")
    plan = plan_of()
    plan = plan.replace(job=plan.job.model_copy(update={"summary": {"metrics": str(metrics)}}))
    (tmp_path / "node-0.log").write_text(result_line(
        exit_code=1, error="running job t-c1 failed: it ended STOPPED", failed_step="running job t-c1",
        node_ids=["p", "q"], job={"submission_id": "t-c1", "status": "STOPPED"}))
    outcome = follow_head_log(cluster_on(tmp_path, lambda: False), plan, quiet(tmp_path))
    summarise(plan, outcome, 0.0)
    out = capsys.readouterr().out
    assert "job t-c1: STOPPED" in out and "stopped before it finished, by `rlhf-tasks stop`" in out
    assert "trained nothing" not in out and "already at step" not in out
    assert "no metrics row before it ended STOPPED (the file's last row, step 476, is an earlier run's)" in out
    with pytest.raises(StepFailed, match="running job t-c1: it was STOPPED before it finished"):
        verdict(plan, outcome, True)


def test_a_job_cut_short_by_its_cluster_stopping_is_not_said_never_to_have_run(tmp_path, capsys):
    """`rlhf-tasks down` (or the provider) stops the cluster under a running job: the head's
    result line names the job with no end state; the summary says it was cut short, and why."""
    (tmp_path / "node-0.log").write_text(result_line(
        exit_code=143, error="stopped by signal 15", job={"submission_id": "t-c1", "status": None, "attempts": []}))
    plan = plan_of()
    outcome = follow_head_log(cluster_on(tmp_path, lambda: False), plan, quiet(tmp_path))
    summarise(plan, outcome, 0.0)
    out = capsys.readouterr().out
    assert "job t-c1: cut short, with no end state in " in out and "s wall time (stopped by signal 15)" in out
    assert "not run" not in out



def test_a_head_ended_while_it_waits_to_restart_the_job_is_cut_short_with_its_cause(rlhf_home, monkeypatch, capsys):
    """Through the dashboard (dstack): the head stopped the job because a node left and waits for a machine to take its
    place; the provider ends the run meanwhile (dstack fails the lost machine's job `instance_unreachable` and ends
    the head's): the dashboard's forward resets while `dstack apply` still runs, then the head's process is gone, its
    result line that of a signal (130). The outcome is no end state, with the head's cause and the provider's word,
    not the dashboard's error nor "STOPPED by rlhf-tasks stop" (tests/test_dstack_cluster.py, against dstack)."""
    import rlhf_tasks.jobs
    from rlhf_tasks.follow import follow_dashboard

    class Jobs:
        def __init__(self, *args):
            pass

        def follow(self, sid, *args, **kwargs):
            return "FAILED"

        def status(self, sid):
            raise StepFailed(f"asking for job {sid} through the Ray Jobs API", "[Errno 104] Connection reset by peer")

    monkeypatch.setattr(rlhf_tasks.jobs, "Jobs", Jobs)
    alive = [True, True, True, True, False]  # the result line is there before the head's process has ended
    log = ("[10:00:05] node0: restarting the job, attempt 1 of 2: node 10.0.0.3 left the cluster and the job FAILED "
           "(job t-c1)\n[10:00:08] node0: interrupted\n"
           + result_line(exit_code=130, error="interrupted", job={"submission_id": "t-c1", "status": "FAILED"}))
    cluster = Cluster(name="t", cluster_id="c1", token=None, dashboard="http://127.0.0.1:9",
                      head_alive=lambda: alive.pop(0) if len(alive) > 1 else alive[0], head_log=lambda: log,
                      describe=lambda: ["dstack: the run t failed (job failed); node1 (10.0.0.3) failed: instance "
                                        "unreachable"])
    plan = plan_of(submit="head", max_restarts=2)
    outcome = follow_dashboard(cluster, plan, LogTail([], out=io.StringIO()), "t-c1", set())
    assert (outcome.status, outcome.submission_id) == (None, "t-c1")
    summarise(plan, outcome, 0.0, cluster)
    out = capsys.readouterr().out
    assert "job t-c1: cut short, with no end state" in out and "node 10.0.0.3 left the cluster" in out, out
    assert "node1 (10.0.0.3) failed: instance unreachable" in out and "Connection reset" not in out, out
    with pytest.raises(StepFailed, match="the head was ended while it waited for its nodes to restart the job after: "
                                         "node 10.0.0.3 left the cluster"):
        verdict(plan, outcome, False)
