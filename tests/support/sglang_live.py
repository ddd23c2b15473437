"""A user's rl-msprobe session around a real SGLang CPU engine (DOMAIN §12), through the real CLI.

A plain verl launch script with an SGLang rollout goes through `detect`, `prepare --mode
inference --backend sglang --python PY` and `patch apply` of exactly the sets prepare printed;
bash itself then says what the derived script passes (tests/support/bash_argv.py), and the
engine those arguments imply runs: the Ray runtime-env variables become the engine's
environment (as verl hands them to its rollout workers), `engine_kwargs.sglang.*` become server
arguments, `enforce_eager=True` turns CUDA graphs off. The engine is SGLang's own offline
`Engine` (scheduler in a spawned subprocess) on a tiny local Qwen2 with a capped KV cache.
On exit the sets are reverted and the venv's sglang tree must be byte-identical.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import bash_argv, live_flow, vllm_cpu
from tests.support.sglang_venv import VENVS, site_packages

ROLLOUT = "actor_rollout_ref.rollout."
ENV_PREFIX = "ray_kwargs.ray_init.runtime_env.env_vars."
SGLANG_PREFIX = ROLLOUT + "engine_kwargs.sglang."
KV_TOKENS = 4096  # DOMAIN §12: without a cap SGLang takes 84 % of host RAM for the KV cache
PROMPTS = ("the model rollout prefill", "a tensor layer rank step dump")
MAX_NEW_TOKENS = 4

# Runs in the SGLang venv. The main process never imports msprobe: with the sglang-dump patch the
# dumps can only come from the scheduler subprocess's ModelRunner.
ENGINE_SCRIPT = r"""
import json, os, sys
spec = json.loads(sys.argv[1])

def sync_weights(engine, plan):
    # PLAN's weight syncs, the way verl's SGLang rollout does one: the actor's tensors (its state
    # dict, tied names included, as get_per_tensor_param yields them) go through the patched tree's
    # own `sent` fingerprint and then, bucket by bucket, to the engine's update_weights_from_tensor.
    # A sync may name a tensor to alter after it was fingerprinted as sent (a transfer fault) and a
    # load_format (SGLang's custom weight loader: a fault inside the load).
    import torch
    from transformers import AutoModelForCausalLM
    from sglang.srt import rl_msprobe_weights

    actor = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    done = []
    for step, sync in enumerate(plan["syncs"], 1):
        items = [(name, t.detach().clone()) for name, t in actor.state_dict().items()]
        tensors = []
        for name, tensor in rl_msprobe_weights.sent(iter(items), step):
            if name == sync.get("transfer"):
                tensor = tensor * plan["scale"]  # after the sent fingerprint, before the engine
            tensors.append((name, tensor))
        size = -(-len(tensors) // plan["buckets"])
        buckets = [tensors[i : i + size] for i in range(0, len(tensors), size)]
        session = hasattr(engine, "begin_weight_update")  # newer SGLang brackets a sync's updates
        if session:
            engine.begin_weight_update()
        for i, bucket in enumerate(buckets):
            ok, message = engine.update_weights_from_tensor(
                bucket, load_format=sync.get("load_format"), flush_cache=i == len(buckets) - 1
            )[:2]
            if not ok:
                raise RuntimeError(f"sync {step} bucket {i}: {message}")
        if session:
            engine.end_weight_update()
        done.append({"step": step, "tensors": len(tensors), "buckets": len(buckets)})
    return done


def main():
    import sglang
    engine = sglang.Engine(model_path=spec["model"], device="cpu", max_total_tokens=spec["kv_tokens"],
                           log_level="warning", random_seed=0, **spec["server_args"])
    synced = None
    try:
        outs = engine.generate(spec["prompts"], {"max_new_tokens": spec["max_new_tokens"], "temperature": 0})
        if spec.get("weights"):
            synced = sync_weights(engine, spec["weights"])
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps({"texts": [o["text"] for o in outs],
                                  "prompt_tokens": [o["meta_info"]["prompt_tokens"] for o in outs],
                                  "main_imported_msprobe": "msprobe" in sys.modules,
                                  "sglang": sglang.__version__, "weight_syncs": synced}))

if __name__ == "__main__":
    main()
"""


def plain_script(model: Path, *extra: str) -> str:
    """The user's launch script: plain verl with an SGLang rollout, nothing of rl-msprobe."""
    lines = (
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        *extra,
    )
    body = " \\\n".join(f"    {line}" for line in lines)
    return (
        "#!/usr/bin/env bash\n# GRPO with an SGLang rollout on a tiny Qwen2.\nset -xeuo pipefail\n\n"
        f'python3 -m verl.trainer.main_ppo \\\n{body} \\\n    "$@"\n'
    )


def _value(text: str) -> str:
    """A Hydra override value as the program sees it: the quotes bash kept are Hydra's."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def implied_engine(argv: list[str]) -> tuple[dict[str, str], dict[str, object]]:
    """(environment, server arguments) that a verl command's overrides give its SGLang rollout."""
    env: dict[str, str] = {}
    server_args: dict[str, object] = {}
    for token in argv:
        key, sep, value = token.lstrip("+").partition("=")
        if not sep:
            continue
        if key.startswith(ENV_PREFIX):
            env[key[len(ENV_PREFIX) :]] = _value(value)
        elif key.startswith(SGLANG_PREFIX):
            server_args[key[len(SGLANG_PREFIX) :]] = _value(value)
        elif key == ROLLOUT + "enforce_eager" and value.lower() == "true":
            server_args["disable_cuda_graph"] = True
        elif key == ROLLOUT + "data_parallel_size" and int(value) > 1:
            server_args["dp_size"] = int(value)
    return env, server_args


@dataclass
class EngineRun:
    returncode: int
    seconds: float
    result: dict
    log: str

    def tail(self, chars: int = 6000) -> str:
        return self.log[-chars:]


def run_engine(
    python: Path,
    model: Path,
    env: dict[str, str],
    server_args: dict,
    cwd: Path,
    timeout: int = 900,
    weights: dict | None = None,
) -> EngineRun:
    """SGLang's offline Engine in the venv with ENV and SERVER_ARGS: 2 prompts, greedy; then the
    weight syncs of WEIGHTS (`WeightPlant.plan`), if any, on the same engine."""
    spec = {
        "model": str(model),
        "kv_tokens": KV_TOKENS,
        "server_args": server_args,
        "prompts": list(PROMPTS),
        "max_new_tokens": MAX_NEW_TOKENS,
        "weights": weights,
    }
    full_env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SGLANG_", "MSPROBE_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")
        },
        "SGLANG_USE_CPU_ENGINE": "1",  # DOMAIN §12
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **env,  # what the derived script gives the rollout
    }
    script = cwd / "run_sglang_engine.py"
    script.write_text(ENGINE_SCRIPT)
    started = time.monotonic()
    proc = subprocess.run(
        [str(python), str(script), json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=timeout,
    )
    seconds = time.monotonic() - started
    log = f"$ {shlex.join(map(str, proc.args[:2]))} ...\n{proc.stdout}\n{proc.stderr}"
    result = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return EngineRun(proc.returncode, seconds, result, log)


@contextlib.contextmanager
def patch_lock(python: Path):
    """Held while a shared SGLang venv is patched (apply ... run ... revert)."""
    venv = python.parent.parent
    with (venv.parent / f"{venv.name}.patch.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass
class Session:
    python: Path
    script: Path
    detection: dict
    prepared: dict
    argv: list[str]
    env: dict[str, str]
    server_args: dict
    applied: dict = field(default_factory=dict)

    @property
    def sets(self) -> list[str]:
        return list(self.prepared["patch_sets"])

    @property
    def sglang_sets(self) -> list[str]:
        """The printed sets that patch the SGLang tree."""
        from rl_msprobe.patches import get_set

        return [name for name in self.sets if get_set(name).project == "sglang"]

    @property
    def dump_root(self) -> Path:
        return Path(json.loads(Path(self.prepared["configs"]["generate"]).read_text())["dump_path"])


def sglang_tree(python: Path) -> Path:
    return site_packages(python) / "sglang"


@contextlib.contextmanager
def session(python: Path, script: Path, work: Path, *prepare_args: str):
    """The user's steps on SCRIPT up to patched trees and the implied engine; reverts on exit and
    checks the venv's sglang tree is byte-identical to before."""
    with patch_lock(python):
        tree = sglang_tree(python)
        before = vllm_cpu.tree_digest(tree)
        code, detection, proc = live_flow.cli_json("detect", str(script), "--hint", "推理采集")
        assert code == 0, live_flow.describe(proc)
        code, prepared, proc = live_flow.cli_json(
            "prepare", str(script), "--mode", "inference", "--backend", "sglang", "--python", str(python),
            *prepare_args,
        )  # fmt: skip
        assert code == 0 and prepared["written"], live_flow.describe(proc)
        calls = [
            c
            for c in bash_argv.record(Path(prepared["script"]), work / "argv")
            if "verl.trainer.main_ppo" in c
        ]
        assert len(calls) == 1, calls
        env, server_args = implied_engine(calls[0])
        flow = Session(python, script, detection, prepared, calls[0], env, server_args)
        applied = False
        ours = flow.sglang_sets  # prepare may also print verl's sets (verl-weights): not this venv's tree
        try:
            if ours:
                code, flow.applied, proc = live_flow.cli_json(
                    "patch", "apply", *ours, "--python", str(python)
                )
                assert code == 0, live_flow.describe(proc)
                applied = True
            yield flow
        finally:
            if applied:
                proc = live_flow.cli("patch", "revert", *ours, "--python", str(python))
                assert proc.returncode == 0, live_flow.describe(proc)
            after = vllm_cpu.tree_digest(tree)
            changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
            assert not changed, f"site-packages/sglang differs after `patch revert`: {changed[:20]}"


@dataclass(frozen=True)
class WeightPlant:
    """Weight syncs for an engine that runs with `--weights` (sglang-weights applied): sync 1 as
    sent, sync 2 with RESIDENT scaled inside the load (SGLang's own custom weight loader, test-only
    code, in every TP rank's scheduler), sync 3 with TRANSFER scaled after it was fingerprinted as
    sent. Each sync in BUCKETS update_weights_from_tensor calls, as verl sends them."""

    resident: str = "model.layers.1.mlp.gate_proj.weight"  # fused into gate_up_proj
    transfer: str = "model.layers.0.self_attn.o_proj.weight"
    scale: float = 1.001
    buckets: int = 3
    module: str = "rl_msprobe_weight_plant"

    @property
    def loader(self) -> str:
        return f"{self.module}.scale_one"

    def write(self, folder: Path) -> dict:
        """The loader module in FOLDER (the engine's cwd, on its schedulers' path); the server
        arguments and environment that register it."""
        (folder / f"{self.module}.py").write_text(
            '"""Test-only SGLang custom weight loader: scales one tensor, then loads as SGLang does."""\n\n\n'
            "def scale_one(model, named_tensors):\n"
            f"    named_tensors = [(n, t * {self.scale!r} if n == {self.resident!r} else t) for n, t in named_tensors]\n"
            "    model.load_weights(named_tensors)\n"
        )
        return {"custom_weight_loader": [self.loader]}

    def plan(self) -> dict:
        syncs = [{}, {"load_format": self.loader}, {"transfer": self.transfer}]
        return {"syncs": syncs, "scale": self.scale, "buckets": self.buckets}


def python_or_skip(shape: str) -> Path:
    return VENVS[shape].python_or_skip()
