"""`python -m rl_msprobe` = the `rl-msprobe` command."""

from rl_msprobe.cli import main

main()
