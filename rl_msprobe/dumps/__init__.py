"""After the run: check dump layouts, join rollout and training steps, report msprobe compares.

- `layout`    where msprobe and the rl-msprobe helpers put `dump.json` files, per mode (and TP groups)
- `correlate` the DOMAIN §6 join: one-request prefill steps (every TP rank) <-> training micro-batches
- `compare`   msprobe's own consistency compare per pair, `jobs` at a time, into a fresh pairs/; the verdict
- `inputs`    the dump.json copies msprobe can match (FSDP2 names, module rows, TP ranks merged, fused view)
- `tp_merge`  one rollout dump from every TP rank's: shards merged exactly, replicas checked
- `fused`     the training side's q/k/v and gate/up given as the rollout's fused modules
- `runners`   how msprobe runs: a long-lived worker per job (`msprobe_worker`), or a process per pair
- `summary`   reading msprobe's result CSV: rows, conventions, coverage, input identity
- `judge`     rl-msprobe's divergence rule: output error vs input error and the dtype noise floor
- `report`    report.md and report.html (rl_msprobe.reporting pieces)
"""
