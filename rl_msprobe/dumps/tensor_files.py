"""msprobe's tensor files (`.pt`, written by `torch.save`): TP shards concatenated, tensors read as numpy.

Tensor-mode dumps need torch to be read at all. rl-msprobe does not depend on torch: these two
jobs run in this interpreter when torch imports here, else in the training interpreter
(`--python PY`, which has torch since msprobe needs it), as `PY -c <this file's text>` with one
JSON request on stdin and one JSON reply line on stdout (as `msprobe_worker` does). The file
therefore imports only the standard library at the top and torch / numpy inside the jobs.

- ``concat``: the tensor a TP group holds, from each rank's shard file: concatenated on the shard
  dimension; for a fused column-parallel module (qkv, gate/up) each rank holds a slice of every
  part, so the parts are cut out of every rank and put back in the training order
  (``[q0 q1 k0 k1 v0 v1]``, not ``[q0 k0 v0 q1 k1 v1]``). Written with `torch.save` (the dtype
  kept); the reply gives msprobe's statistics of the result.
- ``npy``: each tensor file as a float32 (integers: int64) ``.npy`` file, so that numpy can
  read rows of it (`positions`).

Request: ``{"op": "concat", "jobs": [{"files": [...], "dim": D, "parts": [W, ...] | null,
"out": PATH}]}`` or ``{"op": "npy", "jobs": [{"src": PT, "dst": NPY}]}``; reply
``{"ok": true, "results": [...]}`` or ``{"ok": false, "error": TEXT}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _stats(t: Any) -> dict[str, Any]:
    """msprobe's statistics of a tensor (Max, Min, Mean, Norm; Mean/Norm None for integers)."""
    import torch

    if t.numel() == 0:
        return {"shape": list(t.shape), "Max": None, "Min": None, "Mean": None, "Norm": None}
    floating = t.is_floating_point()
    f = t.double() if floating else t
    return {
        "shape": list(t.shape),
        "Max": f.max().item(),
        "Min": f.min().item(),
        "Mean": f.mean().item() if floating else None,
        "Norm": torch.linalg.vector_norm(f).item() if floating else None,
    }


def _concat(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    shards = [torch.load(p, map_location="cpu", weights_only=True) for p in job["files"]]
    dim, n = int(job["dim"]), len(shards)
    parts = job.get("parts")
    if parts:
        if any(int(w) % n for w in parts) or sum(int(w) for w in parts) != sum(s.shape[dim] for s in shards):
            raise ValueError(
                f"{job['files'][0]}: parts {parts} do not split evenly over {n} shards of "
                f"{[list(s.shape) for s in shards]} on dim {dim}"
            )
        widths = [int(w) // n for w in parts]
        pieces = [torch.split(s, widths, dim=dim) for s in shards]
        whole = torch.cat([pieces[r][i] for i in range(len(widths)) for r in range(n)], dim=dim)
    else:
        whole = torch.cat(shards, dim=dim)
    torch.save(whole.contiguous(), job["out"])
    return _stats(whole)


def _npy(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    t = torch.load(job["src"], map_location="cpu", weights_only=True)
    t = t.detach()
    a = t.to(torch.float32 if t.is_floating_point() else torch.int64).numpy()
    np.save(job["dst"], a)
    return {"shape": list(a.shape)}


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """Run one request (module doc); errors are replies, never raised."""
    ops = {"concat": _concat, "npy": _npy}
    op = ops.get(str(request.get("op")))
    if op is None:
        return {"ok": False, "error": f"unknown op {request.get('op')!r}"}
    try:
        return {"ok": True, "results": [op(job) for job in request.get("jobs") or []]}
    except Exception as exc:  # noqa: BLE001 - the reply carries it to the caller
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    reply = handle(json.loads(sys.stdin.read() or "{}"))
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
