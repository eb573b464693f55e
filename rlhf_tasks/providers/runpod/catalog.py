"""Checking a task against RunPod's catalog before anything is created: the GPU type, the
data centers (Global Networking, placement.regions, the network volume's, stock for pods or
for an Instant Cluster) and the price; then saying what the launch will create and cost, and
asking to confirm it."""

from __future__ import annotations

import sys

from ...errors import BadInput, StepFailed
from ...console import say
from ...models import did_you_mean
from ...plan import Plan
from ..shipping import shared_entry
from .api import RunPodClient, RunPodNotFound
from .render import DEFAULT_GPU, GLOBAL_LINK, NAME, RunPodShared, cross_node_traffic, gpu_request, is_cluster


def fit(client: RunPodClient, plan: Plan) -> dict:
    """The GPU type and the data centers that fit, from RunPod's catalog; BadInput naming the
    field that does not fit. Nothing is created here. A task that gives the GPUs' memory (`80GB:8`)
    gets the cheapest of the catalog's GPU types of that memory (each type's `memory`, "VRAM in GB")
    that fits; `matched` lists them all."""
    gpu_id, count = gpu_request(plan.resources)
    gpus = client.gpu_types()
    memory = plan.resources.gpu_memory
    if not memory:
        return _fit_type(client, plan, gpu_id, count, gpus)
    low, high = memory
    words = plan.resources.gpus
    matched = sorted((g for g in gpus if (low is None or g.get("memory", 0) * 10**9 >= low)
                      and (high is None or g.get("memory", 0) * 10**9 <= high)
                      and (plan.resources.gpu_name is None or g["id"] == gpu_id)),
                     key=lambda g: ((g.get("price") or {}).get("secure") or float("inf"), g["id"]))
    if not matched:
        sizes = ", ".join(f"{size}GB" for size in sorted({g.get("memory") for g in gpus if g.get("memory")}))
        whose = f"{gpu_id} has {next((g.get('memory') for g in gpus if g['id'] == gpu_id), '?')}GB" \
            if plan.resources.gpu_name else f"its GPU types have {sizes}"
        raise BadInput(f"resources.gpus: {words}: RunPod's catalog has no GPU type of that memory ({whose})")
    refusals = []
    for gpu in matched:
        try:
            chosen = _fit_type(client, plan, gpu["id"], count, gpus)
        except BadInput as exc:
            refusals.append(str(exc))
            continue
        return {**chosen, "matched": [g["id"] for g in matched]}
    raise BadInput(f"resources.gpus: {words}: none of RunPod's GPU types of that memory fits:\n  "
                   + "\n  ".join(refusals))


def fit_groups(client: RunPodClient, plan: Plan) -> dict:
    """fit, with node groups: each group's GPU type from the catalog (its own plan, plan.for_group; a refusal names
    groups[i]), the data centers every group fits in (the first group's order: the pods share one Global Networking
    group and go where the head is), and the price the sum of each group's pods at its own type's price, with
    `groups` each group's (name, nodes, gpu, count, price per pod)."""
    chosen, offered = [], None
    for index, group in enumerate(plan.groups):
        try:
            one = fit(client, plan.for_group(group))
        except BadInput as exc:
            raise BadInput(f"groups[{index}].{exc}") from None
        chosen.append((group.name, group.nodes, one["gpu"], one["count"], one["price"]))
        offered = one["datacenters"] if offered is None else [dc for dc in offered if dc in one["datacenters"]]
    if not offered:
        raise BadInput("groups: no data center offers every group's GPU type (" + ", ".join(
            f"{name}: {gpu}" for name, _, gpu, _, _ in chosen) + "); the pods of one Global Networking group go "
            "where the head is")
    priced = all(price for *_, price in chosen)
    total = sum(nodes * price for _, nodes, _, _, price in chosen) if priced else None
    first = chosen[0]
    return {"gpu": first[2], "count": first[3], "datacenters": offered, "groups": chosen,
            "gpus": {name: gpu for name, _, gpu, _, _ in chosen},
            "price": total / plan.nodes if total else None, "total": total}


def _fit_type(client: RunPodClient, plan: Plan, gpu_id: str, count: int, gpus: list[dict]) -> dict:
    """fit, for one GPU type."""
    field = "resources.gpus"
    gpu = next((g for g in gpus if g["id"] == gpu_id), None)
    if gpu is None:
        raise BadInput(f"{field}: RunPod has no GPU type {gpu_id!r} "
                       f"{did_you_mean(gpu_id, [g['id'] for g in gpus], 'its GPU types')}")
    global_networking = not is_cluster(plan) and plan.nodes > 1
    if global_networking and gpu.get("manufacturer") != "NVIDIA":
        raise BadInput(f"{field}: Global Networking needs NVIDIA GPUs; {gpu_id} is {gpu.get('manufacturer')}'s "
                       f"(network: runpod-cluster for an Instant Cluster)")
    most = (gpu.get("maxCount") or {}).get("secure")
    if not gpu.get("secure") or not most:
        raise BadInput(f"{field}: RunPod does not offer {gpu_id} on Secure Cloud, where the provider creates pods")
    if count > most:
        raise BadInput(f"{field}: RunPod offers at most {most}x {gpu_id} per pod, not {count}")
    datacenters = client.datacenters(gpu_availability=True)
    known = {dc["id"]: dc for dc in datacenters}
    eligible = [dc["id"] for dc in datacenters if dc.get("globalNetwork") or not global_networking]
    regions = list(plan.placement.regions)
    for region in regions:
        if region not in known:
            raise BadInput(f"placement.regions: RunPod has no data center {region!r} "
                           f"{did_you_mean(region, list(known), 'its data centers')}")
        if region not in eligible:
            raise BadInput(f"placement.regions: {region} has no Global Networking (data centers with it: "
                           f"{', '.join(eligible) or 'none'})")
    candidates = regions or eligible
    shared = shared_entry(RunPodShared, plan.checkpoint_shared, NAME)
    if shared:
        where = "checkpoints.shared.runpod.network_volume"
        try:
            volume = client.network_volume(shared.network_volume)
        except RunPodNotFound:
            raise BadInput(f"{where}: RunPod has no network volume {shared.network_volume!r}") from None
        if volume["dataCenter"] not in candidates:
            why = "not in placement.regions" if regions else "without Global Networking"
            raise BadInput(f"{where}: volume {shared.network_volume} is in {volume['dataCenter']}, {why}; the "
                           f"pods must be where the volume is")
        candidates = [volume["dataCenter"]]
    # Anything but NONE is stock: RunPod's own sample keeps {"LOW", "MEDIUM", "HIGH"}.
    rank = {"HIGH": 0, "MEDIUM": 1, "LOW": 2}
    if is_cluster(plan):
        # Only the GPU catalog has stock per product ("the same GPU type can be scarce for pods and
        # plentiful for serverless, so the context has to be stated"); the data centers' is for pods.
        stock = next((g for g in client.gpu_types(availability=True, product="CLUSTER", count=count, cloud="SECURE")
                      if g["id"] == gpu_id), {})
        levels = {dc["id"]: dc.get("availability") for dc in stock.get("dataCenters") or []}
    else:
        levels = {dc_id: {g["id"]: g.get("availability") for g in known[dc_id].get("gpuAvailability") or []
                          }.get(gpu_id) for dc_id in candidates}
    offered = sorted((dc for dc in candidates if levels.get(dc) in rank), key=lambda dc: rank[levels[dc]])
    if not offered:
        where = "" if not global_networking else " with Global Networking"
        what = f"{gpu_id} for an Instant Cluster" if is_cluster(plan) else gpu_id
        looked = ", ".join(f"{dc}: {levels.get(dc) or 'not offered'}" for dc in candidates) or "none"
        raise BadInput(f"{'placement.regions' if regions else field}: no data center{where} offers {what} "
                       f"(looked in {looked})")
    price = (gpu.get("price") or {}).get("secure")
    return {"gpu": gpu_id, "count": count, "datacenters": offered, "price": price * count if price else None}


def announce(plan: Plan, fit: dict, warning: str | None) -> None:
    """What the launch creates, where, and what it costs (by the hour and for job.timeout)."""
    nodes, count = plan.nodes, fit["count"]
    where = fit["datacenters"][0] if len(fit["datacenters"]) == 1 else f"one of {', '.join(fit['datacenters'])}"
    what = "an Instant Cluster of" if is_cluster(plan) else ""
    price = fit["price"]
    hourly = f"${price * nodes:.2f}/h" if price else "price not in the catalog"
    if fit.get("groups"):
        for name, n, gpu, per, each in fit["groups"]:
            cost = f"${each * n:.2f}/h (${each:.2f}/h per pod)" if each else "price not in the catalog"
            say(f"RunPod: group {name}: {n} pod(s) x {per}x {gpu}, Secure Cloud: {cost}")
        say(f"RunPod: {nodes} pod(s) in {where}: {hourly}")
    else:
        say(f"RunPod: {what + ' ' if what else ''}{nodes} pod(s) x {count}x {fit['gpu']}, Secure Cloud, in {where}: "
            f"{hourly}" + (f" (${price:.2f}/h per pod)" if price and nodes > 1 else ""))
    timeout = plan.job.timeout_s
    if timeout:
        hours = timeout / 3600
        cost = f", at most ${price * nodes * hours:.2f} for the job" if price else ""
        length = f"{timeout / 60:.0f}m" if timeout < 3600 else f"{hours:.3g}h"
        say(f"job.timeout {length}: {nodes * count * hours:.2f} GPU-hours{cost} (plus start-up)")
    else:
        say(f"no job.timeout: the pods run (and bill) until the job ends or `rlhf-tasks down {plan.name}`")
    if not plan.resources.gpus and not plan.groups:
        why = "an Instant Cluster's pods have GPUs" if is_cluster(plan) else "Global Networking needs an NVIDIA GPU"
        say(f"resources.gpus is not set: each pod gets 1x {DEFAULT_GPU} ({why})")
    if len(fit.get("matched") or []) > 1:
        say(f"resources.gpus {plan.resources.gpus}: RunPod's GPU types of that memory: {', '.join(fit['matched'])}; "
            f"chosen: {fit['gpu']}, the cheapest that fits")
    if not is_cluster(plan) and nodes > 1:
        say(f"Global Networking links the pods at {GLOBAL_LINK}: {cross_node_traffic(plan)}")
    if warning:
        say(f"warning: {warning}")


def confirm(yes: bool) -> None:
    """The user's yes to the price (or -y); StepFailed when not given."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise BadInput("-y: creating the pods needs your confirmation of the price, and stdin is not a terminal; "
                       "pass -y to create them without asking")
    try:
        answer = input("create them? [y/N] ")
    except (EOFError, KeyboardInterrupt):
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise StepFailed("confirming the price", "not confirmed: nothing was created")
