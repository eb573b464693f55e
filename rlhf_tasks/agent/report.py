"""Preflight's result as the table the head prints (nodes, interfaces, addresses, versions,
bandwidth), and the rates and sizes in it. Standard library only."""

from __future__ import annotations

from typing import Dict, List, Optional

from .probe import MiB


def rate(bits: Optional[float]) -> str:
    if bits is None:
        return "-"
    if bits >= 1e9:
        return "%.1f Gbit/s" % (bits / 1e9)
    return "%.0f Mbit/s" % (bits / 1e6) if bits >= 1e7 else "%.2f Mbit/s" % (bits / 1e6)


def size_text(size: float) -> str:
    return "%d MiB" % (size // MiB) if size >= MiB else "%d KiB" % (size // 1024)


def table(result: dict) -> List[str]:
    """The result as the lines the head prints (nodes, interfaces, addresses, versions, bandwidth)."""
    nodes = result["nodes"]
    sends, receives = {}, {}  # type: Dict[str, float], Dict[str, float]
    for pair in result["pairs"]:
        sends[pair["src"]] = min(sends.get(pair["src"], pair["bits_per_s"]), pair["bits_per_s"])
        receives[pair["dst"]] = min(receives.get(pair["dst"], pair["bits_per_s"]), pair["bits_per_s"])
    gpus = any(n.get("gpus") for n in nodes)

    def endpoint(e):
        if not e:
            return "-"
        name = e.get("iface") or ("(unset)" if not e.get("value") else "?")
        return "%s %s" % (name, e.get("address") or "")

    header = ["rank", "node", "address", "gloo interface"] + (["nccl interface"] if gpus else []) + [
        "python", "ray", "torch"] + (["cuda", "nccl", "gpus"] if gpus else []) + ["slowest send",
                                                                                "slowest receive"]
    rows = [header]
    for n in nodes:
        row = [str(n.get("rank") if n.get("rank") is not None else "-"), (n.get("name") or "?") + (" (head)" if n.get("head") else ""),
               n.get("address") or "-", endpoint(n.get("gloo_if"))]
        row += [endpoint(n.get("nccl_if"))] if gpus else []
        row += [n.get("python") or "-", n.get("ray") or "-", n.get("torch") or ("none" if n.get("torch_why") else "-")]
        row += [n.get("cuda") or n.get("rocm") or "-", n.get("nccl") or "-", str(n.get("gpus") or 0)] if gpus else []
        row += [rate(sends.get(n.get("name"))), rate(receives.get(n.get("name")))]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    for backend, coll in sorted(result["collectives"].items()):
        lines.append("  %s all_reduce across %d nodes, bus bandwidth: %s" % (
            "Gloo" if backend == "gloo" else "NCCL", coll["nodes"],
            ", ".join("%s %s" % (size_text(s["bytes"]), rate(s["bus_bits_per_s"])) for s in coll["sizes"])))
    slowest = result.get("slowest_pair")
    if slowest:
        fastest = max(result["pairs"], key=lambda p: p["bits_per_s"])
        plan = result.get("pair_plan") or {}
        if plan.get("directions") == plan.get("of"):
            measured = "every pair both ways: %d directions" % len(result["pairs"])
        else:
            measured = "%d of the %d directions, every node to and from at least %d others" % (
                len(result["pairs"]), plan.get("of", 0), plan.get("peers_at_least", 0))
        count = plan.get("rounds", 0)
        lines.append("  pairs (TCP over the Gloo addresses, %s, in %d round%s): slowest %s -> %s %s, fastest %s -> %s %s" % (
            measured, count, "" if count == 1 else "s", slowest["src"], slowest["dst"], rate(slowest["bits_per_s"]),
            fastest["src"], fastest["dst"], rate(fastest["bits_per_s"])))
    return lines
