"""Triage after a `--mode triage` run: the rollout vs training log-prob gap, per step, position,
token and request, and which request to dump next (`rl-msprobe mismatch report`)."""
