"""The SkyPilot render against what SkyPilot 0.14.1's own code does (read from the installed
package, not copied): the ports its Ray takes on every node, the environment its command
runner leaks into the task, and where `sky launch` resolves `file_mounts` and `workdir`
from. The cluster test (tests/sky/) runs the same render through SkyPilot's own driver."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, need
from test_providers_render import tasks_for
from rlhf_tasks import providers
from rlhf_tasks.spec import load_task, parse_task



def _sky():
    try:
        import sky  # noqa: F401
    except ImportError:
        need(False, "the skypilot package (pip install 'rlhf-tasks[sky]')")


def _flags(command: str) -> dict[str, str]:
    """`--flag=value` and `--flag value` of one `ray start`, as bash expands SkyPilot's command with
    none of its SKYPILOT_RAY_* overrides set (what a cloud VM gets)."""
    start = command.split(" start ", 1)[1].split("||", 1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYPILOT_")}
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {start}"], env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    flags, i = {}, 0
    while i < len(words):
        word = words[i]
        if "=" in word:
            key, value = word.split("=", 1)
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            key, value = word, words[i + 1]
            i += 1
        else:
            key, value = word, ""
        flags[key.lstrip("-").replace("-", "_")] = value
        i += 1
    return flags


def skypilot_ray_ports() -> tuple[set[int], list[tuple[int, int]]]:
    """The ports SkyPilot's Ray holds on its nodes: single ports and worker port ranges, from
    SkyPilot's own head and worker `ray start` commands, and for what they leave out, `ray
    start`'s own defaults (Ray's click options; the cluster test checks Ray 2.9.3's)."""
    _sky()
    need(__import__("importlib").util.find_spec("ray") is not None, "ray")
    from ray.scripts.scripts import start
    from sky.provision import instance_setup

    defaults = {p.name: p.default for p in start.params}
    if defaults["ray_client_server_port"] is None:  # `ray start --head` fills it in; its help says with what
        help_text = next(p.help for p in start.params if p.name == "ray_client_server_port")
        defaults["ray_client_server_port"] = int(re.search(r"default to (\d+)", help_text).group(1))
    head = _flags(instance_setup.ray_head_start_command(None, None))
    worker = _flags(instance_setup.ray_worker_start_command(None, None, no_restart=False))
    single = {int(head["port"]), int(head["dashboard_port"]), int(head["object_manager_port"]),
              int(worker["object_manager_port"]),
              int(head.get("ray_client_server_port") or defaults["ray_client_server_port"]),
              int(head.get("dashboard_agent_listen_port") or defaults["dashboard_agent_listen_port"])}
    ranges = [(int(flags.get("min_worker_port") or defaults["min_worker_port"]),
               int(flags.get("max_worker_port") or defaults["max_worker_port"])) for flags in (head, worker)]
    return single, ranges


def test_skypilots_ray_ports_as_read_from_its_code():
    """The reading itself (so that a SkyPilot that moves its ports shows here first)."""
    single, ranges = skypilot_ray_ports()
    assert {6380, 8266, 8076, 10001, 52365} <= single
    assert (11002, 19999) in ranges and (10002, 19999) in ranges  # head; workers keep Ray's default


@pytest.mark.parametrize("task_path", tasks_for("sky"), ids=lambda p: p.stem)
def test_no_port_of_our_ray_is_one_skypilots_ray_uses(task_path):
    single, ranges = skypilot_ray_ports()
    ray = providers.get("sky").plan(load_task(task_path)).ray
    ours = {"port": ray.port, "dashboard_port": ray.dashboard_port, "client_server_port": ray.client_server_port,
            "ready_port": ray.ready_port, "agent_listen_port": ray.agent_listen_port}
    low, high = ray.min_worker_port or 10002, ray.max_worker_port or 19999  # Ray's default when none is given
    for name, port in ours.items():
        assert port not in single and not any(a <= port <= b for a, b in ranges), (name, port)
        assert not low <= port <= high, (name, port, "inside our own worker range")
    for a, b in ranges:
        assert high < a or low > b, ((low, high), (a, b))
    assert not any(low <= port <= high for port in single)


def test_sky_check_refuses_a_port_skypilots_ray_takes():
    from rlhf_tasks.errors import BadInput

    for ray in ({"client_server_port": 10001}, {"dashboard_port": 8076}, {"client_server_port": 12000}):
        task = parse_task({"name": "p", "nodes": 2, "ray": ray, "job": {"recipe": "command", "args": {"entrypoint": "true"}}})
        with pytest.raises(BadInput, match=r"ray\.\w+: \d+ is"):
            providers.get("sky").plan(task)


def skypilot_runner_command(cmd: str) -> str:
    """The shell line SkyPilot's command runner runs on a node (the one its provisioner starts
    its Ray with, so Ray and every task it runs inherit its environment)."""
    _sky()
    from sky.utils import command_runner

    return command_runner.CommandRunner._get_command_to_run(  # pylint: disable=protected-access
        None, cmd, process_stream=True, separate_stderr=False, skip_num_lines=0, source_bashrc=False)


@pytest.mark.parametrize("task_env", [{}, {"OMP_NUM_THREADS": "4"}])
def test_the_environment_skypilots_runner_leaks_is_set_right_for_our_ray(task_env, tmp_path):
    """SkyPilot's runner exports OMP_NUM_THREADS=1 (and PYTHONWARNINGS=ignore) before its `ray
    start`, and its job hands them to the task, over the task's own envs (log_lib.add_ray_env_vars):
    our agent, our Ray and the job get Ray's own default (threads = the task's CPUs), or the
    task's value where it sets one."""
    provider = providers.get("sky")
    task = parse_task({"name": "omp", "nodes": 2, "env": task_env,
                       "job": {"recipe": "command", "args": {"entrypoint": "true"}}})
    config = yaml.safe_load(provider.render(provider.plan(task))["omp.sky.yaml"])
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text("#!/bin/sh\nprintf 'OMP=%s WARN=%s\\n' \"${OMP_NUM_THREADS-unset}\" "
                                  "\"${PYTHONWARNINGS-unset}\"\n")
    (stub / "python3").chmod(0o755)
    # What SkyPilot's job exports into the task script before `run` (the task's envs, then Ray's).
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in {**task_env, "OMP_NUM_THREADS": "1"}.items())
    inner = skypilot_runner_command(f"export PATH={stub}:$PATH\n{exports}{config['run']}")
    assert "OMP_NUM_THREADS=1" in inner
    out = subprocess.run(["bash", "-c", inner], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    want = task_env.get("OMP_NUM_THREADS", "unset")
    assert f"OMP={want} WARN=unset" in out.stdout, out.stdout


def project(tmp_path: Path, submit: str = "head") -> Path:
    code = tmp_path / "proj"
    (code / "src").mkdir(parents=True)
    (code / "src" / "reward_fn.py").write_text("def score(x):\n    return 1.0\n")
    (code / "task.yaml").write_text(yaml.safe_dump({
        "name": "wd", "nodes": 2, "job": {"recipe": "command", "working_dir": "src", "submit": submit,
                                          "args": {"entrypoint": "python3 -c 'import reward_fn'"}}}))
    return code


def cli(args, cwd, rlhf_home):
    env = dict(os.environ, RLHF_TASKS_HOME=str(rlhf_home), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("output", ["out/", "out/deeper/wd.sky.yaml", "wd.sky.yaml"])
def test_sky_launch_from_where_the_header_says_finds_the_mounts_and_the_working_dir(output, tmp_path, rlhf_home):
    """SkyPilot resolves `file_mounts` sources and `workdir` against the directory `sky launch`
    runs from (Task.expand_and_validate_*): run from the directory the rendered header names,
    its own code finds the shipped files and the task's job.working_dir, whose copy (~/sky_workdir,
    where SkyPilot's run script cd's) is what the head submits the job from."""
    _sky()
    import sky

    code = project(tmp_path)
    out = cli(["render", "task.yaml", "--provider", "sky", "-o", output], code, rlhf_home)
    assert out.returncode == 0, out.stderr
    main = code / output / "wd.sky.yaml" if output.endswith("/") else code / output
    text = main.read_text()
    assert "# Rendered by rlhf-tasks for SkyPilot. From this directory (the one this file is in):" in text
    config = yaml.safe_load(text)
    os.chdir(main.parent)
    try:
        task = sky.Task.from_yaml_config(copy.deepcopy(config))
        task.expand_and_validate_file_mounts()
        task.expand_and_validate_workdir()
    finally:
        os.chdir(ROOT)
    assert task.file_mounts["/opt/rlhf-tasks"] == str(main.parent / "rlhf-tasks")
    assert Path(task.file_mounts["/opt/rlhf-tasks"], "wd.sky.plan.json").is_file()
    assert task.workdir == str(code / "src") and (Path(task.workdir) / "reward_fn.py").is_file()
    shipped = json.loads((main.parent / "rlhf-tasks" / "wd.sky.plan.json").read_text())
    assert shipped["job"]["working_dir"] == "."  # ~/sky_workdir: SkyPilot's run script cd's there


def test_check_says_where_the_jobs_working_directory_will_be(tmp_path, rlhf_home):
    code = project(tmp_path)
    out = cli(["check", "task.yaml", "--provider", "sky"], code, rlhf_home)
    assert out.returncode == 0, out.stderr
    assert re.search(rf"working_dir {code / 'src'} packs \d+ bytes \(measured with .*\): `sky launch` syncs it to "
                     r"~/sky_workdir on every node", out.stdout), out.stdout
    client = cli(["check", str(project(tmp_path / "c", submit="client") / "task.yaml"), "--provider", "sky"],
                 tmp_path / "c" / "proj", rlhf_home)
    assert f"working_dir {tmp_path / 'c' / 'proj' / 'src'} packs" in client.stdout, client.stdout
    config = yaml.safe_load(cli(["render", "task.yaml", "--provider", "sky"], tmp_path / "c" / "proj",
                                rlhf_home).stdout)
    assert "workdir" not in config  # submit: client uploads it from here through Ray


@pytest.mark.parametrize("resources,cpus,memory", [({"cpus": 8, "memory": "64GiB"}, "8+", "64+"),
                                                    ({"cpus": "8..", "memory": "64GiB+"}, "8+", "64+"),
                                                    ({"cpus": 8, "memory": "64GiB", "exact": ["cpus", "memory"]},
                                                     "8", "64")])
def test_amounts_are_at_least_unless_the_task_says_exactly(resources, cpus, memory, tmp_path, monkeypatch):
    """SkyPilot reads `cpus: 8` as exactly 8 and `8+` as 8 or more (its Resources): a task's amount is a minimum
    unless resources.exact lists it."""
    _sky()
    import sky

    provider = providers.get("sky")
    task = parse_task({"name": "t", "nodes": 1, "resources": resources,
                       "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}})
    files = provider.render(provider.plan(task))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    (parsed,) = sky.Task.from_yaml_config(yaml.safe_load(files["t.sky.yaml"])).resources
    assert (parsed.cpus, parsed.memory) == (cpus, memory)


def test_placement_backends_slurm_selects_skypilots_slurm_infra(tmp_path, monkeypatch):
    """`placement.backends: [slurm]` is how a task points SkyPilot at its Slurm infra: the render's
    `resources.any_of: [{cloud: slurm}]` is, to SkyPilot 0.14.1's own Task parser, the same one
    Slurm resource as `--infra slurm` (`cloud` is its older spelling of `infra`, still accepted)."""
    _sky()
    import sky

    provider = providers.get("sky")
    task = parse_task({"name": "t", "nodes": 2, "placement": {"backends": ["slurm"]},
                       "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}})
    files = provider.render(provider.plan(task))
    config = yaml.safe_load(files["t.sky.yaml"])
    monkeypatch.chdir(tmp_path)
    (parsed,) = sky.Task.from_yaml_config(copy.deepcopy(config)).resources
    (by_flag,) = sky.Task.from_yaml_config({**copy.deepcopy(config), "resources": {
        **{k: v for k, v in config["resources"].items() if k != "any_of"}, "infra": "slurm"}}).resources
    assert parsed.infra.to_str() == "slurm" and str(parsed.cloud) == "Slurm", parsed
    assert parsed.to_yaml_config() == by_flag.to_yaml_config()


def test_an_amd_image_gets_its_gpus_in_skypilots_container(tmp_path, monkeypatch):
    """SkyPilot's docker run gives a container NVIDIA's GPUs only (sky/provision/docker_utils.py,
    DockerInitializer._configure_runtime): an AMD task's image gets the devices and options of verl's AMD
    script through docker.run_options, as SkyPilot's own Task.from_yaml_config reads them."""
    from test_sizes import _sky_resources, render, task

    _, _, files = render("sky", task({"gpus": "MI300X:8", "shm_size": "64GiB"}, image="rocm/verl:1"))
    parsed = _sky_resources(files, tmp_path, monkeypatch)
    assert parsed.cluster_config_overrides["docker"]["run_options"] == [
        "--shm-size=64g", "--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--cap-add=SYS_PTRACE",
        "--security-opt=seccomp=unconfined"]
    for other in (task({"gpus": "H100:8"}, image="verlai/verl:1"), task({"gpus": "MI300X:8"})):  # NVIDIA; no image
        assert "config" not in yaml.safe_load(render("sky", other)[2]["t.sky.yaml"])
