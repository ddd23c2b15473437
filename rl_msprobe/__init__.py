"""rl-msprobe: prepare verl RL jobs for msprobe precision dumps."""

__version__ = "0.1.0"
