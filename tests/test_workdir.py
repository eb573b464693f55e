"""`working_dir: .` uploads this machine's directory: what never belongs in a job's code is
left out by default (virtualenvs, node_modules, __pycache__, .git, the runs directory), and
what is left is measured at `check`, `render` and `launch`, before anything starts, with Ray's
own traversal or (Ray not installed) a standard-library one that follows the same rules.
Also: the local provider replaces a worker's agent that was lost, not one that left."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import need
from rlhf_tasks import workdir
from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks.plan import DEFAULT_EXCLUDES


def sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:  # no disk used: the size is what Ray would read
        handle.truncate(size)


def venv(path: Path, size: int) -> None:
    """A virtualenv as `python -m venv` leaves it: pyvenv.cfg at its top, big packages below."""
    sparse(path / "lib" / "python3.11" / "site-packages" / "torch" / "libtorch.so", size)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")


def project(root: Path) -> Path:
    """A project directory as a new user has it: code, two virtualenvs, node_modules, caches."""
    (root / "train.py").parent.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text("print(1)\n")
    for name in ("env-a", "tools/env-b"):
        venv(root / name, workdir.upload_limit())
    sparse(root / "web" / "node_modules" / "big.js", workdir.upload_limit())
    sparse(root / "pkg" / "__pycache__" / "x.pyc", workdir.upload_limit())
    return root


@pytest.fixture(params=["ray", "stdlib"])
def traversal(request, monkeypatch):
    """Measure with Ray's traversal, and as on a machine without Ray."""
    if request.param == "stdlib":
        real = importlib.util.find_spec
        monkeypatch.setattr(workdir.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    return request.param


def test_virtualenvs_node_modules_and_caches_are_left_out(tmp_path, traversal):
    found = workdir.measure(str(project(tmp_path)), DEFAULT_EXCLUDES)
    assert found.size == len("print(1)\n")
    assert sorted(found.left_out) == ["/env-a", "/tools/env-b"]
    assert ("not installed" in found.how) == (traversal == "stdlib")


def test_the_runs_directory_of_rlhf_tasks_is_left_out(tmp_path, monkeypatch, traversal):
    monkeypatch.setenv("RLHF_TASKS_HOME", str(tmp_path / "state"))
    (tmp_path / "a.py").write_text("x")
    sparse(tmp_path / "state" / "runs" / "old" / "checkpoints" / "model.safetensors.part", workdir.upload_limit())
    found = workdir.measure(str(tmp_path), [])
    assert found.size == 1 and found.left_out == ["/state/runs"]


def test_too_big_is_refused_with_its_size_biggest_entries_and_how_to_exclude(tmp_path, traversal):
    (tmp_path / "train.py").write_text("print(1)\n")
    sparse(tmp_path / "datasets" / "big.jsonl", workdir.upload_limit() + 2**20)
    sparse(tmp_path / "notes.tar", 3 * 2**20)
    with pytest.raises(BadInput) as err:
        workdir.check(str(tmp_path), DEFAULT_EXCLUDES)
    said = str(err.value)
    assert said.startswith("job.working_dir: ") and "104 MiB" in said and "limit of 100 MiB" in said
    assert "datasets/ 101 MiB, notes.tar 3 MiB" in said and 'job.excludes: ["/datasets/"]' in said, said
    assert ("not installed" in said) == (traversal == "stdlib")


def test_too_big_suggests_only_the_entries_that_bring_it_under_the_limit(tmp_path, traversal):
    """Not `/src/` of 9 bytes beside the one entry that matters (issue 32, item 9)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print(1)\n")
    sparse(tmp_path / "weights.tar", workdir.upload_limit() + 2**20)
    with pytest.raises(BadInput) as err:
        workdir.check(str(tmp_path), DEFAULT_EXCLUDES)
    said = str(err.value)
    assert "the biggest entries: weights.tar 101 MiB." in said and 'job.excludes: ["/weights.tar"]' in said, said
    assert "src" not in said
    sparse(tmp_path / "a.tar", 60 * 2**20)  # now two entries must go: the biggest first, then the next
    sparse(tmp_path / "weights.tar", 60 * 2**20)
    sparse(tmp_path / "b.tar", 45 * 2**20)
    with pytest.raises(BadInput) as err:
        workdir.check(str(tmp_path), DEFAULT_EXCLUDES)
    assert 'job.excludes: ["/a.tar", "/weights.tar"]' in str(err.value) or \
        'job.excludes: ["/weights.tar", "/a.tar"]' in str(err.value), str(err.value)


@pytest.mark.parametrize("files, ignores, excludes", [
    ({"a.py": 1, "big/blob": 5, "keep/x.log": 7, "keep/y.txt": 11}, {".gitignore": "big/\n*.log\n"}, []),
    ({"a.py": 1, "sub/b.bin": 5, "sub/c.py": 3, "sub/d/e.bin": 2}, {"sub/.rayignore": "*.bin\n!d/e.bin\n"}, []),
    ({"a.py": 1, "data/x": 9, "src/data/y": 4, "m.pt": 6, "deep/a/b/c.ckpt": 8, "x/runs/z": 2}, {}, DEFAULT_EXCLUDES),
    ({"a.py": 1, "out/1": 5, "src/out/2": 3, "lib/t.py": 2}, {}, ["/out", "lib/**/*.py"]),
])
def test_the_standard_library_traversal_follows_rays_rules(tmp_path, monkeypatch, files, ignores, excludes):
    need(importlib.util.find_spec("ray") is not None, "Ray is installed (the test extras), to compare with its rules")
    for name, size in files.items():
        sparse(tmp_path / name, size)
    for name, text in ignores.items():
        (tmp_path / name).write_text(text)
    with_ray = workdir.measure(str(tmp_path), excludes)
    real = importlib.util.find_spec
    monkeypatch.setattr(workdir.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    without = workdir.measure(str(tmp_path), excludes)
    assert (without.size, without.biggest) == (with_ray.size, with_ray.biggest)


def task_file(tmp_path: Path, **job) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"name": "wd", "nodes": 2, "job": {"recipe": "command", "working_dir": ".",
                                                                      "args": {"entrypoint": "python train.py"},
                                                                      **job}}))
    return path


@pytest.mark.parametrize("argv", [["check"], ["check", "--provider", "local"], ["render", "--provider", "local"],
                                  ["render", "--provider", "dstack", "--submit-client"], ["launch"]])
def test_check_render_and_launch_refuse_a_working_dir_over_rays_limit(argv, tmp_path, monkeypatch, capsys, rlhf_home):
    """Before anything starts, `submit: head` too (the local head uploads this directory)."""
    code = project(tmp_path / "code")
    sparse(code / "dumps" / "core.1", workdir.upload_limit())
    monkeypatch.chdir(code)
    submit = "client" if "--submit-client" in argv else "head"
    argv = [a for a in argv if a != "--submit-client"]
    out = tmp_path / "out" / "x"
    args = [argv[0], str(task_file(tmp_path, submit=submit)), *argv[1:]] + (["-o", str(out)] if argv[0] == "render" else [])
    assert main(args) == 2
    said = capsys.readouterr()
    assert "job.working_dir: . packs 100 MiB" in said.err and "dumps/ 100 MiB" in said.err, said.err
    assert "env-a" not in said.err  # left out by default, so never among the biggest
    assert not (tmp_path / "out").exists() and not rlhf_home.exists()  # nothing written, nothing started


def test_check_says_what_it_measured_and_the_plan_leaves_the_virtualenvs_out(tmp_path, monkeypatch, capsys, rlhf_home):
    monkeypatch.chdir(project(tmp_path / "code"))
    assert main(["check", str(task_file(tmp_path)), "--provider", "local"]) == 0
    said = capsys.readouterr().out
    assert "working_dir . packs 9 bytes (measured with Ray's own traversal; left out: env-a, tools/env-b)" in said
    assert main(["check", str(task_file(tmp_path)), "--provider", "local", "--json"]) == 0
    excludes = json.loads(capsys.readouterr().out)["job"]["excludes"]
    assert {"/env-a", "/tools/env-b", "node_modules", "__pycache__", ".git"} <= set(excludes)


def test_a_remote_head_working_dir_is_not_this_machines(tmp_path, monkeypatch, rlhf_home):
    """dstack's head uploads its own directory: nothing here is measured."""
    from rlhf_tasks import providers
    from rlhf_tasks.spec import load_task

    sparse(tmp_path / "code" / "big", workdir.upload_limit() + 1)
    monkeypatch.chdir(tmp_path / "code")
    provider = providers.provider_class("dstack")()
    provider.plan(load_task(task_file(tmp_path)))
    assert provider.upload is None


# ------------------------------------------------------------------ the local provider's tend


def test_workers_that_left_after_their_head_are_not_started_again(tmp_path, monkeypatch, rlhf_home):
    """A worker agent that ended on its own (its head went away: exit code 0 in its result
    line) is not a lost machine; one that vanished without a word is replaced."""
    from rlhf_tasks.agent.protocol import result_line
    from rlhf_tasks.providers.local import LocalProvider
    from rlhf_tasks.spec import parse_task

    provider = LocalProvider()
    plan = provider.plan(parse_task({"name": "tend", "nodes": 3, "job": {"recipe": "command", "working_dir": None,
                                                                         "args": {"entrypoint": "true"}}}))
    started: list[list[int]] = []
    procs: list[subprocess.Popen] = []

    def fake_start(run_dir, env, ranks):
        started.append(list(ranks))
        pids = {}
        for rank in ranks:
            said = result_line({"exit_code": 0, "rank": rank, "error": None, "steps": []})
            code = "import time; time.sleep(600)" if rank == 0 else f"print({said!r})" if rank == 1 else "pass"
            log = open(run_dir / "nodes" / f"node-{rank}.log", "a")
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT))
            pids[rank] = procs[-1].pid
        return pids

    (rlhf_home / "runs" / "tend" / "nodes").mkdir(parents=True)
    monkeypatch.setattr(provider, "_start", fake_start)
    try:
        cluster = provider.apply(plan, {})
        for proc in procs[1:]:
            proc.wait(timeout=30)
        said = cluster.tend()
        assert started == [[0, 1, 2], [2]], said  # rank 1 left on its own; rank 2 vanished: replaced
        assert len(said) == 1 and "rank 2 died; started it again" in said[0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
