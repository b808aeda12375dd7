"""The roles a rank can hold between two sync boundaries (shared by the store, the policies and the ranks)."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    ROLLOUT = "rollout"
    ACTOR = "actor"
    REF = "ref"
    IDLE = "idle"
