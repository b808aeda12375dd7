"""Elastic Resource Scaling (ERS): the role map, RA2P mode and fetch size of the next version, planned at a
sync boundary from readiness signals (paper section 5.2). Pure: no torch, no database, no HTTP, no processes.

``plan = overrides(choose(model(signals)))`` (docs/ers.md: each stage, its rules and invariants):
:mod:`~tiderl.policy.ers.signals` builds the signals from a snapshot of the run (the control plane and the
simulator alike); :mod:`~tiderl.policy.ers.model` predicts each split's goodput from them;
:mod:`~tiderl.policy.ers.choose` picks the split and the moves toward it; :mod:`~tiderl.policy.ers.overrides`
holds the rules around the choice and the paper's threshold rules (``ers.policy: paper``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiderl.policy.ers.choose import plan_rate
from tiderl.policy.ers.inputs import ErsLimits, ErsPolicy, ErsSignals, StepObservation
from tiderl.policy.ers.outputs import ErsPlan, ErsReason, RoleMove
from tiderl.policy.ers.overrides import await_engines, before_choice, plan_paper
from tiderl.roles import Role

__all__ = ["ErsLimits", "ErsPlan", "ErsPolicy", "ErsReason", "ErsSignals", "Role", "RoleMove", "StepObservation",
           "plan"]


def plan(roles: Sequence[Role], signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """The next role map, RA2P mode and fetch size, by ``limits.policy``."""
    current = tuple(roles)
    planned = before_choice(current, signals, limits)
    if planned is None:
        planned = (plan_rate if limits.policy is ErsPolicy.RATE else plan_paper)(current, signals, limits)
    return await_engines(current, planned, signals, limits)
