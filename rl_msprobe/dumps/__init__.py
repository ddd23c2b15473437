"""After the run: check dump layouts, join rollout and training steps, report msprobe compares.

- `layout`    where msprobe and the rl-msprobe helpers put `dump.json` files, per mode
- `logs`      streaming readers for `dispatch_log.jsonl` and `update_actor_log.jsonl`
- `correlate` the DOMAIN §6 join: one-request prefill steps <-> training micro-batches
- `compare`   msprobe's own consistency compare per pair, in parallel processes
- `summary`   reading msprobe's result CSV: verdicts, first divergence, per-layer curve
- `report`    report.md and a self-contained report.html with an embedded plot
"""
