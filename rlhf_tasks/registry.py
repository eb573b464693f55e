"""Which providers exist, by name: the built-in ones and those registered under the
entry-point group `rlhf_tasks.providers` (as torchx registers schedulers), as import
targets ("module:Class"). Imports no provider, so the task file's checks (spec.py) can
name the providers without importing them; provider_class loads one by name, when asked."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from .errors import BadInput

GROUP = "rlhf_tasks.providers"
BUILTIN = {
    "local": "rlhf_tasks.providers.local:LocalProvider",
    "dstack": "rlhf_tasks.providers.dstack:DstackProvider",
    "sky": "rlhf_tasks.providers.sky:SkyProvider",
    "runpod": "rlhf_tasks.providers.runpod:RunPodProvider",
    "slurm": "rlhf_tasks.providers.slurm:SlurmProvider",
    "kuberay": "rlhf_tasks.providers.kuberay:KubeRayProvider",
}


def targets() -> dict[str, str]:
    """Provider name -> "module:Class"; a built-in name wins over a plugin's."""
    found = dict(BUILTIN)
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def names() -> list[str]:
    return sorted(targets())


def provider_class(name: str) -> Any:
    """The provider's class (a providers.base.Provider), its module imported now (only the one named)."""
    target = targets().get(name)
    if target is None:
        raise BadInput(f"--provider: unknown provider {name!r} (known: {', '.join(names())})")
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
