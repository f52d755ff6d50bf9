"""Interleaved timing, shared by the benchmarks in ``scripts/``: every side is measured once per
round, in reverse order every other round (the second side of a round measured up to 10% slower on
identical work), and each side's ratio to the reference is the median over the rounds of the ratio
*within* a round, so the machine speeding up or slowing down between rounds (a shared VM) cancels out.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence


def interleaved(
    measure: Callable[[str], float], sides: Sequence[str], rounds: int, reference: str
) -> tuple[dict[str, float], dict[str, float]]:
    """Run ``measure(side)`` (seconds, or any time unit) for every side, ``rounds`` times.

    Returns:
        ``({side: median time}, {side: median over rounds of time / reference's time})``; the
        ratios are ``nan`` when ``reference`` is not one of ``sides``.
    """
    sides = list(sides)
    samples: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            samples[side].append(measure(side))
    ratios = {
        s: statistics.median(x / ref for x, ref in zip(samples[s], samples[reference]))
        if reference in samples else float("nan")
        for s in sides
    }
    return {s: statistics.median(v) for s, v in samples.items()}, ratios
