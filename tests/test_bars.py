"""OpenRLHF's torchrun trainers' tqdm bars as the launcher follows them (issue 47, item 7): the
bars are drawn by the real tqdm in a process of their own, in the order each release's
`sft_trainer.py` drives them (read from the release's wheel), into a log file as the node agent
keeps one (stdout and stderr together); the launcher's follower (follow.LogTail) and its reader
of the training (progress.Training with the recipe's reader) read that file."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest

import frameworks
from conftest import need
from rlhf_tasks.follow import LogTail
from rlhf_tasks.progress import Training, last_step
from rlhf_tasks.recipes.torchrun import TorchrunJob

#: The lines of `fit` in each release's openrlhf/trainer/sft_trainer.py that set the step bar's
#: postfix and update it, in the order they run.
SFT_ORDER = {"0.9.10": [(179, "step_bar.set_postfix(logs_dict)"), (180, "step_bar.update()")],
             "0.11.2": [(161, "step_bar.update()"), (205, "step_bar.set_postfix(logs_dict)")]}

#: The trainer's bars: `Train epoch` over the epochs and, nested under it (tqdm position 1 and
#: on, never closed), `Train step of epoch E` over one epoch's batches (sft_trainer.py fit). tqdm's
#: default mininterval (0.1 s) lets every redraw of a step that takes seconds through; these steps
#: take microseconds, so it is 0 here. PRINT: a line printed right after the step (DeepSpeed's, as
#: a checkpoint is saved in save_logs_and_checkpoints). STEPWISE: each step waits for a line on
#: stdin and says it is done on the file descriptor DONE_FD (the epoch's end waits for one more).
TRAINER = textwrap.dedent("""
    import functools, os, sys
    import tqdm as _tqdm
    tqdm = functools.partial(_tqdm.tqdm, mininterval=0)
    order, epochs, steps, prints, stepwise = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", \\
        sys.argv[5] == "1"
    epoch_bar = tqdm(range(epochs), desc="Train epoch")
    for epoch in range(epochs):
        step_bar = tqdm(range(steps), desc="Train step of epoch %d" % epoch)
        for i in range(steps):
            if stepwise:
                sys.stdin.readline()
            logs_dict = {"gpt_loss": 2.0 - 0.1 * (epoch * steps + i), "lr": 1e-05, "grad_norm": 1.0}
            if order == "postfix_first":
                step_bar.set_postfix(logs_dict)
                step_bar.update()
            else:
                step_bar.update()
                step_bar.set_postfix(logs_dict)
            if prints:
                print("[INFO] [engine.py:3536:_save_checkpoint] Saving model checkpoint: /ckpt/global_step%d"
                      % (epoch * steps + i + 1), flush=True)
            if stepwise:
                os.write(int(os.environ["DONE_FD"]), b"done\\n")
        if stepwise:
            sys.stdin.readline()
        epoch_bar.update()
""")


def loss_of(step: int, steps: int = 3) -> float:
    return 2.0 - 0.1 * (step - 1)


def release_order(version: str) -> str:
    """The order of the release's own sft_trainer.py: postfix_first or update_first."""
    source, why = frameworks.wheel_source("openrlhf", version, "openrlhf/trainer/sft_trainer.py")
    need(source is not None, f"openrlhf {version}: {why}")
    lines = source.splitlines()
    for number, text in SFT_ORDER[version]:
        assert lines[number - 1].strip() == text, (version, number, lines[number - 1])
    return "postfix_first" if "set_postfix" in SFT_ORDER[version][0][1] else "update_first"


def sft_reader():
    return TorchrunJob.model_validate({"recipe": "torchrun", "args": {"module": "openrlhf.cli.train_sft"}}).metrics_reader()


def run_trainer(tmp_path, order: str, epochs: int, steps: int, prints: bool):
    log = tmp_path / "node-0.log"
    with open(log, "wb") as out:
        subprocess.run([sys.executable, "-c", TRAINER, order, str(epochs), str(steps), "1" if prints else "0", "0"],
                       stdout=out, stderr=subprocess.STDOUT, check=True, timeout=60)
    return log


@pytest.mark.parametrize("prints", [False, True], ids=["bars", "a print after each step"])
@pytest.mark.parametrize("version", ["0.9.10", "0.11.2"])
def test_each_step_is_read_with_its_own_loss_in_the_releases_order(tmp_path, version, prints):
    """0.9.10 sets the postfix before update() (sft_trainer.py lines 179-180), 0.11.2 after (lines
    161, 205): the same reader reads both, every step with its own loss; a line printed right after
    a nested bar's redraw lands on the bar's line (after its cursor-up) and costs no step."""
    order = release_order(version)
    log = run_trainer(tmp_path, order, epochs=2, steps=3, prints=prints)
    if prints:
        assert b"]\x1b[A[INFO] [engine.py" in log.read_bytes()  # the print on the bar's line
    view = Training(sft_reader(), io.StringIO(), tmp_path / "run", terminal=False)
    tail = LogTail([str(log)], out=view)
    tail.pump()
    view.close()
    steps = view.steps
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert {s: round(steps[s]["loss"], 6) for s in steps} == {s: round(loss_of(s), 6) for s in steps}
    assert steps[6]["total"] == 6
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 6


@pytest.mark.parametrize("version", ["0.9.10", "0.11.2"])
def test_status_shows_the_step_the_bar_shows_now(tmp_path, version):
    """The newest redraw of a nested bar ends in no newline (tqdm moves the cursor back up after it):
    the follower shows it and reads it as soon as it is written, so `status` (runs/NAME/metrics.jsonl)
    is at the step the bar shows, not one behind."""
    order = release_order(version)
    log = tmp_path / "node-0.log"
    done_read, done_write = os.pipe()
    shown = io.StringIO()
    run_dir = tmp_path / "run"
    view = Training(sft_reader(), shown, run_dir, terminal=False)
    tail = LogTail([str(log)], out=view)
    with open(log, "wb") as out:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, order, "1", "4", "0", "1"], stdin=subprocess.PIPE,
                                   stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "DONE_FD": str(done_write)},
                                   pass_fds=(done_write,))
    os.close(done_write)
    try:
        with os.fdopen(done_read, "rb") as done:
            for step in range(1, 5):
                trainer.stdin.write(b"go\n")
                trainer.stdin.flush()
                assert done.readline() == b"done\n"  # the step's redraws are in the log
                tail.pump()
                newest = log.read_bytes().rsplit(b"\r", 1)[-1]
                assert not newest.endswith(b"\n") and f"{step}/4".encode() in newest  # the bar's newest redraw
                assert shown.getvalue().endswith(newest.decode())  # shown as it stands
                said = last_step(run_dir)
                assert said is not None and said["step"] == step, (step, said)
                assert round(said["loss"], 6) == round(loss_of(step), 6)
        trainer.stdin.close()
        assert trainer.wait(timeout=30) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    tail.pump()
    view.close()
    assert sorted(view.steps) == [1, 2, 3, 4]
