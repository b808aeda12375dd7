"""Slurm launch: sbatch scripts and job states as text (`sbatch`, `states`), the commands that use them (`cluster`)."""
