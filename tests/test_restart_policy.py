"""The job runner's restart policy, a pure function: every branch, with the messages the
head fails with (the namespace-host tests in test_node_loss.py drive it end to end)."""

from __future__ import annotations

from rlhf_tasks.agent.jobrunner import FAST_FAILURE_S, Restart, restart_policy

SID = "tiny-grpo-abc-r1"


def bug(line: str = "ValueError: boom") -> Restart:
    return Restart("the job FAILED", bug=True, fingerprint=line)


def decide(previous, cause, seconds=10.0, before=1.0, after=1.0, max_restarts=3):
    return restart_policy(previous, cause, seconds, before, after, max_restarts, SID)


def test_an_attempt_without_a_cause_is_not_restarted():
    verdict = decide([], None)
    assert verdict == (False, None, None)


def test_no_restarts_left_gives_up_naming_the_setting():
    verdict = decide([{}, {}], Restart("node 10.0.0.2 left the cluster"), max_restarts=2)
    assert not verdict.restart
    assert verdict.reason == "node 10.0.0.2 left the cluster; no restarts left (job.max_restarts is 2)"
    assert not decide([], bug(), max_restarts=0).restart  # max_restarts 0: the first failure is final


def test_the_same_fast_failure_twice_without_a_new_checkpoint_is_a_bug():
    verdict = decide([{"fingerprint": "ValueError: boom"}], bug(), seconds=FAST_FAILURE_S - 1)
    assert not verdict.restart
    assert verdict.reason == ("it failed the same way twice in a row within %.0fs, with no new checkpoint between: a "
                              "bug, not a fault, so it is not restarted (last: the job FAILED (job %s))"
                              % (FAST_FAILURE_S, SID))


def test_the_same_failure_after_a_new_checkpoint_is_restarted():
    verdict = decide([{"fingerprint": "ValueError: boom"}], bug(), before=1.0, after=2.0)
    assert verdict.restart and verdict.reason == "the job FAILED (job %s)" % SID
    assert verdict.fingerprint == "ValueError: boom"  # fast: the next attempt compares with it


def test_a_different_failure_is_restarted():
    assert decide([{"fingerprint": "ValueError: boom"}], bug("OSError: disk full")).restart


def test_a_slow_failure_is_restarted_and_leaves_no_fingerprint():
    verdict = decide([{"fingerprint": "ValueError: boom"}], bug(), seconds=FAST_FAILURE_S + 1)
    assert verdict.restart and verdict.fingerprint is None
    # ... so the same fast failure after it is restarted once more
    assert decide([{"fingerprint": None}], bug()).restart


def test_the_first_failure_is_restarted():
    verdict = decide([], bug())
    assert verdict.restart and verdict.fingerprint == "ValueError: boom"


def test_a_lost_node_is_restarted_even_right_after_the_same_one():
    lost = Restart("node 10.0.0.2 left the cluster and the job FAILED")
    verdict = decide([{"fingerprint": None}], lost, seconds=5.0)
    assert verdict.restart and verdict.reason == "node 10.0.0.2 left the cluster and the job FAILED (job %s)" % SID
    assert verdict.fingerprint is None


def test_a_stall_is_restarted():
    stall = Restart("its log has not grown for 600s (job.stall_timeout)")
    assert decide([{"fingerprint": None}], stall, seconds=700.0).restart


def test_the_spend_record_the_head_rewrites_is_no_new_checkpoint(tmp_path):
    """The head rewrites the training's spend record in the checkpoint directory every few seconds
    (agent/budget.py): that is no new checkpoint, or a job failing the same way twice would look like
    progress and be restarted to its last restart (the full run's test_node_loss failure); a real
    checkpoint file still moves the mark."""
    import os

    from rlhf_tasks.agent.jobrunner import checkpoint_mark
    from rlhf_tasks.agent.protocol import CACHE_DIR
    from rlhf_tasks.agent.protocol.spend import SPEND_FILE, write_spend

    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "model.pt").write_text("weights")
    old = os.path.getmtime(tmp_path / "step_1" / "model.pt") - 100
    for path in (tmp_path, tmp_path / "step_1", tmp_path / "step_1" / "model.pt"):
        os.utime(path, (old, old))
    before = checkpoint_mark(str(tmp_path))
    write_spend(str(tmp_path / SPEND_FILE), {"version": 1, "training": "t", "attempts": {}})
    assert checkpoint_mark(str(tmp_path)) == before
    # nor the models' cache there (agent/hub.py), which a relaunch's fetch writes into
    (tmp_path / CACHE_DIR / "huggingface" / "hub").mkdir(parents=True)
    (tmp_path / CACHE_DIR / "huggingface" / "hub" / "fetched").write_text("done")
    assert checkpoint_mark(str(tmp_path)) == before
    (tmp_path / "step_2.pt").write_text("weights")
    assert checkpoint_mark(str(tmp_path)) > before
