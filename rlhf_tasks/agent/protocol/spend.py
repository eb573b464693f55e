"""The training's spend and its caps, spoken by the head agent (which counts them) and the launcher
(which keeps the training's record between launches and refuses a launch past a cap): the spend
record `.rlhf-tasks-spend.json` in the checkpoint directory, `{"version": 1, "training": ID,
"attempts": {ATTEMPT: {"seconds", "cost", "price_per_hour", "started", "ended"}}}`, and what a cap
allows after the attempts before. Standard library only, Python >= 3.8.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Tuple

#: The training's spend record, in the checkpoint directory; how often the head rewrites it.
SPEND_FILE = ".rlhf-tasks-spend.json"
SPEND_EVERY_S = 5.0
SPEND_VERSION = 1


def hm(seconds: float) -> str:
    """`1 h 05 m`, `0 h 02 m`: how the summary says a duration."""
    minutes = int(round(seconds / 60.0))
    return "%d h %02d m" % (minutes // 60, minutes % 60)


def spent(price_per_hour: Optional[float], seconds: float) -> Optional[float]:
    """US dollars after `seconds` at the price; None without a price."""
    return None if price_per_hour is None else price_per_hour * seconds / 3600.0


def _caps(budget: dict, before_s: float = 0.0, before_cost: float = 0.0) -> dict:
    """Seconds left in this attempt by each cap, after what the attempts before it spent."""
    caps = {}
    if budget.get("max_duration_s"):
        caps["max_duration"] = max(0.0, float(budget["max_duration_s"]) - before_s)
    price, cost = budget.get("price_per_hour"), budget.get("max_cost")
    if cost is not None and price:
        caps["max_cost"] = max(0.0, (float(cost) - before_cost) / float(price) * 3600.0)
    return caps


def cap_seconds(budget: dict, before_s: float = 0.0, before_cost: float = 0.0) -> Optional[float]:
    """When the first cap is reached, in seconds from the head's start: max_duration, or the
    time max_cost buys at the price (a free cluster never reaches a cost cap), less what the
    training's attempts before this one spent (`before_s`, `before_cost`); None: no cap."""
    caps = _caps(budget, before_s, before_cost)
    return min(caps.values()) if caps else None


def cap_words(budget: dict, seconds: float, cost: Optional[float] = None, attempts: int = 1,
              before_s: float = 0.0, before_cost: float = 0.0) -> str:
    """`stopped at the budget cap: $12.00 after 1 h 30 m` (or at max_duration), for the logs,
    the summary and `status`: the training's whole spend (`seconds`, `cost`) over its `attempts`."""
    cost = spent(budget.get("price_per_hour"), seconds) if cost is None else cost
    money = "$%.2f" % cost if cost is not None else "cost unknown"
    over = " over %d attempts" % attempts if attempts > 1 else ""
    caps = _caps(budget, before_s, before_cost)
    if "max_cost" in caps and ("max_duration" not in caps or caps["max_cost"] < caps["max_duration"]):
        return "stopped at the budget cap: %s after %s%s (placement.max_cost $%.2f)" % (
            money, hm(seconds), over, float(budget["max_cost"]))
    return "stopped at the budget cap: %s after %s%s (placement.max_duration %s)" % (
        money, hm(seconds), over, hm(float(budget["max_duration_s"])))


def merge(*attempts: dict) -> dict:
    """Attempt records merged by attempt id (the larger spend of one attempt wins: a later write of it)."""
    out = {}  # type: dict
    for records in attempts:
        for key, entry in (records or {}).items():
            if not isinstance(entry, dict):
                continue
            have = out.get(key)
            if have is None or float(entry.get("seconds") or 0) >= float(have.get("seconds") or 0):
                out[key] = dict(have or {}, **entry)
    return out


def totals(attempts: dict) -> Tuple[float, float, int]:
    """(seconds, dollars, failed attempts) over a training's attempts."""
    seconds = sum(float(a.get("seconds") or 0) for a in attempts.values())
    cost = sum(float(a.get("cost") or 0) for a in attempts.values())
    return seconds, cost, sum(1 for a in attempts.values() if a.get("ended") == "failed")


def read_spend(path: Optional[str], training: Optional[str]) -> dict:
    """The attempts of `training` in the spend record at `path`; {} when there is none (or it is another
    training's: one moved aside by `launch --fresh`, a name reused)."""
    if not path or not training:
        return {}
    try:
        with open(path) as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or record.get("training") != training:
        return {}
    return record.get("attempts") if isinstance(record.get("attempts"), dict) else {}


def write_spend(path: str, record: dict) -> None:
    """The record written whole (a temporary file renamed over it): a reader never sees half of it."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as handle:
        json.dump(record, handle, sort_keys=True)
    os.replace(tmp, path)
