"""What the dstack provider asks dstack's server before it submits a run, through dstack's own Python
API (`dstack.api.Client`, configured as the `dstack` CLI is: ~/.dstack/config.yml, DSTACK_PROJECT).

Run as a script by the interpreter the `dstack` command runs on (the launcher imports no dstack):

    python dstack_api.py fleets        -> {"fleets": [NAME, ...]}
    python dstack_api.py plan FILE     -> {"jobs": [{"offers": N, "total_offers": N, ...}, ...], "fleets": [...]}

`plan` asks for the run plan `dstack apply -f FILE` shows before its "Submit the run?" question
(RunCollection.get_run_plan, which the CLI's apply calls), for the file's resources, nodes, fleets,
backends and spot policy; its env and files are left out of the question (they choose no offer, and a
secret's value need not travel for it). Standard library, PyYAML and dstack only; prints one JSON object
on stdout, or what failed on stderr with exit code 1.
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
    """dstack's run plan of a task configuration, as counts: per job, the offers that fit it."""
    from dstack._internal.core.models.envs import Env

    configuration = configuration.model_copy(deep=True)
    configuration.env = Env()
    configuration.files = []
    run_plan = client.runs.get_run_plan(configuration=configuration, repo=None, max_offers=3)
    jobs = []
    for job_plan in run_plan.job_plans:
        requirements = job_plan.job_spec.requirements
        jobs.append({"job": job_plan.job_spec.job_name, "offers": len(job_plan.offers),
                     "total_offers": job_plan.total_offers, "max_price": job_plan.max_price,
                     "requirements": requirements.pretty_format(resources_only=True)
                     if hasattr(requirements, "pretty_format") else str(requirements.resources)})
    return {"jobs": jobs}


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
    else:
        print("usage: dstack_api.py fleets | plan FILE", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as exc:  # dstack's errors (no server, no project, a refused configuration): said, exit 1
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
