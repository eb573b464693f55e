"""The dstack render judged by dstack 0.22.5's own code: GPU names its catalog (gpuhunt's
KNOWN_ACCELERATORS) knows, resources as its ranges (or exactly, as the task says), a disk its offers
can meet, a fleet that frees its instances when the run is over, or the user's own hosts over SSH,
a custom image's user, CPU architecture and registry credentials, commands that stop at the first
failure under dstack's `bash -i -c`, `files:` as one directory and the task's working_dir shipped
to where its job runs (issue 40, item 5; issue 37, item 1)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.providers.dstack.archive import JOB_DIR
from rlhf_tasks.spec import load_task, parse_task

from conftest import ROOT, need

TASKS = sorted((ROOT / "tasks").glob("*.yaml"))


def _dstack():
    try:
        import gpuhunt
        from dstack._internal.core.models.configurations import parse_apply_configuration
    except ImportError:
        need(False, "the dstack package (pip install 'rlhf-tasks[dstack]')")
    return parse_apply_configuration, gpuhunt


def render(data: dict) -> tuple[dict, dict]:
    """The task and fleet configurations dstack parses from our render of a task given as data."""
    parse, _ = _dstack()
    files = render_files(data)
    return (parse(yaml.safe_load(files["t.dstack.yml"])), parse(yaml.safe_load(files["t-fleet.dstack.yml"])))


def render_files(data: dict) -> dict[str, str]:
    provider = providers.get("dstack")
    job = {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}
    task = parse_task({"name": "t", "nodes": 2, "job": job, **data})
    return provider.render(provider.plan(task))


def known_accelerators() -> dict[str, set[int]]:
    """gpuhunt's known-GPU table, as dstack's catalog reads it: name -> the memory sizes (GiB) it comes in."""
    _, gpuhunt = _dstack()
    table: dict[str, set[int]] = {}
    for accelerator in gpuhunt.KNOWN_ACCELERATORS:
        table.setdefault(accelerator.name.lower(), set()).add(int(accelerator.memory))
    return table


def gpu_forms() -> list[tuple[str, str, int | None]]:
    """Every GPU name a task gives in tasks/, and each GPU of gpuhunt's table written as tasks write
    it (NAME:8, and NAME-<memory>GB:8 as SkyPilot and our shipped tasks spell memory): (spec, name, memory)."""
    _, gpuhunt = _dstack()
    forms = []
    for path in TASKS:
        gpus = load_task(path).resources.gpus
        if gpus and not gpus.isdigit():
            name = gpus.split(":")[0]
            memory = int(name.rsplit("-", 1)[1][:-2]) if name.upper().endswith("GB") and "-" in name else None
            forms.append((gpus, name.rsplit("-", 1)[0] if memory else name, memory))
    for accelerator in gpuhunt.KNOWN_ACCELERATORS:
        forms.append((f"{accelerator.name}:8", accelerator.name, None))
        if accelerator.memory:
            forms.append((f"{accelerator.name}-{accelerator.memory}GB:8", accelerator.name, accelerator.memory))
    return forms


def test_the_shipped_tasks_give_a_gpu_with_memory():
    """The check below covers the memory-suffixed form because a shipped task uses it."""
    assert any(spec.startswith("A100-80GB") for spec, _, _ in gpu_forms())


@pytest.mark.parametrize("spec,name,memory", gpu_forms(), ids=lambda v: str(v))
def test_every_gpu_name_renders_to_one_dstacks_catalog_knows(spec, name, memory):
    table = known_accelerators()
    task, fleet = render({"resources": {"gpus": spec}})
    for config in (task, fleet):
        gpu = config.resources.gpu
        assert gpu.name and len(gpu.name) == 1, gpu
        assert gpu.name[0].lower() in table, f"{spec} renders GPU name {gpu.name[0]!r}, which gpuhunt does not know"
        assert gpu.name[0].lower() == name.lower()
        assert gpu.count.min == gpu.count.max == int(spec.rsplit(":", 1)[1])
        if memory is None:
            assert gpu.memory is None
        else:
            assert gpu.memory.min == gpu.memory.max == memory
            assert memory in table[name.lower()]


@pytest.mark.parametrize("spec,count", [("A100-80GB", 1), ("H100", 1), ("4", 4)])
def test_a_bare_gpu_name_is_exactly_one_gpu(spec, count):
    """The spec reads `gpus: H100` as one GPU; dstack reads a bare `gpu: H100` as one or more."""
    task, fleet = render({"resources": {"gpus": spec}})
    for config in (task, fleet):
        assert config.resources.gpu.count.min == config.resources.gpu.count.max == count


def test_amounts_render_as_at_least_ranges():
    """`cpus: 28` is "at least 28": dstack reads `cpu: 28` as exactly 28, so we render `28..`."""
    task, fleet = render({"resources": {"cpus": 28, "memory": "200GiB", "disk": "500GiB", "shm_size": "64GiB"}})
    resources = task.resources
    assert (resources.cpu.count.min, resources.cpu.count.max) == (28, None)
    assert (resources.memory.min, resources.memory.max) == (200, None)
    assert (resources.disk.size.min, resources.disk.size.max) == (500, None)
    assert resources.shm_size == 64
    assert (fleet.resources.disk.size.min, fleet.resources.disk.size.max) == (500, None)


def test_a_task_without_disk_asks_less_than_dstacks_default():
    """dstack's default disk is `100GB..` (resources.DEFAULT_DISK), compared to an offer's disk (a host's
    free disk on an SSH fleet): with none in the task we ask 50GB or more, in the task and the fleet."""
    from dstack._internal.core.models.resources import DEFAULT_DISK

    task, fleet = render({})
    for config in (task, fleet):
        assert config.resources.disk.size.max is None
        assert config.resources.disk.size.min == 50 < DEFAULT_DISK.size.min


@pytest.mark.parametrize("idle,expected", [(None, 300), ("15m", 900), ("1h", 3600), ("never", -1)])
def test_the_fleet_frees_its_instances_when_the_run_is_over(idle, expected):
    """dstack terminates only idle instances above nodes.min (fleets.py, idle_duration): the fleet
    starts at 0, grows to the task's nodes, and idle_duration comes from placement.idle where the task
    sets it, else 5 minutes (dstack's own default for a run's instances)."""
    placement = {} if idle is None else {"placement": {"idle": idle}}
    task, fleet = render(placement)
    assert fleet.nodes.min == 0
    assert fleet.nodes.max == task.nodes == 2
    assert fleet.idle_duration == expected


@pytest.mark.parametrize("task_path", TASKS, ids=lambda p: p.stem)
def test_every_shipped_fleet_scales_to_zero(task_path: Path):
    parse, _ = _dstack()
    provider = providers.get("dstack")
    plan = provider.plan(load_task(task_path))
    fleet = parse(yaml.safe_load(provider.render(plan)[f"{plan.name}-fleet.dstack.yml"]))
    assert fleet.nodes.min == 0 and fleet.nodes.max == plan.nodes
    assert fleet.idle_duration and fleet.idle_duration > 0


# ------------------------------------------------------------------ exactly or at least

def test_a_task_can_say_exactly_or_at_least():
    """Amounts are minimums (`28`, `28..`, `28+`), rendered as dstack's `28..`; listed under resources.exact they
    render as dstack's exact amount."""
    task, fleet = render({"resources": {"cpus": "28..", "memory": "200GiB+", "disk": "500GiB.."}})
    assert (task.resources.cpu.count.min, task.resources.cpu.count.max) == (28, None)
    assert (task.resources.memory.min, task.resources.memory.max) == (200, None)
    assert (task.resources.disk.size.min, task.resources.disk.size.max) == (500, None)
    task, fleet = render({"resources": {"cpus": 28, "memory": "200GiB", "disk": "500GiB",
                                        "exact": ["cpus", "memory", "disk"]}})
    assert task.resources.cpu.count.min == task.resources.cpu.count.max == 28
    assert task.resources.memory.min == task.resources.memory.max == 200
    for config in (task, fleet):
        assert config.resources.disk.size.min == config.resources.disk.size.max == 500


@pytest.mark.parametrize("resources,words", [
    ({"cpus": "28..32"}, r"resources\.cpus: '28\.\.32' is not an amount"),
    ({"disk": "1..2TB"}, r"resources\.disk: '1\.\.2TB' is not an amount"),
    ({"cpus": "many"}, r"resources\.cpus: 'many' is not a CPU count"),
    ({"disk": "500GB..", "exact": ["disk"]}, r"resources: .*disk: '500GB\.\.' says at least, and exact lists disk"),
    ({"exact": ["memory"]}, r"resources: .*exact lists memory, which the task does not give"),
    ({"cpus": 4, "exact": ["gpus"]}, r"resources\.exact\[0\]"),
])
def test_amount_errors_name_the_field(resources, words):
    from rlhf_tasks.errors import BadInput

    with pytest.raises(BadInput, match=words):
        parse_task({"name": "t", "nodes": 1, "resources": resources,
                    "job": {"recipe": "command", "args": {"entrypoint": "true"}}})


# ------------------------------------------------------------------ an SSH fleet

SSH = {"hosts": ["10.0.0.11", "10.0.0.12"], "user": "ubuntu", "identity_file": "~/.ssh/fleet_key",
       "network": "10.0.0.0/24"}


def backend_only_fields(fleet) -> list[str]:
    """The fields dstack refuses in an SSH fleet: server/services/fleets.py,
    _validate_fleet_configuration_subtype_specific_fields (every field of BackendFleetConfiguraionProps
    set to other than its default); its server module does not import without the server's extra."""
    from dstack._internal.core.models.fleets import BackendFleetConfiguraionProps

    return [name for name, field in BackendFleetConfiguraionProps.model_fields.items()
            if getattr(fleet, name) != (None if field.is_required() else field.get_default(call_default_factory=True))]


def test_the_fleet_can_be_your_own_hosts_over_ssh():
    task, fleet = render({"placement": {"dstack": {"ssh": SSH}}, "resources": {"gpus": "H100:8"}})
    assert fleet.ssh_config.hosts == SSH["hosts"] and fleet.ssh_config.user == "ubuntu"
    assert fleet.ssh_config.identity_file == "~/.ssh/fleet_key" and fleet.ssh_config.network == "10.0.0.0/24"
    assert fleet.nodes is None and fleet.placement.value == "cluster"
    assert backend_only_fields(fleet) == [], "dstack refuses these in an SSH fleet"
    assert [f.name for f in task.fleets] == ["t-fleet"]  # the run goes on the task's own hosts
    _, cloud = render({})
    assert backend_only_fields(cloud)  # the check above can fail: a cloud fleet has them


@pytest.mark.parametrize("placement,words", [
    ({"spot": "on"}, r"placement\.spot: on: an SSH fleet's hosts"),
    ({"backends": ["aws"]}, r"placement\.backends: the task runs on its SSH fleet"),
    ({"dstack": {"ssh": {**SSH, "hosts": []}}}, r"placement\.dstack\.ssh\.hosts"),
    ({"dstack": {"ssh": {"hosts": ["h"]}}}, r"placement\.dstack\.ssh\.user"),
    ({"dstack": {"sshh": {}}}, r"placement\.dstack\.sshh"),
])
def test_ssh_fleet_errors_name_the_field(placement, words):
    from rlhf_tasks.errors import BadInput

    placement = {"dstack": {"ssh": SSH}, **placement} if "dstack" not in placement else placement
    with pytest.raises(BadInput, match=words):
        render(placement and {"placement": placement})


# ------------------------------------------------------------------ a custom image

def test_a_custom_image_needs_no_look_up_and_a_private_registry_works():
    """With `user:` and the CPU architecture dstack's server reads nothing of the image from its registry
    (jobs/configurators/base.py: _user looks the image up when `user` is None, _requirements when
    resources.cpu.arch is None; _commands only without `commands`); registry_auth's password is the
    dstack secret's reference, which the server fills with its VariablesInterpolator."""
    from dstack._internal.utils.interpolator import VariablesInterpolator

    options = {"user": "1000:1000", "cpu_arch": "arm",
               "registry_auth": {"username": "robot", "password_secret": "REGISTRY_TOKEN"}}
    files = render_files({"image": "registry.example.com/team/verl:1", "resources": {"cpus": 8},
                          "placement": {"dstack": options}})
    assert "REGISTRY_TOKEN" in files["t.dstack.yml"]
    parse, _ = _dstack()
    task = parse(yaml.safe_load(files["t.dstack.yml"]))
    assert task.user == "1000:1000" and task.commands
    assert task.resources.cpu.arch.value == "arm" and task.resources.cpu.count.min == 8
    password = VariablesInterpolator({"secrets": {"REGISTRY_TOKEN": "s3cret"}}).interpolate_or_error(
        task.registry_auth.password)
    assert (task.registry_auth.username, password) == ("robot", "s3cret")


def test_an_image_without_user_or_architecture_is_said_to_be_looked_up():
    provider = providers.get("dstack")
    plan = provider.plan(parse_task({"name": "t", "nodes": 1, "image": "verlai/verl:latest",
                                     "job": {"recipe": "command", "working_dir": None,
                                             "args": {"entrypoint": "true"}}}))
    assert any("reads the image's configuration from its registry" in note for note in provider.notes(plan))


@pytest.mark.parametrize("field,value", [("user", "root"), ("cpu_arch", "x86"),
                                         ("registry_auth", {"username": "u", "password_secret": "P"})])
def test_image_options_without_an_image_are_refused(field, value):
    from rlhf_tasks.errors import BadInput

    with pytest.raises(BadInput, match=rf"placement\.dstack\.{field}: it is for a custom image"):
        render({"placement": {"dstack": {field: value}}})


def test_registry_password_is_a_secret_name_never_a_value():
    from rlhf_tasks.errors import BadInput

    with pytest.raises(BadInput, match=r"placement\.dstack\.registry_auth\.password_secret"):
        render({"image": "x/y:1", "placement": {"dstack": {"registry_auth": {"username": "u",
                                                                            "password_secret": "hunter2 !"}}}})


# ------------------------------------------------------------------ secrets: dstack's project secrets

def test_secrets_and_the_token_are_project_secret_references_the_server_fills():
    """The job's env names each secret and the Ray token as a reference to the cluster's own dstack project
    secret, which dstack's server fills as it hands the job to its runner (server/services/jobs/__init__.py
    interpolate_job_spec_secrets: VariablesInterpolator({"secrets": ...}) over every env value); the header says
    how to set them by hand. No bare name is left for `dstack apply` to fill from the environment."""
    from dstack._internal.utils.interpolator import VariablesInterpolator

    files = render_files({"name": "my-run", "secrets": ["HF_TOKEN", "WANDB_API_KEY"], "env": {"A": "1"}})
    parse, _ = _dstack()
    task = parse(yaml.safe_load(files["my-run.dstack.yml"]))
    names = {"HF_TOKEN": "rlhf_tasks__my_run__HF_TOKEN", "WANDB_API_KEY": "rlhf_tasks__my_run__WANDB_API_KEY",
             "RAY_AUTH_TOKEN": "rlhf_tasks__my_run__RAY_AUTH_TOKEN"}
    env = dict(task.env.as_dict())
    assert env == {"A": "1", **{k: f"${{{{ secrets.{v} }}}}" for k, v in names.items()}}, env
    project = {v: f"value-of-{k}" for k, v in names.items()}
    filled = {k: VariablesInterpolator({"secrets": project}).interpolate_or_error(v) for k, v in env.items()}
    assert filled == {"A": "1", **{k: f"value-of-{k}" for k in names}}
    header = files["my-run.dstack.yml"].split("\ntype: task")[0]
    assert 'dstack secret set rlhf_tasks__my_run__HF_TOKEN "$HF_TOKEN"' in header
    assert 'dstack secret set rlhf_tasks__my_run__RAY_AUTH_TOKEN "$(rlhf-tasks token my-run)"' in header


def test_two_clusters_never_share_a_secret_name():
    from rlhf_tasks.providers.dstack.project_secrets import secret_name

    pairs = [("a-b", "C"), ("a", "b_C"), ("a", "B__C"), ("a-b-c", "X"), ("a-b", "c_X"), ("ab", "C")]
    assert len({secret_name(c, v) for c, v in pairs}) == len(pairs)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", secret_name(c, v)) for c, v in pairs)  # a reference's name


# ------------------------------------------------------------------ commands under `bash -i -c`

def dstack_command_line(task) -> list[str]:
    """The job's command line as dstack's server makes it from `commands` (jobs/configurators/base.py,
    _commands: [shell, "-i", "-c", _join_shell_commands(commands)]; _join_shell_commands strips each item,
    wraps one ending in `&` in braces, and joins them with " && "); the server module does not import
    without the server's extra, so these lines follow it."""
    items = []
    for command in task.commands:
        command = command.strip()
        items.append("{ %s }" % command if command.endswith("&") else command)
    return ["/bin/bash", "-i", "-c", " && ".join(items)]


def test_commands_stop_at_the_first_failing_line_under_dstacks_shell(tmp_path):
    """A multi-line setup item whose middle line fails: without `set -e` bash goes on to the next line."""
    parse, _ = _dstack()
    marker = tmp_path / "went-on"
    files = render_files({"setup": [f"echo first\nfalse\ntouch {marker}", f"touch {marker}.next"]})
    argv = dstack_command_line(parse(yaml.safe_load(files["t.dstack.yml"])))
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert "first" in out.stdout
    assert out.returncode != 0 and not marker.exists() and not Path(f"{marker}.next").exists(), out.stderr
    assert "agent/__main__.py" not in out.stderr  # nor the agent


# ------------------------------------------------------------------ files: and the working directory

def archive_names(local_path: str) -> set[str]:
    """What `dstack apply` uploads of a `files:` entry: dstack's own archive of it."""
    from dstack._internal.utils.files import create_file_archive

    buffer = io.BytesIO()
    create_file_archive(local_path, buffer)
    buffer.seek(0)
    with tarfile.open(fileobj=buffer) as tar:
        return set(tar.getnames())


def resolved_files(config_path: Path):
    """The task's `files:` as dstack's client resolves them (RunCollection._validate_configuration_files:
    relative to the configuration file's directory; a missing path is refused)."""
    from dstack.api._public.runs import RunCollection

    parse, _ = _dstack()
    config = parse(yaml.safe_load(config_path.read_text()))
    RunCollection._validate_configuration_files(None, config, str(config_path))
    return config


def test_files_is_one_directory_mapping(tmp_path):
    for name, text in render_files({}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    config = resolved_files(tmp_path / "t.dstack.yml")
    assert [(f.local_path, f.path) for f in config.files] == [(str(tmp_path / "rlhf-tasks"), "/opt/rlhf-tasks")]
    names = archive_names(config.files[0].local_path)
    assert {"rlhf-tasks/t.dstack.plan.json", "rlhf-tasks/lib/rlhf_tasks/agent/__main__.py"} <= names


def project(tmp_path: Path, submit: str = "head") -> Path:
    code = tmp_path / "proj"
    (code / "src" / "data").mkdir(parents=True)
    (code / "src" / "reward_fn.py").write_text("def score(x):\n    return 1.0\n")
    (code / "task.yaml").write_text(yaml.safe_dump({
        "name": "wd", "nodes": 2, "job": {"recipe": "command", "working_dir": "src", "submit": submit,
                                          "args": {"entrypoint": "python3 -c 'import reward_fn'"}}}))
    return code


def cli(args, cwd, home, **env):
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, RLHF_TASKS_HOME=str(home), PYTHONPATH=str(ROOT), **env), timeout=120)


@pytest.mark.parametrize("output", ["out/", "out/deeper/wd.dstack.yml", "wd.dstack.yml"])
def test_the_working_dir_reaches_the_directory_the_job_runs_in(output, tmp_path):
    """job.working_dir is a `files:` entry that dstack's client finds from the rendered file's directory and
    archives; it lands where the task's working_dir says the commands run, which the shipped plan submits from."""
    code = project(tmp_path)
    out = cli(["render", "task.yaml", "--provider", "dstack", "-o", output], code, tmp_path / "home")
    assert out.returncode == 0, out.stderr
    main = code / output / "wd.dstack.yml" if output.endswith("/") else code / output
    config = resolved_files(main)
    mapped = {f.path: f.local_path for f in config.files}
    assert config.working_dir == JOB_DIR and Path(mapped[JOB_DIR]).resolve() == code / "src"
    assert "src/reward_fn.py" in archive_names(mapped[JOB_DIR])
    shipped = json.loads((main.parent / "rlhf-tasks" / "wd.dstack.plan.json").read_text())
    assert shipped["job"]["working_dir"] == JOB_DIR


def test_check_says_where_the_jobs_working_directory_will_be(tmp_path):
    code = project(tmp_path)
    out = cli(["check", "task.yaml", "--provider", "dstack"], code, tmp_path / "home")
    assert out.returncode == 0, out.stderr
    assert re.search(rf"working_dir {code / 'src'} \(\d+ KiB as dstack packs it, its limit 2 MiB\): "
                     r"`dstack apply` ships it "
                     r"\(dstack's files:.*\) to /opt/rlhf-tasks-workdir on every node, where the job's commands run", out.stdout), \
        out.stdout
    client = project(tmp_path / "c", submit="client")
    config = yaml.safe_load(cli(["render", "task.yaml", "--provider", "dstack"], client, tmp_path / "home").stdout)
    assert "working_dir" not in config and len(config["files"]) == 1  # submit: client uploads it through Ray


def test_a_working_dir_over_dstacks_limit_is_refused_at_check_and_launch(tmp_path):
    """Refused, not warned of: the issue's shipped verl task, checked from the repository's root, said it packs
    4 MiB and `check` exited 0."""
    code = project(tmp_path)
    (code / "src" / "data" / "big.bin").write_bytes(os.urandom(3 * 2**20))
    out = cli(["check", "task.yaml", "--provider", "dstack"], code, tmp_path / "home")
    assert out.returncode == 2 and "over the dstack server's limit of 2 MiB" in out.stderr and "/data/" in out.stderr
    (code / "bin").mkdir()
    (code / "bin" / "dstack").write_text("#!/bin/sh\nexit 0\n")
    (code / "bin" / "dstack").chmod(0o755)
    path = f"{code / 'bin'}:{os.environ['PATH']}"
    out = cli(["launch", "task.yaml", "--provider", "dstack"], code, tmp_path / "home", PATH=path)
    assert out.returncode == 2 and f"job.working_dir: {code / 'src'} packs 3 MiB" in out.stderr, out.stdout + out.stderr
    assert not (tmp_path / "home" / "runs").exists()  # nothing written
    (code / "src" / ".dstackignore").write_text("/data/\n")  # what the message says to do
    out = cli(["check", "task.yaml", "--provider", "dstack"], code, tmp_path / "home")
    assert "over the dstack server's limit" not in out.stdout + out.stderr
    from rlhf_tasks.providers.dstack.archive import dstack_packs

    assert "src/data/big.bin" not in archive_names(str(code / "src"))  # dstack's own archive agrees
    assert dstack_packs(str(code / "src")).size < 2**20
