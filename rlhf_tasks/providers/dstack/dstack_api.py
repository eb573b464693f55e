"""What the dstack provider asks dstack's server before it submits a run, through dstack's own Python
API (`dstack.api.Client`, configured as the `dstack` CLI is: ~/.dstack/config.yml, DSTACK_PROJECT).

Run as a script by the interpreter the `dstack` command runs on (the launcher imports no dstack):

    python dstack_api.py fleets        -> {"fleets": [NAME, ...]}
    python dstack_api.py plan FILE     -> {"jobs": [{"group": G, "offers": N, "total_offers": N, ...}, ...],
                                           "fleets": [...]}
    python dstack_api.py secrets-set   -> {"set": [NAME, ...]}      (stdin: {"NAME": "value", ...})
    python dstack_api.py secrets-delete NAME... -> {"deleted": [NAME, ...]}  (those of them the project has)

`plan` asks for the run plan `dstack apply -f FILE` shows before its "Submit the run?" question
(RunCollection.get_run_plan, which the CLI's apply calls), for the file's resources, nodes, fleets,
backends and spot policy; its env and files are left out of the question (they choose no offer, and a
secret's value need not travel for it). `secrets-set` sets the project's secrets (`dstack secret set`'s call,
SecretsAPIClient.create_or_update) from the mapping it reads on stdin, so that no value is on a command line;
`secrets-delete` deletes those of the names the project has (`dstack secret delete`'s call; dstack's server
refuses the whole request when one of the names is not there: services/secrets.py delete_secrets). Standard
library, PyYAML and dstack only; prints one JSON object on stdout, or what failed on stderr with exit code 1.
"""

from __future__ import annotations

import json
import sys


def fleet_names(client) -> list[str]:
    """The project's fleets (its own and those imported into it) that a run can use, as `dstack fleet` lists
    them, less those being deleted (a deleted fleet is listed `terminating` until its instances are gone)."""
    fleets = client.client.fleets.list(client.project, include_imported=True)
    return [fleet.name for fleet in fleets if str(getattr(fleet.status, "value", fleet.status)) not in
            ("terminating", "terminated", "failed")]


def plan_summary(client, configuration) -> dict:
    """dstack's run plan of a task configuration, as counts: per job, the offers that fit it, and the node group
    it is of (JobSpec.node_group_name, core/models/runs.py: a task's `groups:` are planned group by group,
    server/services/runs/plan.py _get_job_batches_for_planning; a task without groups is one group, "0")."""
    from dstack._internal.core.models.envs import Env

    configuration = configuration.model_copy(deep=True)
    configuration.env = Env()
    configuration.files = []
    run_plan = client.runs.get_run_plan(configuration=configuration, repo=None, max_offers=3)
    jobs = []
    for job_plan in run_plan.job_plans:
        requirements = job_plan.job_spec.requirements
        jobs.append({"job": job_plan.job_spec.job_name, "group": job_plan.job_spec.node_group_name,
                     "offers": len(job_plan.offers),
                     "total_offers": job_plan.total_offers, "max_price": job_plan.max_price,
                     "requirements": requirements.pretty_format(resources_only=True)
                     if hasattr(requirements, "pretty_format") else str(requirements.resources)})
    return {"jobs": jobs}


#: What dstack's server requires of a user who sets or deletes a project's secrets (services/secrets.py
#: _check_can_manage_secrets: the global admin, or a member whose role can manage secrets).
FORBIDDEN = ("dstack's server refused to manage the project's secrets (ForbiddenError): setting and deleting them "
             "needs the project's admin or manager role, or the server's admin (dstack project's members)")


def set_secrets(client, values: dict) -> dict:
    from dstack._internal.core.errors import ForbiddenError

    try:
        for name, value in values.items():
            client.client.secrets.create_or_update(client.project, name=name, value=value)
    except ForbiddenError:
        raise SystemExit(FORBIDDEN) from None
    return {"set": list(values)}


def delete_secrets(client, names: list[str]) -> dict:
    from dstack._internal.core.errors import ForbiddenError

    try:
        there = [name for name in names if name in {s.name for s in client.client.secrets.list(client.project)}]
        if there:
            client.client.secrets.delete(client.project, names=there)
    except ForbiddenError:
        raise SystemExit(FORBIDDEN) from None
    return {"deleted": there}


def main(argv: list[str]) -> int:
    import yaml
    from dstack._internal.core.models.configurations import parse_apply_configuration
    from dstack.api import Client

    client = Client.from_config()
    if argv[:1] == ["fleets"]:
        out: dict = {"fleets": fleet_names(client)}
    elif argv[:1] == ["plan"] and len(argv) == 2:
        with open(argv[1]) as handle:
            configuration = parse_apply_configuration(yaml.safe_load(handle))
        out = {**plan_summary(client, configuration), "fleets": fleet_names(client)}
    elif argv == ["secrets-set"]:
        out = set_secrets(client, json.load(sys.stdin))
    elif argv[:1] == ["secrets-delete"]:
        out = delete_secrets(client, argv[1:])
    else:
        print("usage: dstack_api.py fleets | plan FILE | secrets-set | secrets-delete NAME...", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as exc:  # dstack's errors (no server, no project, a refused configuration): said, exit 1
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
