"""`tiderl sim`: a discrete-event simulator of agentic RL runs at cluster scale
that calls the same policy functions as the real ranks (:mod:`tiderl.policy`).

Modules: :mod:`spec` (workload and cluster files), :mod:`workload` (task
sampling), :mod:`costs` (roofline costs), :mod:`engine` (a vLLM-like rollout
engine: batching, prefill, KV cache, eviction, preemption), :mod:`rollout`
(tasks, ranks, feeder, CTB and vanilla schedulers), :mod:`trainer` (micro-batch
formation and ref/actor execution), :mod:`simulator` (step boundaries, ERS,
sync), :mod:`metrics`, :mod:`systems`, :mod:`report`, :mod:`cli`.
See docs/simulator.md.
"""
