"""`launch` and `down` with dstack and SkyPilot up to their CLIs, the remote boundary:
a stand-in `dstack` / `sky` / `ssh` on PATH records how it was called and with which
environment, so we check the argv (parsed with dstack's and SkyPilot's own CLI parsers,
as the real commands would read it), that secrets and the token reach the CLI by
environment only, and the install hint when the CLI is missing."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

from conftest import ROOT
from rlhf_tasks.agent.protocol import RESULT_PREFIX

RECORDER = """#!{python}
import json, os, sys
files = {{a: open(a).read() for a in sys.argv[1:] if os.path.isfile(a)}}  # what it was asked to apply
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": [os.path.basename(sys.argv[0])] + sys.argv[1:], "cwd": os.getcwd(), "files": files,
                        "token": os.environ.get("RAY_AUTH_TOKEN"), "wandb": os.environ.get("WANDB_API_KEY"),
                        "own_session": os.getsid(0) == os.getpid()}}) + "\\n")
print({output!r}, end="", flush=True)
sys.exit({code})
"""


#: A stand-in for the interpreter that runs rlhf_tasks/providers/dstack/dstack_api.py against dstack's server
#: ($RLHF_TASKS_DSTACK_PYTHON): records the question (and what it was given on stdin), answers from the JSON
#: file beside it; setting and deleting secrets succeed.
API = """#!{python}
import json, os, sys
args = [a for a in sys.argv[1:] if a != "-I"]
given = sys.stdin.read()
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": ["dstack_api.py"] + args[1:], "cwd": os.getcwd(), "files": {{}}, "stdin": given,
                        "wandb": os.environ.get("WANDB_API_KEY")}}) + "\\n")
answers = json.load(open({answers!r}))
if args[1] == "secrets-set":
    print(json.dumps({{"set": sorted(json.loads(given))}}))
elif args[1] == "secrets-delete":
    print(json.dumps({{"deleted": args[2:]}}))
else:
    print(json.dumps(answers[args[1]]))
"""
#: dstack's answers by default: a fleet of the user's is there, and its plan has offers for every job.
FITS = {"fleets": {"fleets": ["user-fleet"]},
        "plan": {"jobs": [{"offers": 3, "requirements": "gpu=H100:8"}] * 2, "fleets": ["user-fleet"]}}


def fake_api(bin_dir: Path, log: Path, answers: dict = FITS) -> Path:
    (bin_dir / "api-answers.json").write_text(json.dumps(answers))
    path = bin_dir / "python-dstack-api"
    path.write_text(API.format(python=sys.executable, log=str(log), answers=str(bin_dir / "api-answers.json")))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def dstack_parsed(argv: list[str]) -> tuple[str, dict]:
    """`dstack ...` as dstack's own CLI reads it (its main's parser, every command registered):
    the command and its arguments; a command line it would refuse fails the test."""
    import argparse
    import importlib

    main = importlib.import_module("dstack._internal.cli.main")
    parser = argparse.ArgumentParser(prog="dstack", exit_on_error=False)
    commands = parser.add_subparsers(dest="command")
    for name, command in vars(main).items():
        if name.endswith("Command") and hasattr(command, "register"):
            command.register(commands)
    assert argv[0] == "dstack", argv
    args, unknown = parser.parse_known_args(argv[1:])
    assert unknown == [], f"dstack would not know {unknown} in {argv}"
    return args.command, {k: v for k, v in vars(args).items() if k not in ("command", "func", "help")}


def sky_parsed(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict]:
    """`sky ...` as SkyPilot's own click CLI reads it (with the environment the command saw:
    `--secret NAME` reads NAME from it): the (sub)command names and the parameters given."""
    import click
    from sky.client.cli.command import cli

    assert argv[0] == "sky", argv
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        ctx = cli.make_context("sky", list(argv[1:]))
        command, names, rest = cli, [], [*ctx.protected_args, *ctx.args]
        while isinstance(command, click.Group):
            name, command, rest = command.resolve_command(ctx, rest)
            names.append(name)
            ctx = command.make_context(name, rest, parent=ctx)
            rest = [*ctx.protected_args, *ctx.args] if isinstance(command, click.Group) else ctx.args
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert rest == [], f"sky would not know {rest} in {argv}"
    return names, {k: v for k, v in ctx.params.items() if v not in (None, False, (), [])}


def seen_env(call: dict) -> dict[str, str]:
    return {k: v for k, v in (("RAY_AUTH_TOKEN", call["token"]), ("WANDB_API_KEY", call["wandb"])) if v}


def fake_cli(bin_dir: Path, name: str, log: Path, code: int = 1, output: str = "") -> None:
    path = bin_dir / name
    path.write_text(RECORDER.format(python=sys.executable, log=str(log), code=code, output=output))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def bare_venv(tmp_path: Path) -> Path:
    """A venv whose bin/ holds only its python (and what a test puts there), with the real
    venv's packages: so "the provider's CLI beside the interpreter" is under the test's control."""
    venv = tmp_path / "venv"
    if not venv.exists():
        site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        site.mkdir(parents=True)
        (venv / "bin").mkdir()
        (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
        (venv / "pyvenv.cfg").write_text((Path(sys.prefix) / "pyvenv.cfg").read_text())
        real = next(p for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages"))
        (site / "real.pth").write_text(f"import site; site.addsitedir({real!r})\n")
    return venv / "bin"


def run_cli(args, cwd, env):
    python = bare_venv(Path(env["RLHF_TASKS_HOME"]).parent) / "python"
    return subprocess.run([str(python), "-m", "rlhf_tasks.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def task_file(tmp_path: Path, submit="client") -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({
        "name": "boundary", "nodes": 2, "resources": {"gpus": "H100:8"}, "secrets": ["WANDB_API_KEY"],
        "job": {"recipe": "command", "submit": submit, "working_dir": None, "args": {"entrypoint": "true"}}}))
    return path


def env_with(tmp_path: Path, bin_dir: Path | None) -> dict:
    env = dict(os.environ, RLHF_TASKS_HOME=str(tmp_path / "home"), WANDB_API_KEY="wandb-value-xyz",
               PYTHONPATH=str(ROOT))
    path_dirs = [str(bin_dir)] if bin_dir else []
    path_dirs += ["/usr/bin", "/bin"]  # no dstack/sky of the machine's own
    env["PATH"] = os.pathsep.join(path_dirs)
    if bin_dir:  # dstack's server as the launcher asks it (fleets, the run's plan): it fits
        env["RLHF_TASKS_DSTACK_PYTHON"] = str(fake_api(bin_dir, tmp_path / "calls.jsonl"))
    env.pop("RAY_AUTH_TOKEN", None)
    return env


SECRETS = ["rlhf_tasks__boundary__RAY_AUTH_TOKEN", "rlhf_tasks__boundary__WANDB_API_KEY"]


def test_dstack_launch_sets_the_secrets_as_project_secrets_and_the_cli_sees_none(tmp_path):
    """The task's secrets and the Ray token go to dstack's project secrets through dstack's API, their values on
    dstack_api.py's stdin (never a command line); `dstack apply` gets none of them, and the rendered file only
    references them. The launch that failed before its job deletes them again."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", log, code=1)  # "apply" fails at once, like a dstack without a server
    out = run_cli(["launch", str(task_file(tmp_path)), "--provider", "dstack"], tmp_path, env_with(tmp_path, bin_dir))
    assert out.returncode == 1, out.stderr
    assert "head" in out.stderr  # the failed step is named
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["argv"] for c in calls[:3]] == [["dstack_api.py", "fleets"], ["dstack_api.py", "plan",
                                                                         "boundary.dstack.yml"],
                                              ["dstack_api.py", "secrets-set"]]
    given = json.loads(calls[2]["stdin"])
    token = given["rlhf_tasks__boundary__RAY_AUTH_TOKEN"]
    assert sorted(given) == SECRETS and given["rlhf_tasks__boundary__WANDB_API_KEY"] == "wandb-value-xyz" and token
    assert all(c["wandb"] is None for c in calls[:5])  # nor does dstack's API or apply get the variable
    call = calls[3]  # a fleet of the user's is there: none applied; dstack's plan has offers: the task applied
    generated = tmp_path / "home" / "runs" / "boundary" / "dstack" / "boundary.dstack.yml"
    assert dstack_parsed(call["argv"]) == ("apply", {"project": None, "configuration_file": str(generated),
                                                     "yes": True, "force": False, "detach": False, "verbose": False})
    assert call["token"] is None and call["wandb"] is None  # the server fills the job's env, not the CLI
    # in a session of its own: a terminal's Ctrl-C reaches the launcher only, which SIGINTs it once (dstack's CLI aborts
    # the run on a second SIGINT while it handles the first: the terminal's, then the launcher's)
    assert call["own_session"] is True
    rendered = call["files"][str(generated)]
    assert "RAY_AUTH_TOKEN=${{ secrets.rlhf_tasks__boundary__RAY_AUTH_TOKEN }}" in rendered
    assert "WANDB_API_KEY=${{ secrets.rlhf_tasks__boundary__WANDB_API_KEY }}" in rendered
    assert token not in rendered and "wandb-value-xyz" not in rendered
    assert token not in out.stdout + out.stderr and "wandb-value-xyz" not in out.stdout + out.stderr
    assert all(token not in " ".join(c["argv"]) and "wandb-value-xyz" not in " ".join(c["argv"]) for c in calls)
    # A launch that failed before its job leaves nothing behind: no secrets, no staged files, no token, no record.
    assert calls[4]["argv"] == ["dstack_api.py", "secrets-delete", *SECRETS]
    assert "cleaned up what this launch created" in out.stdout and "the dstack project secrets it set" in out.stdout
    assert not generated.parent.exists() and not (tmp_path / "home" / "clusters" / "boundary").exists()


def earlier_run(tmp_path: Path) -> tuple[Path, dict]:
    """An earlier local run of `boundary` that has ended: its record (how its job ended) and
    its node logs, as `down` and `status --cluster` read them."""
    home = tmp_path / "home"
    script = ("import sys; from rlhf_tasks import state; state.save('boundary', {'provider': 'local', "
              "'cluster_id': 'c0ffee00', 'job': {'submission_id': 'boundary-1', 'status': 'SUCCEEDED'}}); "
              "state.end('boundary')")
    subprocess.run([sys.executable, "-c", script], env=dict(os.environ, RLHF_TASKS_HOME=str(home),
                                                             PYTHONPATH=str(ROOT)), check=True)
    (home / "runs" / "boundary" / "nodes").mkdir(parents=True)
    (home / "runs" / "boundary" / "nodes" / "node-0.log").write_text("the earlier run's log\n")
    record = home / "clusters" / "boundary" / "cluster.json"
    return record, json.loads(record.read_text())


def test_a_launch_without_the_providers_cli_removes_nothing_of_an_earlier_run(tmp_path):
    """Exit 2 means nothing was written or removed: the earlier run's record stays, so `down`
    and `status --cluster` still know it."""
    record, kept = earlier_run(tmp_path)
    env = env_with(tmp_path, None)
    env["PATH"] = str(tmp_path / "nothing")  # no sbatch, dstack or sky (this machine may have sbatch in /usr/bin)
    for provider in ("slurm", "dstack", "sky"):
        submit = "head" if provider == "slurm" else "client"
        out = run_cli(["launch", str(task_file(tmp_path, submit=submit)), "--provider", provider], tmp_path, env)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "clean" not in out.stdout + out.stderr, out.stdout  # nothing was created, nothing is cleaned
        assert json.loads(record.read_text()) == kept, provider
        assert (tmp_path / "home" / "runs" / "boundary" / "nodes" / "node-0.log").exists()
        assert not (tmp_path / "home" / "runs" / "boundary" / provider).exists()
    down = run_cli(["down", "boundary"], tmp_path, env)
    assert down.returncode == 0 and "its job boundary-1 ended SUCCEEDED" in down.stdout, down.stdout + down.stderr


def test_a_failed_launch_cleans_up_only_what_it_wrote(tmp_path):
    """`dstack apply` fails: the launch removes its staged files and the token it made, and
    puts back the earlier run's record it had replaced; an earlier launch's files stay."""
    record, kept = earlier_run(tmp_path)
    earlier_log = tmp_path / "home" / "runs" / "boundary" / "dstack" / "dstack-apply.log"
    earlier_log.parent.mkdir(parents=True)
    old_result = {"exit_code": 0, "rank": 0, "steps": [], "job": {"submission_id": "boundary-old", "status": "SUCCEEDED"}}
    earlier_log.write_text("an earlier apply's log\n" + RESULT_PREFIX + json.dumps(old_result) + "\n")
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", log, code=1)
    out = run_cli(["launch", str(task_file(tmp_path)), "--provider", "dstack"], tmp_path, env_with(tmp_path, bin_dir))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "boundary-old" not in out.stdout + out.stderr  # this launch's head log starts where its apply began
    assert "cleaned up what this launch created" in out.stdout and "the earlier record put back" in out.stdout
    assert json.loads(record.read_text()) == kept
    assert not (record.parent / "token").exists()
    assert earlier_log.read_text().startswith("an earlier apply's log")  # the file was there before: kept
    assert not (earlier_log.parent / "boundary.dstack.yml").exists()  # what this launch staged: gone
    assert (tmp_path / "home" / "runs" / "boundary" / "nodes" / "node-0.log").exists()


def test_down_fails_when_the_providers_command_fails(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", log, code=1)
    down = run_cli(["down", "boundary", "--provider", "dstack"], tmp_path, env_with(tmp_path, bin_dir))
    assert down.returncode == 1 and "dstack stop boundary" in down.stderr, down.stdout + down.stderr
    assert dstack_parsed(json.loads(log.read_text().splitlines()[-1])["argv"]) == \
        ("stop", {"project": None, "abort": False, "yes": True, "run_name": "boundary"})
    fake_cli(bin_dir, "dstack", log, code=0)
    assert run_cli(["down", "boundary", "--provider", "dstack"], tmp_path, env_with(tmp_path, bin_dir)).returncode == 0


def dstack_calls(log: Path) -> list[tuple[str, dict] | list[str]]:
    """What the launcher asked: dstack_api.py's questions as argv, `dstack` commands as dstack's parser reads them."""
    calls = [json.loads(line)["argv"] for line in log.read_text().splitlines()]
    return [argv if argv[0] == "dstack_api.py" else dstack_parsed(argv) for argv in calls]


FLEET_APPLY = ("apply", {"project": None, "configuration_file": "boundary-fleet.dstack.yml", "yes": True,
                         "force": False, "detach": False, "verbose": False})

def test_dstack_launch_refuses_a_run_no_offer_fits_before_it_submits(tmp_path):
    """The project has no fleet: launch applies the rendered one (nodes 0..N: nothing billed while empty), asks
    dstack for the run's plan, which has no offer: exit 2 before `dstack apply` of the task, and the fleet it
    applied deleted again."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", log, code=0)
    env = env_with(tmp_path, bin_dir)
    fake_api(bin_dir, log, {"fleets": {"fleets": []}, "plan": {"jobs": [
        {"offers": 0, "total_offers": 0, "requirements": "cpu=x86:2.. mem=8GB.. disk=50GB.. gpu=H100:8"}] * 2,
        "fleets": ["boundary-fleet"]}})
    out = run_cli(["launch", str(task_file(tmp_path)), "--provider", "dstack"], tmp_path, env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "dstack's plan for boundary has no offer for 2 of its 2 jobs (cpu=x86:2.. mem=8GB.. disk=50GB.. " \
           "gpu=H100:8) on the fleets boundary-fleet" in out.stderr, out.stderr
    calls = dstack_calls(log)
    assert calls[0] == ["dstack_api.py", "fleets"] and calls[1] == FLEET_APPLY
    assert calls[2] == ["dstack_api.py", "plan", "boundary.dstack.yml"]
    command, args = calls[3]  # the fleet this launch applied, deleted; the task never applied
    assert (command, args["action"], args["name"].name, args["yes"]) == ("fleet", "delete", "boundary-fleet", True)
    assert len(calls) == 4
    assert "cleaned up what this launch created" in out.stdout and "boundary-fleet" in out.stdout


def test_dstack_launch_leaves_the_users_fleets_alone(tmp_path):
    """A fleet of the user's is there (or the task names its fleets): launch applies none and deletes none."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", log, code=1)
    run_cli(["launch", str(task_file(tmp_path)), "--provider", "dstack"], tmp_path, env_with(tmp_path, bin_dir))
    calls = dstack_calls(log)
    assert [c[0] for c in calls] == ["dstack_api.py", "dstack_api.py", "dstack_api.py", "apply", "dstack_api.py"]
    assert calls[3][1]["configuration_file"].endswith("boundary.dstack.yml")


def test_down_deletes_the_secrets_and_the_fleet_launch_applied_and_only_those(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", log, code=0)
    env = env_with(tmp_path, bin_dir)
    for made in (True, False):
        record = {"provider": "dstack", "cluster_id": "boundary",
                  **({"fleet_made": "boundary-fleet", "dstack_secrets": SECRETS} if made else {})}
        subprocess.run([sys.executable, "-c", f"from rlhf_tasks import state; state.save('boundary', {record!r})"],
                       env=env, check=True)
        log.unlink(missing_ok=True)
        down = run_cli(["down", "boundary"], tmp_path, env)
        assert down.returncode == 0, down.stdout + down.stderr
        calls = dstack_calls(log)
        assert calls[0] == ("stop", {"project": None, "abort": False, "yes": True, "run_name": "boundary"})
        if made:
            assert calls[1] == ["dstack_api.py", "secrets-delete", *SECRETS]
            assert f"dstack: deleted 2 project secret(s) of boundary: {', '.join(SECRETS)}" in down.stdout
            command, args = calls[2]
            assert (command, args["action"], args["name"].name, args["yes"]) == ("fleet", "delete", "boundary-fleet",
                                                                                 True)
        assert len(calls) == (3 if made else 1)


def test_sky_launch_and_managed_launch(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "sky", log, code=0)
    fake_cli(bin_dir, "ssh", log, code=255)  # the tunnel to the head cannot be opened
    env = env_with(tmp_path, bin_dir)
    out = run_cli(["launch", str(task_file(tmp_path)), "--provider", "sky"], tmp_path, env)
    assert out.returncode == 1, out.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert sky_parsed(calls[0]["argv"], seen_env(calls[0])) == (["launch"], {
        "cluster": "boundary", "entrypoint": ("boundary.sky.yaml",), "yes": True, "detach_run": True,
        "secret": (("WANDB_API_KEY", "wandb-value-xyz"), ("RAY_AUTH_TOKEN", calls[0]["token"]))})
    assert calls[0]["cwd"] == str(tmp_path / "home" / "runs" / "boundary" / "sky") and calls[0]["token"]
    # SkyPilot's job log is kept here as it runs (autostop takes the cluster, and its logs, after the job)
    follower, = [c for c in calls[1:] if c["argv"][0].endswith("sky")]  # beside the ssh: in either order
    assert sky_parsed(follower["argv"], {})[0] == ["logs"] and sky_parsed(follower["argv"], {})[1]["cluster"] == "boundary"
    ssh, = [c for c in calls[1:] if c["argv"][0] == "ssh"]
    assert "8265:127.0.0.1:8265" in ssh["argv"]
    # The forward failed after `sky launch` made the cluster: a clear error, and the cluster is left to
    # `down` (its record stays; SkyPilot's API server, which the cluster needs, too).
    assert "ssh exited with code 255" in out.stderr and "boundary" in out.stderr, out.stderr
    assert len(calls) == 3 and (tmp_path / "home" / "runs" / "boundary" / "sky" / "boundary.sky.yaml").exists()
    assert run_cli(["down", "boundary"], tmp_path, env).returncode == 0
    assert sky_parsed(json.loads(log.read_text().splitlines()[-1])["argv"], {}) == \
        (["down"], {"clusters": ("boundary",), "yes": True})

    # `sky jobs launch` streams the managed job's log with SkyPilot's prefix on every line; the head
    # agent's result line among them ends the job for the launcher, which never shows it raw.
    result = {"exit_code": 0, "rank": 0, "job": {"submission_id": "boundary-1", "status": "SUCCEEDED"}}
    fake_cli(bin_dir, "sky", log, code=0, output="(head, rank=0, pid=7) the job's own line\n"
             f"(head, rank=0, pid=7) RLHF_TASKS_RESULT {json.dumps(result)}\n")
    managed = run_cli(["launch", str(task_file(tmp_path, submit="head")), "--provider", "sky", "--managed"], tmp_path, env)
    assert managed.returncode == 0, managed.stdout + managed.stderr
    assert "the job's own line" in managed.stdout and "RLHF_TASKS_RESULT" not in managed.stdout
    assert "job boundary-1: SUCCEEDED" in managed.stdout and "sky jobs launch exited with code 0" in managed.stdout
    launched = json.loads(log.read_text().splitlines()[-1])
    assert sky_parsed(launched["argv"], seen_env(launched)) == (["jobs", "launch"], {
        "name": "boundary", "entrypoint": ("boundary.sky.yaml",), "yes": True,
        "secret": (("WANDB_API_KEY", "wandb-value-xyz"), ("RAY_AUTH_TOKEN", launched["token"]))})
    assert run_cli(["down", "boundary"], tmp_path, env).returncode == 0
    assert sky_parsed(json.loads(log.read_text().splitlines()[-1])["argv"], {}) == \
        (["jobs", "cancel"], {"name": "boundary", "yes": True})


def test_managed_needs_head_submission_and_sky(tmp_path):
    env = env_with(tmp_path, None)
    out = run_cli(["launch", str(task_file(tmp_path)), "--provider", "dstack", "--managed"], tmp_path, env)
    assert out.returncode == 2 and "--managed" in out.stderr


def test_missing_provider_cli_says_how_to_install_it(tmp_path):
    env = env_with(tmp_path, None)
    for provider, extra in (("dstack", "dstack"), ("sky", "sky")):
        out = run_cli(["launch", str(task_file(tmp_path)), "--provider", provider], tmp_path, env)
        assert out.returncode == 2, out.stderr
        assert f"rlhf-tasks[{extra}]" in out.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "home").exists()


def test_a_provider_cli_beside_the_interpreter_is_found_without_path(tmp_path):
    """`.venv/bin/rlhf-tasks launch --provider dstack` uses `.venv/bin/dstack` though PATH lacks it."""
    log = tmp_path / "calls.jsonl"
    env = env_with(tmp_path, None)
    (tmp_path / "api").mkdir()
    env["RLHF_TASKS_DSTACK_PYTHON"] = str(fake_api(tmp_path / "api", log))
    fake_cli(bare_venv(tmp_path), "dstack", log, code=1)
    out = run_cli(["launch", str(task_file(tmp_path)), "--provider", "dstack"], tmp_path, env)
    assert out.returncode == 1 and "not installed" not in out.stderr, out.stderr
    assert ["dstack", "apply"] in [json.loads(line)["argv"][:2] for line in log.read_text().splitlines()]


def test_local_refuses_gpu_tasks_before_starting_anything(tmp_path):
    env = env_with(tmp_path, None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    out = run_cli(["launch", str(task_file(tmp_path))], tmp_path, env)
    assert out.returncode == 2 and "resources.gpus" in out.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "home").exists()


def test_local_plan_keeps_object_stores_small_and_ports_apart():
    from rlhf_tasks.providers.local import LOCAL_OBJECT_STORE_BYTES, LocalProvider
    from rlhf_tasks.spec import parse_task

    task = parse_task({"name": "t", "nodes": 3, "job": {"recipe": "command", "args": {"entrypoint": "true"}}})
    plan = LocalProvider().plan(task)
    assert plan.ray.object_store_memory == LOCAL_OBJECT_STORE_BYTES  # not 30% of RAM per node
    assert plan.ray.agent_listen_port == 0  # every node its own dashboard agent port
    sized = parse_task({"name": "t", "nodes": 3, "ray": {"object_store_memory": "1GB"},
                        "job": {"recipe": "command", "args": {"entrypoint": "true"}}})
    assert LocalProvider().plan(sized).ray.object_store_memory == 10**9


def test_each_local_cluster_has_its_own_loopback_addresses():
    """Two local clusters never share an address, so a service's fixed port cannot clash."""
    from rlhf_tasks.providers.local import node_address

    assert node_address("00ab12cd", 0) == "127.1.171.1" and node_address("00ab12cd", 2) == "127.1.171.3"
    heads = {node_address(f"{i:02x}{j:02x}0000", 0) for i in range(0, 256, 7) for j in range(0, 256, 5)}
    assert len(heads) > 1500 and not any(h.startswith("127.0.") for h in heads)  # never 127.0.0.1's /24


def test_local_setup_runs_once_on_the_head_where_every_node_shares_the_environment():
    """Every local node is a process of this machine, in one environment: the task's setup
    (e.g. `pip install ...`) runs once, on the head, not once per node at the same time.
    The workers wait for the head's beacon, which opens after its setup (issue 20, item 5)."""
    from rlhf_tasks.providers.local import LocalProvider
    from rlhf_tasks.spec import parse_task

    task = parse_task({"name": "t", "nodes": 3, "setup": ["pip install numpy"],
                       "job": {"recipe": "command", "args": {"entrypoint": "true"}}})
    provider = LocalProvider()
    script = provider.render(provider.plan(task))["start-nodes.sh"]
    lines = {rank: next(line for line in script.splitlines() if line.strip().startswith(f"{rank})")) for rank in range(3)}
    assert "--skip-setup" not in lines[0]
    assert all("--skip-setup" in lines[rank] for rank in (1, 2))


def test_a_missing_secret_is_said_once_before_anything_starts(tmp_path):
    """dstack and SkyPilot refuse a secret the rendered file names and the environment lacks:
    the launch refuses first (exit 2, nothing run or written), saying it once (issue 32, item 5)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    for cli in ("dstack", "sky", "ssh"):
        fake_cli(bin_dir, cli, log, code=0)
    env = env_with(tmp_path, bin_dir)
    env.pop("WANDB_API_KEY")
    for provider in ("dstack", "sky"):
        out = run_cli(["launch", str(task_file(tmp_path)), "--provider", provider], tmp_path, env)
        said = out.stdout + out.stderr
        assert out.returncode == 2, said
        assert "error: secrets: WANDB_API_KEY not set in your environment" in out.stderr, said
        assert said.count("WANDB_API_KEY") == 1 and "launching" not in said, said
        assert not log.exists() and not (tmp_path / "home").exists()


def test_a_provider_that_runs_without_a_secret_says_so_once_before_launching(tmp_path, rlhf_home, monkeypatch, capsys):
    from rlhf_tasks.launch import launch
    from rlhf_tasks.providers.slurm import SlurmProvider
    from rlhf_tasks.spec import parse_task

    class Refused(Exception):
        pass

    class Slurm(SlurmProvider):
        def ready(self, plan):
            pass

        def apply(self, plan, secrets):
            assert "HF_TOKEN" not in secrets
            raise Refused

    monkeypatch.delenv("HF_TOKEN", raising=False)
    task = parse_task({"name": "t", "nodes": 2, "secrets": ["HF_TOKEN"], "checkpoints": {"path": "/shared/t"},
                       "job": {"recipe": "command", "args": {"entrypoint": "true"}}})
    try:
        launch(task, Slurm())
    except Refused:
        pass
    out = capsys.readouterr()
    said = out.out + out.err
    assert said.count("HF_TOKEN") == 1 and "not set in your environment, so not passed: HF_TOKEN" in said
    assert said.index("HF_TOKEN") < said.index("launching t on slurm")


#: A `dstack` whose run ended before `dstack apply` attached (a job of seconds; or one failed job, which ends a
#: multi-node run at once): apply prints its table and the run's end, none of the head's log (dstack's CLI
#: attaches only to a run that is running or done: cli/services/configurators/run.py), and exits; `dstack logs`
#: gives job 0's log as the server kept it.
ENDED_BEFORE_ATTACH = """#!{python}
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": [os.path.basename(sys.argv[0])] + sys.argv[1:]}}) + "\\n")
if sys.argv[1] == "apply":
    print(" NAME      BACKEND  RESOURCES  PRICE  STATUS  SUBMITTED\\n boundary  ssh      cpu=2      $0     {status}\\n")
    print("boundary provisioning completed ({status})", flush=True)
    sys.exit({code})
if sys.argv[1] == "logs":  # job 0's log (job 1's the same here), a secret in it as a job might print one (its value
    # the job's, which dstack's server put in from the project's secret; the CLI's environment has none)
    text = {head_log!r} + "job " + sys.argv[-1] + " saw WANDB_API_KEY=wandb-value-xyz\\n"
    sys.stdout.buffer.write(text.encode().replace(b"\\n", b"\\r\\n"))  # a PTY's line ends
"""


def ended_before_attach(tmp_path: Path, status: str, code: int, result: dict) -> tuple[dict, Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    head_log = "[10:00:01] node0: Ray head up\n[10:00:03] node0: job boundary-boundary: the command runs\n" \
        "job output here\n" + RESULT_PREFIX + json.dumps(result) + "\n[10:00:05] node0: stopped Ray\n"
    path = bin_dir / "dstack"
    path.write_text(ENDED_BEFORE_ATTACH.format(python=sys.executable, log=str(log), status=status, code=code,
                                               head_log=head_log))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return env_with(tmp_path, bin_dir), log


def test_dstack_a_job_over_before_apply_attached_is_summarised_from_the_heads_result_line(tmp_path):
    """A `submit: head` job of a second: the head submitted it, saw it end and left, and dstack's run was done
    before `dstack apply` attached or the launcher saw the dashboard. The outcome is the head's result line (from
    `dstack logs`, since apply showed none of it), not "the head's process exited"."""
    env, log = ended_before_attach(tmp_path, "done", 0, {
        "exit_code": 0, "rank": 0, "node_ids": ["a", "b"],
        "job": {"submission_id": "boundary-boundary", "status": "SUCCEEDED", "attempts": []}})
    out = run_cli(["launch", str(task_file(tmp_path, submit="head")), "--provider", "dstack"], tmp_path, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "job boundary-boundary: SUCCEEDED" in out.stdout and "process exited" not in out.stdout + out.stderr
    assert out.stdout.count("job output here") == 1 and RESULT_PREFIX not in out.stdout
    assert ("logs", {"project": None, "diagnose": False, "replica": 0, "job": 0, "since": None, "run_name": "boundary"}
            ) in dstack_calls(log)[3:]


def test_dstack_a_failed_job_over_before_apply_attached_names_each_nodes_first_error(tmp_path):
    """The job failed on the head and dstack ended the run (JOB_FAILED) before `dstack apply` attached: the
    summary still names each node's first error, from the head's result line, and the launch exits 1."""
    first = {"label": "node0", "ip": "10.0.0.2", "error": "json.decoder.JSONDecodeError: Expecting property name",
             "kind": "traceback", "at": "10:00:04", "file": "rlhf-tasks/job-boundary-boundary.log"}
    env, _ = ended_before_attach(tmp_path, "failed", 1, {
        "exit_code": 1, "rank": 0, "error": "running job boundary-boundary failed: it ended FAILED",
        "failed_step": "running job boundary-boundary",
        "job": {"submission_id": "boundary-boundary", "status": "FAILED", "attempts": []},
        "forensics": {"gathered": True, "bundle": "/opt/rlhf-tasks/logs/forensics-boundary-x.tar.gz", "problem": None,
                      "first_errors": [first]}})
    out = run_cli(["launch", str(task_file(tmp_path, submit="head")), "--provider", "dstack"], tmp_path, env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "first error on each node:" in out.stdout and "node0 (10.0.0.2)" in out.stdout, out.stdout
    assert "JSONDecodeError" in out.stdout and "running job boundary-boundary: it ended FAILED" in out.stderr
    # the bundle, gathered here from each job's `dstack logs` (the dashboard is gone with the run), secrets scrubbed
    bundles = list((tmp_path / "home" / "runs" / "boundary").glob("forensics-boundary-*.tar.gz"))
    assert len(bundles) == 1 and f"every node's logs: {bundles[0]} (each node's log as dstack's server kept it " \
        f"(`dstack logs boundary --job N`); the head's own is /opt/rlhf-tasks/logs/forensics-boundary-x.tar.gz on " \
        f"the head machine)" in out.stdout, out.stdout
    with tarfile.open(bundles[0]) as tar:
        texts = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers()}
    assert "job output here" in texts["node0/dstack-logs-job0.log"] and "job 1 saw" in texts["node1/dstack-logs-job1.log"]
    assert "wandb-value-xyz" not in "".join(texts.values()) and "[secret WANDB_API_KEY]" in texts["node0/dstack-logs-job0.log"]
    assert "process exited" not in out.stdout + out.stderr


def test_dstack_run_words_name_each_node_with_its_host_and_why_dstack_ended_it(tmp_path):
    """After `dstack apply` ended, the summary has dstack's word on the run (`dstack ps --json`, dstack's Run model):
    a worker lost mid-run is named with its host and dstack's reason; a `dstack` that says nothing adds nothing."""
    from rlhf_tasks.providers.dstack.cli import run_words

    def job(num, host, status, reason, message=None, exit_status=None):
        return {"job_spec": {"job_num": num}, "job_submissions": [{"status": "running"}, {
            "status": status, "termination_reason": reason, "termination_reason_message": message,
            "exit_status": exit_status, "job_provisioning_data": {"hostname": host}}]}
    runs = {"project": "main", "runs": [
        {"run_spec": {"run_name": "other"}, "status": "done", "jobs": []},
        {"run_spec": {"run_name": "lost"}, "status": "failed", "termination_reason": "job_failed", "jobs": [
            job(1, "10.0.0.3", "failed", "instance_unreachable", "Instance is unreachable"),
            job(0, "10.0.0.2", "terminated", "terminated_by_server")]}]}
    dstack = tmp_path / "dstack"
    dstack.write_text(f"#!{sys.executable}\nimport sys\nassert sys.argv[1:3] == ['ps', '--json']\n"
                      f"print({json.dumps(json.dumps(runs))})\n")
    dstack.chmod(0o755)
    assert run_words(str(dstack), "lost") == [
        "dstack: the run lost failed (job failed); node0 (10.0.0.2) terminated: terminated by server; "
        "node1 (10.0.0.3) failed: instance unreachable, Instance is unreachable"]
    assert run_words(str(dstack), "nosuch") == []
    dstack.write_text("#!/bin/sh\nexit 1\n")
    assert run_words(str(dstack), "lost") == []


def test_skypilots_job_log_gives_each_nodes_first_error_and_a_scrubbed_bundle(tmp_path):
    """`sky logs NAME` as the launch keeps it: SkyPilot's prefixes split it by node; a failed job's summary names
    the node that failed and its first error, and the bundle holds each node's lines, the secret scrubbed."""
    import tarfile

    from rlhf_tasks.providers.sky.joblog import bundle_from_job_log, by_node, skypilots_word

    log = tmp_path / "sky-job.log"
    log.write_text("Running setup on 2 nodes.\n"
                   "\x1b[36m(head, rank=0, pid=7)\x1b[0m [10:00:00] node0: Ray head up\n"
                   "(worker1, rank=1, pid=8, ip=10.0.0.2) token is s3cr3t-value-123\n"
                   "(worker1, rank=1, pid=8, ip=10.0.0.2) Traceback (most recent call last):\n"
                   "(worker1, rank=1, pid=8, ip=10.0.0.2)   File \"train.py\", line 3, in <module>\n"
                   "(worker1, rank=1, pid=8, ip=10.0.0.2) ValueError: bad shard 7\n")
    assert by_node(log.read_text())[0] == ["[10:00:00] node0: Ray head up"]
    said = skypilots_word("t", 100, log.read_text())
    assert said[0] == "SkyPilot: the job on t ended FAILED (sky queue t)"
    assert "node1" in said[1] and "ValueError: bad shard 7" in said[1] and "node0" not in said[1], said
    assert skypilots_word("t", 0, log.read_text()) == ["SkyPilot: the job on t ended SUCCEEDED (sky queue t)"]
    bundle = bundle_from_job_log("t", log, {"TOKEN": "s3cr3t-value-123"}, str(tmp_path / "out"), "job failed")
    with tarfile.open(bundle) as tar:
        texts = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    joined = "\n".join(texts.values())
    assert "s3cr3t-value-123" not in joined and "[secret TOKEN]" in joined
    assert any(name.endswith("node1.log") and "ValueError: bad shard 7" in text for name, text in texts.items()), \
        list(texts)
    assert bundle_from_job_log("t", tmp_path / "none.log", {}, str(tmp_path / "out"), "x") is None


def test_skypilots_single_node_prefix_is_the_head():
    """On a one-node cluster SkyPilot prefixes the run's lines with the task's name, no rank (`(wd, pid=996)`:
    skylet/executor/slurm.py, RayCodeGen's `name_str`; seen on the Slurm testbed): they are node 0's; setup's
    `(setup pid=5)` lines are nobody's."""
    from rlhf_tasks.providers.sky.joblog import by_node, skypilots_word

    text = ("\x1b[36m(setup pid=5)\x1b[0m installing\n"
            "\x1b[36m(wd, pid=996)\x1b[0m [17:04:25] node0: sky node 0 of 1\n"
            "(my-task.v2, pid=996) Traceback (most recent call last):\n"
            "(my-task.v2, pid=996) ValueError: bad shard 7\n")
    assert by_node(text) == {0: ["[17:04:25] node0: sky node 0 of 1", "Traceback (most recent call last):",
                                 "ValueError: bad shard 7"]}
    said = skypilots_word("wd", 100, text)
    assert "node0" in said[1] and "ValueError: bad shard 7" in said[1], said
