"""After the run: check dump layouts, join rollout and training steps, report msprobe compares.

- `layout`    where msprobe and the rl-msprobe helpers put `dump.json` files, per mode
- `logs`      streaming readers for `dispatch_log.jsonl` and `update_actor_log.jsonl`
- `correlate` the DOMAIN §6 join: one-request prefill steps <-> training micro-batches
- `compare`   msprobe's own consistency compare per pair, `jobs` at a time, into a fresh pairs/
- `inputs`    the dump.json copies msprobe can match (FSDP2 names, module rows of mix dumps)
- `runners`   how msprobe runs: a long-lived worker per job (`msprobe_worker`), or a process per pair
- `summary`   reading msprobe's result CSV: verdicts, conventions, coverage, first divergence
- `report`    the verdict (NOT COMPARED when too little matched), report.md and report.html
"""
