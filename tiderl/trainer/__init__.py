"""The trainer: GRPO loss, micro-batching, RA2P execution modes, trainer backends, weight publishing.

See docs/trainer.md. Pure modules (`advantages`, `microbatch`) import no torch;
`grpo` is tensor math only; everything else is mechanism.
"""
