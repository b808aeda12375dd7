"""TideRL: asynchronous multi-turn agentic RL on Slurm."""

__version__ = "0.1.0"
