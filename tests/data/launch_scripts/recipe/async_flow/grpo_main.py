"""Excerpt of verl-recipe recipe/async_flow/grpo_main.py at 48ea0a797fa29867ea0ad92aff7d284eec7d4be3 (Apache-2.0).

Only its @hydra.main line, which names the config the main composes; the rest is not needed here.
"""

import hydra


@hydra.main(config_path="config", config_name="async_grpo", version_base=None)
def main(config):  # noqa: ANN001, ANN201
    """The recipe's body is left out."""
