"""rl-msprobe: prepare verl RL jobs for msprobe precision dumps."""

__version__ = "0.2.0"
