"""`placement.dstack` and `checkpoints.shared.dstack`, read with this provider's models (an SSH fleet
of the user's hosts, a custom image's user, CPU architecture and registry credentials; a network volume
or a host directory every node mounts), and which storage the nodes of one dstack run share (SHARING),
as read in dstack 0.22.5's code: what `check` refuses before anything is rented.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ...errors import BadInput
from ...models import StrictModel, require_absolute
from ...spec import group_part, provider_part
from ..base import Sharing

#: Which storage the nodes of one dstack run share, read in dstack 0.22.5. A network volume is one cloud disk that
#: dstack attaches to each job's instance (server/background/pipeline_tasks/jobs_submitted.py,
#: _process_volume_attachments: a failed attach ends the job VOLUME_ERROR, after its instance was provisioned), and
#: the run's offers are limited to the volume's backend and region (server/services/offers.py).
SHARING = (
    Sharing("volume", "runpod", "yes", "a RunPod network volume mounts in many pods of its data center at once; "
            "dstack's volume docs: mounting one volume in several runs and instances \"is currently supported only "
            "by the `runpod` backend\" (concepts/volumes.md, FAQ)"),
    Sharing("volume", "kubernetes", "if its PersistentVolumeClaim is ReadWriteMany",
            "a dstack Kubernetes volume is a PVC whose `access_modes` default to ReadWriteOnce "
            "(core/models/volumes.py, KubernetesVolumeConfiguration); a ReadWriteOnce claim mounts on one "
            "Kubernetes node, and dstack does not check it"),
    Sharing("volume", "aws", "no", "an EBS volume attaches to one instance: the second node's attach fails "
            "(aws/compute.py attach_volume, VolumeInUse) after its instance is billed, and its job ends VOLUME_ERROR"),
    Sharing("volume", "gcp", "no", "a persistent disk is attached read-write to one instance (gcp/compute.py "
            "attach_volume, READ_WRITE): the second node's attach fails as on aws"),
    Sharing("volume", "other backends, SSH fleets", "no", "no network volumes (only aws, gcp, kubernetes, runpod, "
            "daytona and lium implement ComputeWithVolumeSupport, core/backends/base/compute.py; daytona and lium run "
            "no multi-node task)"),
    Sharing("volume", "any, a name with `${{ dstack.node_rank }}`", "no", "one volume per node (dstack interpolates "
            "the name per job: server/services/jobs/configurators/base.py, interpolate_job_volumes): not shared"),
    Sharing("host_path", "any", "if it is one network filesystem mounted on every host",
            "you declare it (an NFS or Lustre mount on an SSH fleet's hosts): dstack mounts the host's directory "
            "(instance_path) and shares nothing itself; it mounts no shared filesystem on cloud instances"),
)


def volume_backends(sharing=SHARING) -> list[str]:
    """The backends on which one dstack network volume can be mounted by every node of a run (perhaps with a
    condition `check` cannot see), from the rules."""
    return [rule.backend for rule in sharing
            if rule.form == "volume" and rule.shared != "no" and "`" not in rule.backend]


def per_node_name(volume: str) -> bool:
    """A volume name dstack interpolates per job (`ckpt-${{ dstack.node_rank }}`): each node its own volume."""
    return bool(re.search(r"\$\{\{\s*dstack\.(node_rank|job_num)\s*\}\}", volume))


class DstackShared(StrictModel):
    """`checkpoints.shared.dstack`: storage every node mounts at checkpoints.path."""

    volume: str | None = Field(None, description=(
        "a dstack network volume; for several nodes only where every backend the run may land on mounts one in "
        "several instances (placement.backends: [runpod]; kubernetes with a ReadWriteMany claim)"))
    host_path: str | None = Field(None, description="a directory on every fleet host that is the same storage "
                                  "on all of them (e.g. an NFS mount): you declare it shared")

    _absolute = field_validator("host_path")(classmethod(lambda cls, v: require_absolute(v, "it is a host path")))

    @model_validator(mode="after")
    def _one(self):
        if (self.volume is None) == (self.host_path is None):
            raise ValueError("give exactly one of volume: NAME or host_path: /PATH")
        return self


_SECRET_NAME = r"^[A-Za-z0-9_-]+$"


class DstackSSH(StrictModel):
    """`placement.dstack.ssh`: the fleet is these hosts of yours (dstack's SSH fleet, `ssh_config`)."""

    hosts: list[str] = Field(min_length=1, description="the hosts' addresses or names, as SSH reaches them")
    user: str = Field(description="the user SSH logs in as on every host (root or one with passwordless sudo)")
    identity_file: str = Field(description="the private key file for that user (e.g. ~/.ssh/id_rsa), read by "
                               "`dstack apply` on this machine")
    port: int | None = Field(None, ge=1, le=65535, description="the SSH port, when not 22")
    network: str | None = Field(None, description="the hosts' private network (10.0.0.0/24): dstack takes the "
                                "nodes' addresses from it; without it, the first internal one found")


class DstackRegistryAuth(StrictModel):
    """`placement.dstack.registry_auth`: credentials for a private image, the password by a dstack secret's name."""

    username: str = Field(description="the registry user (e.g. oauth2accesstoken, AWS, your user name)")
    password_secret: str = Field(pattern=_SECRET_NAME, description=(
        "the name of a dstack secret holding the password or token (`dstack secret set NAME VALUE`): the "
        "rendered file names it as ${{ secrets.NAME }}, never the value"))


class DstackPlacement(StrictModel):
    """`placement.dstack`: dstack's own options."""

    ssh: DstackSSH | None = Field(None, description=(
        "the fleet is your own hosts over SSH (an on-prem or rented cluster): the rendered fleet has ssh_config "
        "with them instead of cloud instances, and the task runs on it"))
    user: str | None = Field(None, description=(
        "the user inside the image's containers (dstack's `user:`, e.g. root or 1000:1000); with cpu_arch, dstack "
        "needs no look-up of the image's configuration in its registry at submit time"))
    cpu_arch: Literal["x86", "arm"] | None = Field(None, description="the image's CPU architecture (x86 or arm)")
    registry_auth: DstackRegistryAuth | None = Field(None, description="credentials for a private registry")


def dstack_placement(placement) -> DstackPlacement:
    return provider_part(DstackPlacement, placement.dstack, "placement.dstack")


#: placement.dstack keys that are the run's, not a node group's: dstack 0.22.5's NodeGroup has `name`, `nodes`,
#: `resources`, `commands` and `ports` only (core/models/configurations.py), so the image's user and registry
#: credentials are the task configuration's, one for every group, and the fleet (an SSH fleet's hosts) is one for
#: the run: each group's `resources` pick its hosts among the fleet's (server/services/runs/plan.py plans each node
#: group's offers apart, _get_job_batches_for_planning). A group may give `cpu_arch`, which dstack reads per group
#: (its `resources.cpu`, jobs/configurators/base.py _requirements).
RUN_KEYS = {
    "ssh": "the fleet's hosts are the run's: give placement.dstack.ssh once with every group's hosts, and each "
           "group's resources match its own among them (dstack plans each node group's offers apart)",
    "user": "dstack's `user:` is the task configuration's, one for every group's jobs (its NodeGroup has no user)",
    "registry_auth": "dstack's `registry_auth:` is the task configuration's, one for every group's jobs (its "
                     "NodeGroup has no registry_auth)",
}


def group_dstack(placement, group, index: int) -> DstackPlacement:
    """A node group's options: its `placement.dstack` keys over the task's, read with this provider's model
    (BadInput naming `groups[i].placement.dstack.<key>`); the run's own keys (RUN_KEYS) refused per group."""
    for key, why in RUN_KEYS.items():
        if key in group.placement.dstack:
            raise BadInput(f"groups[{index}].placement.dstack.{key}: {why}; give it in placement.dstack")
    return group_part(DstackPlacement, placement, group, index, "dstack")
