"""The tiny policy models TideRL builds for a job without `model.path`: a text model
(`tiny_model`) and a vision-language one (`tiny_vl_model`), each warm-started on the
environment's demonstrations (`demos`), cached by content hash, their tokenizers saved with
ChatML's tokens and template (`chatml`); `tiderl init-model` (`cli_init_model`) and the job's
model directory (`for_job.model_dir`).

This package sits above `tiderl.rollout` (the chat format the warm start builds its id pieces with) and
`tiderl.trainer` (a vision-language model's image inputs, as the trainer builds them);
neither imports it at module level."""
