"""The trainer: GRPO loss, micro-batching, RA2P execution modes, trainer backends, weight publishing.

See docs/trainer.md. The pure module `microbatch` imports no torch
(GRPO advantages are `tiderl.advantages`, shared with the store);
`grpo` is tensor math only; everything else is mechanism.
"""
