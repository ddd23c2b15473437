"""Added to this tree by rl-msprobe (placeholder)."""
