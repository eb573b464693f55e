"""Provider adapters. Each turns a cluster plan into the provider's native files
(`render`, pure: the dry run) and makes them real (`apply`, `down`: side effects).

This package owns loading a provider by name. Which names exist (the built-in ones and
those registered under the entry-point group `rlhf_tasks.providers`, so a third party can
add one with a package of its own) is `rlhf_tasks.registry`'s, which imports no provider.
"""

from __future__ import annotations

import importlib

from ..errors import BadInput
from ..registry import BUILTIN, GROUP, names, targets
from .base import Cluster, Option, Provider


def provider_class(name: str) -> type[Provider]:
    """The provider's class, its module imported now (only the one named)."""
    target = targets().get(name)
    if target is None:
        raise BadInput(f"--provider: unknown provider {name!r} (known: {', '.join(names())})")
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def get(name: str, **options) -> Provider:
    """The provider named `name`, with values for its own `launch` options."""
    return provider_class(name)(**options)


def sharing_rows() -> list[str]:
    """The rows of docs/providers.md's table of which storage every node of a run can share: each built-in
    provider's rules (Provider.sharing), which its `check` follows."""
    return [rule.row(name) for name in BUILTIN for rule in provider_class(name).sharing]


__all__ = ["BUILTIN", "GROUP", "Cluster", "Option", "Provider", "get", "names", "provider_class", "sharing_rows"]
