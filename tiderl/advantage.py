"""GRPO group-relative advantages: A_i = (r_i - mean(r)) / (std(r) + eps).

std is the sample standard deviation (n - 1 in the denominator, as torch.std
and the common GRPO implementations use); a group whose rewards are all equal
gets zero advantages (it carries no learning signal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    n = len(rewards)
    if n == 0:
        raise ValueError("group_advantages: empty group")
    mean = sum(rewards) / n
    if n == 1:
        return [0.0]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]
