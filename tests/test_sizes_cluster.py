"""The sizes of tests/test_sizes.py read back by the real tools that take them (issue 48, item 4):
podman's --shm-size (docker's go-units parser, the form SkyPilot's container and Slurm's
docker/podman get), Slurm's --mem by the real slurmctld, and Kubernetes' quantities by the real
API server of tests/kube/, each to the bytes the task asked (Slurm's: rounded up to its MiB)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import pytest
import yaml

import slurm_testbed as stmod
from conftest import need
from rlhf_tasks import providers
from rlhf_tasks.models import size_bytes
from rlhf_tasks.providers.kuberay.pods import SUBMITTER_MEMORY
from rlhf_tasks.spec import parse_task

pytestmark = pytest.mark.cluster

JOB = {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}
SIZES = ("128GB", "64GiB", "1.5TB", "0.5GiB", "100MB", "200 gb", "1.0000001GB")


def render(provider_name: str, resources: dict, **extra) -> dict[str, str]:
    provider = providers.get(provider_name)
    task = parse_task({"name": "t", "nodes": 2, "job": JOB, "resources": resources, **extra}, "t.yaml")
    return provider.render(provider.plan(task))


# ---------------------------------------------------------------------------------------------- podman

def podman_shm_bytes(flag: str, tmp_path) -> int:
    """What podman makes of `--shm-size=...`: a container created (not run) on an empty root filesystem, in a
    store of the test's own, inspected and removed."""
    (tmp_path / "rootfs").mkdir(exist_ok=True)
    (tmp_path / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{tmp_path}/storage"\nrunroot = "{tmp_path}/run"\n')
    (tmp_path / "containers.conf").write_text('[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n'
                                              'events_logger = "file"\n')
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "CONTAINERS_STORAGE_CONF": str(tmp_path / "storage.conf"),
           "CONTAINERS_CONF": str(tmp_path / "containers.conf")}
    made = subprocess.run(["podman", "create", flag, "--rootfs", str(tmp_path / "rootfs"), "true"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    cid = made.stdout.strip().splitlines()[-1]
    try:
        shown = subprocess.run(["podman", "inspect", "--format", "{{.HostConfig.ShmSize}}", cid], env=env,
                               capture_output=True, text=True, timeout=60, check=True)
        return int(shown.stdout.strip())
    finally:
        subprocess.run(["podman", "rm", cid], env=env, capture_output=True, timeout=60)


@pytest.mark.parametrize("size", SIZES)
def test_podman_reads_the_rendered_shm_size_back_to_the_same_bytes(size, tmp_path):
    """The --shm-size of Slurm's podman line and of SkyPilot's docker.run_options, as podman reads it
    (go-units RAMInBytes, which docker's CLI uses too)."""
    need(shutil.which("podman") is not None, "podman (apt-get install podman)")
    slurm = render("slurm", {"shm_size": size}, image="img:1", placement={"slurm": {"container": "podman"}})
    sky = yaml.safe_load(render("sky", {"shm_size": size}, image="img:1")["t.sky.yaml"])
    (flag,) = re.findall(r"--shm-size=\S+", slurm["t.sbatch"])
    assert sky["config"]["docker"]["run_options"] == [flag]
    assert podman_shm_bytes(flag, tmp_path) == size_bytes(size)


# ---------------------------------------------------------------------------------------------- Slurm

slurm = stmod.make_slurm_fixture(1)

SLURM_UNITS = {"M": 2**20, "G": 2**30, "T": 2**40}


@pytest.mark.parametrize("size", ["200MB", "0.5GiB", "100MiB", "1000MB", "1GiB", "1.0000001MB"])
def test_slurm_reads_the_rendered_mem_back_as_the_bytes_rounded_up_to_its_mib(slurm, size, tmp_path):
    """The rendered `#SBATCH --mem=...`, given to the real sbatch (held, so it never runs), as slurmctld
    records it (MinMemoryNode): the task's bytes rounded up to Slurm's whole MiB, never less."""
    (mem,) = re.findall(r"^#SBATCH (--mem=\S+)$", render("slurm", {"memory": size})["t.sbatch"], re.M)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    job = slurm.sbatch(script, "--hold", mem)
    try:
        recorded = slurm.job_info(job)["MinMemoryNode"]
    finally:
        slurm.scancel(job)
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([MGT])", recorded).groups()
    assert float(number) * SLURM_UNITS[unit] == -(-size_bytes(size) // 2**20) * 2**20, (mem, recorded)


# ---------------------------------------------------------------------------------------------- Kubernetes

def dry_run(cluster, ns: str, objects: list[dict]) -> subprocess.CompletedProcess:
    """`kubectl create --dry-run=server`: the real API server validates (and admits) without keeping anything;
    retried while the namespace's default service account is not made yet (its admission needs it)."""
    deadline = time.monotonic() + 60
    while True:
        out = cluster.cp.kubectl("-n", ns, "create", "--dry-run=server", "-o", "json", "-f", "-",
                                 stdin=yaml.safe_dump_all(objects), check=False)
        if "serviceaccount" not in out.stderr or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def json_documents(text: str) -> list[dict]:
    """What `kubectl create -o json` prints for a stream: one JSON document after another."""
    decoder, docs, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        doc, end = decoder.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
        docs.append(doc)
        at = end
    return docs


def probe_pod(name: str, resource: str, limit: str, request: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "automountServiceAccountToken": False,
        "containers": [{"name": "c", "image": "probe:1", "resources": {"limits": {resource: limit},
                                                                       "requests": {resource: str(request)}}}]}}


def test_the_api_server_reads_every_rendered_quantity_back_to_the_same_bytes(kube_cluster, ns, tmp_path):
    """The RayJob rendered with each size (memory, ephemeral-storage, /dev/shm's sizeLimit) is taken by the
    API server (KubeRay's CRD schema: each a quantity); then each quantity is a probe pod's limit, which the
    API server's own parser compares to a request of exactly the task's bytes (taken) and one byte more
    (refused: a request above its limit). The probes go in two dry runs, each pod named for what it probes
    (kubectl creates every object of a stream and says each one's error)."""
    cluster = kube_cluster
    probes = {}  # pod name -> (size, resource, quantity, expected bytes)
    for size in SIZES:
        nbytes = size_bytes(size)
        memory = size if nbytes > SUBMITTER_MEMORY else "1GiB"  # check refuses less (the head's submitter's)
        files = render("kuberay", {"memory": memory, "shm_size": size, "disk": size},
                       placement={"kuberay": {"ephemeral_storage": True}})
        docs = list(yaml.safe_load_all(files["t.rayjob.yaml"]))
        taken = dry_run(cluster, ns, docs)
        assert taken.returncode == 0, f"{size}: {taken.stderr}"
        rayjob = next(doc for doc in docs if doc["kind"] == "RayJob")["spec"]["rayClusterSpec"]
        worker = rayjob["workerGroupSpecs"][0]["template"]["spec"]
        head = rayjob["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        limits = worker["containers"][0]["resources"]["limits"]
        shm = [v for v in worker["volumes"] if v["name"] == "shm"][0]["emptyDir"]["sizeLimit"]
        head_bytes = (size_bytes(memory) - SUBMITTER_MEMORY) // 2**20 * 2**20
        for resource, quantity, expected in (("memory", limits["memory"], size_bytes(memory)),
                                             ("ephemeral-storage", limits["ephemeral-storage"], nbytes),
                                             ("memory", shm, nbytes), ("memory", head["memory"], head_bytes)):
            probes[f"probe-{len(probes)}"] = (size, resource, quantity, expected)
    exact = dry_run(cluster, ns, [probe_pod(name, resource, quantity, expected)
                                  for name, (_, resource, quantity, expected) in probes.items()])
    assert exact.returncode == 0, exact.stderr
    made = {pod["metadata"]["name"]: pod for pod in json_documents(exact.stdout)}
    for name, (size, resource, quantity, expected) in probes.items():
        assert made[name]["spec"]["containers"][0]["resources"]["requests"][resource], \
            f"{size} {resource} {quantity}: {made.get(name)}"
    over = dry_run(cluster, ns, [probe_pod(name, resource, quantity, expected + 1)
                                 for name, (_, resource, quantity, expected) in probes.items()])
    assert over.returncode != 0, over.stdout
    refused = {name: line for line in over.stderr.splitlines()
               for name in re.findall(r'Pod "(probe-\d+)" is invalid', line)}
    for name, (size, resource, quantity, expected) in probes.items():
        assert "must be less than or equal to" in refused.get(name, ""), \
            f"{size} {resource} {quantity} (request {expected + 1}): {over.stdout}{over.stderr}"
