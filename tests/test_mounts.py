"""A test host never hides the checkout: the mounts the cluster tests' hosts make (the dstack
fleet's own /root, the SkyPilot-on-Slurm homes, the Kubernetes node runner's pod volumes),
planned as data and checked against what every host must see (tests/testbed.py must_see), for
a checkout wherever a user clones it: root's home on a fresh GPU machine, /var/tmp, /opt."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

try:
    import testbed as tbmod
except ImportError:  # tests/ imported as a package
    from tests import testbed as tbmod

from kube import noderunner
from rlhf_tasks import providers
from rlhf_tasks.spec import load_task

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "sky"))
import slurm_infra  # noqa: E402  (tests/sky has no __init__: a package named sky would hide SkyPilot's)


def _dstack_server():
    """tests/dstack/server.py, loaded as conftest's dstack_bed loads it (a package named dstack would hide dstack's)."""
    import importlib.util
    if "dstack_bed_server" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dstack_bed_server", ROOT / "tests" / "dstack" / "server.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["dstack_bed_server"]


dstack_server = _dstack_server()

#: Where users clone: root's home (a fresh GPU machine), /var/tmp, /opt (the device's Python lives there).
CLONES = ["/root/rt-clone", "/var/tmp/rt-clone", "/opt/rt-clone"]


def keep(clone: str) -> list[str]:
    """What must_see gives for a checkout at ``clone`` with its own .venv on pyenv's Python."""
    return [clone, "/root/.pyenv/versions/3.11.7", "/root/.cache/rlhf-tasks"]


def test_mount_source_follows_binds_and_fresh_filesystems():
    plan = [("/root/rt-clone", "/tmp/home/rt-clone"), ("/tmp/home", "/root"), (None, "/var")]
    assert tbmod.mount_source("/root/rt-clone/.venv/bin/python", plan) == "/root/rt-clone/.venv/bin/python"
    assert tbmod.mount_source("/root/.bashrc", plan) == "/tmp/home/.bashrc"
    assert tbmod.mount_source("/var/tmp/rt-clone", plan) is None
    assert tbmod.mount_source("/variable", plan) == "/variable"  # a sibling, not under /var
    assert tbmod.hidden([("/tmp/home", "/root")], keep=["/root/rt-clone", "/usr"]) == ["/root/rt-clone"]


def test_must_see_holds_this_checkout_and_this_python():
    seen = tbmod.must_see()
    for path in (tbmod.REPO, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent):
        assert any(tbmod._under(str(path), p) for p in seen), (path, seen)
    assert all(os.path.exists(p) for p in seen)


def test_check_plan_says_what_a_fresh_root_would_hide(monkeypatch):
    monkeypatch.setattr(tbmod, "must_see", lambda: keep("/root/rt-clone"))
    with pytest.raises(tbmod.TestbedError, match=r"would hide /root/rt-clone, .*must never hide the checkout"):
        tbmod.check_plan([("/tmp/fresh", "/root")], "a fresh /root")
    with pytest.raises(tbmod.TestbedError, match="clone the checkout into a directory below /root"):
        tbmod.fresh_over("/tmp/fresh", "/root", keep=["/root"])


@pytest.mark.parametrize("clone", CLONES)
def test_a_dstack_fleet_hosts_own_root_keeps_the_checkout(monkeypatch, tmp_path, clone):
    monkeypatch.setattr(tbmod, "must_see", lambda: keep(clone))
    plan = dstack_server.host_mounts(tmp_path / "fleet" / "node0")
    assert tbmod.hidden(plan) == []
    assert tbmod.mount_source("/root/.bashrc", plan) == str(tmp_path / "fleet" / "node0" / "root" / ".bashrc")
    assert tbmod.mount_source("/var/lib/docker/x", plan) is None  # the shim's disk: a tmpfs of its own


@pytest.mark.parametrize("clone", CLONES)
def test_the_sky_slurm_hosts_homes_keep_the_checkout(monkeypatch, tmp_path, clone):
    monkeypatch.setattr(tbmod, "must_see", lambda: keep(clone))
    cache = tmp_path / "cache"
    cache.mkdir()
    for plan in (slurm_infra.host_mounts(tmp_path / "laptop-home", cache),
                 slurm_infra.host_mounts(tmp_path / "home", cache, tmp_path / "curl", tmp_path / "opt-node0")):
        assert tbmod.hidden(plan) == []
        assert tbmod.hidden(plan, keep=[str(cache)]) == []
        assert tbmod.mount_source("/root/.ssh", plan).startswith(str(tmp_path))


def kuberay_pods() -> list[dict]:
    """The pods of a rendered RayJob as the API server admits them: each with the service-account
    token volume at /var/run/secrets/kubernetes.io/serviceaccount (its ServiceAccount admission)."""
    provider = providers.get("kuberay")
    (text,) = provider.render(provider.plan(load_task(ROOT / "tasks" / "tiny-grpo.yaml"))).values()
    _, rayjob = yaml.safe_load_all(text)
    cluster = rayjob["spec"]["rayClusterSpec"]
    pods = []
    for template in [cluster["headGroupSpec"]["template"], *[g["template"] for g in cluster["workerGroupSpecs"]],
                     rayjob["spec"]["submitterPodTemplate"]]:
        spec = template["spec"]
        for c in spec["containers"]:
            c.setdefault("volumeMounts", []).append({"name": "kube-api-access", "mountPath": noderunner.SA_DIR})
        spec.setdefault("volumes", []).append({"name": "kube-api-access", "projected": {"sources": []}})
        pods.append({"spec": spec})
    return pods


@pytest.mark.parametrize("clone", CLONES)
def test_the_node_runner_mounts_each_volume_at_its_own_path_never_over_the_checkout(clone):
    """A tmpfs over /var for the token at /var/run/secrets/... hid a checkout under /var/tmp from
    the pods (pod web never Ready, ray-head CrashLoopBackOff); /opt's for the ConfigMap, one under /opt."""
    for pod in kuberay_pods():
        points = noderunner.mount_points(pod)
        assert noderunner.SA_DIR in points
        assert tbmod.hidden([(None, p) for p in points], keep=keep(clone)) == []


def test_a_tmpfs_script_keeps_what_is_under_it():
    lines = tbmod.tmpfs_script("/opt", keep=["/opt/rt-clone", "/usr"])
    assert lines == ["mkdir -p /tmp/.rlhf-tasks-keep-0 && mount --bind /opt/rt-clone /tmp/.rlhf-tasks-keep-0",
                     "mount -t tmpfs tmpfs /opt",
                     "mkdir -p /opt/rt-clone && mount --move /tmp/.rlhf-tasks-keep-0 /opt/rt-clone"]
    with pytest.raises(tbmod.TestbedError, match="must stay visible"):
        tbmod.tmpfs_script("/opt", keep=["/opt"])
