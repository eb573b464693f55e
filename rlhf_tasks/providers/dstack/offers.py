"""The task's resources and price in dstack's words, which its offers are matched against: GPUs as
dstack's GPU spec reads them (gpuhunt's names, memory as its own field), amounts as `N..` ranges in
dstack's units, the spot policy, `max_price` per instance; and the cluster's price as dstack's run plan
gives it before anything is provisioned.
"""

from __future__ import annotations

import math
import re

from ...models import size_bytes, size_text
from ...plan import Plan
from ...gpu_spec import gpu_memory_words, gpu_parts

SPOT = {"off": "on-demand", "on": "spot", "auto": "auto"}

#: What we render when the task gives no disk. dstack's own default is `100GB..` (resources.DEFAULT_DISK),
#: which it compares to an offer's disk and, on an SSH fleet, to the host's free disk: a host with less is no
#: offer. 50GB (dstack's, 50GiB) holds the image with Ray and torch and a small model; a task that needs more says
#: `disk:`. In dstack's words, as rendered.
DEFAULT_DISK = "50GB"

#: A GPU name with its memory as a suffix (A100-80GB, V100-32G), which dstack's GPUSpec parser takes whole as a
#: name its catalog (gpuhunt's KNOWN_ACCELERATORS) does not know: dstack writes the memory as its own field.
_GPU_MEMORY_SUFFIX = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9._-]*?)[-_](?P<memory>\d+)\s*G(?:i?B)?$", re.IGNORECASE)


def max_price(plan: Plan) -> float | None:
    """The task's price (placement.price_per_hour, or its groups' per node) as dstack's `max_price`, "The maximum instance price per
    hour" (core/models/profiles.py, Profile.max_price): an offer filter on every instance (gpuhunt's QueryFilter
    through backends/base/offers.py requirements_to_query_filter, and on a fleet's instances through
    server/services/instances.py instance_matches_constraints), so one node's bound (Plan.node_price_bound: the
    cluster's price split over its nodes, or the dearest group's price per node), rounded up to 1/10000 of a dollar
    (an offer at the bound stays). None without a price, or a free one (dstack wants > 0). With node groups, dstack
    has one max_price for the run, which every group's jobs ask alike (server/services/jobs/configurators/base.py
    _requirements: the run profile's max_price, beside the group's own resources): groups priced each
    (groups[i].price_per_hour) bound every node at the dearest group's; a cluster's price split evenly leaves a
    group whose nodes cost more than that share with no offer (DstackRender.notes says so)."""
    price = plan.node_price_bound
    return math.ceil(price * 10000) / 10000 if price else None


def plan_price(answer: dict, task_price: float | None) -> float | None:
    """The cluster's price per hour as dstack's run plan gives it before anything is provisioned (dstack_api.py
    plan): for each job the dearest offer that fits it (JobPlan.max_price, over every matching offer, not only those
    listed: server/services/runs/plan.py _get_job_plan), summed. dstack tries the offers cheapest first and moves on
    to dearer ones when one fails, so this is never under what it provisions. Where a job's offers are unpriced
    (an SSH fleet's hosts, which dstack prices at $0: server/services/instances.py), the task's price."""
    prices = [job.get("max_price") for job in answer.get("jobs") or []]
    if not prices or not all(prices):
        return task_price
    return round(sum(prices), 4)


def dstack_gpu(gpus: str) -> str:
    """`resources.gpus` in dstack's words: `A100-80GB:8` -> `A100:80GB:8`; `H100:8` and `8` as given; a bare
    name is one GPU (`MI300X` -> `MI300X:1`: dstack reads a bare name as one GPU or more); a memory in GB
    (`80GB:8`, `24GB..:1`): dstack compares a GPU spec's memory with gpuhunt's figure for each GPU
    (KNOWN_ACCELERATORS' memory, the GB it is sold by: 80 for an A100 80GB), so the task's GB are that figure."""
    if gpus.isdigit():
        return gpus
    name, memory, count = gpu_parts(gpus)
    match = _GPU_MEMORY_SUFFIX.match(name or "")
    if match:
        name = f"{match.group('name')}:{match.group('memory')}GB"
    if memory:
        name = f"{name}:{gpu_memory_words(memory)}" if name else gpu_memory_words(memory)
    return f"{name}:{count}"


#: dstack's size units (core/models/resources.py, Memory.parse): its GB is 2^30 bytes (the server gives a container
#: `shm_size * 1024**3` bytes: runner/client.py, _memory_to_bytes), TB 1024 of them, MB 1/1024; it has no GiB.
DSTACK_UNITS = (("TB", 2**40), ("GB", 2**30), ("MB", 2**20))


def dstack_size(size: str) -> str:
    """A task's size in dstack's units, the same bytes: `64GiB` -> `64GB`, `128GB` (10^9 bytes each) ->
    `122070.3125MB` (exact: dstack's Memory is a float, which holds any byte count / 2^20 exactly)."""
    return size_text(size_bytes(size), DSTACK_UNITS)


def amount(res, field: str) -> str:
    """A task's amount in dstack's words: `28..` (28 or more: dstack reads a bare `28` as exactly 28) unless the
    task lists the field under resources.exact, then `28` as given; a size in dstack's units."""
    value = getattr(res, field)
    value = dstack_size(value) if field in ("memory", "disk") else value
    return str(value) if res.is_exact(field) else f"{value}.."


def dstack_resources(res, keys: tuple[str, ...], cpu_arch: str | None = None) -> dict:
    """The resources block for a task or fleet: GPUs in dstack's catalog names, amounts as `N..` ranges (or
    exactly, as resources.exact says), the CPU architecture where the task gives it (`x86:28..`)."""
    resources: dict = {}
    if "shm_size" in keys and res.shm_size:
        resources["shm_size"] = dstack_size(res.shm_size)  # a size dstack gives the container, not an offer filter
    if "memory" in keys and res.memory:
        resources["memory"] = amount(res, "memory")
    resources["disk"] = amount(res, "disk") if res.disk else f"{DEFAULT_DISK}.."
    if res.gpus:
        resources["gpu"] = dstack_gpu(res.gpus)
    if "cpu" in keys and (res.cpus or cpu_arch):
        resources["cpu"] = ":".join(part for part in (cpu_arch, res.cpus and amount(res, "cpus")) if part)
    return resources

