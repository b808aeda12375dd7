"""`tiderl sim`: a discrete-event simulator of agentic RL runs at cluster scale
that calls the same policy functions as the real ranks (:mod:`tiderl.policy`).

Modules: :mod:`spec` (workload and cluster files), :mod:`workload` (task
sampling), :mod:`costs` (roofline costs), :mod:`engine` (a vLLM-like rollout
engine: batching, prefill, KV cache, eviction, preemption), :mod:`tasks` (tasks
and groups), :mod:`rollout` (task pool, feeder, a task's turns, vanilla
scheduler), :mod:`rollout_ranks` (rollout ranks' engines, weight syncs, shared
host, accounting), :mod:`rollout_ctb` (CTB on a rank), :mod:`trainer`
(micro-batch formation and ref/actor execution), :mod:`simulator` (event loop,
feed, asynchronous step boundaries), :mod:`ers_boundary` (ERS's signals and
plan at a boundary), :mod:`sync_steps` (sync), :mod:`step_records`,
:mod:`metrics`, :mod:`systems`, :mod:`report`, :mod:`cli`.
See docs/simulator.md.
"""
