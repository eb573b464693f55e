"""Which nodes preflight pairs up: rounds of disjoint pairs whose number does not grow with the
node count, for the bandwidth streams and the interfaces step's connections. Used by preflight's
driver (preflight.py) and by the head agent's checks as the nodes come up (early.py).
Standard library only.
"""

from __future__ import annotations

import math
import random
from typing import List, Set, Tuple  # noqa: F401 - Set: in a type comment

from .probe import MiB

PAIR_BUDGET_S = 0.3        # each direction of each pair streams for about this long
PAIR_MAX_BYTES = 64 * MiB
#: Which pairs stream, in rounds of disjoint pairs (`schedule`): ring neighbours at these
#: distances, then seeded random pairs; so every node sends to and receives from at least
#: PAIR_PEERS others (all of them up to 8 nodes) in at most PAIR_ROUNDS rounds, at any node count.
PAIR_DISTANCES = (1, 2)
PAIR_SAMPLE_ROUNDS = 2
PAIR_PEERS = 2 * len(PAIR_DISTANCES)
PAIR_ROUNDS = 3 * len(PAIR_DISTANCES) + PAIR_SAMPLE_ROUNDS
#: Whom each node connects to in the interfaces step (connections are cheap: more of them,
#: all at once): every other node up to 24 nodes, else at least REACH_PEERS, at most 23.
REACH_DISTANCES = (1, 2, 3, 4, 5, 6, 7)
REACH_SAMPLE_ROUNDS = 2
REACH_PEERS = 2 * len(REACH_DISTANCES)


def rounds(count: int) -> List[List[tuple]]:
    """Rounds of disjoint pairs that together cover every pair once (the circle method)."""
    ids = list(range(count)) + ([None] if count % 2 else [])  # type: list
    size, out = len(ids), []
    for _ in range(size - 1):
        pairs = [(ids[i], ids[size - 1 - i]) for i in range(size // 2)]
        out.append([p for p in pairs if None not in p])
        ids = [ids[0], ids[-1]] + ids[1:-1]
    return out


def schedule(count: int, distances: Tuple[int, ...], sample_rounds: int, seed: int = 0) -> List[List[tuple]]:
    """Rounds of disjoint pairs whose number does not grow with `count`: every pair when that
    takes no more rounds than the bound (3 per distance + `sample_rounds`), else the ring
    neighbours at each distance (2 rounds, 3 where the ring's cycles are odd) and then
    `sample_rounds` rounds of seeded random pairs; idle nodes in any round get a random
    partner not yet met. With distances 1..d every node meets at least min(2d, count-1) others."""
    if count - 1 + count % 2 <= 3 * len(distances) + sample_rounds:  # len(rounds(count)), every pair
        return rounds(count)
    rng = random.Random(seed * 1000003 + count)
    used = set()  # type: Set[Tuple[int, int]]
    out = []  # type: List[List[tuple]]

    def add(into: list, a: int, b: int) -> None:
        key = (min(a, b), max(a, b))
        if a != b and key not in used:
            used.add(key)
            into.append(key)

    for distance in distances:
        colours = ([], [], [])  # type: Tuple[list, list, list]
        cycles = math.gcd(count, distance)
        length = count // cycles
        for start in range(cycles):  # the ring at this distance is `cycles` disjoint cycles
            cycle = [(start + step * distance) % count for step in range(length)]
            for step in range(length if length > 2 else 1):
                colour = 2 if length % 2 and step == length - 1 else step % 2
                add(colours[colour], cycle[step], cycle[(step + 1) % length])
        out.extend(c for c in colours if c)
    out.extend([] for _ in range(sample_rounds))
    for pairs in out:  # the seeded sample: whoever is idle in a round meets someone new
        busy = {n for pair in pairs for n in pair}
        idle = [n for n in range(count) if n not in busy]
        rng.shuffle(idle)
        while len(idle) > 1:
            a = idle.pop()
            for position in range(len(idle) - 1, max(-1, len(idle) - 17), -1):  # a few tries
                if (min(a, idle[position]), max(a, idle[position])) not in used:
                    add(pairs, a, idle.pop(position))
                    break
    return out


def partners(count: int, plan: List[List[tuple]]) -> List[List[int]]:
    """For each node, the others a schedule pairs it with."""
    out = [[] for _ in range(count)]  # type: List[List[int]]
    for pairs in plan:
        for a, b in pairs:
            out[a].append(b)
            out[b].append(a)
    return out
