"""Jobs client pieces that need no cluster: the upload size check uses Ray's own
traversal and exclude rules, before anything is uploaded."""

from __future__ import annotations

import pytest

from rlhf_tasks.errors import BadInput
from rlhf_tasks.jobs import check_working_dir, working_dir_size
from rlhf_tasks.workdir import upload_limit
from rlhf_tasks.plan import DEFAULT_EXCLUDES


def sparse(path, size):
    with open(path, "wb") as handle:  # no disk used: the size is what Ray would read
        handle.truncate(size)


def test_too_large_working_dir_is_refused_before_upload(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    sparse(tmp_path / "dataset.jsonl", upload_limit() + 1)
    with pytest.raises(BadInput, match="job.working_dir.*upload limit"):
        check_working_dir(str(tmp_path), DEFAULT_EXCLUDES)


def test_excludes_keep_weights_checkpoints_and_git_out(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    for name in ("model.safetensors", "pytorch_model.bin", "runs/x/log.txt", "checkpoints/step_1.pt", ".git/objects/a"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        sparse(tmp_path / name, upload_limit() + 1)
    assert working_dir_size(str(tmp_path), DEFAULT_EXCLUDES) == len("print(1)\n")
    assert check_working_dir(str(tmp_path), DEFAULT_EXCLUDES) == len("print(1)\n")


def test_gitignore_is_honoured_like_ray_does(tmp_path):
    (tmp_path / ".gitignore").write_text("big/\n")
    (tmp_path / "big").mkdir()
    sparse(tmp_path / "big" / "blob", upload_limit() + 1)
    (tmp_path / "a.py").write_text("x")
    assert working_dir_size(str(tmp_path), []) == 1 + len("big/\n")


def test_missing_working_dir_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="job.working_dir"):
        check_working_dir(str(tmp_path / "nope"), [])


def test_final_status_and_unseen_log_come_from_the_head_agents_result_line():
    """The launcher reads the head agent's one structured result line, not its prose."""
    from rlhf_tasks.follow import final_status_from_head
    from rlhf_tasks.agent.protocol import result_line
    from rlhf_tasks.providers import Cluster

    job_log = "step 1\nstep 2\ndone: nothing to do\n"
    result = {"exit_code": 0, "job": {"submission_id": "t-1", "status": "SUCCEEDED"},
              "job_log_chars": len(job_log), "job_log_tail": job_log}
    head_log = ("[01:00:00] node0: cluster ready: 3/3 nodes alive\n" + job_log
                + "[01:00:09] node0: job t-1 SUCCEEDED after 8.0s (reworded freely)\n" + result_line(result) + "\n")
    gone = Cluster(name="t", cluster_id="1", dashboard="", token=None, head_alive=lambda: False,
                   head_log=lambda: head_log)
    assert final_status_from_head(gone, len("step 1\n")) == ("SUCCEEDED", "step 2\ndone: nothing to do\n")
    assert final_status_from_head(gone, 0) == ("SUCCEEDED", job_log)
    assert final_status_from_head(gone, len(job_log)) == ("SUCCEEDED", "")
    long = dict(result, job_log_chars=len(job_log) + 100)  # more was printed than the line repeats
    gone.head_log = lambda: result_line(long)
    status, rest = final_status_from_head(gone, 0)
    assert status == "SUCCEEDED" and rest.startswith("[... 100 characters") and rest.endswith(job_log)
    gone.head_log = lambda: "[01:00:00] node0: ERROR: the head never got to run the job\n"
    assert final_status_from_head(gone, 0) is None  # the head never said
