"""Following the training (rlhf_tasks/progress.py): the log passes once and unchanged, the
progress line stands in place on a terminal and comes as a plain line every few minutes
otherwise, every step goes to runs/NAME/metrics.jsonl, and the summary gives reward and loss
first -> last and best, a curve, and a picture where matplotlib is installed."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from rlhf_tasks.progress import Training, duration, last_step, sparkline, status_line
from rlhf_tasks.recipes.metrics import TinyGrpoReader, VerlReader


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def verl_line(step: int, reward: float, loss: float, step_s: float = 41.0) -> str:
    return (f"(TaskRunner pid=9) step:{step} - actor/pg_loss:{loss} - critic/score/mean:{reward} - "
            f"timing_s/step:{step_s}\n")


def test_the_progress_line_says_what_is_known(tmp_path):
    clock = Clock()
    out = io.StringIO()
    view = Training(VerlReader(), out, tmp_path, price_per_hour=24.0, started=clock.now - 46800, clock=clock,
                    terminal=False)
    view.write("(TaskRunner pid=9) Total training steps: 1005\n")
    assert view.line() is None  # no step yet: nothing to say
    view.write(verl_line(120, 0.43, 0.12))
    assert view.line() == "step 120/1005 · reward 0.43 · loss 0.12 · 41 s/step · 10 h 04 m left · $312 so far"
    view.close()


def test_without_a_step_time_the_pace_is_the_launchers_clock(tmp_path):
    clock = Clock()
    view = Training(TinyGrpoReader(), io.StringIO(), tmp_path, clock=clock, terminal=False)
    view.write("step 1/100  reward 0.100  loss +0.500  0 ms\n")  # a step time of 0: not a pace
    clock.now += 30
    view.write("step 11/100  reward 0.200  loss +0.400  0 ms\n")
    assert view.line() == "step 11/100 · reward 0.2 · loss 0.4 · 3 s/step · 4 m 27 s left"
    view.close()


def test_plain_lines_every_few_minutes_and_the_log_once(tmp_path):
    clock = Clock()
    out = io.StringIO()
    view = Training(VerlReader(), out, tmp_path, clock=clock, terminal=False, plain_every_s=300)
    log = ["Total training steps: 50\n"] + [verl_line(step, step / 50, 1 - step / 50) for step in range(1, 51)]
    log.insert(3, "an odd line \x00 with step:x in it\n")
    for i, line in enumerate(log):
        clock.now += 37
        view.write(line[:10])  # lines arrive in pieces too
        view.write(line[10:])
        if i % 7 == 0:
            view.tick()
    view.close()
    shown = out.getvalue().splitlines(keepends=True)
    plain = [line for line in shown if "rlhf-tasks: step " in line]
    assert [line for line in shown if line not in plain] == log  # each line once, unchanged
    assert 5 <= len(plain) <= 7  # 51 lines x 37 s = 31 min: one every 5 minutes
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] rlhf-tasks: step \d+/50 · reward [\d.]+ · loss [\d.]+ · 41 s/step · "
                        r"\d+ m \d\d s left\n", plain[0])


def screen(text: str) -> str:
    """What a terminal shows of `text`: `\\r ESC[K` wipes the line being written."""
    lines = [""]
    for token in re.split(r"(\r\x1b\[K|\n)", text):
        if token == "\r\x1b[K":
            lines[-1] = ""
        elif token == "\n":
            lines.append("")
        else:
            lines[-1] += token
    return "\n".join(lines)


def test_in_place_on_a_terminal(tmp_path):
    out = io.StringIO()
    view = Training(TinyGrpoReader(), out, tmp_path, terminal=True)
    view.write("starting\n")
    view.write("step 1/10  reward 0.100  loss +0.500  800 ms\n")
    view.write("step 2/10  reward 0.150  loss +0.450  800 ms\n")
    view.write("a line of the log\n")
    view.close()
    text = out.getvalue()
    assert "\r\x1b[Kstep 2/10 · reward 0.15 · loss 0.45 · 0.8 s/step · 6 s left" in text
    assert screen(text) == ("starting\nstep 1/10  reward 0.100  loss +0.500  800 ms\n"
                       "step 2/10  reward 0.150  loss +0.450  800 ms\na line of the log\n")
    assert text.endswith("\r\x1b[K")  # the in-place line is gone at the end


def test_a_bar_standing_on_its_line_is_not_drawn_over(tmp_path):
    """A bar's newest redraw ends no line: it is read, and the in-place line waits for the log's line
    to end rather than wipe the bar (a plain line starts a line of its own)."""
    from rlhf_tasks.recipes.torchrun import TorchrunJob

    def reader():
        return TorchrunJob.model_validate({"recipe": "torchrun", "args": {"module": "openrlhf.cli.train_dpo"}}).metrics_reader()

    bar = "\rTrain step of epoch 0:  50%|#####     | 2/4 [00:02<00:02, 1.00s/it, loss=0.5, acc=0.6]"
    out = io.StringIO()
    view = Training(reader(), out, tmp_path, terminal=True)
    view.write("\rTrain step of epoch 0:   0%|          | 0/4 [00:00<?, ?it/s]\n")
    view.write(bar)
    view.tick()
    assert out.getvalue().endswith(bar) and view.last()["step"] == 3  # DPO sets the postfix first: the step after the count
    view.write(" and the line ends\n")
    assert out.getvalue().endswith(" and the line ends\n\r\x1b[Kstep 3 · loss 0.5 · 1 s/step")
    view.close()
    plain = io.StringIO()
    clock = Clock()
    view = Training(reader(), plain, tmp_path, terminal=False, clock=clock, plain_every_s=60)
    view.write(bar)
    clock.now += 61
    view.tick()
    assert plain.getvalue().startswith(bar + "\n[") and plain.getvalue().endswith("rlhf-tasks: step 3 · loss 0.5 · 1 s/step\n")
    view.close()


def test_a_failing_reader_loses_the_progress_line_not_the_log(tmp_path):
    class Broken:
        def read(self, line):
            raise RuntimeError("a reader's bug")

    out = io.StringIO()
    view = Training(Broken(), out, tmp_path, terminal=True)
    view.write("one\ntwo\n")
    view.close()
    assert out.getvalue() == "one\ntwo\n" and view.failed and view.line() is None


def test_metrics_file_has_one_line_per_step_and_the_summary(tmp_path):
    view = Training(VerlReader(), io.StringIO(), tmp_path, terminal=False)
    rewards = [0.1, 0.3, 0.2, 0.6, 0.5]
    for step, reward in enumerate(rewards, 1):
        view.write(verl_line(step, reward, 1.0 / step))
    view.write(verl_line(4, 0.55, 0.3))  # a restart resumed before step 4: its reading wins
    view.write(verl_line(5, 0.7, 0.2))
    assert last_step(tmp_path)["step"] == 5  # `status NAME` reads it while the job runs
    view.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["reward"] == 0.55 and rows[3]["values"]["timing_s/step"] == 41.0
    lines = view.summary_lines()
    assert lines[0] == "reward 0.1 -> 0.7 over steps 1..5, best 0.7 at step 5"
    assert lines[1].startswith("reward curve: ▁") and lines[1].endswith("█ (0.1..0.7)")
    assert lines[2] == "loss 1 -> 0.2 over steps 1..5, best 0.2 at step 5"
    assert lines[3] == f"training metrics: {tmp_path / 'metrics.jsonl'} ({len(rows)} steps)"
    assert lines[4] in (f"curves: {tmp_path / 'metrics.png'}",) or lines[4].startswith("no picture of the curves: ")
    assert "step 5 · reward 0.7 · loss 0.2 · 41 s/step (read" in status_line(rows[-1])


def test_the_picture_where_matplotlib_is_installed(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    view = Training(VerlReader(), io.StringIO(), tmp_path, terminal=False)
    for step in range(1, 30):
        view.write(verl_line(step, step / 30, 1 / step))
    view.close()
    assert f"curves: {tmp_path / 'metrics.png'}" in view.summary_lines()
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    (tmp_path / "metrics.png").unlink()
    said = view.summary_lines()[-1]
    assert said.startswith("no picture of the curves: matplotlib is not installed in ") and "pip install" in said
    assert not (tmp_path / "metrics.png").exists()


def test_the_wandb_run_is_said_as_soon_as_wandb_prints_it(tmp_path):
    printer = pytest.importorskip("wandb.sdk.lib.printer")
    said = []
    out = io.StringIO()
    view = Training(None, out, tmp_path, terminal=False, say=said.append)
    url = "https://wandb.ai/team/rlhf/runs/verl-ppo-gsm8k-3f2a"
    p = printer.new_printer()
    view.write(f"(TaskRunner pid=3) wandb: {p.emoji('rocket')} View run at {p.link(url)}\n")
    assert said == [f"W&B run: {url}"]
    view.write(f"wandb: {p.emoji('rocket')} View run x at: {p.link(url + '-other')}\n")
    assert said == [f"W&B run: {url}"] and view.summary_lines() == [f"W&B run: {url}"]


def test_helpers():
    assert duration(36300) == "10 h 05 m" and duration(250) == "4 m 10 s" and duration(12.4) == "12 s"
    assert sparkline([0, 1]) == "▁█" and sparkline([]) == "" and len(sparkline(list(range(500)))) == 60


def test_status_of_a_running_cluster_shows_the_last_step(rlhf_home, capsys):
    """`status NAME` of a running cluster: the last step the launch read, and its W&B run."""
    import subprocess

    from rlhf_tasks import state
    from rlhf_tasks.cli import main

    view = Training(TinyGrpoReader(), io.StringIO(), state.run_dir("tiny-grpo"), terminal=False)
    view.write("step 40/150  reward 0.612  loss +0.031  420 ms\n")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        state.save("tiny-grpo", {"provider": "local", "cluster_id": "c1", "dashboard": "http://127.0.0.1:9",
                                 "pids": [sleeper.pid], "wandb_url": "https://wandb.ai/t/p/runs/x",
                                 "job": {"submission_id": "tiny-grpo-c1", "status": "RUNNING"}})
        assert main(["status", "tiny-grpo"]) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
        view.close()
    out = capsys.readouterr().out
    assert re.search(r"\n  training: step 40/150 · reward 0\.612 · loss 0\.031 · 0\.42 s/step \(read \d+ s ago\) "
                     r"\(launch's following reads it; all steps: .*/runs/tiny-grpo/metrics\.jsonl\)\n", out), out
    assert "\n  W&B run: https://wandb.ai/t/p/runs/x\n" in out


def test_a_message_of_the_launchers_wipes_the_line_first(tmp_path, capsys):
    import sys as _sys

    from rlhf_tasks.console import before_say, say

    view = Training(TinyGrpoReader(), _sys.stdout, tmp_path, terminal=True)
    view.write("step 1/10  reward 0.100  loss +0.500  800 ms\n")
    view.tick()  # unchanged: not drawn again
    say("a node is slow")
    view.tick()  # drawn again under the message
    view.close()
    out = capsys.readouterr().out
    assert out.count("\r\x1b[Kstep 1/10 · ") == 2
    assert screen(out).splitlines()[1].endswith("rlhf-tasks: a node is slow") and not before_say


def test_following_through_the_dashboard_reads_the_steps(tmp_path, rlhf_home):
    """The dashboard path (dstack, SkyPilot, submit: client): the job's log through Ray's Jobs API."""
    import yaml

    from rlhf_tasks import providers
    from rlhf_tasks.jobs import Jobs
    from rlhf_tasks.follow import LogTail, follow_attempts
    from rlhf_tasks.spec import parse_task
    from conftest import ROOT
    from test_messages import FakeDashboard

    data = yaml.safe_load(open(ROOT / "tasks" / "tiny-grpo.yaml"))
    data["job"]["submit"] = "client"
    plan = providers.get("dstack").plan(parse_task(data))

    class Cluster:
        def tend(self):
            return []

        def head_alive(self):
            return True

    dashboard = FakeDashboard()
    dashboard.jobs["j1"] = "SUCCEEDED"
    dashboard.logs["j1"] = "".join(f"step {s}/150  reward {s / 150:.3f}  loss +0.100  20 ms\n" for s in (1, 10, 20))
    out = io.StringIO()
    view = Training(TinyGrpoReader(), out, tmp_path, terminal=False)
    try:
        status, sid = follow_attempts(Jobs(dashboard.url, None), Cluster(), plan, "j1", LogTail([], None, out=view))
    finally:
        dashboard.close()
    view.close()
    assert (status, sid) == ("SUCCEEDED", "j1")
    assert out.getvalue() == dashboard.logs["j1"] and sorted(view.steps) == [1, 10, 20]


def test_the_demos_own_install_draws_the_picture():
    """`make demo` installs `.[demo]` (Makefile's install-demo): what draws metrics.png comes with it,
    and the README's demo output shows where the picture went."""
    import re
    import tomllib

    from conftest import ROOT

    assert "pip install -q -e '.[demo]'" in (ROOT / "Makefile").read_text()
    demo = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["demo"]
    assert "matplotlib" in {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0] for req in demo}
    readme = (ROOT / "README.md").read_text()
    assert "      curves: ~/.rlhf-tasks/runs/tiny-grpo/metrics.png\n" in readme
