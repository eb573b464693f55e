"""`resources.*` in SkyPilot's words: the GPUs as its accelerators (`A100-80GB:8`, `80GB+:1`) and what it has
no words for, the memory and disk in its units.

Its own module because both the render (task_config, size_notes) and the catalog (a GPU given by memory)
read a task's resources this way; each function cites the SkyPilot code whose reading it follows.
"""

from __future__ import annotations

import math
import re

from ...gpu_spec import gpu_gb, gpu_parts
from ...models import size_bytes, size_text

#: A GPU name with its memory as a suffix, in any of the forms a task may write (A100-80G, A100-80GiB,
#: V100_32GB): SkyPilot's catalog spells it NAME-<N>GB (A100-80GB, V100-32GB: its common/accelerators.csv).
_GPU_MEMORY_SUFFIX = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9._-]*?)[-_](?P<memory>\d+)\s*G(?:i?B)?$", re.IGNORECASE)


def sky_gpu(gpus: str) -> str:
    """`resources.gpus` in SkyPilot's words: `A100-80G:8` -> `A100-80GB:8`; other names as given. By memory, as
    SkyPilot takes it (Resources._parse_accelerators_from_str: `80GB:8` any GPU of exactly 80GB, `24GB+:1` of at
    least 24GB, resolved to the names of its catalog's common/metadata.csv by
    accelerator_registry.get_devices_by_memory); `A100:80GB:8` -> `A100-80GB:8`, the catalog's spelling of a
    memory variant. sky_gpu_refusal says what SkyPilot has no words for."""
    if gpus.isdigit():
        return gpus
    name, memory, count = gpu_parts(gpus)
    if memory:
        low, high = memory
        size = f"{math.ceil((low or 0) / 10**9)}GB"  # whole GB: sky_gpu_refusal refuses others
        return f"{name}-{size}:{count}" if name else f"{size}{'' if low == high else '+'}:{count}"
    match = _GPU_MEMORY_SUFFIX.match(name)
    if match:
        name = f"{match.group('name')}-{match.group('memory')}GB"
    return f"{name}:{count}" if ":" in gpus else name


def sky_gpu_refusal(gpus: str | None) -> str | None:
    """Why SkyPilot cannot be asked for `resources.gpus` as the task gives it, or None: its accelerators
    take a memory in whole GB (its pattern `^[0-9]+[GgMmTt][Bb]\\+?$`; its catalog's figures are whole, so
    at least 25.8GB is at least 26GB), exactly or at least, never at most (Resources._parse_accelerators_from_str),
    and with a GPU's name only as the catalog's NAME-<N>GB."""
    if not gpus or gpus.isdigit():
        return None
    name, memory, _ = gpu_parts(gpus)
    if not memory:
        return None
    low, high = memory
    if high is not None and low != high:
        return (f"SkyPilot takes a GPU memory exactly (80GB:8) or at least (24GB..:1 -> 24GB+:1), not at most "
                f"(Resources._parse_accelerators_from_str): write {gpu_gb(low) + '..' if low else 'a lower bound'}, "
                f"or name the GPU")
    if low % 10**9 and low == high:
        return (f"SkyPilot takes a GPU memory in whole GB (its catalog lists each GPU's, 80 for an A100 80GB): "
                f"{gpu_gb(low)} is not; write {math.ceil(low / 10**9)}GB")
    if name and low != high:
        return f"SkyPilot names a GPU's memory variant exactly (A100-80GB), not by a range: write {name}:{gpu_gb(low)}"
    if name and _GPU_MEMORY_SUFFIX.match(name):
        return f"the memory given twice, in the name {name} and as {gpu_gb(low)}: give one"
    return None


#: SkyPilot's size units (skylet/constants.py MEMORY_SIZE_UNITS, read by utils/resources_utils.py
#: parse_memory_resource): its GB is 2^30 bytes, and a bare number is its GB.
SKY_UNITS = (("TB", 2**40), ("GB", 2**30), ("MB", 2**20))
#: SkyPilot's own disk_size, which Resources._from_yaml_config_single reads as none given (no ephemeral-storage
#: request on Kubernetes): sky/resources.py DEFAULT_DISK_SIZE_GB.
SKY_DEFAULT_DISK = 256
#: The clouds of SkyPilot's whose nodes are Kubernetes pods: Kubernetes (`k8s` its alias: clouds/kubernetes.py), and
#: its SSH node pools (clouds/ssh.py: class SSH(kubernetes.Kubernetes)).
KUBERNETES_CLOUDS = ("kubernetes", "k8s", "ssh")


def sky_memory(size: str) -> str:
    """`resources.memory` in SkyPilot's units, the same bytes (a fraction is allowed: Resources._set_memory reads
    a float): `64GiB` -> `64` (a bare number is its GB), `200GB` -> `190734.86328125MB`."""
    text = size_text(size_bytes(size), SKY_UNITS)
    return text.removesuffix("GB") if text.endswith("GB") and text[:-2].isdigit() else text


def disk_size(size: str) -> int:
    """SkyPilot's `disk_size`: a whole number of its GB (Resources.__init__ takes an int), rounded up so that the
    disk is at least what the task asks."""
    return -(-size_bytes(size) // 2**30)
