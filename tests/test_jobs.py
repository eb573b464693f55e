"""Jobs client pieces that need no cluster: the upload size check uses Ray's own
traversal and exclude rules, before anything is uploaded."""

from __future__ import annotations

import pytest

from rlhf_tasks.errors import BadInput
from rlhf_tasks.jobs import check_working_dir, upload_limit, working_dir_size
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


def test_final_status_and_unseen_log_come_from_the_head_agents_log():
    from rlhf_tasks.launch import final_status_from_head
    from rlhf_tasks.providers import Cluster

    head_log = ("[01:00:00] node0: cluster ready: 3/3 nodes alive\n"
                "[01:00:01] node0: submitting job t-1: python3 train.py\n"
                "step 1\nstep 2\ndone: nothing to do\n"
                "[01:00:09] node0: job t-1 SUCCEEDED after 8.0s\n"
                "[01:00:10] node0: stopped the processes this agent started\n")
    gone = Cluster(name="t", cluster_id="1", dashboard="", token=None, head_alive=lambda: False,
                   head_log=lambda: head_log)
    assert final_status_from_head(gone, "t-1", "step 1\n") == ("SUCCEEDED", "step 2\ndone: nothing to do\n")
    assert final_status_from_head(gone, "t-1", "") == ("SUCCEEDED", "step 1\nstep 2\ndone: nothing to do\n")
    assert final_status_from_head(gone, "t-2", "") is None  # the head never said
