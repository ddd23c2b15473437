"""What a verl job runs (`patch apply --for NAME`), read from the launch script's command.

Its own module so that every verl set can name entry points without importing another set's codemods.
"""

from __future__ import annotations

from rl_msprobe.patches.patch_set import EntryPoint

# what a verl job runs, read from the launch script's command (python3 -m MODULE)
MAIN_PPO = EntryPoint(
    "main_ppo",
    "verl",
    ("verl.trainer.main_ppo",),
    "RayPPOTrainer.fit, or the v1 PPOTrainer (trainer.use_v1) where the tree has it; the agent-loop rollout",
)
MAIN_PPO_SYNC = EntryPoint(
    "main_ppo_sync",
    "verl",
    ("verl.trainer.main_ppo_sync",),
    "the TransferQueue PPOTrainer of main_ppo_sync.py",
)
ONE_STEP_OFF = EntryPoint(
    "one_step_off",
    "verl",
    ("verl.experimental.one_step_off_policy.main_ppo",),
    "the one-step-off-policy trainer (a SeparateRayPPOTrainer)",
)
FULLY_ASYNC = EntryPoint(
    "fully_async",
    "verl",
    ("verl.experimental.fully_async_policy.fully_async_main",),
    "FullyAsyncTrainer (a SeparateRayPPOTrainer) and the fully-async rollouter's client",
)
ENTRY_POINTS = (MAIN_PPO, MAIN_PPO_SYNC, ONE_STEP_OFF, FULLY_ASYNC)
EVERY_TRAINER = ENTRY_POINTS  # a rollout client every trainer uses
