"""A task's secrets (its `secrets:` and the cluster's Ray token) in RunPod's vault: one account
secret per variable, named for the cluster and the variable (`rlhf-tasks.NAME.VARIABLE`), which
every pod's env references as `{{ RUNPOD_SECRET_rlhf-tasks.NAME.VARIABLE }}`; RunPod puts the
value in when the pod boots, so no create request, and no pod's configuration, holds a value.

RunPod's API v2 (api-reference-v2, "Create a secret", "List secrets", "Delete a secret";
"Manage secrets"): `POST /account/secrets` {name, value}, the value write-only ("never returned
by the API"); a name is unique in the account, up to 191 characters of letters, digits and
`_.-/`, not starting with RUNPOD; deleting one "is not blocked while the secret is in use", and
a variable that references it then stops resolving, so they are deleted after the pods are gone.

They are deleted by `down` and by the launcher when the cluster ends (after its job, or when it
ended itself while the launcher followed it); a pod cannot delete them itself (the key RunPod
gives a pod is "limited in scope to only the pod"), so a cluster that ended itself with no
launcher following leaves them until `rlhf-tasks down NAME` (`status NAME` lists them), or the
next launch of NAME, which replaces them.
"""

from __future__ import annotations

from .api import RunPodClient

PREFIX = "rlhf-tasks"


def secret_name(cluster: str, variable: str) -> str:
    """The account secret that holds `variable` for `cluster`."""
    return f"{PREFIX}.{cluster}.{variable}"


def reference(cluster: str, variable: str) -> str:
    """What a pod's env says for `variable`: RunPod substitutes the secret's value at boot."""
    return "{{ RUNPOD_SECRET_" + secret_name(cluster, variable) + " }}"


def held(client: RunPodClient, cluster: str) -> list[dict]:
    """The account secrets of `cluster` (by the names this module gives), nothing else of the account."""
    prefix = f"{PREFIX}.{cluster}.".lower()
    return [s for s in client.list_secrets() if s.get("name", "").lower().startswith(prefix)]


def store(client: RunPodClient, cluster: str, values: dict[str, str]) -> set[str]:
    """One account secret per variable that has a value (those left of an earlier cluster of this name,
    which has no pods now, deleted first); the names of those made."""
    forget(client, cluster)
    made = set()
    for variable, value in values.items():
        if not value:
            continue
        name = secret_name(cluster, variable)
        client.create_secret(name, value, description=f"{variable} of the rlhf-tasks cluster {cluster}; "
                             f"deleted by `rlhf-tasks down {cluster}`")
        made.add(name)
    return made


def forget(client: RunPodClient, cluster: str) -> list[str]:
    """Delete the account secrets of `cluster`; their names."""
    gone = []
    for secret in held(client, cluster):
        client.delete_secret(secret["id"])
        gone.append(secret["name"])
    return gone
