"""`working_dir: .` uploads the task file's directory: what never belongs in a job's code is
left out by default (virtualenvs, node_modules, __pycache__, .git, the runs directory), and
what is left is measured at `check`, `render` and `launch`, before anything starts, with Ray's
own traversal or (Ray not installed) a standard-library one that follows the same rules, on every
provider that uploads it (and dstack's and RunPod's own limits); a relative one is of the task
file's directory, from whatever directory rlhf-tasks runs in. Also: the local provider replaces a worker's agent that was lost, not one that left."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, need
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


def task_file(directory: Path, **job) -> Path:
    """A task file in `directory`, whose job.working_dir `.` is that directory."""
    path = directory / "t.yaml"
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
    args = [argv[0], str(task_file(code, submit=submit)), *argv[1:]] + (["-o", str(out)] if argv[0] == "render" else [])
    assert main(args) == 2
    said = capsys.readouterr()
    assert f"job.working_dir: {code} packs 100 MiB" in said.err and "dumps/ 100 MiB" in said.err, said.err
    assert "env-a" not in said.err  # left out by default, so never among the biggest
    assert not (tmp_path / "out").exists() and not rlhf_home.exists()  # nothing written, nothing started


def test_check_says_what_it_measured_and_the_plan_leaves_the_virtualenvs_out(tmp_path, monkeypatch, capsys, rlhf_home):
    code = project(tmp_path / "code")
    monkeypatch.chdir(code)
    assert main(["check", str(task_file(tmp_path, working_dir="code")), "--provider", "local"]) == 0
    said = capsys.readouterr().out
    assert f"working_dir {code} packs 9 bytes (measured with Ray's own traversal; left out: env-a, tools/env-b)" in said
    assert main(["check", str(task_file(tmp_path, working_dir="code")), "--provider", "local", "--json"]) == 0
    excludes = json.loads(capsys.readouterr().out)["job"]["excludes"]
    assert {"/env-a", "/tools/env-b", "node_modules", "__pycache__", ".git"} <= set(excludes)


def test_a_remote_head_working_dir_is_not_this_machines(tmp_path, monkeypatch, rlhf_home):
    """dstack's head uploads its own directory: nothing here is measured."""
    from rlhf_tasks import providers
    from rlhf_tasks.spec import load_task

    (tmp_path / "code").mkdir()
    monkeypatch.chdir(tmp_path / "code")
    provider = providers.provider_class("dstack")()
    provider.plan(load_task(task_file(tmp_path / "code")))
    assert provider.upload is None and provider.packed is not None  # measured as dstack archives it


# ------------------------------------------------------------------ where it is, and every provider's limit

ALL_PROVIDERS = ("local", "dstack", "sky", "slurm", "runpod", "kuberay")


def code_task(root: Path, working_dir: str | None = "src", **job) -> Path:
    """A project as users lay one out: the task file at its top, the job's code in src/."""
    (root / "src").mkdir(parents=True, exist_ok=True)
    (root / "src" / "train.py").write_text("print(1)\n")
    path = root / "task.yaml"
    path.write_text(yaml.safe_dump({"name": "wd", "nodes": 2, "job": {
        "recipe": "command", "working_dir": working_dir, "args": {"entrypoint": "python train.py"}, **job}}))
    return path


@pytest.mark.parametrize("cwd", ["/", "tmp", "project"])
def test_a_relative_working_dir_is_of_the_task_files_directory(cwd, tmp_path, monkeypatch, capsys, rlhf_home):
    """As dstack, SkyPilot and docker compose resolve paths: not of the shell's directory (issue 48, item 5)."""
    task = code_task(tmp_path / "project")
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir({"/": "/", "tmp": tmp_path / "tmp", "project": tmp_path / "project"}[cwd])
    assert main(["check", str(task), "--provider", "local", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job"]["working_dir"] == str(tmp_path / "project" / "src")


def test_check_says_when_the_current_directory_would_have_named_another(tmp_path, monkeypatch, capsys, rlhf_home):
    """What changed, for a task that relied on the shell's directory: said, not refused."""
    task = code_task(tmp_path / "project")
    (tmp_path / "elsewhere" / "src").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["check", str(task), "--provider", "local"]) == 0
    assert (f"warning: job.working_dir: src is {tmp_path / 'project' / 'src'}, of the task file's directory"
            in capsys.readouterr().err)
    monkeypatch.chdir(tmp_path / "project")
    assert main(["check", str(task), "--provider", "local"]) == 0
    assert "warning: job.working_dir" not in capsys.readouterr().err


def test_skypilot_finds_the_working_dir_from_the_rendered_files_directory(tmp_path, monkeypatch, rlhf_home):
    """`sky launch` resolves `workdir` against the directory it runs in (sky/task.py
    Task.expand_and_validate_workdir: os.path.abspath), which the header names: the rendered file's.
    Rendered from /tmp, it is the task file's src/ all the same."""
    need(importlib.util.find_spec("sky") is not None, "SkyPilot is installed (the sky extra)")
    task = code_task(tmp_path / "project")
    out = tmp_path / "out" / "deeper"
    monkeypatch.chdir("/tmp")
    assert main(["render", str(task), "--provider", "sky", "-o", str(out) + "/"]) == 0
    config = yaml.safe_load((out / "wd.sky.yaml").read_text())
    assert not os.path.isabs(config["workdir"])  # portable: the render moves with the task's tree
    import sky

    monkeypatch.chdir(out)  # where the header says to run `sky launch`, and where `launch` runs it
    parsed = sky.Task.from_yaml(str(out / "wd.sky.yaml"))
    parsed.expand_and_validate_workdir()
    assert parsed.workdir == str(tmp_path / "project" / "src")


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_a_missing_working_dir_is_refused_for_every_provider(provider, tmp_path, monkeypatch, capsys, rlhf_home):
    """Refused at check, naming the field, where SkyPilot's render used to carry it to `sky launch`."""
    task = code_task(tmp_path, "nope", submit="client" if provider == "kuberay" else "head")
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(task), "--provider", provider]) == 2
    err = capsys.readouterr().err
    assert f"job.working_dir: nope ({tmp_path / 'nope'}, of the task file's directory) does not exist" in err, err


#: 143 MiB: over Ray's 100 MiB upload limit (and dstack's 2 MiB, and RunPod's start command).
BIG = 143 * 2**20


@pytest.mark.parametrize("provider, limit", [
    ("local", "Ray's upload limit of 100 MiB"),
    ("sky", "Ray's upload limit of 100 MiB (the head uploads it to the job on sky)"),
    ("slurm", "Ray's upload limit of 100 MiB (the head uploads it to the job on slurm)"),
    ("dstack", "the dstack server's limit of 2 MiB"),
    ("runpod", "Ray's upload limit of 100 MiB"),
    ("kuberay", "Ray's upload limit of 100 MiB"),  # submit: client, through the port forward
])
def test_every_provider_that_uploads_it_refuses_it_over_a_limit_at_check(provider, limit, tmp_path, monkeypatch,
                                                                          capsys, rlhf_home):
    """`check --provider sky` and `slurm` exited 0 and the head's upload failed on the cluster (issue 48)."""
    task = code_task(tmp_path, submit="client" if provider == "kuberay" else "head")
    sparse(tmp_path / "src" / "dumps" / "core.1", BIG) if provider != "dstack" else \
        (tmp_path / "src" / "dumps").mkdir() or (tmp_path / "src" / "dumps" / "core.1").write_bytes(os.urandom(3 * 2**20))
    monkeypatch.chdir("/")
    assert main(["check", str(task), "--provider", provider]) == 2
    err = capsys.readouterr().err
    size = "3 MiB" if provider == "dstack" else "143 MiB"
    assert f"job.working_dir: {tmp_path / 'src'} packs {size}" in err and f"over {limit}" in err, err
    assert "dumps/ " in err and ('job.excludes: ["/dumps/"]' in err or "e.g. /dumps/" in err), err


@pytest.mark.parametrize("provider", ["sky", "slurm"])
def test_launch_refuses_it_before_anything_starts(provider, tmp_path, monkeypatch, capsys, rlhf_home):
    task = code_task(tmp_path)
    sparse(tmp_path / "src" / "dumps" / "core.1", BIG)
    monkeypatch.chdir(tmp_path)
    assert main(["launch", str(task), "--provider", provider]) == 2
    assert "packs 143 MiB" in capsys.readouterr().err
    assert not (rlhf_home / "runs").exists()


def test_what_skypilot_leaves_out_by_its_skyignore_is_not_counted(tmp_path, monkeypatch, capsys, rlhf_home):
    """SkyPilot's rsync leaves out what .skyignore names (sky/utils/command_runner.py: dir-merge of every
    .skyignore when the workdir has one), so the head's Ray never sees it; the local head would."""
    task = code_task(tmp_path)
    sparse(tmp_path / "src" / "dumps" / "core.1", BIG)
    (tmp_path / "src" / ".skyignore").write_text("/dumps/\n")
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(task), "--provider", "sky"]) == 0
    assert re.search(r"working_dir \S+ packs \d+ bytes .*: `sky launch` syncs it", capsys.readouterr().out)
    assert main(["check", str(task), "--provider", "local"]) == 2


def shipped_tasks_providers() -> list[tuple[str, str]]:
    """Each shipped task with each provider it names (a command with `--provider X` in its comments, a key of its
    checkpoints.shared or placement) and each the repository renders it for (providers/)."""
    from rlhf_tasks import providers

    pairs = []
    for path in sorted((ROOT / "tasks").glob("*.yaml")):
        text, data = path.read_text(), yaml.safe_load(path.read_text())
        named = set(re.findall(r"rlhf-tasks \w+ \S+ --provider (\w+)", text)) | {"dstack", "sky", "slurm", "kuberay"}
        named |= set((data.get("checkpoints") or {}).get("shared") or {}) | set(data.get("placement") or {})
        named &= set(providers.names())
        if data["job"]["recipe"] == "torchrun":
            named.discard("kuberay")  # KubeRay always starts Ray: refused, no render kept
        if data.get("groups"):
            named.discard("sky")  # SkyPilot renders no node groups: refused at check (tests/test_groups.py)
        pairs += [(path.name, name) for name in sorted(named)]
    return pairs


@pytest.mark.parametrize("cwd", ["/", "root", "tmp"])
def test_the_shipped_tasks_pass_check_for_every_provider_they_name_from_any_directory(cwd, tmp_path, monkeypatch,
                                                                                       capsys, rlhf_home):
    """The verl task checked from the repository's root for dstack said it packs 4 MiB (the repository),
    over dstack's 2 MiB: the shipped tasks' code is in their images, so they ship no working_dir."""
    monkeypatch.chdir({"/": "/", "root": ROOT, "tmp": tmp_path}[cwd])
    failed = []
    for name, provider in shipped_tasks_providers():
        if main(["check", str(ROOT / "tasks" / name), "--provider", provider]) != 0:
            failed.append(f"{name} --provider {provider}: {capsys.readouterr().err}")
        said = capsys.readouterr()
        assert "working_dir" not in said.err, said.err
    assert not failed, "\n".join(failed)


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
