"""Rollout side of TideRL: the tiny policy model, inference engines, the multi-turn agent
loop and the task schedulers (`vanilla`, `ctb`)."""
