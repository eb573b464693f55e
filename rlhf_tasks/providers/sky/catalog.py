"""SkyPilot's catalog, as it is on this machine: which accelerators it knows and on which clouds, each
GPU's memory, and the price its optimizer puts on a rendered task.

SkyPilot ships no catalog and fetches one on first use: its files are read here where SkyPilot put them,
never through its reader (which would fetch them), so `check` and `render` stay offline. The price is
read with SkyPilot's own code (its optimizer's candidates), which `launch` counts against the budget.
"""

from __future__ import annotations

import os
from pathlib import Path

from .resources import sky_gpu

#: Clouds whose accelerator names are the cluster's own (a Kubernetes node label, a Slurm gres), not the catalog's.
OWN_NAMES = {"kubernetes", "ssh", "slurm"}


def _catalog_path(name: str) -> Path:
    """Where SkyPilot keeps its catalog's `name` (sky/catalog/common.py get_catalog_path), read at call time
    (SkyPilot reads SKY_RUNTIME_DIR at import)."""
    from sky.skylet import constants, runtime_utils

    return Path(runtime_utils.get_runtime_dir_path(
        os.path.join(".sky/catalogs", constants.CATALOG_SCHEMA_VERSION, name)))


def catalog_memory() -> dict[str, float]:
    """SkyPilot's common/metadata.csv as GPU -> MemoryGB, where it is on this machine (else empty)."""
    import csv

    path = _catalog_path("common/metadata.csv")
    if not path.is_file():
        return {}
    with path.open(newline="") as handle:
        return {row["GPU"]: float(row["MemoryGB"]) for row in csv.DictReader(handle)}


def devices_by_memory(gpus: str) -> list[str] | None:
    """The GPUs SkyPilot takes for a memory-only `resources.gpus` (`80GB:8`, `24GB..:1`), in the order of its
    catalog: what accelerator_registry.get_devices_by_memory selects from common/metadata.csv (MemoryGB equal,
    or at least with `+`), read here as a file where SkyPilot has put it (None where not: its reader would
    fetch it)."""
    table = catalog_memory()
    if not table:
        return None
    memory = sky_gpu(gpus).partition(":")[0]
    plus, size = memory.endswith("+"), int(memory.rstrip("+").removesuffix("GB"))
    return [gpu for gpu, listed in table.items() if (listed >= size if plus else listed == size)]


def catalog_accelerators() -> dict[str, list[str]] | None:
    """SkyPilot's accelerator catalog (common/accelerators.csv: name -> clouds) where it is on this
    machine; None where it is not. SkyPilot ships no catalog: read_catalog (sky/catalog/common.py)
    fetches it from GitHub on first use into ~/.sky/catalogs/<schema>/, so it is read here as a file,
    never through SkyPilot's reader, which would fetch it."""
    import ast
    import csv

    path = _catalog_path("common/accelerators.csv")
    if not path.is_file():
        return None
    with path.open(newline="") as handle:
        return {row["AcceleratorName"]: [c.lower() for c in ast.literal_eval(row["Clouds"])]
                for row in csv.DictReader(handle)}


def optimizer_price(config: dict) -> tuple[float | None, str]:
    """The cluster's price per hour as SkyPilot's optimizer prices what `sky launch` may provision for the rendered
    task, read with SkyPilot's own code as its optimizer fills in the candidates (sky/optimizer.py
    _fill_in_launchable_resources): for each of the task's resources (any_of), on its cloud or else each cloud
    `sky check` enabled (global_user_state.get_cached_enabled_clouds, the cache read without a refresh), the
    cheapest feasible instance that fits (Cloud.get_feasible_launchable_resources, a filter of the cloud's catalog
    by accelerators, spot and max_hourly_cost), in each region that offers it
    (resources_utils.make_launchables_for_valid_region_zones), priced by Resources.get_cost (the catalog's
    instance_type_to_hourly_cost), times num_nodes. The optimizer takes the cheapest of them; on a failed provision
    the backend blocks it and optimizes again (backends/cloud_vm_ray_backend.py provision_with_retries), and a
    managed job's recovery may move region (EAGER_NEXT_REGION): the dearest is counted, never under what it
    provisions. None where SkyPilot prices nothing (Kubernetes, SSH, Slurm: the cluster's own machines), knows no
    enabled cloud, or its catalog cannot be read; with the words that say it."""
    import copy

    import sky
    from sky.utils import resources_utils

    try:
        task = sky.Task.from_yaml_config(copy.deepcopy(config))  # it consumes the dict
        enabled = None
        offers = []  # (cost per node per hour, what)
        for resources in task.resources:
            if resources.cloud is not None:
                clouds = [resources.cloud]
            else:
                if enabled is None:
                    from sky import global_user_state, skypilot_config
                    from sky.clouds import cloud as sky_cloud

                    enabled = global_user_state.get_cached_enabled_clouds(
                        sky_cloud.CloudCapability.COMPUTE, skypilot_config.get_active_workspace())
                clouds = enabled
            if not clouds:
                return None, "SkyPilot knows no enabled cloud here (`sky check` enables them), so it prices nothing"
            own = sorted(str(c) for c in clouds if str(c).lower() in OWN_NAMES)
            if own:
                return None, (f"SkyPilot prices nothing on {', '.join(own)} (the cluster's own machines: its "
                              f"optimizer counts them at $0)")
            for cloud in clouds:
                feasible = cloud.get_feasible_launchable_resources(resources, task.num_nodes)
                if not feasible.resources_list:
                    continue
                for launchable in resources_utils.make_launchables_for_valid_region_zones(
                        feasible.resources_list[0]):
                    offers.append((launchable.get_cost(3600), f"{launchable.instance_type} on {cloud} in "
                                                              f"{launchable.region}"))
    except Exception as exc:  # noqa: BLE001 - its catalog unreadable (no network), a cloud's own error: said
        return None, f"SkyPilot's optimizer could not price it ({type(exc).__name__}: {str(exc).strip()[:300]})"
    if not offers:
        return None, ("SkyPilot's catalog has no instance that fits the task (`sky launch` will say so; "
                      "max_hourly_cost, the task's price per node, filters it too)")
    nodes = task.num_nodes
    (low, cheapest), (high, dearest) = min(offers), max(offers)
    words = f"SkyPilot's optimizer prices {nodes} x {cheapest} at ${low * nodes:.2f}/h"
    if high > low:
        words += f", up to ${high * nodes:.2f}/h ({dearest}, the dearest of the {len(offers)} it may fail over to)"
    return round(high * nodes, 4), words
