"""The Slurm provider's batch script, without a cluster: what `rlhf-tasks render --provider
slurm` writes passes `bash -n` and shellcheck, carries the agent and the plan, takes its
#SBATCH lines from the task, runs an image with pyxis, docker or podman as documented,
and never holds a secret. (tests/test_slurm_provider.py runs it on a real Slurm.)"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.agent.protocol import PLAN_VERSION
from rlhf_tasks.errors import BadInput
from rlhf_tasks.plan import ROCM_ENV, gpu_vendor
from rlhf_tasks.providers.shipping import AGENT, module_files
from rlhf_tasks.providers.slurm.container import CONTAINER_SH, CONTAINER_STOP_S
from rlhf_tasks.spec import load_task, parse_task

from conftest import ROOT, need

TASKS = sorted((ROOT / "tasks").glob("*.yaml"))
IMAGE_TASK = ROOT / "tasks" / "verl-ppo-gsm8k.yaml"

FULL = {
    "name": "full", "nodes": 4, "resources": {"gpus": "H100:8", "cpus": 64, "memory": "512GiB", "shm_size": "64GiB"},
    "env": {"NCCL_DEBUG": "INFO", "QUOTED": "it's $HOME; `x`"}, "secrets": ["WANDB_API_KEY", "HF_TOKEN"],
    "checkpoints": {"path": "/shared/ckpt"}, "wait": {"head": "10m", "nodes": "5m"},
    "placement": {"retry": True, "slurm": {"partition": "gpu", "account": "proj-42", "qos": "high",
                                           "constraint": "h100&ib", "reservation": "rlhf"}},
    "job": {"recipe": "command", "timeout": "2h", "args": {"entrypoint": "python3 train.py"}},
}


def task_data(path: Path, **slurm) -> dict:
    data = yaml.safe_load(path.read_text())
    if slurm:
        data.setdefault("placement", {}).setdefault("slurm", {}).update(slurm)
    return data


def render(data: dict) -> str:
    provider = providers.get("slurm")
    (script,) = provider.render(provider.plan(parse_task(data))).values()
    return script


def sbatch_options(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def heredoc(script: str, delimiter: str) -> str:
    match = re.search(rf"<<'{delimiter}'\n(.*?)\n{delimiter}\n", script, re.S)
    return match.group(1) + "\n"


def srun_step(script: str) -> str:
    """The srun command line, continuations joined."""
    return script[script.index("\nsrun "):script.index("|| status=$?")].replace("\\\n", " ")


#: FULL with the options of the guides' scripts (OpenRLHF's and verl's Slurm guides) as placement.slurm's fields,
#: and one more through the checked pass-through.
GUIDES = {**FULL, "placement": {**FULL["placement"], "slurm": {
    **FULL["placement"]["slurm"], "nodelist": "gpu[01-04]", "output": "logs/%x-%j.out", "error": "logs/%x-%j.err",
    "mail_type": "end,FAIL", "mail_user": "me@example.org", "overcommit": True,
    "sbatch": ["--signal=B:USR1@300", "--comment=rlhf"]}}}

SCRIPTS = [(path.stem, task_data(path)) for path in TASKS] + [
    (f"{IMAGE_TASK.stem}-{container}", task_data(IMAGE_TASK, container=container))
    for container in ("pyxis", "docker", "podman")] + [("full", FULL), ("guides", GUIDES)]


@pytest.mark.parametrize("name,data", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_every_script_passes_bash_n_and_shellcheck(name, data, tmp_path):
    need(shutil.which("shellcheck") is not None, "shellcheck (apt-get install shellcheck)")
    path = tmp_path / f"{name}.sbatch"
    path.write_text(render(data))
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    lint = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", str(path)], capture_output=True, text=True)
    assert lint.returncode == 0 and not lint.stdout, lint.stdout


def test_sbatch_lines_come_from_the_task():
    assert sbatch_options(render(FULL)) == [
        "--job-name=full", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=64", "--gpus-per-node=8",
        "--mem=512G", "--exclusive", "--time=0-02:15:00",  # the job's 2h + the waits for head (10m) and nodes (5m)
        "--output=%x-%j.out", "--export=ALL", "--requeue",
        "--partition=gpu", "--account=proj-42", "--qos=high", "--constraint=h100&ib", "--reservation=rlhf"]
    gres = {**FULL, "placement": {"max_duration": "3d", "slurm": {"gres": "gpu:h100:8"}}}
    options = sbatch_options(render(gres))
    assert "--gres=gpu:h100:8" in options and not any(o.startswith("--gpus-per-node") for o in options)
    assert "--time=3-00:00:00" in options and "--no-requeue" in options


def test_the_guides_slurm_options_are_fields_and_the_rest_passes_through():
    """issue 47 item 2: --nodelist, --output/--error, --mail-type/--mail-user and --overcommit as the guides write
    them, after the script's own lines; then placement.slurm.sbatch, as given."""
    assert sbatch_options(render(GUIDES)) == [
        "--job-name=full", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=64", "--gpus-per-node=8",
        "--mem=512G", "--exclusive", "--time=0-02:15:00", "--output=logs/%x-%j.out", "--error=logs/%x-%j.err",
        "--export=ALL", "--requeue", "--partition=gpu", "--account=proj-42", "--qos=high", "--constraint=h100&ib",
        "--reservation=rlhf", "--nodelist=gpu[01-04]", "--mail-type=END,FAIL", "--mail-user=me@example.org",
        "--overcommit", "--signal=B:USR1@300", "--comment=rlhf"]
    assert "# Output: logs/%x-%j.out (its stderr: logs/%x-%j.err) (this script)" in render(GUIDES)
    listed = {**GUIDES, "placement": {"slurm": {"mail_type": ["begin", "END"]}}}
    assert "--mail-type=BEGIN,END" in sbatch_options(render(listed))
    # --mem=0 (all of each node's memory, sbatch(1)) through the pass-through, where the task gives no memory
    whole = {**FULL, "resources": {"gpus": "H100:8"}, "placement": {"slurm": {"sbatch": ["--mem=0"]}}}
    assert sbatch_options(render(whole))[-1] == "--mem=0"
    # A task without them plans and renders as before: its plan names none of them (the goldens hold the rest).
    plan = json.loads(heredoc(render(FULL), "RLHF_TASKS_PLAN_JSON"))
    assert set(plan["placement"]["slurm"]) == {"partition", "account", "qos", "constraint", "reservation", "gres",
                                               "gpu_type", "container", "mounts"}
    assert json.loads(heredoc(render(GUIDES), "RLHF_TASKS_PLAN_JSON"))["placement"]["slurm"]["overcommit"] is True


def test_every_option_the_script_sets_is_refused_through_the_pass_through():
    """Each of the script's own #SBATCH lines (read from its render, the guides' fields too), given again in
    placement.slurm.sbatch, is refused naming the item and where the script's line comes from: sbatch would
    take the later one silently."""
    provider = providers.get("slurm")
    rendered = provider.sbatch_lines(provider.plan(parse_task(GUIDES)), passed=False)
    assert len(rendered) == 21
    for option, where in rendered:
        data = {**GUIDES, "placement": {**GUIDES["placement"], "slurm": {**GUIDES["placement"]["slurm"],
                                                                        "sbatch": ["--comment=ok", option]}}}
        with pytest.raises(BadInput) as err:
            provider.plan(parse_task(data))
        assert f"placement.slurm.sbatch[1]: {option} fights the script's own #SBATCH {option} (" in str(err.value)
        assert where in str(err.value) and "sbatch takes the later of the two, silently" in str(err.value)


@pytest.mark.parametrize("item,slurm,fights", [
    ("--gpus=16", {}, "#SBATCH --gpus-per-node=8 (from resources.gpus): both set the job's GPUs"),
    ("--gres=gpu:h100:8", {}, "#SBATCH --gpus-per-node=8 (from resources.gpus): both set the job's GPUs"),
    ("--mem-per-cpu=4G", {}, "#SBATCH --mem=512G (from resources.memory): both set the job's memory"),
    ("--cpus-per-gpu=8", {}, "#SBATCH --cpus-per-task=64 (from resources.cpus): both set the CPUs of a task"),
    ("--ntasks=32", {}, "#SBATCH --ntasks-per-node=1 (the script's own: one agent a node): both set the job's tasks"),
    ("--oversubscribe", {}, "#SBATCH --exclusive (the script's own: Ray's fixed ports"),
    ("--no-requeue", {}, "#SBATCH --requeue (from placement.retry): both set whether Slurm requeues the job"),
    ("--nodefile=/etc/nodes", {"nodelist": "gpu[01-04]"},
     "#SBATCH --nodelist=gpu[01-04] (from placement.slurm.nodelist): both set the job's hosts"),
    ("--mail-type=FAIL", {"mail_type": "END"}, "#SBATCH --mail-type=END (from placement.slurm.mail_type)"),
    ("--partition=big", {"partition": "gpu"}, "#SBATCH --partition=gpu (from placement.slurm.partition)"),
    ("--output=x.out", {}, "#SBATCH --output=%x-%j.out (the script's own, %x-%j.out beside it, which launch follows; "
                           "placement.slurm.output sets it)"),
    ("--ntasks-per=2", {}, "#SBATCH --ntasks-per-node=1 (the script's own: one agent a node): sbatch reads "
                           "--ntasks-per, which starts --ntasks-per-node, as that option"),
    ("--exp=NONE", {}, "#SBATCH --export=ALL (the script's own: the secrets and the Ray token come from the "
                       "submitting environment): sbatch reads --exp"),
])
def test_a_passed_option_that_fights_the_scripts_own_is_refused(item, slurm, fights):
    data = {**FULL, "placement": {"retry": True, "slurm": {**slurm, "sbatch": [item]}}}
    with pytest.raises(BadInput) as err:
        render(data)
    assert f"placement.slurm.sbatch[0]: {item} fights the script's own {fights}" in str(err.value)


@pytest.mark.parametrize("item,slurm,why", [
    ("--array=0-3", {}, "an array would start one cluster per task"),
    ("--wait", {}, "sbatch would not return until the job ended"),
    ("--clusters=other", {}, "launch asks this cluster's slurmctld"),
    ("--chdir=/scratch", {}, "moves the script's --output=%x-%j.out"),
    ("--chdir=/scratch", {"output": "/shared/logs/%x-%j.out", "error": "err-%j"}, "moves the script's --error=err-%j"),
])
def test_a_passed_option_that_breaks_launch_is_refused(item, slurm, why):
    with pytest.raises(BadInput, match=re.escape(f"placement.slurm.sbatch[0]: {item}")) as err:
        render({**FULL, "placement": {"slurm": {**slurm, "sbatch": [item]}}})
    assert why in str(err.value)


def test_what_the_script_does_not_set_passes_through():
    """The pass-through takes what the script leaves: --mem=0 without resources.memory, --partition without
    placement.slurm.partition (the issue's own --mail-type=FAIL without mail_type), --chdir with absolute outputs."""
    open_task = {**FULL, "resources": {"gpus": "8"}, "placement": {"slurm": {
        "output": "/shared/%x-%j.out", "sbatch": ["--mem=0", "--partition=gpu", "--mail-type=FAIL", "--chdir=/scratch",
                                                  "--mem-bind=local"]}}}
    assert sbatch_options(render(open_task))[-5:] == ["--mem=0", "--partition=gpu", "--mail-type=FAIL",
                                                      "--chdir=/scratch", "--mem-bind=local"]


def test_sbatch_writes_the_script_output_where_launch_follows_it(tmp_path):
    """--output/--error patterns as Slurm fills them for a job that is no array, relative to the submission
    directory; a host's %N only the node knows (left out of what launch follows)."""
    import getpass

    from rlhf_tasks.providers.slurm.commands import filename

    user = getpass.getuser()
    assert filename("%x-%j.out", "t", "42", tmp_path) == tmp_path / "t-42.out"
    assert filename("logs/%x-%A-%u-%5j-%%.out", "t", "42", tmp_path) == tmp_path / f"logs/t-42-{user}-00042-%.out"
    assert filename("/abs/o-%j", "t", "42", tmp_path) == Path("/abs/o-42")
    assert filename("o-%N.out", "t", "42", tmp_path) is None


def test_one_srun_step_runs_the_agent_on_every_node():
    script = render(FULL)
    step = srun_step(script)
    assert step.split()[:7] == ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                "--whole", '--output="$run_dir/node%n.out"']
    assert 'python3 "$run_dir/lib/rlhf_tasks/agent/__main__.py" --plan "$run_dir/plan.json"' in step
    shell = script
    for text in module_files([AGENT]).values():
        shell = shell.replace(text, "")  # Python, not shell
    assert script.count("\nsrun ") == 1 and "sleep" not in shell
    assert script.rstrip().endswith('exit "$status"')  # the job's exit code is the script's


def test_the_script_carries_the_agent_and_its_plan():
    script = render(FULL)
    agent = module_files([AGENT])
    assert "rlhf_tasks/__init__.py" in agent and "rlhf_tasks/agent/__main__.py" in agent
    for path, text in agent.items():  # the agent's package as plain files under lib/, first on PYTHONPATH
        assert f"cat > \"$run_dir/lib/{path}\" <<'RLHF_TASKS_MODULE_PY'\n{text}RLHF_TASKS_MODULE_PY\n" in script
    assert 'export PYTHONPATH="$run_dir/lib${PYTHONPATH:+:$PYTHONPATH}"' in script
    plan = json.loads(heredoc(script, "RLHF_TASKS_PLAN_JSON"))
    assert plan["version"] == PLAN_VERSION and plan["provider"] == "slurm"
    assert plan["contract"]["head"]["command"] == ["scontrol", "show", "hostnames", "{SLURM_JOB_NODELIST}"]
    assert plan["contract"]["head"]["item"] == 0 and plan["contract"]["peer"]["item"] == 1
    assert plan["contract"]["rank"]["env"] == "SLURM_NODEID"
    assert plan["env"]["QUOTED"] == "it's $HOME; `x`"  # data, not shell: the heredoc is quoted


def test_secrets_travel_by_name_only(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-secret-value")
    for data in (FULL, task_data(IMAGE_TASK, container="docker")):
        script = render(data)
        assert "secret-value" not in script
        assert "never written here: WANDB_API_KEY, HF_TOKEN, RAY_AUTH_TOKEN" in script
    docker = srun_step(render(task_data(IMAGE_TASK, container="docker")))
    for name in ("WANDB_API_KEY", "HF_TOKEN", "RAY_AUTH_TOKEN", "SLURM_NODEID", "RLHF_TASKS_HOSTS"):
        assert f"--env={name} " in docker + " "


def test_pyxis_runs_the_image_with_the_agents_and_checkpoint_dirs_mounted(tmp_path):
    data = task_data(IMAGE_TASK, mounts=["/data:/data:ro"])
    data["job"]["working_dir"] = str(tmp_path)  # the shipped task ships none
    script = render(data)
    step = srun_step(script)
    assert "--container-image=verlai/verl:vllm017.latest" in step
    assert ('--container-mounts="$job_dir":"$job_dir","$run_dir":"$run_dir",/checkpoints/verl-ppo-gsm8k:'
            "/checkpoints/verl-ppo-gsm8k,/data:/data:ro") in step
    assert '--container-workdir="$job_dir"' in step  # the head uploads job.working_dir `.` from there
    # no scontrol in the image: the script expands the host list, the contract reads it
    assert 'RLHF_TASKS_HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)' in script
    contract = json.loads(heredoc(script, "RLHF_TASKS_PLAN_JSON"))["contract"]
    assert contract["head"] == {**contract["head"], "env": "RLHF_TASKS_HOSTS", "item": 0}


def test_the_agents_run_where_job_working_dir_is_read(tmp_path, monkeypatch, capsys):
    """job.working_dir, relative to the task file's directory, is written absolute (the path every node sees
    on the shared filesystem, wherever `sbatch` or `launch` runs): the agents run there and the head uploads
    `.` to the job; none named, they run where they did. `check` measures it, as the head's Ray will."""
    from rlhf_tasks.cli import main

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print(1)\n")
    data = {**FULL, "job": {**FULL["job"], "working_dir": "code"}}
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(data))
    provider = providers.get("slurm")
    (script,) = provider.render(provider.plan(load_task(path))).values()
    assert f"job_dir={tmp_path / 'code'}" in script.splitlines()
    assert '--chdir="$job_dir"' in srun_step(script).split()
    plan = json.loads(heredoc(script, "RLHF_TASKS_PLAN_JSON"))
    assert plan["job"]["working_dir"] == "."
    none = render({**FULL, "job": {**FULL["job"], "working_dir": None}})
    assert "job_dir" not in none and "--chdir" not in srun_step(none)
    monkeypatch.chdir("/")
    assert main(["check", str(path), "--provider", "slurm"]) == 0
    out = capsys.readouterr().out
    assert (f"working_dir {tmp_path / 'code'} packs 9 bytes (measured with Ray's own traversal): the agents run in it "
            "and the head uploads it to the job (Ray's working_dir), so it must be on the cluster's shared "
            "filesystem") in out, out


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_docker_and_podman_wrap_the_agent_as_verls_amd_script_does(engine, tmp_path):
    data = task_data(ROOT / "tasks" / "verl-ppo-gsm8k-mi300x.yaml", container=engine)
    data["job"]["working_dir"] = str(tmp_path)  # the shipped task ships none
    script = render(data)
    step = srun_step(script)
    words = step.split()
    run = words.index(engine)
    assert words[run:run + 4] == [engine, "run", "--rm", "--init"]
    for option in ("--network=host", "--shm-size=125000000k", "--device=/dev/kfd", "--device=/dev/dri",
                   "--group-add=video", "--cap-add=SYS_PTRACE", "--security-opt=seccomp=unconfined",
                   "--device=/dev/infiniband", "--env=ROCR_VISIBLE_DEVICES", "--env=NCCL_IB_HCA",
                   '--volume="$run_dir":"$run_dir"', '--volume="$job_dir":"$job_dir"', '--workdir="$job_dir"'):
        assert option in words, option
    # the scheduler's choice goes in; the agent turns it into HIP_VISIBLE_DEVICES there (test_agent.py)
    assert "--env=CUDA_VISIBLE_DEVICES" not in words and "--env=HIP_VISIBLE_DEVICES" not in words
    assert "--privileged" not in words  # the site's opt-in
    assert "--ipc=host" not in words  # podman refuses it beside --shm-size; the host's /dev/shm where no size is given
    unsized = {**data, "resources": {k: v for k, v in data["resources"].items() if k != "shm_size"}}
    assert "--ipc=host" in srun_step(render(unsized)).split() and "--shm-size" not in srun_step(render(unsized))
    privileged = srun_step(render({**data, "placement": {"slurm": {"container": engine, "privileged": True}}}))
    assert "--privileged" in privileged.split()
    # The image's own PYTHONPATH is kept: the agent runs by its path and puts lib/ before the image's
    # entries for what it starts (issue 32, item 3); no option sets the container's PYTHONPATH.
    assert not [w for w in words if w.startswith("--env=PYTHONPATH")], step
    assert words[words.index('--workdir="$job_dir"') + 1:][:3] == [
        "rlsys/verl:verl-0.4.1_ubuntu-22.04_rocm6.3.4-numa-patch_vllm0.8.5_sglang0.4.6.post4", "python3",
        '"$run_dir/lib/rlhf_tasks/agent/__main__.py"']
    # the task's env is exported for the container to take by name
    assert "export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_8,mlx5_9" in script
    nvidia = srun_step(render(task_data(IMAGE_TASK, container=engine)))
    assert ("--gpus=all" if engine == "docker" else "--device=nvidia.com/gpu=all") in nvidia.split()
    assert "--env=CUDA_VISIBLE_DEVICES" in nvidia.split() and "/dev/kfd" not in nvidia
    assert "SYS_PTRACE" not in nvidia and "seccomp" not in nvidia


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_every_nodes_container_is_named_and_stopped_by_its_name(engine):
    script = render(task_data(IMAGE_TASK, container=engine))
    assert 'container=verl-ppo-gsm8k-"$SLURM_JOB_ID"' in script
    assert heredoc(script, "RLHF_TASKS_CONTAINER_SH") == CONTAINER_SH
    words = srun_step(script).split()
    wrapper = words.index("bash")  # the wrapper runs the engine's client and stops the container it names
    assert words[wrapper:wrapper + 6] == ["bash", '"$run_dir/container.sh"', '"$container"', engine, "run", "--rm"]
    assert '--name="$container"' in words
    # after the agents' step, one more on every node: what a task Slurm killed could not stop
    after = script[script.index("|| status=$?"):]
    assert (f'srun --overlap --nodes=2 --ntasks=2 --ntasks-per-node=1 \\\n    bash "$run_dir/container.sh" '
            f'"$container" {engine} stop ||') in after
    assert after.rstrip().endswith('exit "$status"')
    for other in ("pyxis", None):  # in the step, or no image: Slurm stops it, no wrapper
        plain = render(task_data(IMAGE_TASK, container=other) if other else FULL)
        assert "container.sh" not in plain and "$container" not in plain


def test_the_container_wrapper_passes_shellcheck(tmp_path):
    need(shutil.which("shellcheck") is not None, "shellcheck (apt-get install shellcheck)")
    path = tmp_path / "container.sh"
    path.write_text(CONTAINER_SH)
    lint = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", str(path)], capture_output=True, text=True)
    assert lint.returncode == 0 and not lint.stdout, lint.stdout


#: A stand-in engine: `run` starts the "container" as a process of its own (as conmon does) and
#: relays its output until it ends; `stop` signals it by name and waits; `rm` forgets it.
FAKE_ENGINE = """#!/bin/bash
dir=$(dirname "$0")
echo "$*" >> "$dir/calls"
case $1 in
run)
    name=${2#--name=}
    shift 2
    : > "$dir/$name.out"
    setsid "$@" > "$dir/$name.out" 2>&1 &
    echo $! > "$dir/$name.pid"
    tail --pid=$! -n +1 -f "$dir/$name.out"
    wait $!
    ;;
stop) pid=$(cat "$dir/$3.pid" 2>/dev/null) || exit 125; kill -TERM "$pid"; tail --pid="$pid" -f /dev/null ;;
rm) rm -f "$dir/$3.pid" ;;
container) test -e "$dir/$3.pid" ;;
esac
"""
#: The agent's stand-in: says it is up, and on SIGTERM prints its last line and exits 143.
FAKE_AGENT = ("import signal, sys\n"
              "signal.signal(signal.SIGTERM, lambda *_: (print('agent: result line', flush=True), sys.exit(143)))\n"
              "print('agent: up', flush=True)\n"
              "signal.pause()\n")


def test_the_container_wrapper_stops_its_container_by_name_however_the_task_ends(tmp_path):
    engine = tmp_path / "engine"
    engine.write_text(FAKE_ENGINE)
    engine.chmod(0o755)
    wrapper = tmp_path / "container.sh"
    wrapper.write_text(CONTAINER_SH)
    calls = tmp_path / "calls"

    def stops() -> list[str]:
        return [line for line in calls.read_text().splitlines() if line.startswith(("stop ", "rm "))]

    def run(name: str, *command: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(wrapper), name, str(engine), *command], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=tmp_path, **kw)

    # the container ends by itself: the task ends with its exit code, and the name is removed
    done = run("c1", "run", "--name=c1", "python3", "-c", "raise SystemExit(3)")
    assert done.wait(60) == 3
    assert stops() == [f"stop --time={CONTAINER_STOP_S} c1", "rm --force c1"]

    # Slurm's SIGTERM (scancel, the time limit): the wrapper stops the container by name, then
    # waits for the client to pass on the agent's last lines, and ends with the container's code
    calls.unlink()
    task = run("c2", "run", "--name=c2", "python3", "-c", FAKE_AGENT)
    deadline = time.monotonic() + 30
    while "agent: up" not in ((tmp_path / "c2.out").read_text() if (tmp_path / "c2.out").exists() else ""):
        assert time.monotonic() < deadline and task.poll() is None, "the fake container did not start"
        time.sleep(0.05)
    task.send_signal(signal.SIGTERM)
    out, _ = task.communicate(timeout=60)
    assert task.returncode == 143, out
    assert "rlhf-tasks: signalled: stopping container c2" in out and "agent: result line" in out, out
    assert stops() == [f"stop --time={CONTAINER_STOP_S} c2"] * 2 + ["rm --force c2"]  # on the signal, at the end
    assert not (tmp_path / "c2.pid").exists()

    # the script's clean-up step: stop and remove by name; it fails only if the container stays
    assert run("c2", "stop").wait(60) == 0
    (tmp_path / "stuck.pid").write_text("999999999")  # an engine that cannot remove it
    engine.write_text(FAKE_ENGINE.replace('rm) rm -f "$dir/$3.pid"', "rm) true"))
    stuck = run("stuck", "stop")
    assert stuck.wait(60) == 1 and "container stuck is still there" in stuck.stdout.read()


def test_amd_gpus_get_the_rocm_preset():
    assert [gpu_vendor(n) for n in ("MI300X", "mi250", "MI355X", "AMD-Instinct-MI300X-OAM", "H100", "A100-80GB", None)] == [
        "amd", "amd", "amd", "amd", "nvidia", "nvidia", None]
    provider = providers.get("slurm")
    amd = provider.plan(parse_task({**FULL, "resources": {"gpus": "MI300X:8"}}))
    assert amd.gpu_vendor == "amd"  # the agent names the node's GPUs (raynode.amd_visible_devices)
    assert {k: amd.env[k] for k in ROCM_ENV} == ROCM_ENV and amd.env["NCCL_DEBUG"] == "INFO"
    assert not {"HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & set(amd.env)
    overridden = provider.plan(parse_task({**FULL, "resources": {"gpus": "MI250:4"}, "env": {"NCCL_PROTO": "LL"}}))
    assert overridden.env["NCCL_PROTO"] == "LL"
    nvidia = provider.plan(parse_task(FULL))
    assert nvidia.gpu_vendor == "nvidia" and not set(nvidia.env) & set(ROCM_ENV)
    assert provider.plan(parse_task({**FULL, "resources": {"gpus": "8"}})).gpu_vendor is None  # a bare count
    infiniband = provider.plan(parse_task({**FULL, "network": "infiniband"}))
    assert infiniband.network_env == {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}",
                                      "NCCL_IB_DISABLE": "0"}  # HCA names stay the task's


@pytest.mark.parametrize("change,field", [
    ({"placement": {"slurm": {"container": "docker"}}}, "placement.slurm.container"),
    ({"placement": {"slurm": {"mounts": ["/data:/data"]}}}, "placement.slurm.mounts"),
    ({"image": "x", "placement": {"slurm": {"mounts": ["data:/data"]}}}, "placement.slurm.mounts"),
    ({"placement": {"slurm": {"partition": "gpu\n#SBATCH --uid=0"}}}, "placement.slurm.partition"),
    ({"placement": {"slurm": {"container": "singularity"}}}, "placement.slurm.container"),
    ({"placement": {"slurm": {"mail_type": "END,FAILED"}}}, "placement.slurm.mail_type[1]: 'FAILED' is not one of "
                                                          "sbatch's mail types (did you mean FAIL?)"),
    ({"placement": {"slurm": {"nodelist": "gpu01 gpu02"}}}, "placement.slurm.nodelist: 'gpu01 gpu02': one word"),
    ({"placement": {"slurm": {"output": "my logs/%j"}}}, "placement.slurm.output: 'my logs/%j': one word"),
    ({"placement": {"slurm": {"error": "logs/%j/err"}}}, "placement.slurm.error: 'logs/%j/err': Slurm makes no "
                                                      "directory for it"),
    ({"placement": {"slurm": {"overcommit": "yes please"}}}, "placement.slurm.overcommit"),
    ({"placement": {"slurm": {"sbatch": ["--comment=ok", "-w gpu01"]}}},
     "placement.slurm.sbatch[1]: '-w gpu01': one option an item, --NAME or --NAME=VALUE in sbatch's long form"),
    ({"placement": {"slurm": {"sbatch": ["--comment=a b"]}}}, "placement.slurm.sbatch[0]: '--comment=a b'"),
    ({"placement": {"slurm": {"sbatch": ["--comment=x\n#SBATCH --uid=0"]}}}, "placement.slurm.sbatch[0]"),
    ({"placement": {"slurm": {"sbatch": "--mem=0"}}}, "placement.slurm.sbatch"),
    ({"image": "x", "placement": {"slurm": {"privileged": True}}}, "placement.slurm.privileged"),
    ({"placement": {"slurm": {"container": "podman", "privileged": True}}}, "placement.slurm.container"),
    ({"placement": {"slurm": {"privileged": "yes please"}}}, "placement.slurm.privileged"),
    ({"job": {"recipe": "torchrun", "submit": "client", "args": {"module": "m"}}}, "job.submit"),
    ({"job": {"recipe": "torchrun", "args": {"module": "m", "script": "/s.py"}}}, "job.args"),
])
def test_bad_slurm_inputs_name_their_field(change, field):
    data = {"name": "bad", "nodes": 2, "job": {"recipe": "command", "args": {"entrypoint": "true"}}, **change}
    provider = providers.get("slurm")
    with pytest.raises(BadInput, match=re.escape(field)):
        provider.plan(parse_task(data))


def test_launch_refuses_a_client_submission_before_submitting(tmp_path, monkeypatch, rlhf_home):
    monkeypatch.chdir(tmp_path)
    provider = providers.get("slurm")
    plan = provider.plan(parse_task({**FULL, "job": {**FULL["job"], "submit": "client"}}))
    assert "--provider slurm" in render({**FULL, "job": {**FULL["job"], "submit": "client"}})  # renders fine
    with pytest.raises(BadInput, match="job.submit"):
        provider.apply(plan, {})
    assert not (rlhf_home / "runs").exists()  # nothing staged, nothing submitted


def test_torchrun_runs_on_every_node_without_ray():
    provider = providers.get("slurm")
    plan = provider.plan(parse_task({
        "name": "dpo", "nodes": 2, "resources": {"gpus": "H100:8"},
        "job": {"recipe": "torchrun", "args": {"module": "openrlhf.cli.train_dpo", "args": ["--beta", "0.1"]}}}))
    assert plan.job.mode == "every_node" and plan.token_env is None and plan.job.working_dir is None
    assert plan.job.entrypoint == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "{rank}",
                                   "--rdzv-endpoint", "{head_addr}:29500", "-m", "openrlhf.cli.train_dpo",
                                   "--beta", "0.1"]
    script = render({"name": "dpo", "nodes": 2, "job": {"recipe": "torchrun", "args": {"script": "/x.py"}}})
    assert "never written here: nothing" in script  # no Ray: no token
    with pytest.raises(BadInput, match="nproc_per_node 16 is more than the 8 GPUs"):
        provider.plan(parse_task({"name": "dpo", "nodes": 2, "resources": {"gpus": "H100:8"},
                                  "job": {"recipe": "torchrun", "args": {"module": "m", "nproc_per_node": 16}}}))


def test_the_gpu_type_reaches_slurm_by_the_clusters_name_for_it_or_its_drop_is_said():
    """resources.gpus H100:8 -> --gpus-per-node=h100:8 when placement.slurm.gpu_type gives the
    cluster's name for the type (gres.conf's); without it the type is dropped, and `check` and
    `render` say so (a warning, as the KubeRay provider's for its node selector)."""
    provider = providers.get("slurm")
    typed = {**FULL, "placement": {"slurm": {"gpu_type": "h100"}}}
    plan = provider.plan(parse_task(typed))
    assert "--gpus-per-node=h100:8" in sbatch_options(provider.render(plan)[f"{plan.name}.sbatch"])
    assert not any("gpu_type" in note for note in provider.notes(plan))
    untyped = provider.plan(parse_task(FULL))
    assert "--gpus-per-node=8" in sbatch_options(render(FULL))
    (said,) = [note for note in provider.notes(untyped) if "resources.gpus" in note]
    assert "H100" in said and "any type" in said and "placement.slurm.gpu_type" in said
    counted = provider.plan(parse_task({**FULL, "resources": {"gpus": "8"}}))  # no type asked for: nothing dropped
    assert not any("resources.gpus" in note for note in provider.notes(counted))
    gres = provider.plan(parse_task({**FULL, "placement": {"slurm": {"gres": "gpu:h100:8"}}}))
    assert not any("resources.gpus" in note for note in provider.notes(gres))


@pytest.mark.parametrize("change, why", [
    ({"placement": {"slurm": {"gpu_type": "h100", "gres": "gpu:h100:8"}}}, "placement.slurm.gres says the GPUs"),
    ({"resources": {"cpus": 4}, "placement": {"slurm": {"gpu_type": "h100"}}}, "no GPUs"),
    ({"placement": {"slurm": {"gpu_type": "h100 --uid=0"}}}, "one word")])
def test_a_gpu_type_that_cannot_apply_is_refused(change, why):
    with pytest.raises(BadInput, match=re.escape("placement.slurm.gpu_type") + ".*" + re.escape(why)):
        providers.get("slurm").plan(parse_task({**FULL, **change}))


def test_a_script_without_a_time_limit_is_said():
    """No placement.max_duration and no job.timeout: no --time, so Slurm gives the partition's
    default limit; `check` and `render` say so, with the field that sets it."""
    provider = providers.get("slurm")
    open_ended = {**FULL, "job": {"recipe": "command", "args": {"entrypoint": "python3 train.py"}}}
    plan = provider.plan(parse_task(open_ended))
    assert not any(o.startswith("--time") for o in sbatch_options(render(open_ended)))
    (said,) = [note for note in provider.notes(plan) if "--time" in note]
    assert "placement.max_duration" in said and "partition" in said
    for limited in (FULL, {**open_ended, "placement": {"max_duration": "3h"}}):
        assert not any("--time" in note for note in provider.notes(provider.plan(parse_task(limited))))


def test_check_and_render_print_the_slurm_notes(tmp_path, capsys, rlhf_home):
    from rlhf_tasks.cli import main

    task = tmp_path / "t.yaml"
    task.write_text(yaml.safe_dump({**FULL, "job": {"recipe": "command", "args": {"entrypoint": "true"}}}))
    assert main(["render", str(task), "--provider", "slurm"]) == 0
    err = capsys.readouterr().err
    assert "warning: resources.gpus" in err and "--time" in err
