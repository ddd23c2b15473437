"""One process of the msprobe request-slice tests (msprobe's PrecisionDebugger is a per-process
singleton): a tiny per-token model (no attention: a row depends on its token only, so a request's
rows are the same alone and in a batch) run through rl-msprobe's real helpers under real msprobe.

Usage: python msprobe_slice_scenario.py SIDE OUT [--level L] [--request ID] [--list A,B] [--fault F]
  SIDE: rollout-batch  the vllm-dump helper (V1 runner stand-in): one step of three requests, one
                       decode step without the selected request
        rollout-alone  the selected request alone in one step, no request_id
        train-packed   the verl engine helper: one rmpad micro-batch [1, total_nnz] of three prompts
        train-padded   the same three prompts as a left-padded [3, S] micro-batch with a mask
        train-alone    the selected request alone, [1, P]
  --fault F: layer 1's activation scaled by 1 + F inside its mlp (Tensor.__mul__), a planted fault.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace as NS

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = {"req-a": [1, 2, 3], "req-b": [4, 5, 6, 7, 8], "req-c": [9, 10]}
SUFFIX = "-0badcafe"  # vLLM >= 0.14 appends -<8 hex> to verl's id


class MLP(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.up_proj, self.down_proj, self.scale = nn.Linear(8, 16), nn.Linear(16, 8), scale

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)) * self.scale)


class Layer(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.mlp = MLP(scale)

    def forward(self, x):
        return x + self.mlp(x)


class Inner(nn.Module):
    def __init__(self, fault: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([Layer(1.0), Layer(1.0 + fault), Layer(1.0)])

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return h


class Model(nn.Module):
    def __init__(self, fault: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Inner(fault)

    def forward(self, ids):
        return self.model(ids)


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree_records(package: str) -> None:
    """The shared recorder as PACKAGE's `rl_msprobe_records` (stand-in packages down to PACKAGE), as
    in a patched tree, where the engine helpers import it from (this process only)."""
    import sys
    from types import ModuleType

    parts = package.split(".")
    for depth in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:depth]), ModuleType(".".join(parts[:depth])))
    records = load(
        ROOT / "rl_msprobe/patches/files/common/rl_msprobe_records.py", f"{package}.rl_msprobe_records"
    )
    sys.modules[package].rl_msprobe_records = records  # type: ignore[attr-defined]
    sys.modules[f"{package}.rl_msprobe_records"] = records


def write_config(out: str, level: str, request: str | None, names: list[str]) -> str:
    section = {"scope": [], "list": names, "data_mode": ["all"], "summary_mode": "statistics"}
    if request:
        section["request_id"] = request
    doc = {"task": "statistics", "dump_path": out, "rank": [], "step": [], "level": level,
           "risk_level": "ALL", "statistics": section}  # fmt: skip
    path = out.rstrip("/") + ".config.json"
    Path(path).write_text(json.dumps(doc))
    return path


def sched(rows: dict[str, int], new: bool = True):
    ids = [rid + SUFFIX for rid in rows]
    reqs = [
        NS(req_id=rid, prompt_token_ids=PROMPTS[rid[: -len(SUFFIX)]], num_computed_tokens=0) for rid in ids
    ]
    cached = NS(req_ids=[] if new else ids, num_computed_tokens=[] if new else [9] * len(ids))
    return NS(
        scheduled_new_reqs=reqs if new else [],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(zip(ids, rows.values(), strict=True)),
        total_num_scheduled_tokens=sum(rows.values()),
    )


def rollout(
    out: str, config: str, model: nn.Module, steps: list[tuple[dict[str, int], list[int], bool]]
) -> None:
    os.environ["MSPROBE_ROLLOUT_CONFIG"] = config
    tree_records("vllm.v1.worker")
    helper = load(ROOT / "rl_msprobe/patches/files/vllm/vllm/v1/worker/rl_msprobe_dump.py", "rl_msprobe_dump")

    class Runner:
        def __init__(self) -> None:
            self.model_config = NS(enforce_eager=True)
            self.model = model
            self.requests: dict = {}
            self.input_batch = NS(req_ids=[])
            helper.init_runner(self)

        @helper.dump_step
        def execute_model(self, scheduler_output, tokens):
            for new in scheduler_output.scheduled_new_reqs:
                self.requests[new.req_id] = NS(prompt_token_ids=new.prompt_token_ids, num_computed_tokens=0)
            self.input_batch.req_ids = list(scheduler_output.num_scheduled_tokens)  # the rows' order
            helper.start_forward(self)
            with torch.no_grad():
                return self.model(torch.tensor(tokens))

    runner = Runner()
    for rows, tokens, new in steps:
        runner.execute_model(sched(rows, new), tokens)


def train(config: str, model: nn.Module, batches: list[dict]) -> None:
    os.environ.update(DUMP_ON="1", DUMP_PHASE="log_prob", MSPROBE_ACTOR_CONFIG=config)
    tree_records("verl.utils")
    hooks = load(ROOT / "rl_msprobe/patches/files/verl/verl/utils/rl_msprobe_hooks.py", "rl_msprobe_hooks")
    engine = NS(module=model, engine_config=NS(forward_only=False), rank=0)
    for batch in batches:
        token = hooks.micro_batch_start(engine, batch, True)
        ids = batch["input_ids"]
        with torch.no_grad():
            model(ids.values().unsqueeze(0) if ids.is_nested else ids)
        hooks.micro_batch_end(token)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("side")
    p.add_argument("out")
    p.add_argument("--level", default="L0")
    p.add_argument("--request", default="req-b")
    p.add_argument("--list", default="")
    p.add_argument("--fault", type=float, default=0.0)
    a = p.parse_args()
    model = Model(a.fault).eval()
    names = [n for n in a.list.split(",") if n]
    alone = a.side.endswith("alone")
    config = write_config(a.out, a.level, None if alone else a.request, names)
    ids = list(PROMPTS)
    if a.side == "rollout-batch":
        batch = {rid: len(toks) for rid, toks in PROMPTS.items()}
        rollout(a.out, config, model, [
            (batch, sum(PROMPTS.values(), []), True),
            ({ids[0]: 1, ids[2]: 1}, [3, 10], False),  # a decode step without the request: not dumped
        ])  # fmt: skip
    elif a.side == "rollout-alone":
        rollout(a.out, config, model, [({a.request: len(PROMPTS[a.request])}, PROMPTS[a.request], True)])
    elif a.side == "train-packed":
        nested = torch.nested.nested_tensor([torch.tensor(t) for t in PROMPTS.values()], layout=torch.jagged)
        train(config, model, [
            {"input_ids": nested, "request_id": [i + SUFFIX for i in ids]},
            {"input_ids": torch.nested.nested_tensor([torch.tensor([3, 4])], layout=torch.jagged),
             "request_id": ["req-z"]},  # a micro-batch without the request: not dumped
        ])  # fmt: skip
    elif a.side == "train-padded":
        width = max(len(t) for t in PROMPTS.values())
        rows = [[0] * (width - len(t)) + t for t in PROMPTS.values()]
        mask = [[0] * (width - len(t)) + [1] * len(t) for t in PROMPTS.values()]
        train(
            config,
            model,
            [{"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(mask), "request_id": ids}],
        )
    elif a.side == "train-alone":
        train(config, model, [{"input_ids": torch.tensor([PROMPTS[a.request]]), "request_id": [a.request]}])
    else:
        raise SystemExit(f"unknown side {a.side}")


if __name__ == "__main__":
    main()
