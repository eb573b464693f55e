"""One size grammar (issue 48, item 4): every size has a unit (MB, GB, TB: powers of 10; MiB, GiB,
TiB: powers of 2), a bare number is refused naming the field and the right form, and each provider's
render is read back by that provider's own parser to the bytes the task asked (dstack's Memory,
SkyPilot's Resources; Slurm's, podman's and Kubernetes' in tests/test_sizes_cluster.py). Where a
provider takes only whole units it is rounded up, and `check` says so."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import yaml

from conftest import need
from rlhf_tasks import providers
from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks.models import size_bytes
from rlhf_tasks.spec import parse_task

JOB = {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}
#: Sizes as a user writes them, and their bytes.
SIZES = {"128GB": 128 * 10**9, "64GiB": 64 * 2**30, "1TB": 10**12, "2TiB": 2 * 2**40, "500MB": 500 * 10**6,
         "1.5TB": 1500 * 10**9, "100MiB": 100 * 2**20, "200 gb": 200 * 10**9, "0.5GiB": 2**29}


def task(resources: dict | None = None, **extra) -> dict:
    return {"name": "t", "nodes": 2, "job": JOB, **({"resources": resources} if resources else {}), **extra}


def refusal(data: dict) -> str:
    with pytest.raises(BadInput) as info:
        parse_task(data, "t.yaml")
    return str(info.value)


def render(provider_name: str, data: dict) -> tuple[object, object, dict[str, str]]:
    provider = providers.get(provider_name)
    plan = provider.plan(parse_task(data, "t.yaml"))
    return provider, plan, provider.render(plan)


# ---------------------------------------------------------------------------------------------- the grammar

@pytest.mark.parametrize("text", SIZES)
def test_a_size_with_a_unit_is_its_bytes(text):
    assert size_bytes(text) == SIZES[text]


@pytest.mark.parametrize("field,value,said", [
    ("shm_size", "128", 'resources.shm_size: "128" has no unit: write 128GB'),
    ("shm_size", 128, "resources.shm_size: 128 has no unit: write 128GB"),
    ("disk", 500, "resources.disk: 500 has no unit: write 500GB"),
    ("disk", "500", 'resources.disk: "500" has no unit: write 500GB'),
    ("disk", "500..", 'resources.disk: "500" has no unit: write 500GB'),
    ("memory", "200+", 'resources.memory: "200" has no unit: write 200GB'),
    ("shm_size", 134217728, "resources.shm_size: 134217728 has no unit: write 128MiB"),
])
def test_a_bare_number_is_refused_naming_the_field_and_the_right_form(field, value, said):
    """A bare number meant bytes on KubeRay and SkyPilot's --shm-size and gigabytes on dstack and SkyPilot's
    disk_size: refused, saying what changed. A big one reads as bytes, a small one as gigabytes."""
    text = refusal(task({field: value}))
    assert said in text, text
    assert "(sizes need a unit: MB, GB, TB, MiB, GiB, TiB; a bare number" in text, text
    assert "is not a valid string" not in text and 'write "500"' not in text, text


def test_object_store_memory_needs_a_unit_too():
    text = refusal(task(ray={"object_store_memory": 100000000}))
    assert "ray.object_store_memory: 100000000 has no unit: write 100MB" in text, text


@pytest.mark.parametrize("value,said", [
    ("64G", '"64G" is not a size: write 64GB (10^9 bytes each) or 64GiB (2^30)'),
    ("64Gi", '"64Gi" is not a size: write 64GiB'),
    ("512KB", '"512KB" is not a size: write 0.512MB'),
    ("1024KiB", '"1024KiB" is not a size: write 1MiB'),
    ("4096b", '"4096b" is not a size: write 0.004096MB'),
    ("lots", '"lots" is not a size: write e.g. 128GB'),
    ("0GB", '"0GB" is not a size: a size is more than 0 bytes'),
    ("-1GB", '"-1GB" is not a size: write e.g. 128GB'),
])
def test_a_unit_outside_the_grammar_is_refused_with_the_right_form(value, said):
    text = refusal(task({"shm_size": value}))
    assert f"resources.shm_size: {said}" in text, text


def test_object_store_memory_below_rays_minimum_is_refused():
    """`ray start` refuses an object store under 75 MiB (ray/_private/services.py, determine_plasma_store_config:
    OBJECT_STORE_MINIMUM_MEMORY_BYTES): refused at check rather than on every node."""
    text = refusal(task(ray={"object_store_memory": "70MB"}))
    assert "ray.object_store_memory: 70MB is below Ray's minimum object store of 75MiB (78.6432MB)" in text, text
    assert parse_task(task(ray={"object_store_memory": "75MiB"})).ray.object_store_memory == "75MiB"


def test_the_schema_says_the_grammar():
    from rlhf_tasks.spec import json_schema

    schema = json_schema()
    props = schema["$defs"]["Resources"]["properties"]
    shm = [s for s in props["shm_size"]["anyOf"] if s.get("type") == "string"][0]["pattern"]
    disk = [s for s in props["disk"]["anyOf"] if s.get("type") == "string"][0]["pattern"]
    assert re.match(shm, "128GB") and re.match(shm, "64GiB") and not re.match(shm, "128")
    assert re.match(disk, "500GB..") and re.match(disk, "500GB+") and not re.match(disk, "500")


def test_an_old_bare_number_task_is_exit_2_at_check_and_nothing_is_written(tmp_path, capsys, rlhf_home):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(task({"shm_size": "128", "disk": 500})))
    out = tmp_path / "out" / "t.dstack.yml"
    assert main(["check", str(path), "--provider", "dstack"]) == 2
    assert main(["render", str(path), "--provider", "dstack", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert 'resources.shm_size: "128" has no unit: write 128GB' in err, err
    assert "resources.disk: 500 has no unit: write 500GB" in err, err
    assert not out.parent.exists() and not rlhf_home.exists()


# ---------------------------------------------------------------------------------------------- dstack

def _dstack_parse():
    try:
        from dstack._internal.core.models.configurations import parse_apply_configuration
    except ImportError:
        need(False, "the dstack package (pip install 'rlhf-tasks[dstack]')")
    return parse_apply_configuration


def dstack_bytes(gigabytes: float) -> int:
    """A size as dstack's server turns it into bytes (runner/client.py, _memory_to_bytes): its GB is 2^30."""
    return int(gigabytes * 1024**3)


@pytest.mark.parametrize("text", SIZES)
def test_dstack_reads_every_size_back_to_the_same_bytes(text):
    """dstack's Memory (core/models/resources.py, Memory.parse) reads GB as 2^30 bytes and MB as 2^20, and
    refuses GiB (`could not convert string to float: '128gib'`): each size is rendered in its units, exactly."""
    parse = _dstack_parse()
    _, _, files = render("dstack", task({"memory": text, "disk": text, "shm_size": text}))
    conf, fleet = (parse(yaml.safe_load(files[name])) for name in ("t.dstack.yml", "t-fleet.dstack.yml"))
    res = conf.resources
    assert dstack_bytes(res.shm_size) == SIZES[text]
    assert (dstack_bytes(res.memory.min), res.memory.max) == (SIZES[text], None)
    assert (dstack_bytes(res.disk.size.min), res.disk.size.max) == (SIZES[text], None)
    assert dstack_bytes(fleet.resources.disk.size.min) == SIZES[text]
    exact = parse(yaml.safe_load(render("dstack", task({"memory": text, "disk": text, "exact": ["memory", "disk"]}))[
        2]["t.dstack.yml"])).resources
    assert dstack_bytes(exact.memory.min) == dstack_bytes(exact.memory.max) == SIZES[text]
    assert dstack_bytes(exact.disk.size.min) == dstack_bytes(exact.disk.size.max) == SIZES[text]


def test_dstack_gets_its_own_words_where_they_are_exact():
    _, _, files = render("dstack", task({"shm_size": "64GiB", "memory": "2TiB", "disk": "128GB"}))
    res = yaml.safe_load(files["t.dstack.yml"])["resources"]
    assert (res["shm_size"], res["memory"]) == ("64GB", "2TB..")
    assert res["disk"] == "122070.3125MB.."  # 128 * 10^9 bytes, in dstack's 2^20-byte MB


# ---------------------------------------------------------------------------------------------- SkyPilot

def _sky_resources(files: dict[str, str], tmp_path, monkeypatch):
    try:
        import sky
    except ImportError:
        need(False, "the skypilot package (pip install 'rlhf-tasks[sky]')")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    (parsed,) = sky.Task.from_yaml_config(copy.deepcopy(yaml.safe_load(files["t.sky.yaml"]))).resources
    return parsed


@pytest.mark.parametrize("text", SIZES)
def test_skypilot_reads_memory_back_to_the_same_bytes_and_disk_rounded_up_to_its_whole_gb(text, tmp_path,
                                                                                        monkeypatch):
    """SkyPilot's `memory` and `disk_size` are in its GB, 2^30 bytes (utils/resources_utils.py,
    parse_memory_resource; skylet/constants.py MEMORY_SIZE_UNITS): memory takes a fraction, so it is
    exact; disk_size is a whole number (Resources.__init__: int), so it is rounded up, never down."""
    _, _, files = render("sky", task({"memory": text, "disk": text}))
    parsed = _sky_resources(files, tmp_path, monkeypatch)
    assert parsed.memory.endswith("+") and float(parsed.memory[:-1]) * 2**30 == SIZES[text]
    assert parsed.disk_size == math.ceil(SIZES[text] / 2**30)
    exact = _sky_resources(render("sky", task({"memory": text, "exact": ["memory"]}))[2], tmp_path, monkeypatch)
    assert float(exact.memory) * 2**30 == SIZES[text]


def test_skypilots_container_gets_the_shm_size_in_dockers_words(tmp_path, monkeypatch):
    """docker's --shm-size reads b, k, m, g as powers of 1024 (go-units RAMInBytes, as podman does: its
    read-back is in tests/test_sizes_cluster.py); a bare number was bytes (`128` gave --shm-size=128b)."""
    for text, flag in (("64GiB", "64g"), ("128GB", "125000000k"), ("100MiB", "100m"), ("1.5TB", "1464843750k")):
        _, _, files = render("sky", task({"shm_size": text}, image="verlai/verl:latest"))
        parsed = _sky_resources(files, tmp_path, monkeypatch)
        assert parsed.cluster_config_overrides["docker"]["run_options"] == [f"--shm-size={flag}"]


def check(provider: str, data: dict, tmp_path, capsys) -> str:
    """What `rlhf-tasks check --provider PROVIDER` says of the task, its warnings included."""
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["check", str(path), "--provider", provider]) == 0
    said = capsys.readouterr()
    return said.out + said.err


def test_check_says_when_skypilots_whole_gb_disk_is_more_than_asked(tmp_path, capsys, rlhf_home):
    said = check("sky", task({"disk": "500GB"}, placement={"backends": ["aws"]}), tmp_path, capsys)
    assert ("resources.disk 500GB: SkyPilot's disk_size is a whole number of its GB (2^30 bytes), so it asks "
            "466 (500.4GB), rounded up") in said, said
    exact = check("sky", task({"disk": "512GiB"}, placement={"backends": ["aws"]}), tmp_path, capsys)
    assert "disk_size" not in exact and "Kubernetes" not in exact, exact


@pytest.mark.parametrize("backends,who", [
    ([], "if SkyPilot places the task on Kubernetes (placement.backends does not rule it out), it"),
    (["kubernetes"], "on Kubernetes SkyPilot"), (["aws", "ssh"], "on Kubernetes SkyPilot")])
def test_check_says_what_skypilot_does_with_sizes_on_kubernetes(backends, who, tmp_path, capsys, rlhf_home):
    """On Kubernetes (and SSH node pools, a Kubernetes of SkyPilot's own: clouds/ssh.py) SkyPilot drops
    docker.run_options with a warning (resources.py, Resources.make_deploy_variables) and mounts /dev/shm
    as a memory emptyDir with no size (templates/kubernetes-ray.yml.j2, volume dshm); a disk_size it was
    given is each pod's ephemeral-storage request in Kubernetes' G, 10^9 bytes (clouds/kubernetes.py,
    make_deploy_resources_variables), that only nodes with that much allocatable ephemeral storage take."""
    said = check("sky", task({"disk": "500GB", "shm_size": "64GiB"}, image="verlai/verl:latest",
                          placement={"backends": backends}), tmp_path, capsys)
    assert (f"resources.shm_size 64GiB: {who} ignores docker.run_options, so --shm-size=64g does not reach the "
            f"pod: its pod's /dev/shm is a memory emptyDir with no size limit") in said, said
    assert (f"resources.disk 500GB: {who} makes disk_size 466 each pod's ephemeral-storage request, 466G "
            f"(466GB: Kubernetes' G is 10^9 bytes, less than the 500GB asked)") in said, said
    assert "a pod whose node has less allocatable ephemeral storage is not scheduled" in said, said


def test_check_says_nothing_of_kubernetes_where_the_task_cannot_land_there(tmp_path, capsys, rlhf_home):
    said = check("sky", task({"disk": "512GiB", "shm_size": "64GiB"}, image="verlai/verl:latest",
                          placement={"backends": ["aws", "gcp"]}), tmp_path, capsys)
    assert "Kubernetes" not in said and "ephemeral" not in said, said


def test_skypilots_default_disk_size_is_no_request_on_kubernetes(tmp_path, capsys, rlhf_home):
    """SkyPilot reads disk_size 256, its default, as none given (Resources._from_yaml_config_single): on
    Kubernetes no ephemeral storage is requested at all."""
    said = check("sky", task({"disk": "256GiB"}, placement={"backends": ["kubernetes"]}), tmp_path, capsys)
    assert ("resources.disk 256GiB: on Kubernetes SkyPilot requests no ephemeral storage for disk_size 256, "
            "its default, which it reads as none given") in said, said


# ---------------------------------------------------------------------------------------------- Slurm, RunPod, KubeRay forms

@pytest.mark.parametrize("text,mem,shm", [("200GB", "190735M", "195312500k"), ("512GiB", "512G", "512g"),
                                          ("100MiB", "100M", "100m"), ("1.5TB", "1430512M", "1464843750k"),
                                          ("2TiB", "2T", "2048g")])
def test_slurms_mem_is_whole_mib_rounded_up_and_the_containers_shm_is_exact(text, mem, shm):
    """Slurm keeps --mem in MiB (its M, G, T are powers of 1024; read back by the real slurmctld in
    tests/test_sizes_cluster.py); docker's and podman's --shm-size take bytes exactly."""
    _, _, files = render("slurm", task({"memory": text, "shm_size": text}, image="img:1",
                                       placement={"slurm": {"container": "podman"}}))
    script = files["t.sbatch"]
    assert f"#SBATCH --mem={mem}\n" in script, script
    assert f"--shm-size={shm}" in script, script


@pytest.mark.parametrize("text,disk,note", [("500GB", 500, None), ("1.5GB", 2, "asks 2"), ("500MB", 1, "asks 1"),
                                            ("64GiB", 69, "asks 69")])
def test_runpods_disk_is_whole_gb_rounded_up_and_check_says_so(text, disk, note):
    """RunPod's disk is an integer of GB, at least 1 (its OpenAPI document, tests/data/runpod-openapi-v2.json:
    BaseContainerConfig.disk): rounded up, so a pod has at least what was asked."""
    provider, plan, files = render("runpod", task({"disk": text, "gpus": "H100:1"}))
    document = json.loads(files["t.runpod.json"])
    bodies = [document["head"], *document["workers"]]
    assert [body["disk"] for body in bodies] == [disk, disk]
    notes = " ".join(provider.notes(plan))
    if note:
        assert f"resources.disk {text}: RunPod's disk is a whole number of GB (10^9 bytes), so it {note}GB, " \
               f"rounded up" in notes, notes
    else:
        assert "resources.disk" not in notes, notes


@pytest.mark.parametrize("text,quantity", [("128GB", "128G"), ("64GiB", "64Gi"), ("1.5TB", "1500G"),
                                           ("2TiB", "2Ti"), ("0.5GiB", "512Mi"), ("100MB", "100M")])
def test_kubernetes_quantities_are_exact(text, quantity):
    """Kubernetes' quantities: k, M, G, T are powers of 10, Ki, Mi, Gi, Ti of 2 (the real API server reads
    them back in tests/test_sizes_cluster.py)."""
    memory = text if size_bytes(text) > 200 * 2**20 else "1GiB"  # check refuses less (see below)
    _, _, files = render("kuberay", task({"memory": memory, "shm_size": text, "disk": text},
                                         placement={"kuberay": {"ephemeral_storage": True}}))
    rayjob = next(doc for doc in yaml.safe_load_all(files["t.rayjob.yaml"]) if doc["kind"] == "RayJob")
    spec = rayjob["spec"]["rayClusterSpec"]
    worker = spec["workerGroupSpecs"][0]["template"]["spec"]
    limits = worker["containers"][0]["resources"]["limits"]
    assert (limits["memory"], limits["ephemeral-storage"]) == (quantity if memory == text else "1Gi", quantity)
    shm = [v for v in worker["volumes"] if v["name"] == "shm"][0]
    assert shm["emptyDir"]["sizeLimit"] == quantity


def test_kuberay_refuses_a_memory_the_heads_submitter_would_leave_nothing_of(tmp_path, capsys):
    """The head's Ray container gets resources.memory less the 200Mi KubeRay's submitter requests: a task with
    less rendered a negative limit (`-105Mi`), which KubeRay's CRD schema takes and Kubernetes refuses for the pod.
    Found by the real API server (tests/test_sizes_cluster.py)."""
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(task({"memory": "100MB"})))
    assert main(["check", str(path), "--provider", "kuberay"]) == 2
    err = capsys.readouterr().err
    assert ("resources.memory: 100MB is not more than the 200MiB KubeRay's submitter requests in the head's pod, "
            "which the head's Ray container leaves it: give more") in err, err
    _, _, files = render("kuberay", task({"memory": "300MiB"}))
    assert "memory: 100Mi\n" in files["t.rayjob.yaml"]
