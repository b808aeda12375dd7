"""How sure an evaluation's success rate is: pure arithmetic on counts, for the status and summary.

- :func:`wilson_interval`: the 95% Wilson score interval of a binomial rate (right near 0 and 1 and for
  small n, where the normal approximation is not).
- :func:`compare`: two evaluations' rates, and whether their difference is beyond noise (a two-sided
  two-proportion z-test at 95%, pooled variance).

Both treat the tasks as independent draws. Greedy evaluation of a prompt drawn twice is the same
trajectory, so where an environment has fewer distinct prompts than the evaluation has tasks, the
intervals are narrower than the truth; `rollout.eval_groups` should not exceed the distinct prompts
(hilo: its consecutive evaluation seeds are distinct games up to `high - low + 1`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Comparison", "compare", "wilson_interval"]

Z95 = 1.959964


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) of the Wilson score interval; (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: successes must be in [0, {n}], got {successes}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True, slots=True)
class Comparison:
    change: float
    """Second rate minus first."""
    z: float
    """Two-proportion z statistic (0 when both rates are 0 or both 1)."""

    @property
    def beyond_noise(self) -> bool:
        return abs(self.z) >= Z95


def compare(s1: float, n1: int, s2: float, n2: int) -> Comparison:
    """The change from rate s1 / n1 to s2 / n2 and its z statistic."""
    if n1 <= 0 or n2 <= 0:
        raise ValueError(f"compare: need tasks on both sides, got {n1} and {n2}")
    p1, p2 = s1 / n1, s2 / n2
    pooled = (s1 + s2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return Comparison(p2 - p1, (p2 - p1) / se if se > 0 else 0.0)
