"""The three TideRL decisions as pure modules: state in, actions out.

- :mod:`tiderl.policy.ctb`: Continuous Task Batching on one rollout rank
  (admit / pause / resume by token budget and RL priority).
- :mod:`tiderl.policy.ra2p`: the RA2P readiness signals (RAS, TPRM), the
  Appendix A cost model, the mode choice and the micro-batch dispatchers.
- :mod:`tiderl.policy.ers`: the Elastic Resource Scaling planner (next role
  map, RA2P mode and fetch size at a sync boundary), a package shaped
  ``plan = overrides(choose(model(signals)))``.

None of them imports torch, a database, HTTP or subprocess; the real ranks and
the simulator (`tiderl sim`) call the very same functions. Each module's
docstring lists its invariants; tests/test_policy_*.py has a test per invariant.
"""
