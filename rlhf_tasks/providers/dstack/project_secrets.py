"""The task's secrets and the Ray token as dstack project secrets: one per cluster and variable, named
so that no two clusters' meet, and referenced from the job's env as `${{ secrets.NAME }}`, which
dstack's server fills in when it hands each job to its runner: no value is in a rendered file.
"""

from __future__ import annotations

from ...plan import Plan


def secret_name(cluster: str, variable: str) -> str:
    """The dstack project secret that holds `variable` for `cluster`: `rlhf_tasks__my_run__HF_TOKEN`.

    A project's secrets are one namespace for all its runs, so each cluster has its own (two clusters' Ray
    tokens differ; `down` of one leaves the other's). A reference's name may hold only letters, digits and
    `_` after `secrets.` (utils/interpolator.py Name: no `-`, though the server's own rule for a secret's name
    takes `-`: services/secrets.py _SECRET_NAME_REGEX), so the cluster's dashes become `_`; a cluster name has no
    `__` and ends in a letter or digit, so the first `__` after the prefix ends it: no two clusters' names meet."""
    return f"{SECRET_PREFIX}{cluster.replace('-', '_')}__{variable}"


#: What every project secret of ours begins with (secret_name).
SECRET_PREFIX = "rlhf_tasks__"
#: dstack's limits on a secret (server/services/secrets.py _SECRET_NAME_REGEX, _SECRET_VALUE_MAX_LENGTH).
SECRET_NAME_MAX, SECRET_VALUE_MAX = 200, 5000


def secret_variables(plan: Plan) -> list[str]:
    """The variables that go through dstack's project secrets: the task's secrets and the Ray token's."""
    return list(plan.secrets) + ([plan.token_env] if plan.token_env else [])


def secret_reference(cluster: str, variable: str) -> str:
    """What the job's env says for `variable`: dstack's server puts the project secret's value in."""
    return f"${{{{ secrets.{secret_name(cluster, variable)} }}}}"

