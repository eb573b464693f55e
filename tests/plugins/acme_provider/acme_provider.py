"""acme: a provider written outside rlhf-tasks, as a third party would.

Acme's scheduler starts one script on every machine and tells it ACME_RANK, ACME_COUNT
and ACME_HOSTS (one address per line, rank order). Nothing in rlhf_tasks names Acme:
the contract below travels in the plan and the shipped node agent interprets it.
"""

from __future__ import annotations

import shlex

from rlhf_tasks.plan import Contract, Plan, env
from rlhf_tasks.providers import Provider
from rlhf_tasks.providers.shipping import agent_command, shipped_files


class AcmeProvider(Provider):
    name = "acme"
    contract = Contract(rank=env("ACME_RANK"), nodes=env("ACME_COUNT"),
                        head=env("ACME_HOSTS", item=0), node_addr=env("ACME_HOSTS", item="rank"))
    networks = {"acme-fabric": {"GLOO_SOCKET_IFNAME": "{iface}", "ACME_FABRIC": "on"}}

    def render(self, plan: Plan) -> dict[str, str]:
        setup = [shlex.join(["bash", "-c", command]) for command in plan.setup]
        script = "\n".join(["#!/usr/bin/env bash", "set -euo pipefail", *setup, agent_command(plan)]) + "\n"
        return {f"{plan.name}.acme.sh": script, **shipped_files(plan)}
