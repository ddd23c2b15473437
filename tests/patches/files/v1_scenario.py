"""Run inside the cached verl venv with a verl-triage-patched verl first on PYTHONPATH.

`v1` (default): the real, patched v1 `PPOTrainer._compute_old_log_prob` (verl/trainer/ppo/v1/trainer_base.py)
on a stand-in TransferQueue (the real module's kv_batch_get / kv_batch_put replaced by a
TensorDict store: a TransferQueue controller needs a Ray cluster) and a stand-in actor worker
group. verl's own calculate_debug_metrics runs; the inserted lines write the triage lines.

`dataproto`: the legacy RayPPOTrainer.fit path, whose loop cannot run here: verl's DataProto as
fit holds it after the union with the recompute (left-padded prompts, right-padded responses,
non-tensor ids), verl's calculate_debug_metrics, then the marked lines exactly as the patched
verl/trainer/ppo/ray_trainer.py carries them (read from the file, run with `batch` and `self`).

argv: OUT_FOLDER PATH... (`v1`, `dataproto`), run in turn in this one process (one verl import):
each writes its triage lines under OUT_FOLDER/PATH/triage (RL_MSPROBE_TRIAGE, read when a line is
written) and verl's metrics and the log-probs to OUT_FOLDER/PATH/out.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import transfer_queue
import verl.trainer.ppo.v1.trainer_base as trainer_base
from omegaconf import OmegaConf
from tensordict import NonTensorData, NonTensorStack, TensorDict
from transfer_queue import KVBatchMeta

PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32, 33, 34]]
RESPONSES = [[41, 42, 43, 44], [51, 52], [61, 62, 63, 64, 65]]
MASKS = [[1, 1, 1, 1], [1, 1], [1, 1, 0, 1, 0]]  # a tool token inside, a masked tail
KEYS = ["uid0_0_0", "uid0_1_0", "uid1_0_0"]
torch.manual_seed(0)


def nested(rows, dtype):
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def non_tensor(values):
    return NonTensorStack(*[NonTensorData(v) for v in values])


rollout = [(-torch.rand(len(r)) * 3).tolist() for r in RESPONSES]
store = TensorDict(
    {
        "prompts": nested(PROMPTS, torch.int64),
        "responses": nested(RESPONSES, torch.int64),
        "response_mask": nested(MASKS, torch.int64),
        "rollout_log_probs": nested(rollout, torch.float32),
        "uid": non_tensor(["uid0", "uid0", "uid1"]),
        "request_id": non_tensor(["rid-a", "rid-b", "rid-c"]),
        "data_source": non_tensor(["tiny"] * 3),
        "raw_prompt": non_tensor([[{"role": "user", "content": f"q{i}"}] for i in range(3)]),
    },
    batch_size=[3],
)


def kv_batch_get(keys, partition_id, select_fields):
    assert list(keys) == KEYS and partition_id == "train"
    missing = [f for f in select_fields if f not in store]
    if missing:
        raise KeyError(f"fields {missing} not stored")
    return store.select(*select_fields)


def kv_batch_put(keys, partition_id, fields):
    assert list(keys) == KEYS and partition_id == "train"
    for key in fields.keys():  # noqa: SIM118 - a TensorDict's keys view
        store.set(key, fields.get(key))
    return KVBatchMeta(
        keys=list(keys), tags=[{}] * len(keys), partition_id=partition_id, fields=list(store.keys())
    )


transfer_queue.kv_batch_get = kv_batch_get
transfer_queue.kv_batch_put = kv_batch_put


class StandInActor:
    """compute_log_prob: the training engine's log-probs of every prompt+response token (nested)."""

    def compute_log_prob(self, batch):
        full = []
        for p, r, lp in zip(PROMPTS, RESPONSES, rollout):
            noise = torch.randn(len(r)) * 0.02
            # response_from_nested takes positions [P-1, P+R-1): the log-prob of each response token
            full.append([0.0] * (len(p) - 1) + (torch.tensor(lp) + noise).tolist() + [0.0])
        store.set("log_probs", nested(full, torch.float32))
        store.set(
            "entropy", nested([[0.5] * (len(p) + len(r)) for p, r in zip(PROMPTS, RESPONSES)], torch.float32)
        )
        return batch


def dataproto_path(out: str) -> None:
    import inspect
    import textwrap

    import numpy as np
    import verl.trainer.ppo.ray_trainer as ray_trainer
    from verl.protocol import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    width_p, width_r = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    prompts = torch.zeros(3, width_p, dtype=torch.int64)
    attention = torch.zeros(3, width_p + width_r, dtype=torch.int64)
    responses = torch.zeros(3, width_r, dtype=torch.int64)
    response_mask = torch.zeros(3, width_r, dtype=torch.int64)
    roll = torch.zeros(3, width_r)
    for i, (p, r, m) in enumerate(zip(PROMPTS, RESPONSES, MASKS)):
        prompts[i, width_p - len(p) :] = torch.tensor(p)
        attention[i, width_p - len(p) : width_p + len(r)] = 1
        responses[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = torch.tensor(m)
        roll[i, : len(r)] = torch.tensor(rollout[i])
    old = roll + torch.randn(3, width_r) * 0.02
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "attention_mask": attention,
            "response_mask": response_mask,
            "rollout_log_probs": roll,
            "old_log_probs": old,
        },
        non_tensors={
            "uid": np.array(["uid0", "uid0", "uid1"], dtype=object),
            "request_id": np.array(["rid-a", "rid-b", "rid-c"], dtype=object),
            "data_source": np.array(["tiny"] * 3, dtype=object),
        },
    )
    metrics: dict = {}
    metrics.update(calculate_debug_metrics(batch))
    marked = [
        line.split("#")[0].strip()
        for line in inspect.getsource(ray_trainer).splitlines()
        if line.rstrip().endswith("# rl-msprobe:verl-triage-ray-trainer")
    ]
    assert len(marked) == 2, marked
    exec(textwrap.dedent("\n".join(marked)), {"batch": batch, "self": SimpleNamespace(global_steps=3)})
    doc = {
        "metrics": {k: float(v) for k, v in metrics.items()},
        "old_log_probs": [old[i, : len(r)].tolist() for i, r in enumerate(RESPONSES)],
        "rollout_log_probs": rollout,
    }
    Path(out).write_text(json.dumps(doc))


def v1_path(out: str) -> None:
    config = OmegaConf.create(
        {
            "algorithm": {"rollout_correction": None},
            "actor_rollout_ref": {
                "rollout": {"temperature": 1.0, "calculate_log_probs": True},
                "actor": {"loss_agg_mode": "token-mean", "loss_scale_factor": None},
            },
        }
    )
    trainer = SimpleNamespace(config=config, actor_rollout_wg=StandInActor(), global_steps=7)
    meta = KVBatchMeta(
        keys=KEYS, tags=[{}] * 3, partition_id="train", fields=list(store.keys()), extra_info={}
    )
    metrics: dict = {}
    trainer_base.PPOTrainer._compute_old_log_prob(trainer, meta, metrics)
    old = store.get("old_log_probs")
    result = {
        "metrics": {k: float(v) for k, v in metrics.items()},
        "old_log_probs": [t.tolist() for t in old.unbind()],
        "rollout_log_probs": rollout,
    }
    Path(out).write_text(json.dumps(result))


for name in sys.argv[2:]:
    folder = Path(sys.argv[1]) / name
    os.environ["RL_MSPROBE_TRIAGE"] = str(folder / "triage")
    {"v1": v1_path, "dataproto": dataproto_path}[name](str(folder / "out.json"))
