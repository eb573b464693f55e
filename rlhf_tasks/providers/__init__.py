"""Provider adapters. Each turns a cluster plan into the provider's native files
(`render`, pure: the dry run) and makes them real (`apply`, `down`: side effects).

Providers register under the entry-point group `rlhf_tasks.providers` (as torchx
registers schedulers), so a third party can add one with a package of its own.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from ..errors import BadInput
from .base import Cluster, Option, Provider

GROUP = "rlhf_tasks.providers"
BUILTIN = {
    "local": "rlhf_tasks.providers.local:LocalProvider",
    "dstack": "rlhf_tasks.providers.dstack:DstackProvider",
    "sky": "rlhf_tasks.providers.sky:SkyProvider",
    "runpod": "rlhf_tasks.providers.runpod:RunPodProvider",
    "slurm": "rlhf_tasks.providers.slurm:SlurmProvider",
}


def _targets() -> dict[str, str]:
    targets = dict(BUILTIN)
    for ep in entry_points(group=GROUP):
        targets.setdefault(ep.name, ep.value)
    return targets


def names() -> list[str]:
    return sorted(_targets())


def provider_class(name: str) -> type[Provider]:
    target = _targets().get(name)
    if target is None:
        raise BadInput(f"--provider: unknown provider {name!r} (known: {', '.join(names())})")
    module_name, _, attr = target.partition(":")
    import importlib

    return getattr(importlib.import_module(module_name), attr)


def get(name: str, **options) -> Provider:
    """The provider named `name`, with values for its own `launch` options."""
    return provider_class(name)(**options)


__all__ = ["Cluster", "Option", "Provider", "get", "names", "provider_class"]
