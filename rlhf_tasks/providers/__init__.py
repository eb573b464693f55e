"""Provider adapters. Each turns a cluster plan into the provider's native files
(`render`, pure: the dry run) and makes them real (`apply`, `down`: side effects).

This package makes a provider by name (`get`). Which names exist (the built-in ones and
those registered under the entry-point group `rlhf_tasks.providers`, so a third party can
add one with a package of its own) and loading one's class are `rlhf_tasks.registry`'s.
"""

from __future__ import annotations

from ..registry import BUILTIN, GROUP, names, provider_class
from .base import Cluster, Option, Provider


def get(name: str, **options) -> Provider:
    """The provider named `name`, with values for its own `launch` options."""
    return provider_class(name)(**options)


def sharing_rows() -> list[str]:
    """The rows of docs/providers.md's table of which storage every node of a run can share: each built-in
    provider's rules (Provider.sharing), which its `check` follows."""
    return [rule.row(name) for name in BUILTIN for rule in provider_class(name).sharing]


__all__ = ["BUILTIN", "GROUP", "Cluster", "Option", "Provider", "get", "names", "provider_class", "sharing_rows"]
