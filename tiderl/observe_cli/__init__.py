"""The observability commands: `tiderl status` (`status.py`), `tiderl report` (`report.py`) and `tiderl logs`
(`logs.py`), over `tiderl.observe`.

They sit above `run/` and `slurm/` (each asks Slurm for the run's jobs), while what they print sits below
both in `tiderl.observe`, since the launcher, the control plane and `tiderl submit --wait` use it too."""
