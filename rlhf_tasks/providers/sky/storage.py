"""The storage the nodes of a SkyPilot cluster can share: which of SkyPilot's kinds every node sees
(SHARING, the rows of docs/providers.md's table) and the task's `checkpoints.shared.sky` (a bucket or a
SkyPilot volume), read with this provider's model.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ...models import StrictModel
from ..base import Sharing

#: Which storage the nodes of one SkyPilot cluster share, read in SkyPilot 0.14.1. A volume (`sky volumes apply`)
#: pins the task to its cloud, and SkyPilot refuses a task whose resources name another (task.py,
#: Task.resolve_and_validate_volumes: VolumeTopologyConflictError, "even if user specifies 'any_of'").
SHARING = (
    Sharing("bucket", "any", "yes", "MOUNT and MOUNT_CACHED are close-to-open: a file is in the bucket for every "
            "node once closed (SkyPilot's storage docs, storage modes); MOUNT_CACHED uploads it in the background "
            "after the close and rereads listings every 10 s (data/mounting_utils.py get_mount_cached_cmd: rclone "
            "--vfs-cache-mode full --dir-cache-time 10s); each node writes its own files, two writers of one file: "
            "the last close wins"),
    Sharing("volume", "kubernetes (k8s-pvc)", "if its access mode is ReadWriteMany", "SkyPilot itself refuses a "
            "ReadWriteOnce or ReadWriteOncePod volume for a multi-node task at `sky launch`, before anything is "
            "provisioned (task.py Task.resolve_and_validate_volumes)"),
    Sharing("volume", "kubernetes (k8s-hostpath)", "if its host_path is one network filesystem on every node",
            "a directory on each Kubernetes node: \"Data is local to each node\" (volumes/volume.py HostPathVolume)"),
    Sharing("volume", "runpod (runpod-network-volume)", "yes", "a RunPod network volume, mounted by every pod of "
            "its data center (volumes/volume.py RunpodNetworkVolume: the zone is its DataCenterId)"),
    Sharing("volume", "other clouds", "no", "SkyPilot has volumes on kubernetes and runpod only "
            "(volumes/volume.py VOLUME_TYPE_TO_CLOUD)"),
)

#: The clouds a SkyPilot volume can be on (the SHARING rows of a volume that are not "no").
VOLUME_CLOUDS = ("kubernetes", "runpod")


class SkyShared(StrictModel):
    """`checkpoints.shared.sky`: storage every node mounts at checkpoints.path."""

    bucket: str | None = Field(None, description="an existing bucket (s3://BUCKET/PREFIX, gs://, r2://...) "
                               "mounted there")
    mode: Literal["MOUNT_CACHED", "MOUNT"] = Field(
        "MOUNT_CACHED", description="MOUNT_CACHED: writes go to a local cache and upload in the background (any "
        "write pattern); MOUNT: written through to the bucket (no appends or random writes)")
    volume: str | None = Field(None, description="a SkyPilot volume (sky volumes apply), on kubernetes or runpod: "
                               "every node shares a RunPod one or a ReadWriteMany claim")

    @field_validator("bucket")
    @classmethod
    def _url(cls, value):
        if value is not None and not re.match(r"^[a-z0-9]+://[^/\s]+(/\S*)?$", value):
            raise ValueError(f"{value!r} is not a bucket URL (s3://BUCKET/PREFIX, gs://BUCKET, r2://BUCKET...)")
        return value

    @model_validator(mode="after")
    def _one(self):
        if (self.bucket is None) == (self.volume is None):
            raise ValueError("give exactly one of bucket: URL or volume: NAME")
        if self.volume is not None and "mode" in self.model_fields_set:
            raise ValueError("mode is for a bucket")
        return self
