"""The bandwidth between node groups (issue 46), from preflight's pair streams. The weights go from the
trainer's group (the first: the head's) to the other groups' nodes (rollout engines, a reference or reward
model), so each of those groups' link is the slowest stream measured from a node of the first group into one
of its nodes: what a weight sync to that group waits for."""

from __future__ import annotations

from typing import List


def group_links(nodes: List[dict], pairs: List[dict]) -> List[dict]:
    """For each group after the first (in the order of its lowest rank), the slowest measured stream from the
    first group into it: {"src_group", "dst_group", "pair"} (pair: one of `pairs`); none where a node has no
    group (a task without groups) or there is one group. A group no stream reached is left out."""
    if not nodes or any(node.get("group") is None for node in nodes):
        return []
    order = sorted(range(len(nodes)), key=lambda i: rank_of(nodes[i]))
    groups = list(dict.fromkeys(nodes[i]["group"] for i in order))
    out = []
    for group in groups[1:]:
        into = [p for p in pairs if nodes[p["src_index"]]["group"] == groups[0]
                and nodes[p["dst_index"]]["group"] == group]
        if into:
            out.append({"src_group": groups[0], "dst_group": group, "pair": min(into, key=lambda p: p["bits_per_s"])})
    return out


def rank_of(node: dict) -> int:
    """A node's rank in preflight's records (the last where it is not known)."""
    try:
        return int(node.get("rank"))
    except (TypeError, ValueError):
        return 1 << 30
