"""Excerpt of verl-recipe recipe/spin/main_spin.py at 48ea0a797fa29867ea0ad92aff7d284eec7d4be3 (Apache-2.0).

Only its @hydra.main line, which names the config the main composes; the rest is not needed here.
"""

import hydra


@hydra.main(config_path="config", config_name="spin_trainer", version_base=None)
def main(config):  # noqa: ANN001, ANN201
    """The recipe's body is left out."""
