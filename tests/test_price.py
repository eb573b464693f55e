"""Issue 48, item 2: the provider hears the price, and one task file serves every provider.

placement.price_per_hour (the whole cluster) reaches the provider as its own price bound per instance (dstack's
`max_price`, SkyPilot's `max_hourly_cost`), judged by the provider's own parser; where the provider prices what it
provisions (dstack's run plan and SkyPilot's optimizer at launch, what RunPod bills a pod), the head agent counts that; a
placement field one provider cannot use is said by `check` and ignored there, not refused, so the same file passes
`check` on every provider. dstack's plan read from its real server is in tests/test_dstack_cluster.py."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks.spec import parse_task

from conftest import need
from test_check_words import check

JOB = {"recipe": "command", "working_dir": None, "args": {"entrypoint": "python3 train.py"}}
#: The file the issue names: a price, a cap and a retry, with nothing of any one provider's but the storage that
#: dstack's retries need to count one cap over every attempt (tests/test_budget.py: refused without it).
PORTABLE = {"name": "t", "nodes": 2, "resources": {"gpus": "H100:8"}, "job": JOB,
            "checkpoints": {"path": "/ckpt/t", "shared": {"dstack": {"host_path": "/mnt/nfs/t"}}},
            "placement": {"price_per_hour": 48, "max_cost": 100, "retry": True}}
PROVIDERS = ["dstack", "kuberay", "local", "runpod", "sky", "slurm"]


def plan_and_files(name: str, data: dict):
    provider = providers.get(name)
    plan = provider.plan(parse_task(copy.deepcopy(data)))
    return provider, plan, provider.render(plan)


# ------------------------------------------------------------------ the price bound each provider hears

def test_dstack_hears_the_price_as_max_price_per_instance():
    """dstack's max_price is "The maximum instance price per hour" (core/models/profiles.py, Profile.max_price),
    an offer filter (backends/base/offers.py requirements_to_query_filter; gpuhunt's constraints: price <=
    max_price) on the run and on its cloud fleet (requirements/combine.py takes the lower of the two):
    price_per_hour is the whole cluster's, so each of the 2 instances may cost half."""
    try:
        from dstack._internal.core.models.configurations import parse_apply_configuration
    except ImportError:
        need(False, "the dstack package (pip install 'rlhf-tasks[dstack]')")
    _, _, files = plan_and_files("dstack", PORTABLE)
    task, fleet = (parse_apply_configuration(yaml.safe_load(files[f])) for f in ("t.dstack.yml", "t-fleet.dstack.yml"))
    assert task.max_price == 24.0 and fleet.max_price == 24.0
    thirds = plan_and_files("dstack", {**PORTABLE, "nodes": 3, "placement": {"price_per_hour": 10}})[2]
    assert yaml.safe_load(thirds["t.dstack.yml"])["max_price"] == 3.3334  # rounded up: no offer at the bound lost
    # No price, or a free cluster (dstack's max_price must be > 0): no bound.
    for placement in ({}, {"price_per_hour": 0}):
        files = plan_and_files("dstack", {**PORTABLE, "placement": placement})[2]
        assert "max_price" not in yaml.safe_load(files["t.dstack.yml"]) | yaml.safe_load(files["t-fleet.dstack.yml"])


def test_an_ssh_fleet_gets_no_max_price_which_dstack_refuses_there():
    """max_price is a cloud fleet's field (core/models/fleets.py BackendFleetConfiguraionProps): dstack's server
    refuses it on an SSH fleet (server/services/fleets.py _validate_fleet_configuration_subtype_specific_fields).
    The run's own max_price stays: dstack prices an SSH host at $0 (server/services/instances.py), under any bound."""
    ssh = {"hosts": ["10.0.0.1", "10.0.0.2"], "user": "root", "identity_file": "~/.ssh/id_rsa"}
    _, _, files = plan_and_files("dstack", {**PORTABLE, "placement": {**PORTABLE["placement"], "dstack": {"ssh": ssh}}})
    assert "max_price" not in yaml.safe_load(files["t-fleet.dstack.yml"])
    assert yaml.safe_load(files["t.dstack.yml"])["max_price"] == 24.0


def test_skypilot_hears_the_price_as_max_hourly_cost_per_instance():
    """SkyPilot 0.14.1's `resources.max_hourly_cost`: "the maximum hourly cost (in USD) for instances"
    (sky/resources.py Resources), a filter of each cloud's catalog (sky/catalog/common.py: Price <=
    max_hourly_cost); parsed here by SkyPilot's own schema and Task."""
    try:
        import sky
        from sky.utils import common_utils, schemas
    except ImportError:
        need(False, "the skypilot package (pip install 'rlhf-tasks[sky]')")
    _, _, files = plan_and_files("sky", PORTABLE)
    config = yaml.safe_load(files["t.sky.yaml"])
    common_utils.validate_schema(copy.deepcopy(config), schemas.get_task_schema(), "Invalid task YAML: ")
    (resources,) = sky.Task.from_yaml_config(config).resources
    assert resources.max_hourly_cost == 24.0
    plain = yaml.safe_load(plan_and_files("sky", {**PORTABLE, "placement": {}})[2]["t.sky.yaml"])
    assert "max_hourly_cost" not in plain["resources"]


# ------------------------------------------------------------------ one file serves all

@pytest.mark.parametrize("provider", PROVIDERS)
def test_one_file_with_a_price_a_cap_and_retry_passes_check_on_every_provider(provider, tmp_path, capsys, rlhf_home):
    data = {**PORTABLE, "resources": {"cpus": 1}} if provider == "local" else PORTABLE
    code, out, err = check(tmp_path, capsys, data, "--provider", provider)
    assert code == 0, err
    assert "  cost " in out and "$100.00 (placement.max_cost" in out, out


def test_without_a_provider_every_provider_runs_the_portable_file(tmp_path, capsys, rlhf_home):
    code, out, err = check(tmp_path, capsys, PORTABLE)
    assert code == 0, err
    assert "providers dstack, kuberay, runpod, sky, slurm can run it" in out and "not runpod" not in out, out


@pytest.mark.parametrize("provider, said", [
    ("runpod", ["placement.price_per_hour: ignored on runpod: RunPod's own price is counted",
                "placement.retry: ignored on runpod:"]),
    ("kuberay", ["placement.retry: ignored on kuberay:"]),
    ("local", ["placement.retry: ignored on local:"]),
])
def test_check_says_what_a_provider_ignores(provider, said, tmp_path, capsys, rlhf_home):
    data = {**PORTABLE, "resources": {"cpus": 1}} if provider == "local" else PORTABLE
    code, _, err = check(tmp_path, capsys, data, "--provider", provider)
    assert code == 0, err
    for words in said:
        assert f"warning: {words}" in err, err


@pytest.mark.parametrize("provider", ["dstack", "sky", "slurm"])
def test_what_a_provider_uses_it_does_not_call_ignored(provider, tmp_path, capsys, rlhf_home):
    code, _, err = check(tmp_path, capsys, PORTABLE, "--provider", provider)
    assert code == 0 and "placement.retry: ignored" not in err and "placement.price_per_hour: ignored" not in err, err


def test_runpod_ignores_the_fields_of_other_providers_and_counts_its_catalogs_price():
    """RunPod's v2 API has no bid and no price bound (CreatePodRequest: no price field; pods are on-demand), so the
    task's price is said and ignored: the head counts its pod's billed `cost` (the catalog's where RunPod gives
    none: tests/test_runpod_provider.py)."""
    data = {**PORTABLE, "placement": {**PORTABLE["placement"], "spot": "auto", "fleets": ["f"], "backends": ["aws"]}}
    provider, plan, files = plan_and_files("runpod", data)
    assert plan.budget.price_per_hour is None and plan.budget.max_cost == 100
    notes = provider.notes(plan)
    for field in ("spot", "retry", "price_per_hour", "fleets", "backends"):
        assert any(note.startswith(f"placement.{field}: ignored on runpod: ") for note in notes), notes
    schema = json.loads(files["t.runpod.json"])
    assert "price" not in json.dumps(schema["head"]).lower()


# ------------------------------------------------------------------ a cap with no price

@pytest.mark.parametrize("provider", ["local", "sky", "slurm", "kuberay"])
def test_a_cap_no_price_can_count_is_still_refused(provider):
    """Ignoring it would run with no cap at all: where the provider knows no price of its own, a cap without
    placement.price_per_hour stays refused (exit 2, naming the fields)."""
    data = {**PORTABLE, "resources": {"cpus": 1}, "placement": {"max_cost": 10}}
    with pytest.raises(BadInput, match=r"placement\.max_cost: .*placement\.price_per_hour"):
        providers.get(provider).plan(parse_task(data))


def test_dstack_counts_its_plans_price_for_a_cap_without_one(tmp_path, capsys, rlhf_home):
    """dstack's `launch` reads the run plan's offers before it submits: check passes, says where the price comes
    from, and says that a hand `dstack apply` of the render counts none (the head has no price there)."""
    data = {**PORTABLE, "placement": {"max_cost": 10}}
    code, out, err = check(tmp_path, capsys, data, "--provider", "dstack")
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("  cost")]
    assert "dstack's run plan" in line and "$10.00 (placement.max_cost" in line, line
    assert "warning: placement.max_cost: a `dstack apply` of the rendered file by hand counts no price" in err, err


def test_the_price_dstack_counts_from_its_plan():
    """The dearest offer dstack's plan lists for each job (JobPlan.max_price, over every offer that fits: dstack
    tries them cheapest first and moves on to dearer ones, server/services/runs/plan.py _get_job_plan), summed over
    the jobs: never under what dstack provisions. An SSH fleet's hosts, which dstack prices $0, are the task's."""
    from rlhf_tasks.providers.dstack.offers import plan_price

    def answer(*prices):
        return {"jobs": [{"offers": 3, "max_price": p} for p in prices]}
    assert plan_price(answer(11.5, 12.0), 48) == 23.5
    assert plan_price(answer(11.5, 12.0), None) == 23.5
    assert plan_price(answer(0.0, 0.0), 48) == 48       # an SSH fleet: dstack knows no price
    assert plan_price(answer(0.0, 0.0), None) is None
    assert plan_price(answer(12.0, None), 30) == 30     # a job unpriced: the task's


def test_dstack_refuses_at_launch_a_cap_its_plan_cannot_price():
    from rlhf_tasks.providers.dstack import DstackProvider

    provider = DstackProvider()
    plan = provider.plan(parse_task({**PORTABLE, "placement": {"max_cost": 10}}))
    with pytest.raises(BadInput, match=r"placement\.max_cost: dstack's plan for t prices its offers at \$0"):
        provider.counted_plan(plan, {"jobs": [{"offers": 1, "max_price": 0.0}] * 2})
    priced = provider.counted_plan(plan, {"jobs": [{"offers": 1, "max_price": 3.0}] * 2})
    assert priced.budget.price_per_hour == 6.0


# ------------------------------------------------------------------ SkyPilot's optimizer's price

#: Run in a fresh interpreter: SkyPilot fixes its catalog directory when it is imported (sky/catalog/common.py
#: _ABSOLUTE_VERSIONED_CATALOG_DIR, from SKY_RUNTIME_DIR), so the played catalog must be there first.
SKY_PRICES = """
import json, sys
from rlhf_tasks import providers
from rlhf_tasks.providers.shipping import LOCAL_DIR, plan_file
from rlhf_tasks.spec import parse_task
out = []
for data in json.loads(sys.argv[1]):
    provider = providers.get("sky")
    plan = provider.plan(parse_task(data))
    counted, said = provider.counted_plan(plan)
    shipped = json.loads(provider.render(counted)[f"{LOCAL_DIR}/{plan_file(counted)}"])
    out.append([counted.budget.price_per_hour, said, shipped["budget"]["price_per_hour"]])
print(json.dumps(out))
"""


def test_skypilot_counts_its_optimizers_price_of_what_it_may_provision(tmp_path):
    """SkyPilot's own code on the rendered task, with a played catalog (tests/sky/lambda-vms.csv: gpu_8x_h100_sxm5
    at $23.92/h in us-east-1, $25.50/h in us-west-1), nothing fetched, nothing launched. `launch` counts the
    dearest of the region candidates SkyPilot's optimizer fills in (optimizer.py _fill_in_launchable_resources:
    the cheapest instance type that fits, in every region that offers it): SkyPilot takes the cheapest and, when
    a provision fails, the next (provision_with_retries). max_hourly_cost filters instance types by their price in
    some region (catalog/common.py get_instance_type_for_accelerator_impl), not the regions it fails over to
    (Resources.get_valid_regions_for_launchable), so the count can be over the task's price. Where SkyPilot
    prices nothing (Kubernetes; no enabled cloud), the task's price, said."""
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    try:
        import sky  # noqa: F401
    except ImportError:
        need(False, "the skypilot package (pip install 'rlhf-tasks[sky]')")
    runtime = tmp_path / "sky-runtime"
    (runtime / ".sky/catalogs/v8/lambda").mkdir(parents=True)
    shutil.copy(ROOT / "tests/sky/lambda-vms.csv", runtime / ".sky/catalogs/v8/lambda/vms.csv")
    base = {**PORTABLE, "resources": {"gpus": "H100:8"}, "checkpoints": {"path": "/ckpt/t"}}
    cases = [{"backends": ["lambda"], "price_per_hour": 60}, {"backends": ["lambda"], "price_per_hour": 48},
             {"backends": ["lambda"]}, {"backends": ["lambda"], "price_per_hour": 40},
             {"backends": ["kubernetes"], "price_per_hour": 48}, {"price_per_hour": 48}]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("SKYPILOT")}
    done = subprocess.run([sys.executable, "-c", SKY_PRICES, json.dumps([{**base, "placement": p} for p in cases])],
                          env={**env, "SKY_RUNTIME_DIR": str(runtime), "HOME": str(tmp_path)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (over, under, unpriced, none_fits, kube, no_cloud) = json.loads(done.stdout.strip().splitlines()[-1])
    offers = ("SkyPilot's optimizer prices 2 x gpu_8x_h100_sxm5 on Lambda in us-east-1 at $47.84/h, up to $51.00/h "
              "(gpu_8x_h100_sxm5 on Lambda in us-west-1, the dearest of the 2 it may fail over to)")
    assert over == [51.0, f"{offers} (placement.price_per_hour: $60.00/h): the head counts $51.00/h", 51.0]
    assert under == [51.0, f"{offers} (placement.price_per_hour: $48.00/h): the head counts $51.00/h", 51.0]
    assert unpriced == [51.0, f"{offers}: the head counts $51.00/h", 51.0]  # the progress line's price, no cap
    assert none_fits[0] == 40 and none_fits[1].startswith("SkyPilot's catalog has no instance that fits the task")
    assert kube == [48, "SkyPilot prices nothing on Kubernetes (the cluster's own machines: its optimizer counts "
                        "them at $0): the head counts placement.price_per_hour, $48.00/h", 48]
    assert no_cloud[0] == 48 and no_cloud[1].startswith("SkyPilot knows no enabled cloud here (`sky check`")
    assert not (runtime / ".sky/catalogs/v8/.meta").exists()  # nothing fetched


def test_check_says_skypilot_counts_its_optimizers_price_at_launch(tmp_path, capsys, rlhf_home):
    code, out, err = check(tmp_path, capsys, PORTABLE, "--provider", "sky")
    assert code == 0, err
    assert "the head counts SkyPilot's optimizer's price at launch (the dearest region it may fail over to, which " \
           "max_hourly_cost does not bound) where it prices them, else this price" in out, out
