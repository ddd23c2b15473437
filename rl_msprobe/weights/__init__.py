"""Weight parity after every sync: what the actor sent, what each engine rank received, what it holds.

`fingerprint` (pure statistics and their combine rules), `records` (reading the JSONL lines the
job wrote), `compare` (one document per run: per sync, per tensor), `report` (md + html).
"""
